"""A mixture-of-experts model's expert LoRA is adapter memory like the rest: its arenas are cut
from --lora-memory-mb and allocated at start, an adapter's expert rows are placed and evicted
with its slot, and one whose expert rows outgrow their arena is refused in one line while the
node keeps serving everyone else."""
from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import torch

from family_checkpoints import make_family_adapter
from harness import InProcessNode
from inference_node.adapters.errors import AdapterTooLarge
from inference_node.adapters.manager import AdapterManager
from inference_node.adapters.slots import SlotBuffers, budget_row_nbytes, rows_for_budget
from inference_node.adapters.weights import AdapterWeights, build_adapter_weights
from inference_node.config import NodeConfig
from inference_node.engine.request import Request, SamplingParams
from inference_node.model.config import ModelConfig
from lora_client.node_client import NodeClient
from pool_support import load, pump


class ExpertSource:
    """Adapters of LoRA on the experts only (PEFT's layout: gate_up_proj at twice the rank),
    of rank `ranks[name]`."""

    def __init__(self, config: ModelConfig, ranks: dict[str, int]) -> None:
        self.config, self.ranks = config, ranks

    def load(self, name: str, version: str, cancel=None) -> AdapterWeights:
        rank, config, num = self.ranks[name], self.config, self.config.num_experts
        torch.manual_seed(len(name))
        shapes = config.expert_shapes()
        ranks = {"gate_up_proj": 2 * rank, "down_proj": rank}
        pairs = {(layer, f"experts.{p}"): (torch.randn(ranks[p] * num, shapes[p][0]),
                                           torch.randn(shapes[p][1], ranks[p] * num))
                 for layer in range(config.num_layers) for p in ranks}
        return build_adapter_weights(name, version or "v1", rank, 8.0, False, pairs, config, 16,
                                     expert_ranks=ranks, expert_scalings={"gate_up_proj": 2.0, "down_proj": 2.0})


def expert_manager(config: ModelConfig, budget: int, ranks: dict[str, int], eviction: str = "lru"
                   ) -> AdapterManager:
    """A manager whose adapter memory is `budget` bytes (--lora-memory-mb), as the node sizes it."""
    buffers = SlotBuffers(config, 2, 16, torch.float32, torch.device("cpu"),
                          rows=rows_for_budget(config, torch.float32, budget))
    return AdapterManager(buffers, ExpertSource(config, ranks), 8, fetch_workers=1, eviction=eviction)


def arena_storages(buffers: SlotBuffers) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in list(buffers.experts.a.values()) + list(buffers.experts.b.values())}


@pytest.mark.parametrize("eviction", ["lru", "gdsf"])
def test_a_budget_of_n_expert_adapters_holds_n_and_evicts_for_the_next(tiny_mixtral_path: Path,
                                                                       eviction: str) -> None:
    """13 rank rows per module: the experts' gate_up arena holds 26 rows, down's 13, so three
    rank-4 expert adapters (8 and 4 rows each) and not four. (Before expert LoRA was adapter
    memory, such adapters took no rows at all and none was ever evicted.)"""
    config = ModelConfig.from_checkpoint(tiny_mixtral_path)
    budget = 13 * budget_row_nbytes(config, torch.float32)
    names = [f"e{i}" for i in range(5)]
    m = expert_manager(config, budget, dict.fromkeys(names, 4), eviction)
    buffers = m.buffers
    assert buffers.rows == 13 and buffers.nbytes() <= budget
    assert (buffers.arenas["experts.gate_up_proj"].rows, buffers.arenas["experts.down_proj"].rows) == (26, 13)
    storages = arena_storages(buffers)

    def check(resident: int, live: list[Request] = ()) -> None:
        m.check_consistency(live)
        on_gpu = [e for e in m.slots if e is not None]
        assert len(on_gpu) == resident
        assert sum(e.gpu_nbytes for e in on_gpu) == buffers.used_nbytes() <= buffers.nbytes() <= budget
        for e in on_gpu:  # the slot's expert rows are views of the arenas allocated at start
            assert e.ranks == {"experts.gate_up_proj": 8, "experts.down_proj": 4}
            held = buffers.experts.of(e.slot)
            assert held is not None and len(held) == 2 * config.num_layers
            assert {t.untyped_storage().data_ptr() for a, b, _ in held.values() for t in (a, b)} <= storages
            # the device tables the fused experts read by slot: (first row, rank) per parameter
            first_gu, rank_gu, first_down, rank_down = buffers.experts.slot_rows[:, e.slot].tolist()
            assert (rank_gu, rank_down) == (8, 4) and first_gu + 8 <= 26 and first_down + 4 <= 13
            assert (buffers.experts.slot_scales[:, e.slot] > 0).all()
        held_slots = {e.slot for e in on_gpu}
        for slot in set(range(buffers.experts.slot_rows.shape[1])) - held_slots:  # freed slots read rank 0
            assert not buffers.experts.slot_rows[:, slot].any() and not buffers.experts.slot_scales[:, slot].any()

    for i, name in enumerate(names[:3]):
        entry, error = load(m, name)
        assert error is None and entry.resident
        check(i + 1)
    assert m.stats["evictions"] == 0
    entry, error = load(m, "e3")
    assert error is None and entry.resident and m.stats["evictions"] == 1
    check(3)
    # A running adapter is not evicted for an idle one's sake: the next load takes an idle one.
    running = next(e for e in m.slots if e is not None and e.name != "e3")
    req = Request([1, 2, 3], SamplingParams(max_tokens=4), emit=lambda e: None, adapter=running.name)
    assert m.try_bind(req)
    entry, error = load(m, "e4")
    assert error is None and entry.resident and m.stats["evictions"] == 2 and running.resident
    check(3, [req])
    m.release(req)
    check(3)
    assert m.active == 0 and all(e.refs == 0 for e in m.entries())
    assert arena_storages(buffers) == storages
    m.shutdown()


