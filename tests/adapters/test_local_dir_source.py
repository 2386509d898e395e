"""The local adapter folder as a source: files that passed once are trusted while unchanged,
and any write to them (even one that keeps their size and mtime) makes them checked again."""
from __future__ import annotations

import json
import os
import struct

import pytest

from harness import make_peft_adapter
from inference_node.adapters import sources
from inference_node.adapters.errors import AdapterRejected
from inference_node.adapters.sources import LocalDirSource
from inference_node.model.config import ModelConfig


@pytest.fixture
def root(tmp_path, tiny_llama_path):
    make_peft_adapter(tiny_llama_path, tmp_path / "a", 4, 8.0, ["q_proj", "v_proj"], seed=1)
    return tmp_path


@pytest.fixture
def counted(monkeypatch):
    """How often the source hashed files and which value scans it asked validation for."""
    calls = {"hash": 0, "check_values": []}
    real_hash, real_validate = sources.content_hash, sources.validate_adapter

    def content_hash(files):
        calls["hash"] += 1
        return real_hash(files)

    def validate_adapter(*args, check_values=True, **kwargs):
        calls["check_values"].append(check_values)
        return real_validate(*args, check_values=check_values, **kwargs)

    monkeypatch.setattr(sources, "content_hash", content_hash)
    monkeypatch.setattr(sources, "validate_adapter", validate_adapter)
    return calls


def source(root, tiny_llama_path) -> LocalDirSource:
    return LocalDirSource(root, ModelConfig.from_checkpoint(tiny_llama_path), max_rank=16)


def test_an_unchanged_adapter_is_loaded_again_without_hashing_or_scanning(root, tiny_llama_path, counted):
    src = source(root, tiny_llama_path)
    first, again = src.load("a", ""), src.load("a", "")
    assert again.version == first.version
    assert counted["hash"] == 1
    assert counted["check_values"] == [True, False]
    assert all((a1 == a2).all() and (b1 == b2).all()
               for (a1, b1), (a2, b2) in zip(first.tensors.values(), again.tensors.values()))


def test_a_file_rewritten_in_place_with_its_old_size_and_mtime_is_checked_again(root, tiny_llama_path, counted):
    src = source(root, tiny_llama_path)
    src.load("a", "")
    path = root / "a" / sources.WEIGHTS_FILE
    st = os.stat(path)
    with open(path, "r+b") as f:  # a NaN over the first value of the first tensor, in place
        header_len = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(header_len))
        first = min((v for k, v in header.items() if k != "__metadata__"), key=lambda v: v["data_offsets"][0])
        assert first["dtype"] == "F32"
        f.seek(8 + header_len + first["data_offsets"][0])
        f.write(struct.pack("<f", float("nan")))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_size == st.st_size and os.stat(path).st_mtime_ns == st.st_mtime_ns
    with pytest.raises(AdapterRejected, match="NaN|finite"):
        src.load("a", "")
    assert counted["check_values"] == [True, True]


def test_a_replaced_adapter_is_a_new_version(root, tiny_llama_path, counted):
    src = source(root, tiny_llama_path)
    before = src.load("a", "").version
    make_peft_adapter(tiny_llama_path, root / "a", 4, 8.0, ["q_proj", "v_proj"], seed=2)
    after = src.load("a", "")
    assert after.version != before
    assert counted["check_values"] == [True, True]
