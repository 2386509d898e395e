"""bench/tp_floor.py against the node's own code: the serving benchmark's former floor (the
bytes of the tensors the loader makes) at TP 1, the shards the loader and parallel/shard.py
give each rank at TP 2 and 4, and the collectives a forward pass really calls."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench import tp_floor
from bench.common import ALL_MODULES, LLAMA_3_1_8B, LLAMA_3_2_1B, QV, TINY_LLAMA
from inference_node.engine.kv_cache import KVCache
from inference_node.model.checkpoint import DummyTensors
from inference_node.model.config import ModelConfig
from inference_node.model.forward import ForwardBatch
from inference_node.model.launch import LaunchChoices
from inference_node.model.llama import LlamaModel
from kernels.tuning import DEFAULT_TUNING
from inference_node.parallel.group import TensorParallel
from inference_node.parallel.shard import COLUMN_PARALLEL, Shard

BF16 = 2
QWEN_LIKE_1B = {**LLAMA_3_2_1B, "model_type": "qwen2", "attention_bias": True}  # q/k/v biases
SHAPES = {"llama-1b": LLAMA_3_2_1B, "llama-8b": LLAMA_3_1_8B, "qwen-like-1b": QWEN_LIKE_1B}


class OldBytes:
    """serving_bench's floor before it moved to tp_floor (verbatim): the bytes of the tensors
    a loaded model holds."""

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

    def __init__(self, config: ModelConfig, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__(config, torch.device("cpu"), dtype)
        self.device = torch.device("meta")

    def pop(self, name, rows=None, cols=None):
        out = torch.empty(self.shapes.pop(name), dtype=self.dtype, device="meta")
        if rows is not None:
            out = out[rows[0]:rows[1]]
        if cols is not None:
            out = out[:, cols[0]:cols[1]]
        return out


def meta_model(tmp_path: Path, raw: dict, monkeypatch: pytest.MonkeyPatch, shard: Shard | None = None) -> LlamaModel:
    import inference_node.model.llama as llama

    monkeypatch.setattr(llama, "DummyTensors", MetaTensors)
    folder = tmp_path / f"{raw['model_type']}-{raw['hidden_size']}-{raw.get('attention_bias')}"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(raw))
    tp = TensorParallel(shard) if shard is not None else None
    return LlamaModel.load(folder, torch.device("meta"), torch.bfloat16, max_positions=64,
                           load_format="dummy", tp=tp)


@pytest.mark.parametrize("name", list(SHAPES))
def test_tp1_floor_is_the_serving_bench_floor(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    raw = SHAPES[name]
    cfg = ModelConfig.from_dict(raw)
    model = meta_model(tmp_path, raw, monkeypatch)
    abytes = {f"r16-{k}": old_adapter_nbytes(cfg, 16, ALL_MODULES, BF16) for k in range(3)}
    abytes |= {f"r8-qv-{k}": old_adapter_nbytes(cfg, 8, QV, BF16) for k in range(2)}
    old = OldBytes(model, abytes)
    new = tp_floor.StepBytes.of(cfg, BF16, {n: tp_floor.adapter_bytes_per_rank(cfg, int(n[1:n.index("-")]),
                                                                               QV if "qv" in n else ALL_MODULES, BF16)
                                            for n in abytes})
    assert (new.weights, new.embed_row, new.kv_token, dict(new.adapter)) == \
        (old.weights, old.embed_row, old.kv_token, abytes)
    bw = 3.0e12
    for batch, adapters, kv in ((1, frozenset(), 17), (64, frozenset({"r16-0", "r16-2"}), 64 * 700),
                                (33, frozenset({"r8-qv-1"}), 5000)):
        assert new.step(batch, adapters, kv) == old.step(batch, adapters, kv)
    # decode_floor at TP 1: the same bytes over the same bandwidth, no collectives.
    f = tp_floor.decode_floor(cfg, BF16, 1, rows=64, context_len=700, read_bandwidth=bw,
                              adapters=[tp_floor.AdapterSet(3, 16, ALL_MODULES)])
    assert f.bytes_read == old.step(64, frozenset({"r16-0", "r16-1", "r16-2"}), 64 * 700)
    assert f.seconds == pytest.approx(old.step(64, frozenset({"r16-0", "r16-1", "r16-2"}), 64 * 700) / bw)
    assert f.comm_s == 0 and f.collectives == tp_floor.Collectives(0, 0, 0)


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
    per_rank = tp_floor.weight_bytes_per_rank(cfg, BF16, tp)
    for rank in (0, tp - 1):
        assert loaded_weight_bytes(meta_model(tmp_path, raw, monkeypatch, Shard(rank, tp))) == per_rank
    # Everything but the replicated norms divides by TP (these vocabularies divide evenly).
    norms = tp_floor.norm_bytes(cfg, BF16)
    whole = tp_floor.weight_bytes_per_rank(cfg, BF16, 1)
    assert tp * (per_rank - norms) == whole - norms
    assert norms == (2 * cfg.num_layers + 1) * cfg.hidden_size * BF16


def test_uneven_vocabulary_counts_the_padded_block() -> None:
    cfg = ModelConfig.from_dict({**LLAMA_3_1_8B, "vocab_size": 49153})
    even = ModelConfig.from_dict(LLAMA_3_1_8B)
    extra = tp_floor.weight_bytes_per_rank(cfg, BF16, 2) - tp_floor.weight_bytes_per_rank(even, BF16, 2)
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
            assert tp_floor.adapter_bytes_per_rank(cfg, r, [module], BF16, tp) == cfg.num_layers * held
        split_b = module in COLUMN_PARALLEL  # B with column layers, A with row layers
        expected = r * (fan_in + fan_out // tp) if split_b else r * (fan_in // tp + fan_out)
        assert tp_floor.adapter_bytes_per_rank(cfg, r, [module], BF16, tp) == cfg.num_layers * expected * BF16
    whole = tp_floor.adapter_bytes_per_rank(cfg, r, ALL_MODULES, BF16, 1)
    assert tp_floor.adapter_bytes_per_rank(cfg, r, ALL_MODULES, BF16, tp) < whole
    assert tp_floor.adapter_bytes_per_rank(cfg, r, QV, BF16, tp) == \
        tp_floor.adapter_bytes_per_rank(cfg, r, ["q_proj"], BF16, tp) + \
        tp_floor.adapter_bytes_per_rank(cfg, r, ["v_proj"], BF16, tp)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_kv_per_token_is_the_ranks_cache(tp: int) -> None:
    cfg = ModelConfig.from_dict(LLAMA_3_1_8B)
    local = Shard(0, tp).local_config(cfg)
    assert tp_floor.kv_bytes_per_token(cfg, BF16, tp) == KVCache.bytes_per_block(local, 1, torch.bfloat16)


class CountingParallel:
    """Rank 0 of `size` as the model sees it, counting its collectives (sums nothing)."""

    def __init__(self, size: int) -> None:
        self.shard = Shard(0, size)
        self.rank, self.size = 0, size
        self.all_reduces: list[tuple[int, ...]] = []
        self.gathers: list[tuple[int, ...]] = []
        self.broadcasts: list[tuple[int, ...]] = []

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.all_reduces.append(tuple(x.shape))
        return x

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
    model = LlamaModel.load(tmp_path, torch.device("cpu"), torch.float32, max_positions=64,
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
    counts = tp_floor.collectives_per_step(model.full_config, tp)
    # broadcasts=1: a decode graph's step (ForwardBatch.feedback set) sends rank 0's token ids.
    assert counts == tp_floor.Collectives(all_reduces=2 * cfg.num_layers + 1, all_gathers=1, broadcasts=1)
    assert len(group.all_reduces) == counts.all_reduces
    assert set(group.all_reduces) == {(rows, cfg.hidden_size)}
    assert len(group.gathers) == counts.all_gathers
    rows_per_rank = -(-cfg.vocab_size // tp)
    assert group.gathers == [(rows, rows_per_rank)]
    assert tp_floor.logits_gather_bytes(cfg, 4, tp, rows) == rows * tp * rows_per_rank * 4


def test_tensor_parallel_floor_adds_the_collectives() -> None:
    cfg = ModelConfig.from_dict(LLAMA_3_1_8B)
    with pytest.raises(ValueError, match="all-reduce"):
        tp_floor.decode_floor(cfg, BF16, 2, rows=64, context_len=512, read_bandwidth=3e12)
    with pytest.raises(ValueError, match="broadcast"):
        tp_floor.decode_floor(cfg, BF16, 2, 64, 512, 3e12, all_reduce_s=1e-5, all_gather_s=1e-5)
    adapters = [tp_floor.AdapterSet(32, 16, ALL_MODULES)]
    f2 = tp_floor.decode_floor(cfg, BF16, 2, 64, 512, 3e12, adapters, all_reduce_s=10e-6, all_gather_s=30e-6,
                               broadcast_s=5e-6)
    f1 = tp_floor.decode_floor(cfg, BF16, 1, 64, 512, 3e12, adapters)
    assert f2.comm_s == pytest.approx((2 * 32 + 1) * 10e-6 + 30e-6 + 5e-6)
    assert f2.memory_s == pytest.approx(f2.bytes_read / 3e12)
    assert f2.seconds == pytest.approx(f2.memory_s + f2.comm_s)
    assert f2.kv * 2 == f1.kv and f2.embed_rows == f1.embed_rows
    assert f2.adapters == 32 * tp_floor.adapter_bytes_per_rank(cfg, 16, ALL_MODULES, BF16, 2)
    # Bus bandwidth (NCCL's convention) and the all-gather estimate invert each other.
    bw = tp_floor.bus_bandwidth_all_reduce(64 * 4096 * 2, 2, 10e-6)
    assert bw == pytest.approx(64 * 4096 * 2 / 10e-6)
    assert tp_floor.all_gather_seconds(1_000_000, 4, 1e11) == pytest.approx(0.75 * 1e6 / 1e11)


def test_cli_reads_an_allreduce_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    results = [{"method": "nccl graph", "rows": rows, "hidden": h, "seconds": s * (1 + rows / 64)}
               for h, s in ((4096, 6e-6), (8192, 10e-6)) for rows in (1, 64)]
    report = tmp_path / "ar.json"
    report.write_text(json.dumps({"world_size": 4, "device": "test", "results": results}))
    floors = dict(tp_floor.main(["--allreduce-json", str(report), "--rows", "64"]))
    out = capsys.readouterr().out
    assert set(floors) == {"8B/0", "8B/32", "70B/0", "70B/32"}, out
    assert floors["70B/0"].comm_s > 161 * 20e-6  # 161 all-reduces and the gather
    assert floors["8B/32"].adapters > 0 and floors["8B/0"].adapters == 0


def test_decode_step_floor_ms_for_tp_bench(tmp_path: Path) -> None:
    """bench.tp_bench's call: a checkpoint folder, the batch's rows and context, N adapters."""
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_3_1_8B))
    cfg = ModelConfig.from_dict(LLAMA_3_1_8B)
    sets = [tp_floor.AdapterSet(32, 16, ALL_MODULES)]
    one = tp_floor.decode_step_floor_ms(tmp_path, tp=1, batch=64, context=160, adapters=32, rank=16,
                                        copy_bandwidth=3e12)
    assert one == pytest.approx(tp_floor.decode_floor(cfg, BF16, 1, 64, 160, 3e12, sets).seconds * 1e3)
    with pytest.warns(UserWarning, match="without collectives"):
        bytes_only = tp_floor.decode_step_floor_ms(tmp_path, tp=2, batch=64, context=160, adapters=32)
    assert bytes_only == pytest.approx(tp_floor.decode_floor(cfg, BF16, 2, 64, 160, 3e12, sets, 0, 0, 0).memory_s * 1e3)
    report = {"world_size": 2, "device": "test", "results": [
        {"method": "nccl graph", "rows": rows, "hidden": 4096, "seconds": s}
        for rows, s in ((1, 8e-6), (64, 14e-6), (128, 20e-6))]}
    ar, gather, bcast = tp_floor.collective_times(report, "nccl graph", cfg, 2, 64)
    assert (ar, bcast) == (14e-6, 8e-6)
    busbw = tp_floor.bus_bandwidth_all_reduce(64 * 4096 * 2, 2, 14e-6)
    assert gather == pytest.approx(0.5 * 64 * 49152 * 2 / busbw)
    with_comm = tp_floor.decode_step_floor_ms(tmp_path, tp=2, batch=64, context=160, adapters=32, allreduce=report)
    assert with_comm == pytest.approx(bytes_only + (65 * ar + gather + bcast) * 1e3)
    with pytest.raises(ValueError, match="of 2 processes, not 4"):
        tp_floor.collective_times(report, "nccl graph", cfg, 4, 64)
    with pytest.raises(ValueError, match=r"no 'nccl graph' all-reduce of \[32, 4096\]"):
        tp_floor.collective_times(report, "nccl graph", cfg, 2, 32)
