"""Running code a model wrote, where it cannot hurt anyone: never in bake's own process.

Each program runs in a new Python process (``python -I``) of its own session, in a fresh
temporary directory as its working directory, with a closed stdin, no inherited file
descriptors but the one its verdict comes back on, and its own output sent to /dev/null. Before
the program runs, that process sets its limits and guards:

- ``RLIMIT_AS`` (``task.memory_gib``), ``RLIMIT_CPU`` (``task.timeout_s`` rounded up, plus one),
  ``RLIMIT_FSIZE`` (16 MiB) and ``RLIMIT_NPROC`` (no new process; the kernel does not apply it
  to root, which the audit hook and Landlock cover);
- Landlock, where the kernel has it: no file written, made, renamed or removed outside the
  temporary directory, no TCP connection or listening socket (ABI 4+), no signal to a process
  outside the program's own (ABI 6+);
- an audit hook (``sys.addaudithook``) that refuses opening a file for writing, removing,
  renaming or making files outside the temporary directory, and starting or signalling
  processes;
- a wall-clock timer (``task.timeout_s``) inside, and the whole process group killed from
  outside one second later.

A program passes only when it runs to its end: an exception, ``sys.exit`` (with any code), a
crash or a kill before the checks finish is a failure. The verdict carries a random token the
parent chose, so nothing the program prints can pass for it.
"""

from __future__ import annotations

import ctypes
import math
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache

FILE_LIMIT = 16 << 20  # bytes one file the program writes may reach
GRACE_S = 1.0  # after the inner timer, the process group is killed from outside
VERDICT_LIMIT = 4096  # bytes of a verdict kept (a failure's message)

# The process every program runs in. argv: token, temporary dir, timeout s, memory bytes,
# landlock (0/1). Its verdict, "<token> <result>", goes to the file descriptor that was its
# stdout; the program's own stdout and stderr go to /dev/null.
RUNNER = r"""
import os, sys, resource, signal, math
token, home = sys.argv[1], sys.argv[2]
timeout, memory, landlock = float(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
verdict = os.dup(1)
null = os.open(os.devnull, os.O_RDWR)
for fd in (0, 1, 2):
    os.dup2(null, fd)
os.close(null)
os.set_inheritable(verdict, False)

def say(text):
    os.write(verdict, (token + " " + text).encode("utf-8", "replace")[:4096])
    os._exit(0)

try:
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    cpu = int(math.ceil(timeout)) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_LIMIT, FILE_LIMIT))
    resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
except (ValueError, OSError) as exc:
    say("error: limits: " + str(exc))
if landlock:
    LANDLOCK
with open("program.py", encoding="utf-8") as fh:
    source = fh.read()
home = os.path.realpath(home)
WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

def inside(path):
    if isinstance(path, int):
        return True
    try:
        path = os.fsdecode(path)
    except TypeError:
        return False
    real = os.path.realpath(os.path.join(home, path))
    return real == home or real.startswith(home + os.sep)

PATHS = {"os.remove": (0,), "os.rmdir": (0,), "os.rename": (0, 1), "shutil.rmtree": (0,),
         "os.mkdir": (0,), "os.truncate": (0,), "os.chmod": (0,), "os.chown": (0,),
         "os.link": (0, 1), "os.symlink": (1,), "os.utime": (0,), "os.mkfifo": (0,),
         "os.mknod": (0,), "shutil.move": (0, 1), "shutil.copyfile": (1,), "shutil.copytree": (1,)}
REFUSED = ("os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system",
           "subprocess.Popen", "os.kill", "os.killpg", "pty.spawn", "ctypes.dlopen",
           "os.setuid", "os.setgid", "os.chroot", "socket.connect", "socket.bind",
           "os.startfile", "webbrowser.open", "sys.addaudithook", "os.putenv")

def hook(event, args):
    if event == "open":
        path, mode, flags = (list(args) + [None, None, 0])[:3]
        writes = (mode is not None and any(c in str(mode) for c in "wxa+")) or (
            isinstance(flags, int) and flags & WRITE)
        if writes and not inside(path):
            raise PermissionError("sandbox: writing outside the working directory: " + repr(path))
    elif event in PATHS:
        for i in PATHS[event]:
            if i < len(args) and not inside(args[i]):
                raise PermissionError("sandbox: " + event + " outside the working directory")
    elif event in REFUSED:
        raise PermissionError("sandbox: " + event + " is not allowed")

class TimedOut(BaseException):
    pass

def alarm(signum, frame):
    raise TimedOut()

signal.signal(signal.SIGALRM, alarm)
sys.addaudithook(hook)
signal.setitimer(signal.ITIMER_REAL, timeout)
try:
    exec(source, {})
except TimedOut:
    signal.setitimer(signal.ITIMER_REAL, 0)
    say("timed out")
except BaseException as exc:
    signal.setitimer(signal.ITIMER_REAL, 0)
    name = type(exc).__name__
    try:
        text = str(exc)
    except BaseException:
        text = ""
    say("failed: " + (name + ": " + text if text else name))
signal.setitimer(signal.ITIMER_REAL, 0)
say("passed")
""".replace("FILE_LIMIT", str(FILE_LIMIT))

