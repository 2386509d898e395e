"""The floors' bytes (bench/harness.py) and a tensor-parallel step's collectives
(bench/tensor_parallel.py) against the node's own code: the bytes of the tensors the loader
makes at TP 1, the shards the loader and parallel/shard.py give each rank at TP 2 and 4, and
the collectives a forward pass really calls."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench import harness
from bench import tensor_parallel
from bench.harness import ALL_MODULES, QV
from bench.shapes import LLAMA_3_1_8B, LLAMA_3_2_1B, TINY_LLAMA
from inference_node.engine.kv_cache import KVCache
from inference_node.model.checkpoint import DummyTensors
from inference_node.model.config import ModelConfig
from inference_node.model.forward import ForwardBatch
from inference_node.model.launch import LaunchChoices
from inference_node.model.llama import LlamaModel
from inference_node.model.loader import load_model
from kernels.tuning import DEFAULT_TUNING
from inference_node.parallel.group import TensorParallel
from inference_node.parallel.shard import COLUMN_PARALLEL, Shard

BF16 = 2
QWEN_LIKE_1B = {**LLAMA_3_2_1B, "model_type": "qwen2", "attention_bias": True}  # q/k/v biases
SHAPES = {"llama-1b": LLAMA_3_2_1B, "llama-8b": LLAMA_3_1_8B, "qwen-like-1b": QWEN_LIKE_1B}


class OldBytes:
    """The bytes of the tensors a loaded model holds, counted from the model itself."""

    def __init__(self, model, adapter_bytes: dict[str, int]) -> None:
        cfg = model.config
        es = model.dtype.itemsize
        tensors = [model.final_norm, model.lm_head]
        for layer in model.layers:
            tensors += [layer.input_norm, layer.qkv, layer.o, layer.post_norm, layer.gate_up, layer.down]
            if layer.qkv_bias is not None:
                tensors.append(layer.qkv_bias)
        self.weights = sum(t.numel() * t.element_size() for t in tensors)
        self.embed_row = cfg.hidden_size * es
        self.kv_token = cfg.num_layers * 2 * cfg.kv_size * es
        self.adapter = adapter_bytes

    def step(self, batch: int, adapters: frozenset[str], kv_tokens: int) -> int:
        return (self.weights + batch * self.embed_row + kv_tokens * self.kv_token
                + sum(self.adapter[a] for a in adapters))


def old_adapter_nbytes(model_cfg, rank: int, targets, itemsize: int) -> int:
    shapes = model_cfg.module_shapes()
    return model_cfg.num_layers * sum(rank * sum(shapes[m]) for m in targets) * itemsize


class MetaTensors(DummyTensors):
    """The dummy checkpoint's tensors on the meta device: shapes without memory, so the real
    loader builds an 8B model (or one rank's shard of it) in a test."""

    def __init__(self, shapes: dict, device: torch.device, dtype: torch.dtype, **kwargs) -> None:
        super().__init__(shapes, torch.device("cpu"), dtype, **kwargs)
        self.device = torch.device("meta")

    def pop(self, name, rows=None, cols=None):
        out = torch.empty(self.shapes.pop(name), dtype=self.dtype, device="meta")
        if rows is not None:
            out = out[rows[0]:rows[1]]
        if cols is not None:
            out = out[:, cols[0]:cols[1]]
        return out


def meta_model(tmp_path: Path, raw: dict, monkeypatch: pytest.MonkeyPatch, shard: Shard | None = None) -> LlamaModel:
    import inference_node.model.loader as loader

    monkeypatch.setattr(loader, "DummyTensors", MetaTensors)
    folder = tmp_path / f"{raw['model_type']}-{raw['hidden_size']}-{raw.get('attention_bias')}"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(raw))
    tp = TensorParallel(shard) if shard is not None else None
    return load_model(folder, torch.device("meta"), torch.bfloat16, max_positions=64,
                           load_format="dummy", tp=tp)