def test_an_expert_adapter_larger_than_adapter_memory_is_refused_in_one_line(tiny_mixtral_path: Path) -> None:
    """Rank 8 on the experts (gate_up: 16 rows) where the gate_up arena holds 12: refused by
    an admin load and for a request, RESOURCE_EXHAUSTED with the sizes, no retry."""
    config = ModelConfig.from_checkpoint(tiny_mixtral_path)
    m = expert_manager(config, 6 * budget_row_nbytes(config, torch.float32), {"big": 8, "small": 4})
    entry, error = load(m, "big", pin=True)
    assert entry is None and isinstance(error, AdapterTooLarge)
    assert not m.current["big"].pinned  # its host copy may go like any idle one's
    message = str(error)
    assert error.status == grpc.StatusCode.RESOURCE_EXHAUSTED and not error.retry_may_help
    assert "\n" not in message and "16 rank rows of experts.gate_up_proj" in message, message
    assert "holds 12 rows" in message and " MB" in message and "--lora-memory-mb" in message, message
    req = Request([1, 2, 3], SamplingParams(max_tokens=4), emit=lambda e: None, adapter="big")
    pump(m, [req])
    failures = m.collect_failures([req])
    assert len(failures) == 1 and isinstance(failures[0][1], AdapterTooLarge)
    assert m.buffers.used_nbytes() == 0 and all(e is None for e in m.slots)
    entry, error = load(m, "small")  # the node keeps serving adapters that fit
    assert error is None and entry.resident
    m.check_consistency([])
    m.shutdown()


@pytest.mark.timeout(300)
def test_the_node_refuses_an_expert_adapter_too_large_for_its_memory_and_serves_the_rest(
        tiny_mixtral_path: Path, tmp_path: Path) -> None:
    config = ModelConfig.from_checkpoint(tiny_mixtral_path)
    root = tmp_path / "adapters"
    make_family_adapter(tiny_mixtral_path, root / "big", 8, 16.0, ["w1", "w3", "w2"], seed=1, scale=3.0)
    make_family_adapter(tiny_mixtral_path, root / "small", 2, 4.0, ["q_proj", "w1", "w3", "w2"], seed=2, scale=3.0)
    node = InProcessNode(NodeConfig.of(checkpoint=str(tiny_mixtral_path), device="cpu", dtype="float32",
                                       num_kv_blocks=64, max_loras=2, max_lora_rank=8,
                                       lora_memory_bytes=6 * budget_row_nbytes(config, torch.float32),
                                       adapter_dir=str(root), debug_checks=True))
    try:
        assert node.node.adapters.buffers.arenas["experts.gate_up_proj"].rows == 12
        with NodeClient(node.address) as client:
            with pytest.raises(grpc.RpcError) as err:
                client.generate(client.request(adapter="big", prompt_token_ids=[11, 400, 9000], max_tokens=3),
                                timeout=120)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            details = err.value.details()
            assert "\n" not in details and "experts.gate_up_proj" in details and "--lora-memory-mb" in details
            got = client.generate(client.request(adapter="small", prompt_token_ids=[11, 400, 9000], max_tokens=4,
                                                 ignore_eos=True), timeout=120)
            assert len(got.token_ids) == 4
        node.check_idle()
        assert all(e.refs == 0 for e in node.node.adapters.entries())
    finally:
        node.stop()


