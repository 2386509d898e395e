"""A small model config, a fake adapter source and helpers for pool tests."""
from __future__ import annotations

import time

import torch

from inference_node.adapters.errors import AdapterNotFound
from inference_node.adapters.manager import AdapterManager
from inference_node.adapters.slots import SlotBuffers
from inference_node.adapters.weights import AdapterWeights, build_adapter_weights
from inference_node.engine.request import Request, SamplingParams
from inference_node.model.config import ModelConfig

CONFIG = ModelConfig.from_dict(dict(
    model_type="llama", vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64))


class FakeSource:
    """Adapters in memory; `versions[name]` is the current version (bump it to re-upload)."""

    def __init__(self, names: list[str], rank: int = 4, ranks: dict[str, int] | None = None) -> None:
        self.versions = {n: "v1" for n in names}
        self.rank = rank
        self.ranks = ranks or {}  # a rank of its own per name (else `rank`)
        self.loads: list[tuple[str, str]] = []

    def load(self, name: str, version: str, cancel=None) -> AdapterWeights:
        if name not in self.versions:
            raise AdapterNotFound(f"no adapter {name!r}")
        version = version or self.versions[name]
        self.loads.append((name, version))
        torch.manual_seed(hash((name, version)) % 1000)
        rank = self.ranks.get(name, self.rank)
        fan_in, fan_out = CONFIG.module_shapes()["q_proj"]
        pairs = {(layer, "q_proj"): (torch.randn(rank, fan_in), torch.randn(fan_out, rank))
                 for layer in range(CONFIG.num_layers)}
        return build_adapter_weights(name, version, rank, 8.0, False, pairs, CONFIG, 8)


def make_manager(names: list[str], max_loras: int = 2, max_cpu: int = 8, rows: int | None = None,
                 ranks: dict[str, int] | None = None, eviction: str = "lru"
                 ) -> tuple[AdapterManager, FakeSource]:
    """rows: rank rows of adapter memory per module (default: max_loras adapters of rank 4);
    ranks: a rank per adapter name (default 4); eviction: the GPU eviction policy."""
    source = FakeSource(names, ranks=ranks)
    buffers = SlotBuffers(CONFIG, max_loras, 8, torch.float32, torch.device("cpu"),
                          rows=rows if rows is not None else 4 * max_loras)
    return AdapterManager(buffers, source, max_cpu, fetch_workers=1, eviction=eviction), source


def request(adapter: str) -> Request:
    return Request([1, 2, 3], SamplingParams(max_tokens=4), emit=lambda e: None, adapter=adapter)


def pump(manager: AdapterManager, waiting: list[Request] = (), timeout: float = 10.0) -> None:
    """Runs the manager's per-step work until its background loads are applied."""
    deadline = time.monotonic() + timeout
    manager.prepare(waiting)
    while manager.busy():
        assert time.monotonic() < deadline, "adapter load did not finish"
        time.sleep(0.005)
        manager.prepare(waiting)
    manager.prepare(waiting)


def load(manager: AdapterManager, name: str, pin: bool = False):
    outcome = {}
    manager.load(name, "", pin, lambda e, err: outcome.update(entry=e, error=err))
    pump(manager)
    assert outcome, "load did not complete"
    return outcome["entry"], outcome["error"]


def bind(manager: AdapterManager, name: str) -> Request:
    req = request(name)
    pump(manager, [req])
    assert manager.try_bind(req), f"{name} should be resident"
    return req