@pytest.mark.parametrize("name", list(SHAPES))
def test_tp1_floor_is_the_loaded_models_bytes(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    raw = SHAPES[name]
    cfg = ModelConfig.from_dict(raw)
    model = meta_model(tmp_path, raw, monkeypatch)
    abytes = {f"r16-{k}": old_adapter_nbytes(cfg, 16, ALL_MODULES, BF16) for k in range(3)}
    abytes |= {f"r8-qv-{k}": old_adapter_nbytes(cfg, 8, QV, BF16) for k in range(2)}
    old = OldBytes(model, abytes)
    new = harness.StepBytes.of(cfg, BF16, {n: harness.adapter_bytes_per_rank(cfg, int(n[1:n.index("-")]),
                                                                             QV if "qv" in n else ALL_MODULES, BF16)
                                           for n in abytes})
    assert (new.weights, new.embed_row, new.kv_token, dict(new.adapter)) == \
        (old.weights, old.embed_row, old.kv_token, abytes)
    for batch, adapters, kv in ((1, frozenset(), 17), (64, frozenset({"r16-0", "r16-2"}), 64 * 700),
                                (33, frozenset({"r8-qv-1"}), 5000)):
        assert new.step(batch, adapters, kv) == old.step(batch, adapters, kv)
    # The TP benchmark's floor at TP 1: the same bytes over the same bandwidth, no collectives.
    memory, comm = tensor_parallel.decode_floor_s(cfg, BF16, 1, rows=64, context=700, read_bandwidth=3e12, adapters=3)
    assert memory == pytest.approx(old.step(64, frozenset({"r16-0", "r16-1", "r16-2"}), 64 * 700) / 3e12)
    assert comm == 0 and tensor_parallel.collectives_per_step(cfg, 1) == tensor_parallel.Collectives(0, 0, 0)


def loaded_weight_bytes(model: LlamaModel) -> int:
    tensors = [model.final_norm, model.lm_head]
    for layer in model.layers:
        tensors += [layer.input_norm, layer.qkv, layer.o, layer.post_norm, layer.gate_up, layer.down]
        if layer.qkv_bias is not None:
            tensors.append(layer.qkv_bias)
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("name,tp", [("llama-8b", 2), ("llama-8b", 4), ("llama-1b", 2), ("qwen-like-1b", 2)])
def test_weights_per_rank_are_the_loaders_shards(name: str, tp: int, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    raw = SHAPES[name]
    cfg = ModelConfig.from_dict(raw)
    per_rank = harness.weight_bytes_per_rank(cfg, BF16, tp)
    for rank in (0, tp - 1):
        assert loaded_weight_bytes(meta_model(tmp_path, raw, monkeypatch, Shard(rank, tp))) == per_rank
    # Everything but the replicated norms divides by TP (these vocabularies divide evenly).
    norms = harness.norm_bytes(cfg, BF16)
    whole = harness.weight_bytes_per_rank(cfg, BF16, 1)
    assert tp * (per_rank - norms) == whole - norms
    assert norms == (2 * cfg.num_layers + 1) * cfg.hidden_size * BF16


def test_uneven_vocabulary_counts_the_padded_block() -> None:
    cfg = ModelConfig.from_dict({**LLAMA_3_1_8B, "vocab_size": 49153})
    even = ModelConfig.from_dict(LLAMA_3_1_8B)
    extra = harness.weight_bytes_per_rank(cfg, BF16, 2) - harness.weight_bytes_per_rank(even, BF16, 2)
    assert extra == cfg.hidden_size * BF16  # ceil(49153 / 2) = 24577 rows on every rank


@pytest.mark.parametrize("tp", [2, 4])
def test_adapter_bytes_per_rank_split_as_the_shards(tp: int) -> None:
    cfg = ModelConfig.from_dict(LLAMA_3_1_8B)
    shapes = cfg.module_shapes()
    r = 16
    for module in ALL_MODULES:
        fan_in, fan_out = shapes[module]
        a = torch.empty(r, fan_in, dtype=torch.bfloat16, device="meta")
        b = torch.empty(fan_out, r, dtype=torch.bfloat16, device="meta")
        for rank in range(tp):
            a_s, b_s = Shard(rank, tp).lora_pair(module, a, b)
            held = (a_s.numel() + b_s.numel()) * BF16
            assert harness.adapter_bytes_per_rank(cfg, r, [module], BF16, tp) == cfg.num_layers * held
        split_b = module in COLUMN_PARALLEL  # B with column layers, A with row layers
        expected = r * (fan_in + fan_out // tp) if split_b else r * (fan_in // tp + fan_out)
        assert harness.adapter_bytes_per_rank(cfg, r, [module], BF16, tp) == cfg.num_layers * expected * BF16
    whole = harness.adapter_bytes_per_rank(cfg, r, ALL_MODULES, BF16, 1)
    assert harness.adapter_bytes_per_rank(cfg, r, ALL_MODULES, BF16, tp) < whole
    assert harness.adapter_bytes_per_rank(cfg, r, QV, BF16, tp) == \
        harness.adapter_bytes_per_rank(cfg, r, ["q_proj"], BF16, tp) + \
        harness.adapter_bytes_per_rank(cfg, r, ["v_proj"], BF16, tp)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_kv_per_token_is_the_ranks_cache(tp: int) -> None:
    cfg = ModelConfig.from_dict(LLAMA_3_1_8B)
    local = Shard(0, tp).local_config(cfg)
    assert harness.kv_bytes_per_token(cfg, BF16, tp) == KVCache.bytes_per_block(local, 1, torch.bfloat16)


class CountingParallel:
    """Rank 0 of `size` as the model sees it, counting its collectives (sums nothing)."""

    def __init__(self, size: int) -> None:
        self.shard = Shard(0, size)
        self.rank, self.size = 0, size
        self.fused = None  # the real group's sum-then-add + norm (all_reduce_add_norm) runs its all_reduce
        self.all_reduces: list[tuple[int, ...]] = []
        self.gathers: list[tuple[int, ...]] = []
        self.broadcasts: list[tuple[int, ...]] = []

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.all_reduces.append(tuple(x.shape))
        return x

    all_reduce_add_norm = TensorParallel.all_reduce_add_norm

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        self.gathers.append(tuple(x.shape))
        return torch.cat([x] * self.size, dim=-1)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        self.broadcasts.append(tuple(x.shape))
        return x


@pytest.mark.parametrize("tp", [2, 4])
def test_collectives_are_those_a_decode_forward_calls(tp: int, tmp_path: Path) -> None:
    raw = {**TINY_LLAMA, "num_attention_heads": 4, "num_key_value_heads": 4}  # 4 KV heads: TP 4 splits them
    (tmp_path / "config.json").write_text(json.dumps(raw))
    group = CountingParallel(tp)
    model = load_model(tmp_path, torch.device("cpu"), torch.float32, max_positions=64,
                            load_format="dummy", tp=group)
    cfg, block = model.config, 16
    kv = KVCache(cfg, num_blocks=4, block_size=block, dtype=torch.float32, device=torch.device("cpu"))
    rows, context = 3, [5, 9, 2]  # a decode step: one new token per row
    batch = ForwardBatch(
        input_ids=torch.tensor([11, 4000, 49000]), positions=torch.tensor([c - 1 for c in context]),
        slot_mapping=torch.tensor([r * block + c - 1 for r, c in enumerate(context)]),
        block_tables=torch.tensor([[0], [1], [2]], dtype=torch.int32),
        query_start_loc=torch.arange(rows + 1, dtype=torch.int32), seq_lens=torch.tensor(context, dtype=torch.int32),
        logits_indices=torch.arange(rows), max_query_len=1, max_seq_len=max(context))
    logits = model.forward(batch, kv.k, kv.v, LaunchChoices.of(model.device, DEFAULT_TUNING))
    assert logits.shape == (rows, cfg.vocab_size)
    counts = tensor_parallel.collectives_per_step(model.full_config, tp)
    # broadcasts=1: a decode graph's step (ForwardBatch.feedback set) sends rank 0's token ids.
    assert counts == tensor_parallel.Collectives(all_reduces=2 * cfg.num_layers + 1, all_gathers=1, broadcasts=1)
    assert len(group.all_reduces) == counts.all_reduces
    assert set(group.all_reduces) == {(rows, cfg.hidden_size)}
    assert len(group.gathers) == counts.all_gathers
    assert group.gathers == [(rows, -(-cfg.vocab_size // tp))]


def test_tensor_parallel_floor_adds_the_collectives_of_an_allreduce_report() -> None:
    cfg = ModelConfig.from_dict(LLAMA_3_1_8B)
    report = {"world_size": 2, "device": "test", "results": [
        {"method": "nccl graph", "rows": rows, "hidden": 4096, "seconds": s}
        for rows, s in ((1, 8e-6), (64, 14e-6), (128, 20e-6))] + [
        {"method": "nccl graph", "rows": 64, "hidden": 8192, "seconds": 99e-6}]}
    ar, gather, bcast = tensor_parallel.collective_times(report, "nccl graph", cfg, 2, 64)
    assert (ar, bcast) == (14e-6, 8e-6)  # the broadcast: the smallest all-reduce of this hidden size
    busbw = tensor_parallel.bus_bandwidth(64 * 4096 * 2, 2, 14e-6)
    assert busbw == pytest.approx(64 * 4096 * 2 / 14e-6)  # NCCL's convention: 2 (n-1)/n bytes / time
    assert gather == pytest.approx(0.5 * 64 * 2 * 24576 * 2 / busbw)  # (n-1)/n of the gathered logits
    memory1, comm1 = tensor_parallel.decode_floor_s(cfg, BF16, 1, 64, 160, 3e12, adapters=32)
    memory2, comm2 = tensor_parallel.decode_floor_s(cfg, BF16, 2, 64, 160, 3e12, adapters=32, comm=(ar, gather, bcast))
    assert comm1 == 0 and comm2 == pytest.approx(65 * ar + gather + bcast)
    assert memory2 < memory1 and memory2 * 3e12 == harness.StepBytes.of(
        cfg, BF16, {f"a{k}": harness.adapter_bytes_per_rank(cfg, 16, ALL_MODULES, BF16, 2) for k in range(32)}, 2).step(
        64, frozenset(f"a{k}" for k in range(32)), 64 * 160)
    with pytest.raises(ValueError, match="of 2 processes, not 4"):
        tensor_parallel.collective_times(report, "nccl graph", cfg, 4, 64)
    with pytest.raises(ValueError, match=r"no 'nccl graph' all-reduce of \[32, 4096\]"):
        tensor_parallel.collective_times(report, "nccl graph", cfg, 2, 32)


def test_a_mixture_of_experts_holds_its_experts_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the node says it holds (and the benchmark leaves out of the KV cache's room) counts
    every tensor of the checkpoint once: the routers and experts too."""
    import math

    from bench.shapes import QWEN3_30B_A3B
    from inference_node.model.loader import checkpoint_shapes

    model = meta_model(tmp_path, QWEN3_30B_A3B, monkeypatch)
    shapes = checkpoint_shapes(ModelConfig.from_dict(QWEN3_30B_A3B))
    routed = BF16 * sum(math.prod(s) for n, s in shapes.items() if ".mlp." in n)  # routers and experts
    assert routed > 0.9 * BF16 * sum(math.prod(s) for s in shapes.values())
    assert model.weight_bytes() == LlamaModel.weight_bytes(model) + routed
