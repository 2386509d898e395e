"""Llama-family causal LM (Llama 2/3, SmolLM2, Qwen2, Mistral) over a paged KV cache.

The projections are fused (q/k/v into one matrix, gate/up into one) so one matmul and one
LoRA launch serve each group. LoRA enters through a `LoraApplier` that the engine builds
per step; when no scheduled token uses an adapter the applier is None and the base path
runs unchanged. An applier either adds its deltas into the projections' outputs, or runs
the LoRA shrink beside the base matmul (a side stream) and leaves the expand to the fused op
that follows (RoPE with the KV-cache write, residual add and norm, SiLU), which reads the
projection's output row by row anyway (kernels/lora/delta.py). Every launch choice comes from
the Tuning the model is built with (kernels/tuning.py), or, with a tuning table
(kernels/tuning_table.py), from the Tuning of the step's bucket: the engine runs each step on
`model.for_step(rows, adapters)`.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
import copy
from typing import Protocol

import torch

from kernels.activation import silu_mul, silu_mul_lora
from kernels.attention import paged_attention
from kernels.embedding import embed_tokens
from kernels.gemm import DecodeGemm, GemmLora, RopeOut, cublas
from kernels.lora import LoraDelta, with_delta
from kernels.norm import add_rms_norm, add_rms_norm_lora, rms_norm
from kernels.rope import rope_and_cache
from kernels.tuning import DEFAULT_TUNING, Tuning
from kernels.tuning_table import StepTunings

from ..parallel.group import TensorParallel
from ..parallel.shard import COLUMN_PARALLEL, Shard
from .checkpoint import CheckpointError, DummyTensors, SafetensorsTensors
from .config import ModelConfig
from .rope import RotaryEmbedding

# Fused groups of projections and the LoRA module names they hold, in column order.
FUSED_MODULES: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
# Every LoRA module in fused-group order (the rank columns of a LoRA segment table), and the
# index of each group's first module in it.
LORA_MODULES: tuple[str, ...] = tuple(m for ms in FUSED_MODULES.values() for m in ms)
GROUP_FIRST_MODULE: dict[str, int] = {g: LORA_MODULES.index(ms[0]) for g, ms in FUSED_MODULES.items()}


class LoraApplier(Protocol):
    """The LoRA deltas of one step's tokens for each fused projection."""

    def begin(self, layer: int, group: str, x: torch.Tensor) -> None:
        """Called before the base matmul of `group` is launched: may start the delta beside it."""

    def end(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> LoraDelta | None:
        """Called after it: adds the delta into y (returns None), or returns it unexpanded
        for the next fused op to expand and add."""

    def fold(self, layer: int, group: str) -> GemmLora | None:
        """The group's LoRA for its matmul to add in the same launch (kernels/gemm/fold.py),
        or only to shrink in it (GemmLora.expand False: the next op expands), or None: then
        begin and end apply it."""

    def applies_to(self, group: str) -> bool:
        """Whether the step has LoRA on `group` (else its matmul runs as in a base step)."""


@dataclass
class ForwardBatch:
    """One engine step, flattened over all scheduled sequences (built once per step)."""

    input_ids: torch.Tensor        # [T] int64
    positions: torch.Tensor        # [T] int64
    slot_mapping: torch.Tensor     # [T] int64: KV cache slot (block * block_size + offset)
    block_tables: torch.Tensor     # [B, max_blocks] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor         # [B] int32
    logits_indices: torch.Tensor | None  # [N] int64: rows whose logits are needed; None: all
    max_query_len: int
    max_seq_len: int
    # A decode graph's tokens: where feedback_rows[t] >= 0, token t is feedback[that row] (the
    # previous step's sample, never read back by the host) instead of input_ids[t].
    feedback: torch.Tensor | None = None        # [rows] int64
    feedback_rows: torch.Tensor | None = None   # [T] int64


@dataclass
class LayerWeights:
    """One decoder layer. Projection weights are kept [in, out] (transposed from the
    checkpoint's [out, in]): at decode batch sizes cuBLAS's kernels for x @ W are faster in
    that layout (bench/decode_kernels_sweep.py). With the Triton decode GEMM (kernels/gemm)
    the projections it serves are transposed views of [out, in] matrices instead: each of its
    programs then streams contiguous rows."""

    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


class ElementwiseOps:
    """The small per-layer ops between the matmuls. Eager, they are a few dozen kernel
    launches per layer; on CUDA the residual add + norm and SiLU * up are the Triton kernels
    of kernels/norm and kernels/activation (which also expand a LoRA delta left for them,
    kernels/lora/delta.py) on the base path too, where they beat torch.compile's fusions,
    and the first norm is compiled (torch.compile, dynamic shapes); CUDA graphs then replay
    them. On a CPU the base path runs the PyTorch references. (RoPE and the KV-cache write
    are one kernel of their own, kernels/rope, or in steps without LoRA on q/k/v the epilogue
    of q/k/v's decode GEMM: Tuning.qkv_rope.)"""

    def __init__(self, device: torch.device, tuning: Tuning = DEFAULT_TUNING) -> None:
        self.tuning = tuning
        self.triton = device.type == "cuda"
        self._rms_norm = (torch.compile(rms_norm, dynamic=True, fullgraph=True) if self.triton
                          else rms_norm)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._rms_norm(x, weight, eps)

    def add_rms_norm(self, hidden: torch.Tensor, out: torch.Tensor, weight: torch.Tensor,
                     eps: float, delta: LoraDelta | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden + out (+ its LoRA delta), that normalised)."""
        if delta is not None or self.triton:
            return add_rms_norm_lora(hidden, out, weight, eps, delta, self.tuning)
        return add_rms_norm(hidden, out, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor, delta: LoraDelta | None) -> torch.Tensor:
        if delta is not None or self.triton:
            return silu_mul_lora(gate_up, delta, self.tuning)
        return silu_mul(gate_up)


class LlamaModel:
    """Weights and forward pass; holds no per-request state (the KV cache is passed in)."""

    def __init__(self, config: ModelConfig, layers: list[LayerWeights], embed: torch.Tensor,
                 final_norm: torch.Tensor, lm_head: torch.Tensor, device: torch.device,
                 max_positions: int, tuning: Tuning = DEFAULT_TUNING, tp: TensorParallel | None = None,
                 full_config: ModelConfig | None = None, vocab_start: int = 0,
                 step_tunings: StepTunings | None = None) -> None:
        """config: the shapes this process computes with (its shard's, under tensor
        parallelism); full_config: the whole model's, which adapters are checked against.
        step_tunings: each step's Tuning by its rows and adapters (for_step), `tuning` their
        base (None: `tuning` for every step)."""
        self.config = config
        self.full_config = full_config or config
        self.tp = tp                # None: one device holds the whole model
        self.vocab_start = vocab_start  # the first vocabulary row of this rank's embedding
        self.tuning = tuning
        self.step_tunings = step_tunings
        self._by_tuning: dict[int, tuple[Tuning, LlamaModel]] = {}  # for_step's models
        self.gemm = DecodeGemm(device, tuning)
        self.layers = layers
        self.embed = embed          # [vocab, hidden] (a view of lm_head when the two are tied)
        self.final_norm = final_norm
        self.lm_head = lm_head      # [hidden, vocab]
        self.device = device
        self.dtype = embed.dtype
        self.rope = RotaryEmbedding(config.head_dim, max_positions, config.rope_theta,
                                    config.rope_scaling, device)
        self.scale = config.head_dim ** -0.5
        self.ops = ElementwiseOps(device, tuning)
        if device.type == "cuda":
            # cuBLASLt's kernels for the matmuls cuBLAS runs: faster than cuBLAS's own choice
            # at decode batch sizes (docs/PERFORMANCE.md). A process-wide setting: the node
            # serves one model.
            torch.backends.cuda.preferred_blas_library("cublaslt")

    def with_tuning(self, tuning: Tuning) -> "LlamaModel":
        """The same weights run with other launch choices (a benchmark's sweep). The decode
        GEMM's groups set the weights' layout, so they stay."""
        if tuning.gemm_groups != self.tuning.gemm_groups:
            raise ValueError("gemm_groups sets the weights' layout: load the model again")
        model = copy.copy(self)
        model.tuning, model.gemm = tuning, DecodeGemm(self.device, tuning)
        model.ops = ElementwiseOps(self.device, tuning)
        model.step_tunings, model._by_tuning = None, {}  # this tuning for every step
        return model

    def with_step_tunings(self, steps: StepTunings) -> "LlamaModel":
        """The same weights with each step's launch choices taken from `steps` (a benchmark
        comparing a tuning table against none)."""
        model = self.with_tuning(steps.base)
        model.step_tunings = steps
        return model

    def for_step(self, rows: int, adapters: int = 0) -> "LlamaModel":
        """The model with the launch choices of a step of `rows` rows (tokens, or a graph's
        padded batch) and `adapters` distinct adapters: its bucket's in the tuning table,
        itself where the table has none or the model was built without one."""
        if self.step_tunings is None:
            return self
        tuning = self.step_tunings.for_step(rows, adapters)
        if tuning is self.tuning:
            return self
        hit = self._by_tuning.get(id(tuning))
        if hit is None:
            hit = self._by_tuning[id(tuning)] = (tuning, self.with_tuning(tuning))
        return hit[1]

    @classmethod
    def load(cls, path: Path, device: torch.device, dtype: torch.dtype,
             max_positions: int | None = None, tuning: Tuning = DEFAULT_TUNING,
             load_format: str = "safetensors", tp: TensorParallel | None = None,
             step_tunings: StepTunings | None = None) -> "LlamaModel":
        """The model, or with `tp` this rank's shard of it (parallel/shard.py), read from the
        checkpoint's slices so a rank never reads another's part of a weight."""
        full = ModelConfig.from_checkpoint(path)
        shard = tp.shard if tp is not None else Shard()
        config = shard.local_config(full)
        gemm = DecodeGemm(device, tuning)
        if load_format == "dummy":
            tensors: SafetensorsTensors | DummyTensors = DummyTensors(full, device, dtype)
        else:
            tensors = SafetensorsTensors(path)
        fan = full.module_shapes()

        def take(name: str, rows: tuple[int, int] | None = None,
                 cols: tuple[int, int] | None = None) -> torch.Tensor:
            if name not in tensors:
                raise CheckpointError(f"checkpoint {path} lacks tensor {name!r}")
            return tensors.pop(name, rows, cols).to(device=device, dtype=dtype)

        def part(module: str, name: str) -> torch.Tensor:
            """This rank's rows (column-parallel) or columns (row-parallel) of a weight or bias."""
            if shard.size == 1:
                return take(name)
            fan_in, fan_out = fan[module]
            if module in COLUMN_PARALLEL:
                return take(name, rows=shard.block(fan_out))
            return take(name, cols=shard.block(fan_in))

        def projection(*weights: torch.Tensor, decode_gemm: bool = False) -> torch.Tensor:
            """[out, in] weights side by side as one [in, sum(out)] matrix (a view of an
            [out, in] one where the decode GEMM serves it and prefers that layout)."""
            stacked = torch.cat(weights)
            if decode_gemm:
                return stacked.contiguous().t()
            return stacked.t().contiguous()

        layers = []
        for i in range(config.num_layers):
            p = f"layers.{i}."
            qkv_bias = None
            if config.attention_bias:
                qkv_bias = torch.cat([part(m, p + f"self_attn.{m}.bias") for m in FUSED_MODULES["qkv"]])
            layers.append(LayerWeights(
                input_norm=take(p + "input_layernorm.weight"),
                qkv=projection(*(part(m, p + f"self_attn.{m}.weight") for m in FUSED_MODULES["qkv"]),
                               decode_gemm=gemm.serves("qkv")),
                qkv_bias=qkv_bias,
                o=projection(part("o_proj", p + "self_attn.o_proj.weight"), decode_gemm=gemm.serves("o")),
                post_norm=take(p + "post_attention_layernorm.weight"),
                gate_up=projection(*(part(m, p + f"mlp.{m}.weight") for m in FUSED_MODULES["gate_up"]),
                                   decode_gemm=gemm.serves("gate_up")),
                down=projection(part("down_proj", p + "mlp.down_proj.weight"), decode_gemm=gemm.serves("down")),
            ))
        vocab_start, vocab_stop, vocab_rows = shard.vocab_block(full.vocab_size)

        def vocab_part(name: str) -> torch.Tensor:
            """This rank's block of vocabulary rows, zero-padded to the blocks' common height."""
            if shard.size == 1:
                return take(name)
            rows = take(name, rows=(vocab_start, vocab_stop))
            pad = vocab_rows - rows.shape[0]
            return torch.cat([rows, rows.new_zeros(pad, rows.shape[1])]) if pad else rows

        if "lm_head.weight" in tensors:
            lm_head = projection(vocab_part("lm_head.weight"))
            embed = vocab_part("embed_tokens.weight")
        elif config.tie_word_embeddings:
            # One copy serves both: the LM head reads it as [hidden, vocab]; the embedding
            # looks up its columns (a strided gather of a few rows' worth of bytes per step).
            lm_head = projection(vocab_part("embed_tokens.weight"))
            embed = lm_head.t()
        else:
            raise CheckpointError(f"checkpoint {path} has no lm_head.weight")
        positions = max_positions or config.max_position_embeddings
        return cls(config, layers, embed, take("norm.weight"), lm_head, device, positions, tuning,
                   tp=tp, full_config=full, vocab_start=vocab_start, step_tunings=step_tunings)

    def num_parameters(self) -> int:
        tensors = [self.embed, self.final_norm]
        if self.lm_head.data_ptr() != self.embed.data_ptr():
            tensors.append(self.lm_head)
        for layer in self.layers:
            tensors += [layer.input_norm, layer.qkv, layer.o, layer.post_norm, layer.gate_up, layer.down]
        return sum(t.numel() for t in tensors)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, k_caches: list[torch.Tensor],
                v_caches: list[torch.Tensor], lora: LoraApplier | None = None) -> torch.Tensor:
        """Runs all layers over the step's tokens; returns logits [N, vocab] in the model's
        dtype (the sampler widens only the rows it samples from: a greedy argmax needs no
        float32 copy of 64 x vocab logits). The pieces it runs are also run one by one, with
        attention between CUDA graphs of the rest (runner/piecewise_graphs.py)."""
        hidden, x = self.embed_inputs(batch)
        for i in range(len(self.layers)):
            q = self.attention_inputs(i, x, batch, k_caches, v_caches, lora)
            attn = self.attend(i, q, batch, k_caches, v_caches)
            hidden, x = self.after_attention(i, attn, hidden, lora)
        return self.logits(x, batch.logits_indices)

    def embed_inputs(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(the tokens' embeddings: the residual stream, that normalised for layer 0)."""
        if self.tp is None:
            hidden = embed_tokens(self.embed, batch.input_ids, batch.feedback, batch.feedback_rows)
        else:
            hidden = self._embed_vocab_parallel(batch)
        return hidden, self.ops.rms_norm(hidden, self.layers[0].input_norm, self.config.rms_norm_eps)

    def attention_inputs(self, i: int, x: torch.Tensor, batch: ForwardBatch,
                         k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                         lora: LoraApplier | None, q_out: torch.Tensor | None = None) -> torch.Tensor:
        """Layer i's rotated queries [T, Hq, D] (into q_out where given); its keys and values
        written to their cache slots."""
        cfg, layer = self.config, self.layers[i]
        q = q_out
        if (layer.qkv_bias is None and (lora is None or not lora.applies_to("qkv"))
                and self.gemm.serves("qkv")):
            # RoPE and the cache write in q/k/v's GEMM launch (no RoPE launch)
            if q is None:
                q = x.new_empty(x.shape[0], cfg.num_heads, cfg.head_dim)
            rope = RopeOut(q, k_caches[i], v_caches[i], self.rope.cos, self.rope.sin, batch.positions,
                           batch.slot_mapping, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
            if self.gemm.qkv_rope(x, layer.qkv, rope) is not None:
                return q
        qkv, delta = self._project(lora, i, "qkv", x, layer.qkv, layer.qkv_bias)
        # The LoRA delta added, q and k rotated, k and v written to their cache slots.
        return rope_and_cache(qkv, delta, self.rope.cos, self.rope.sin, batch.positions,
                              batch.slot_mapping, k_caches[i], v_caches[i], cfg.num_heads,
                              cfg.num_kv_heads, cfg.head_dim, self.tuning, out=q)

    def attend(self, i: int, q: torch.Tensor, batch: ForwardBatch, k_caches: list[torch.Tensor],
               v_caches: list[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
        """Layer i's attention output [T, Hq * D] (into out, [T, Hq, D], where given)."""
        attn = paged_attention(q, k_caches[i], v_caches[i], batch.block_tables, batch.query_start_loc,
                               batch.seq_lens, self.scale, batch.max_query_len, batch.max_seq_len,
                               self.tuning, out=out)
        return attn.reshape(-1, self.config.q_size)

    def after_attention(self, i: int, attn: torch.Tensor, hidden: torch.Tensor,
                        lora: LoraApplier | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's o projection and MLP with their residual adds: (the residual stream, that
        normalised for the next layer, or by the final norm after the last)."""
        cfg, ops, layer = self.config, self.ops, self.layers[i]
        out, delta = self._reduce(*self._project(lora, i, "o", attn, layer.o))
        hidden, x = ops.add_rms_norm(hidden, out, layer.post_norm, cfg.rms_norm_eps, delta)
        act = None
        if lora is None or not lora.applies_to("gate_up"):
            act = self.gemm.gated_silu(x, layer.gate_up)  # the SiLU in the GEMM's launch
        if act is None:
            gate_up, delta = self._project(lora, i, "gate_up", x, layer.gate_up)
            act = ops.silu_mul(gate_up, delta)
        down, delta = self._reduce(*self._project(lora, i, "down", act, layer.down))
        # The last layer's residual add comes with the final norm (rows are independent,
        # so the logits rows are picked after it).
        last_layer = i + 1 == len(self.layers)
        norm = self.final_norm if last_layer else self.layers[i + 1].input_norm
        return ops.add_rms_norm(hidden, down, norm, cfg.rms_norm_eps, delta)

    def logits(self, x: torch.Tensor, rows: torch.Tensor | None,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """The LM head over the final-normed rows `rows` (None: all), into `out` where given."""
        last = x if rows is None else x[rows]
        if self.tp is not None:  # each rank's block of the vocabulary, then all of them
            logits = self.tp.gather_columns(torch.mm(last, self.lm_head))
            if logits.shape[1] != self.config.vocab_size:  # the last block's padding rows
                logits = logits[:, :self.config.vocab_size].contiguous()
            return logits if out is None else out.copy_(logits)
        return torch.mm(last, self.lm_head) if out is None else torch.mm(last, self.lm_head, out=out)

    def _embed_vocab_parallel(self, batch: ForwardBatch) -> torch.Tensor:
        """Each rank looks up the tokens of its vocabulary block (zeros for the others); the
        all-reduce sums every token's one real row."""
        ids = batch.input_ids
        if batch.feedback is not None:
            # Only rank 0 holds the tokens the previous step sampled: its ids go to every rank
            # (inside a decode graph, where the other ranks cannot be sent them beforehand).
            from_feedback = batch.feedback_rows >= 0
            ids = torch.where(from_feedback, batch.feedback[batch.feedback_rows.clamp(min=0)], ids)
            ids = self.tp.broadcast(ids, 0)
        local = ids - self.vocab_start
        inside = (local >= 0) & (local < self.embed.shape[0])
        hidden = self.embed[torch.where(inside, local, 0)].masked_fill(~inside[:, None], 0)
        return self.tp.all_reduce(hidden)

    def _reduce(self, out: torch.Tensor, delta: LoraDelta | None) -> tuple[torch.Tensor, LoraDelta | None]:
        """A row-parallel projection's output summed over the ranks (its LoRA delta, added
        into each rank's partial output, is summed with it)."""
        if self.tp is None:
            return out, delta
        if delta is not None:  # expanded beside the matmul (parallel.shard.tensor_parallel_tuning)
            if delta.expanded is None:
                raise RuntimeError("a row-parallel projection's LoRA delta must be expanded before its "
                                   "all-reduce (parallel.shard.tensor_parallel_tuning)")
            out = with_delta(out, delta.expanded)
        return self.tp.all_reduce(out), None

    def _project(self, lora: LoraApplier | None, layer: int, group: str, x: torch.Tensor,
                 weight: torch.Tensor, bias: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, LoraDelta | None]:
        """A fused projection with its LoRA: (output, a delta left for the next op or None).
        weight is [in, out]; the decode GEMM serves decode-shaped x where configured."""
        gemm = self.gemm if self.gemm.serves(group) else cublas
        if lora is None:
            return gemm(x, weight, bias, group), None
        fold = lora.fold(layer, group)
        if fold is not None:  # the delta added in the matmul, or left for the next op
            y = self.gemm(x, weight, bias, group, lora=fold)
            return y, None if fold.expand else fold.unexpanded(x.shape[0])
        lora.begin(layer, group, x)  # before the matmul is queued, so the two can overlap
        y = gemm(x, weight, bias, group)
        return y, lora.end(layer, group, x, y)