# Landlock through its three system calls (the numbers are the same on every architecture that
# has them): writes allowed under the temporary directory only; TCP and signals out refused.
LANDLOCK = r"""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    abi = libc.syscall(444, None, 0, 1)
    fs = sum(1 << b for b in (1, 4, 5, 6, 7, 8, 9, 10, 11, 12))
    if abi >= 2: fs |= 1 << 13
    if abi >= 3: fs |= 1 << 14
    net = 3 if abi >= 4 else 0
    scoped = 2 if abi >= 6 else 0
    size = 24 if abi >= 6 else (16 if abi >= 4 else 8)
    attr = (ctypes.c_uint64 * 3)(fs, net, scoped)
    ruleset = libc.syscall(444, ctypes.byref(attr), size, 0)
    if ruleset < 0:
        say("error: landlock: " + os.strerror(ctypes.get_errno()))
    class Beneath(ctypes.Structure):
        _pack_ = 1
        _fields_ = [("allowed", ctypes.c_uint64), ("fd", ctypes.c_int32)]
    where = os.open(home, os.O_PATH | os.O_CLOEXEC)
    rule = Beneath(fs, where)
    if libc.syscall(445, ruleset, 1, ctypes.byref(rule), 0) != 0:
        say("error: landlock rule: " + os.strerror(ctypes.get_errno()))
    if libc.prctl(38, 1, 0, 0, 0) != 0 or libc.syscall(446, ruleset, 0) != 0:
        say("error: landlock: " + os.strerror(ctypes.get_errno()))
    os.close(where)
    os.close(ruleset)
"""
RUNNER = RUNNER.replace("    LANDLOCK", LANDLOCK)


@dataclass(frozen=True)
class Limits:
    timeout_s: float
    memory_gib: float


@cache
def landlock_abi() -> int:
    """The kernel's Landlock ABI version (0: none)."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        abi = int(libc.syscall(444, None, 0, 1))
    except (OSError, AttributeError):
        return 0
    return max(abi, 0)


@cache
def landlock_works() -> bool:
    """Whether a program can run under Landlock here (a container may refuse the calls): one
    trial program that must pass."""
    if landlock_abi() < 1:
        return False
    return _run_one("x = 1\n", Limits(5.0, 1.0), landlock=True).startswith("passed")


def isolation(limits: Limits) -> dict:
    """What keeps a program from harming anything, as report.json records it."""
    abi = landlock_abi() if landlock_works() else 0
    return {
        "process": "a new python -I process per program, its own session, in a fresh temporary "
        "directory; stdin closed, no inherited file descriptors, output to /dev/null",
        "limits": {
            "RLIMIT_AS_gib": limits.memory_gib,
            "RLIMIT_CPU_s": int(math.ceil(limits.timeout_s)) + 1,
            "RLIMIT_FSIZE_bytes": FILE_LIMIT,
            "RLIMIT_NPROC": 0,
            "wall_clock_s": limits.timeout_s,
        },
        "audit_hook": "writes, removals and renames outside the directory; processes, signals, "
        "sockets and ctypes refused",
        "landlock": (
            {"abi": abi, "writes": "the temporary directory only"}
            | ({"tcp": "refused"} if abi >= 4 else {})
            | ({"signals": "own process only"} if abi >= 6 else {})
        )
        if abi
        else None,
        "root_note": "RLIMIT_NPROC does not bind root; the audit hook refuses new processes"
        if os.geteuid() == 0
        else None,
    }


def _run_one(program: str, limits: Limits, landlock: bool) -> str:
    """Run one program; its result: ``passed``, ``failed: ...``, ``timed out``."""
    token = secrets.token_hex(16)
    home = tempfile.mkdtemp(prefix="bake-task-")
    try:
        with open(os.path.join(home, "program.py"), "w", encoding="utf-8") as fh:
            fh.write(program)
        argv = [
            sys.executable,
            "-I",
            "-B",
            "-c",
            RUNNER,
            token,
            home,
            repr(float(limits.timeout_s)),
            str(int(limits.memory_gib * (1 << 30))),
            "1" if landlock else "0",
        ]
        env = {"PATH": "/usr/bin:/bin", "HOME": home, "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen(
            argv,
            cwd=home,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            close_fds=True,
            start_new_session=True,
        )
        try:
            out, _ = proc.communicate(timeout=limits.timeout_s + GRACE_S + 2.0)
        except subprocess.TimeoutExpired:
            _kill(proc)
            return "timed out"
        finally:
            _kill(proc)  # whatever the program left in its process group
        text = out[:VERDICT_LIMIT].decode("utf-8", "replace")
        if not text.startswith(token + " "):
            if proc.returncode is not None and proc.returncode < 0:
                sig = signal.Signals(-proc.returncode).name
                if sig in ("SIGXCPU", "SIGKILL"):
                    return "timed out"
                return f"failed: killed by {sig}"
            return f"failed: the program ended before its checks (exit {proc.returncode})"
        return text[len(token) + 1 :]
    finally:
        shutil.rmtree(home, ignore_errors=True)


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def run(program: str, limits: Limits) -> str:
    """Run ``program`` in the sandbox; ``passed``, ``failed: <why>`` or ``timed out``."""
    return _run_one(program, limits, landlock_works())


def run_all(
    programs: Sequence[str],
    limits: Limits,
    workers: int | None = None,
    on_result: Callable[[int, str], None] | None = None,
) -> list[str]:
    """Each program's result, ``workers`` at a time (default: the cores, at most 4)."""
    workers = workers or max(1, min(4, os.cpu_count() or 1))
    landlock = landlock_works()
    results = [""] * len(programs)

    def one(i: int) -> None:
        results[i] = _run_one(programs[i], limits, landlock)
        if on_result is not None:
            on_result(i, results[i])

    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(one, range(len(programs))))
    return results
