"""The task corpus: documents, a document-disjoint held-out/calibration/test split, chunks.

Documents are read in sorted order and shuffled with the seed. The held-out set is filled
first, then the calibration set, then the test set, from DISJOINT documents, and no document
gives more than ``chunks_per_doc`` chunks: the held-out score then measures the task, not the
calibration files, and the test score is made on documents that neither the training nor any
choice made on held-out scores ever saw. A long document gives its chunks from seeded,
non-overlapping windows (of a seeded region, for very long ones); short documents are packed
with EOS between them into one chunk (the rest of the last one is dropped, so that it counts
once). A document is read once, however many paths lead to it (symbolic links) and whatever
name a copy of its content has. Only as many documents as the run needs are tokenised, and the
result is cached.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from bake.config import CorpusSource
from bake.config.schema import MIN_CALIB_CHUNKS
from bake.corpus.documents import Document, list_documents, read_document, rejected_lines
from bake.errors import BakeError
from bake.storage import cache
from bake.storage.cache import code_digest
from bake.storage.files import atomic_write

if TYPE_CHECKING:
    from torch import Tensor

log = logging.getLogger("bake.corpus")

# The modules whose source decides the chunks: a change to any of them is a new cache key.
CORPUS_CODE = ("bake.corpus.documents", "bake.corpus.globbing", "bake.corpus.splits")
_BATCH = 32  # documents tokenised per call (the tokenizer runs them in parallel)
_SPAN_CHARS_PER_TOKEN = 16  # a long document is tokenised over a random region of
# chunk_len * chunks_per_doc * this many characters (room for many windows at any tokenizer)


@dataclass
class Corpus:
    """Token chunks of the held-out, calibration and test sets, from disjoint documents."""

    held: Tensor  # [n_held, chunk_len]
    calib: Tensor  # [n_calib, chunk_len]
    test: Tensor  # [n_test, chunk_len] (may have no rows)
    key: str = ""  # identity of the chunks: settings, sources, tokenizer
    held_docs: list[str] = field(default_factory=list)
    calib_docs: list[str] = field(default_factory=list)
    test_docs: list[str] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)  # documents read and left out
    cached: bool = False
    rejected_lines: dict[str, int] = field(default_factory=dict)  # JSONL lines, no document

    @property
    def content_key(self) -> str:
        """Identity of the chunks themselves: a file that was only touched (or a cache rebuilt
        from the same text) keeps it, so results and checkpoints keyed by it stay valid."""
        h = hashlib.sha256()
        for t in (self.held, self.calib, self.test):
            h.update(str(tuple(t.shape)).encode())
            h.update(t.contiguous().numpy().tobytes())
        return h.hexdigest()[:20]


def _encode(tokenizer, texts: list[str]) -> list[list[int]]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:  # fast path, no length warnings, parallel over the batch
        return [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


def _region(text: str, span: int, rng: random.Random) -> tuple[str, bool]:
    """A random region of at most ``span`` characters starting at a line, and whether it
    reaches the document's end. Tokenising a whole book for one chunk would be wasted work."""
    if len(text) <= span:
        return text, True
    start = rng.randrange(len(text) - span + 1)
    if start:
        nl = text.find("\n", start, start + span // 4)
        start = nl + 1 if nl >= 0 else start
    return text[start : start + span], start + span >= len(text)


def _tokenised(
    docs: list[Document], tokenizer, skipped: Counter, span: int, rng: random.Random
) -> Iterator[tuple[int, Document, list[int], bool]]:
    """Yield (position, document, token ids, reaches the end) in order, in small batches."""
    contents: set[str] = set()
    for start in range(0, len(docs), _BATCH):
        batch = []
        for i, d in enumerate(docs[start : start + _BATCH]):
            text = read_document(d, skipped, contents)
            if text is not None:
                batch.append((start + i, d, *_region(text, span, rng)))
        if batch:
            ids = _encode(tokenizer, [text for _, _, text, _ in batch])
            yield from ((i, d, t, end) for (i, d, _, end), t in zip(batch, ids, strict=True))


class _Split:
    """Chunks of one split: windows of long documents, short documents packed together."""

    def __init__(
        self,
        want: int,
        chunk_len: int,
        per_doc: int,
        eos: int,
        rng: random.Random,
        prefix: tuple[int, ...] = (),
    ):
        self.want, self.per_doc, self.eos, self.rng = want, per_doc, eos, rng
        # A tokenizer that starts every text with BOS (Gemma's) gets it at the head of every
        # chunk: such models are lost without it (Gemma 3 270M: held-out 30.5 against 7.8).
        self.prefix = list(prefix)
        self.chunk_len = chunk_len - len(self.prefix)
        self.chunks: list[list[int]] = []
        self.docs: list[str] = []
        self._pack: list[int] = []
        self._pack_docs: list[str] = []

    @property
    def full(self) -> bool:
        return len(self.chunks) >= self.want

    def add(self, ident: str, ids: list[int], complete: bool = True) -> None:
        if complete:
            ids = ids + [self.eos]  # EOS closes every document
        n = self.chunk_len
        if len(ids) >= n:
            windows = len(ids) // n
            take = min(self.per_doc, windows, self.want - len(self.chunks))
            for w in sorted(self.rng.sample(range(windows), take)):
                self.chunks.append(self.prefix + ids[w * n : (w + 1) * n])
            self.docs.append(ident)
            return
        self._pack += ids
        self._pack_docs.append(ident)
        if len(self._pack) >= n:
            self.chunks.append(self.prefix + self._pack[:n])
            self.docs += self._pack_docs
            self._pack, self._pack_docs = [], []


def bos_prefix(tokenizer) -> tuple[int, ...]:
    """(BOS,) when the tokenizer puts BOS before every text it encodes, else ()."""
    bos = tokenizer.bos_token_id
    if bos is None:
        return ()
    plain = tokenizer("x", add_special_tokens=False)["input_ids"]
    added = tokenizer("x")["input_ids"]
    starts = bool(added) and added[0] == bos and (not plain or plain[0] != bos)
    return (bos,) if starts else ()


def _split(ccfg, docs: list[Document], tokenizer, seed: int, skipped: Counter):
    eos = tokenizer.eos_token_id
    if eos is None:
        raise BakeError("the model's tokenizer has no EOS token; bake separates documents by it")
    order = list(docs)
    random.Random(seed).shuffle(order)
    args = (
        ccfg.chunk_len,
        ccfg.chunks_per_doc,
        eos,
        random.Random(seed + 1),
        bos_prefix(tokenizer),
    )
    held, calib = _Split(ccfg.held_chunks, *args), _Split(ccfg.calib_chunks, *args)
    test = _Split(ccfg.test_chunks, *args)
    span = ccfg.chunk_len * ccfg.chunks_per_doc * _SPAN_CHARS_PER_TOKEN
    seen = len(order)
    for i, doc, ids, complete in _tokenised(
        order, tokenizer, skipped, span, random.Random(seed + 2)
    ):
        split = held if not held.full else calib if not calib.full else test
        split.add(doc.ident, ids, complete)
        if held.full and calib.full and test.full:
            seen = i + 1
            break
    return held, calib, test, seen


def _cache_key(ccfg, docs: list[Document], tokenizer_key: str, seed: int) -> str:
    # the splitting rules are this module's code: a change to it is a new key
    h = hashlib.sha256(f"corpus-{code_digest(CORPUS_CODE)}".encode())
    settings = {k: ccfg[k] for k in ("source", "glob", "path", "field", "chunk_len")}
    settings |= {
        k: ccfg[k] for k in ("held_chunks", "calib_chunks", "test_chunks", "chunks_per_doc")
    }
    h.update(json.dumps({**{k: str(v) for k, v in settings.items()}, "seed": seed}).encode())
    h.update(tokenizer_key.encode())
    for d in docs:
        if d.path is not None:
            st = d.path.stat()
            h.update(f"{d.ident}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    if ccfg.source == CorpusSource.jsonl:
        st = Path(ccfg.path).expanduser().stat()
        h.update(f"{st.st_size}\0{st.st_mtime_ns}".encode())
    return h.hexdigest()[:20]


def _check(
    ccfg,
    held: _Split,
    calib: _Split,
    test: _Split,
    skipped: Counter,
    seen: int,
    rejected: Counter,
) -> None:
    found = f"{seen - sum(skipped.values())} usable of {seen} documents read"
    if skipped:
        found += " (skipped: " + ", ".join(f"{n} {why}" for why, n in skipped.items()) + ")"
    if rejected:
        found += f"; {rejected_lines(rejected)}"
    if len(calib.chunks) < MIN_CALIB_CHUNKS:
        usable = seen - sum(skipped.values())
        fixes = ["add documents"]
        if usable < 2:  # held-out and calibration text never share a document
            fixes[0] += (
                " (held-out and calibration chunks come from different documents, and there "
                f"{'is' if usable == 1 else 'are'} {usable})"
            )
        fixes += ["lower corpus.chunk_len", "lower corpus.held_chunks"]
        if usable >= 2 and ccfg.chunks_per_doc * usable < ccfg.held_chunks + ccfg.calib_chunks:
            fixes.append(f"raise corpus.chunks_per_doc (now {ccfg.chunks_per_doc})")
        raise BakeError(
            f"corpus: only {len(calib.chunks)} calibration chunks of {ccfg.chunk_len} tokens "
            f"after {len(held.chunks)} held-out chunks, from {found}; bake needs at least "
            f"{MIN_CALIB_CHUNKS}: " + ", ".join(fixes[:-1]) + f" or {fixes[-1]}"
        )
    if skipped or rejected:
        log.warning("corpus: %s", found)
    if len(calib.chunks) < ccfg.calib_chunks:
        log.warning(
            "corpus: %d calibration chunks instead of corpus.calib_chunks=%d (%s); steps "
            "beyond them reuse chunks (chunk = step %% %d)",
            len(calib.chunks),
            ccfg.calib_chunks,
            found,
            len(calib.chunks),
        )
    if len(test.chunks) < ccfg.test_chunks:
        log.warning(
            "corpus: %d test chunks instead of corpus.test_chunks=%d (%s): the documents ran "
            "out after the held-out and calibration sets; test perplexities are %s",
            len(test.chunks),
            ccfg.test_chunks,
            found,
            "on fewer chunks" if test.chunks else "not measured",
        )


def load_corpus(ccfg, tokenizer, tokenizer_key: str, seed: int, cache_dir: Path) -> Corpus:
    """Build (or read from the cache) the held-out, calibration and test chunks."""

    skipped: Counter = Counter()  # documents read and left out
    rejected: Counter = Counter()  # JSONL lines that are no document
    docs = list_documents(ccfg, rejected)
    key = _cache_key(ccfg, docs, tokenizer_key, seed)
    path = Path(cache_dir) / "corpus" / f"{ccfg.name}-{key}.safetensors"
    with cache.building(path):  # bakes at once build it once
        corpus = cache.read(path, _read_cached)
        if corpus is not None:
            log.info("corpus: cached chunks from %s", path)
            return corpus
        return _build(ccfg, docs, tokenizer, seed, key, path, skipped, rejected)


def _build(ccfg, docs, tokenizer, seed: int, key: str, path: Path, skipped, rejected) -> Corpus:
    """Split, chunk and check the corpus, and write it to the cache at ``path``."""
    import torch  # lazy: torch
    from safetensors.torch import save_file  # lazy: safetensors

    held, calib, test, seen = _split(ccfg, docs, tokenizer, seed, skipped)
    _check(ccfg, held, calib, test, skipped, seen, rejected)
    corpus = Corpus(
        torch.tensor(held.chunks, dtype=torch.long),
        torch.tensor(calib.chunks, dtype=torch.long),
        torch.tensor(test.chunks, dtype=torch.long).reshape(-1, ccfg.chunk_len),
        key,
        held.docs,
        calib.docs,
        test.docs,
        dict(skipped),
        rejected_lines=dict(rejected),
    )
    info = {
        "key": key,
        "held_docs": held.docs,
        "calib_docs": calib.docs,
        "test_docs": test.docs,
        "skipped": dict(skipped),
        "rejected_lines": dict(rejected),
    }
    tensors = {"held": corpus.held, "calib": corpus.calib, "test": corpus.test}
    with atomic_write(path) as tmp:
        save_file(tensors, str(tmp), metadata={"info": json.dumps(info)})
    cache.seal(path)
    return corpus


def _read_cached(path: Path) -> Corpus:
    from safetensors import safe_open  # lazy: safetensors

    with safe_open(str(path), framework="pt") as fh:
        info = json.loads(fh.metadata()["info"])
        t = {k: fh.get_tensor(k) for k in ("held", "calib", "test")}
    return Corpus(
        t["held"],
        t["calib"],
        t["test"],
        info["key"],
        info["held_docs"],
        info["calib_docs"],
        info["test_docs"],
        info["skipped"],
        cached=True,
        rejected_lines=info.get("rejected_lines", {}),
    )


def calibration_texts(ccfg, corpus: Corpus) -> Iterator[str]:
    """The text of every document of the corpus outside the held-out and test splits (whole,
    not only the chunks sampled from them): what a task-trimmed vocabulary is counted on. A
    document whose content repeats a held-out or test document is left out as well."""
    rejected: Counter = Counter()
    docs = list_documents(ccfg, rejected)
    scored = set(corpus.held_docs) | set(corpus.test_docs)
    contents: set[str] = set()
    skipped: Counter = Counter()
    for d in docs:  # the scored documents' contents first: their copies are not calibration
        if d.ident in scored:
            read_document(d, skipped, contents)
    for d in docs:
        if d.ident not in scored:
            text = read_document(d, skipped, contents)
            if text is not None:
                yield text


def source_files(ccfg, corpus: Corpus) -> dict[str, list[int]]:
    """The files the corpus's chunks came from, each with its size and modification time: what
    a resume compares to name a file edited since the run started."""
    used = set(corpus.held_docs) | set(corpus.calib_docs) | set(corpus.test_docs)
    paths = {d.path for d in list_documents(ccfg, Counter()) if d.ident in used and d.path}
    if ccfg.source == CorpusSource.jsonl:
        paths.add(Path(ccfg.path).expanduser())
    out = {}
    for path in sorted(str(p) for p in paths):
        try:
            st = Path(path).stat()
            out[path] = [st.st_size, st.st_mtime_ns]
        except OSError:
            out[path] = [-1, -1]
    return out


def changed_files(recorded: dict[str, list[int]], now: dict[str, list[int]]) -> list[str]:
    """The files whose size or modification time differ between two :func:`source_files`."""
    return [path for path, stat in recorded.items() if now.get(path) != stat]