def test_the_experts_arenas_are_held_with_the_mlp_modules_named(tiny_qwen3_moe_path: Path) -> None:
    """--lora-modules q_proj,v_proj keeps no expert memory and refuses expert adapters from
    their config, naming the flag; gate_proj,up_proj hold the experts' gate_up_proj only."""
    from inference_node.adapters.slots import held_modules
    from inference_node.adapters.weights import never_servable
    from inference_node.model.families import FAMILIES

    config, family = ModelConfig.from_checkpoint(tiny_qwen3_moe_path), FAMILIES["qwen3_moe"]
    targets = ("q_proj", "experts.gate_up_proj", "experts.down_proj")
    qv = SlotBuffers(config, 2, 8, torch.float32, torch.device("cpu"), rows=8, modules=("q_proj", "v_proj"))
    assert qv.experts.nbytes() == 0 and qv.arenas["experts.gate_up_proj"].rows == 0
    refusal = never_servable("a", 4, targets, 16, held_modules(("q_proj", "v_proj")), family)
    assert refusal is not None and "\n" not in refusal and "--lora-modules" in refusal
    assert "experts.gate_up_proj,experts.down_proj" in refusal, refusal
    gate_up = SlotBuffers(config, 2, 8, torch.float32, torch.device("cpu"), rows=8, modules=("q_proj", "gate_proj"))
    assert (gate_up.arenas["experts.gate_up_proj"].rows, gate_up.arenas["experts.down_proj"].rows) == (16, 0)
    refusal = never_servable("a", 4, targets, 16, held_modules(("q_proj", "gate_proj")), family)
    assert refusal is not None and "experts.down_proj" in refusal and "gate_up" not in refusal.split(";")[0]
    assert never_servable("a", 4, targets, 16, held_modules(("q_proj", "gate_proj", "down_proj")), family) is None


def test_routed_layers_hold_no_dense_mlp_rows(tiny_qwen3_moe_path: Path) -> None:
    """A routed layer has no dense MLP: its gate/up and down arenas are empty and the budget
    buys rows for the dense layers' only (the tiny Qwen3-MoE's layer 1), where before every
    layer's were allocated for adapters that cannot target them (the family's adapters
    carry their MLP LoRA on the experts)."""
    config = ModelConfig.from_checkpoint(tiny_qwen3_moe_path)
    routed = [layer for layer in range(config.num_layers) if config.is_moe_layer(layer)]
    assert routed and config.dense_layers == (1,)
    buffers = SlotBuffers(config, 2, 16, torch.float32, torch.device("cpu"))
    for layer, groups in enumerate(buffers.layers):
        rows = {g: groups[g].b_all.shape[0] for g in ("qkv", "o", "gate_up", "down")}
        mlp = 0 if layer in routed else buffers.rows
        assert rows == {"qkv": buffers.rows, "o": buffers.rows, "gate_up": mlp, "down": mlp}, layer
    h, inter = config.module_shapes()["down_proj"][::-1]
    assert buffers.row_nbytes["down_proj"] == len(config.dense_layers) * (inter + h) * 4


def test_a_slot_holds_at_most_its_largest_rank_and_the_kernels_tile_by_it(tiny_mixtral_path: Path) -> None:
    """Arenas deep enough for several adapters hand the LoRA kernels a slot's most rows (the
    largest rank served; twice that in gate_up_proj's arena), not the arena's depth, and refuse
    to write an adapter past it."""
    config = ModelConfig.from_checkpoint(tiny_mixtral_path)
    buffers = SlotBuffers(config, 4, 8, torch.float32, torch.device("cpu"))
    experts, layer = buffers.experts, next(i for i in range(config.num_layers) if config.is_moe_layer(i))
    slots = torch.zeros(3, dtype=torch.int32)
    assert experts.a[(layer, "gate_up_proj")].shape[1] == 2 * experts.a[(layer, "down_proj")].shape[1] == 2 * 4 * 8
    assert experts.pair_lora(layer, "gate_up_proj", slots).max_rank == 16
    assert experts.pair_lora(layer, "down_proj", slots).max_rank == 8
    too_deep = ExpertSource(config, {"r16": 16}).load("r16", "v1")
    with pytest.raises(ValueError, match="rank 32 is more than the 16 rows a slot may hold"):
        experts.write(0, too_deep.experts, {"experts.gate_up_proj": 0, "experts.down_proj": 0})
