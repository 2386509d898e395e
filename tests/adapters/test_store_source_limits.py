"""What a node can never serve is known before any weight is read, and a store that cannot be
reached fails a load within seconds: the rules (`never_servable`), a folder source's catalog
and loads, and StoreSource against a store that takes connections and never answers."""
from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest

from harness import make_peft_adapter
from inference_node.adapters.errors import AdapterRejected, SourceUnreachable
from inference_node.adapters.slots import held_modules
from inference_node.adapters.sources import WEIGHTS_FILE, LocalDirSource
from inference_node.adapters.store_source import STORE_CONNECT_S, StoreSource
from inference_node.adapters.weights import LORA_MODULES, never_servable
from inference_node.model.config import ModelConfig


def test_the_rules_name_the_limit_and_its_flag() -> None:
    assert never_servable("a", 8, ("q_proj", "v_proj"), 8) is None
    assert never_servable("a", 16, ("q_proj",), 8) == ("adapter 'a' has rank 16; this node serves ranks up to 8 "
                                                       "(--max-lora-rank)")
    qkv = held_modules(("q_proj", "v_proj"))
    assert qkv == ("q_proj", "k_proj", "v_proj")  # a fused group is held whole
    assert never_servable("a", 8, ("k_proj",), 8, qkv) is None
    refusal = never_servable("a", 8, ("q_proj", "o_proj", "down_proj"), 8, qkv)
    assert refusal == ("adapter 'a' targets o_proj,down_proj; this node keeps adapter memory for "
                       "q_proj,k_proj,v_proj only (--lora-modules)")


@pytest.fixture(scope="module")
def folder(tmp_path_factory, tiny_llama_path) -> Path:
    root = tmp_path_factory.mktemp("limits")
    make_peft_adapter(tiny_llama_path, root / "fits", 4, 8.0, ["q_proj", "v_proj"], seed=1)
    make_peft_adapter(tiny_llama_path, root / "wide", 16, 32.0, ["q_proj", "v_proj"], seed=2)
    make_peft_adapter(tiny_llama_path, root / "mlp", 4, 8.0, ["q_proj", "down_proj"], seed=3)
    return root


def _source(folder: Path, tiny_llama_path: Path, modules=LORA_MODULES) -> LocalDirSource:
    return LocalDirSource(folder, ModelConfig.from_checkpoint(tiny_llama_path), max_rank=8, modules=modules)


def test_a_folder_lists_only_what_the_node_can_serve(folder, tiny_llama_path) -> None:
    assert [n for n, _ in _source(folder, tiny_llama_path).catalog()] == ["fits", "mlp"]
    assert [n for n, _ in _source(folder, tiny_llama_path, ("q_proj", "v_proj")).catalog()] == ["fits"]


def test_a_folder_refuses_from_the_config_before_reading_the_weights(folder, tiny_llama_path, tmp_path) -> None:
    copy = tmp_path / "wide"
    copy.mkdir()
    (copy / "adapter_config.json").write_bytes((folder / "wide" / "adapter_config.json").read_bytes())
    (copy / WEIGHTS_FILE).write_bytes(b"not safetensors at all")  # reading these would fail otherwise
    with pytest.raises(AdapterRejected, match=r"rank 16; this node serves ranks up to 8 \(--max-lora-rank\)"):
        _source(tmp_path, tiny_llama_path).load("wide", "")
    with pytest.raises(AdapterRejected, match=r"targets down_proj; .*\(--lora-modules\)"):
        _source(folder, tiny_llama_path, ("q_proj", "v_proj")).load("mlp", "")
    assert _source(folder, tiny_llama_path).load("mlp", "").rank == 4


class SilentListener:
    """Takes TCP connections and never says a word: a hung store, a black-holed port."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                self.held.append(self.sock.accept()[0])
            except OSError:
                return

    def close(self) -> None:
        self.sock.close()
        for conn in self.held:
            conn.close()


def test_a_store_that_never_answers_fails_a_load_within_seconds(tiny_llama_path) -> None:
    silent = SilentListener()
    source = StoreSource(silent.address, ModelConfig.from_checkpoint(tiny_llama_path), 8, fetch_deadline_s=60)
    try:
        started = time.monotonic()
        with pytest.raises(SourceUnreachable) as err:
            source.load("anything", "")
        waited = time.monotonic() - started
    finally:
        source.close()
        silent.close()
    assert waited < STORE_CONNECT_S + 1.5, waited  # not the 60 s fetch deadline
    assert str(err.value) == (f"adapter 'anything' is on no tier of this node and the adapter store at "
                              f"{silent.address} cannot be reached (no connection within {STORE_CONNECT_S:g}s): "
                              "the node serves it once the store is back")
    assert not err.value.retry_may_help
