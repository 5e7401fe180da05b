"""The corpus: chunking, the document-disjoint and spread split, skips, the too-small error."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from conftest import write_docs
from omegaconf import OmegaConf

from bake.corpus.splits import load_corpus
from bake.errors import BakeError
from bake.models.tiny import byte_tokenizer


def ccfg(**kw):
    base = {
        "name": "t",
        "source": "text_files",
        "glob": None,
        "path": None,
        "field": "text",
        "chunk_len": 32,
        "held_chunks": 6,
        "calib_chunks": 24,
        "test_chunks": 0,
        "chunks_per_doc": 1,
    }
    base.update(kw)
    return OmegaConf.create(base)


def load(cfg, tmp_path, seed=0):
    return load_corpus(cfg, byte_tokenizer(), "bytes", seed, tmp_path / "cache")


def test_chunks_are_document_disjoint_and_spread(tmp_path):
    docs = write_docs(tmp_path / "d", 60)
    c = load(ccfg(glob=f"{docs}/*.py"), tmp_path)
    assert c.held.shape == (6, 32) and c.calib.shape == (24, 32)
    assert not set(c.held_docs) & set(c.calib_docs)
    assert len(c.calib_docs) == 24 and len(set(c.calib_docs)) == 24  # one chunk per document
    texts = {p.name: p.read_bytes() for p in docs.iterdir()}
    for chunk, name in zip(c.calib.tolist(), c.calib_docs, strict=True):
        assert bytes(t for t in chunk if t < 256) in texts[name.rsplit("/", 1)[-1]]


def test_chunks_per_doc_and_seed(tmp_path):
    docs = write_docs(tmp_path / "d", 40, min_lines=80, max_lines=90)
    three = load(ccfg(glob=f"{docs}/*.py", chunks_per_doc=3), tmp_path)
    assert len(three.calib_docs) == 8  # 24 chunks, 3 per document
    again = load(ccfg(glob=f"{docs}/*.py", chunks_per_doc=3), tmp_path)
    assert again.cached and torch.equal(again.calib, three.calib)
    other = load(ccfg(glob=f"{docs}/*.py", chunks_per_doc=3), tmp_path, seed=1)
    assert not torch.equal(other.calib, three.calib)


def test_short_documents_are_packed_with_eos(tmp_path):
    folder = tmp_path / "short"
    folder.mkdir()
    for i in range(200):
        (folder / f"{i:03d}.txt").write_text(f"doc {i}\n")
    c = load(ccfg(glob=f"{folder}/*.txt"), tmp_path)
    eos = byte_tokenizer().eos_token_id
    assert (c.calib == eos).sum(dim=1).min() >= 3  # several documents per chunk
    assert not set(c.held_docs) & set(c.calib_docs)


def test_too_few_calibration_chunks_names_count_and_settings(tmp_path):
    docs = write_docs(tmp_path / "d", 10)
    with pytest.raises(BakeError) as err:
        load(ccfg(glob=f"{docs}/*.py"), tmp_path)
    msg = str(err.value)
    assert "only 4 calibration chunks" in msg and "corpus.chunk_len" in msg
    assert "corpus.chunks_per_doc" in msg


def test_fewer_than_requested_is_a_warning(tmp_path, caplog):
    docs = write_docs(tmp_path / "d", 26)
    with caplog.at_level(logging.WARNING, logger="bake.corpus"):
        c = load(ccfg(glob=f"{docs}/*.py"), tmp_path)
    assert c.calib.shape[0] == 20
    assert "20 calibration chunks instead of corpus.calib_chunks=24" in caplog.text


def test_no_files_match(tmp_path):
    with pytest.raises(BakeError, match="corpus.glob=.*no documents found"):
        load(ccfg(glob=f"{tmp_path}/nothing/*.txt"), tmp_path)


def test_empty_binary_and_undecodable_files_are_skipped_and_counted(tmp_path, caplog):
    docs = write_docs(tmp_path / "d", 40)
    (docs / "empty.py").write_text("")
    (docs / "blank.py").write_text("   \n\n")
    (docs / "binary.py").write_bytes(b"\x00\x01\x02" * 100)
    (docs / "latin1.py").write_bytes("caf\xe9 au lait\n".encode("latin-1") * 50)
    with caplog.at_level(logging.WARNING, logger="bake.corpus"):
        c = load(ccfg(glob=f"{docs}/*.py", calib_chunks=30), tmp_path)
    assert c.skipped == {"empty": 2, "binary": 1, "not UTF-8": 1}
    assert "skipped: " in caplog.text and "1 binary" in caplog.text


def test_all_files_unusable_is_an_error_not_a_crash(tmp_path):
    folder = tmp_path / "bad"
    folder.mkdir()
    for i in range(5):
        (folder / f"{i}.txt").write_bytes(b"")
        (folder / f"{i}.bin").write_bytes(b"\xff\xfe\x00\x00" * 10)
    with pytest.raises(BakeError) as err:
        load(ccfg(glob=f"{folder}/*"), tmp_path)
    assert "0 usable of 10 documents read" in str(err.value)
    assert "5 empty" in str(err.value)


def test_jsonl_source(tmp_path):
    path = tmp_path / "d.jsonl"
    rows = [json.dumps({"text": f"document number {i} " * 8}) for i in range(40)]
    rows += ["not json", json.dumps({"other": "x"})]
    path.write_text("\n".join(rows) + "\n")
    c = load(ccfg(source="jsonl", path=str(path)), tmp_path)
    assert c.calib.shape == (24, 32)
    assert c.rejected_lines == {"not valid JSON": 1, "no string field 'text'": 1}
    assert c.skipped == {}  # every line that is a document was usable


def test_stdlib_is_the_default_source(tmp_path):
    c = load(ccfg(source="python_stdlib", chunk_len=64, calib_chunks=12), tmp_path)
    assert c.calib.shape == (12, 64)
    assert all(d.endswith(".py") and "site-packages" not in d for d in c.calib_docs)
