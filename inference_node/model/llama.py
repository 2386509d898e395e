"""Llama-family causal LM (Llama 2/3, SmolLM2, Qwen2, Mistral) over a paged KV cache.

The projections are fused (q/k/v into one matrix, gate/up into one) so one matmul and one
LoRA launch serve each group. LoRA enters through a `LoraApplier` that the runner builds
per step; when no scheduled token uses an adapter the applier is None and the base path
runs unchanged. An applier either adds its deltas into the projections' outputs, or runs
the LoRA shrink beside the base matmul (a side stream) and leaves the expand to the fused op
that follows (RoPE with the KV-cache write, residual add and norm, SiLU), which reads the
projection's output row by row anyway (kernels/lora/delta.py). Every launch choice comes from
the LaunchChoices each forward is given (model/launch.py: its step bucket's, picked by the
runner); only which projections the decode GEMM serves is fixed at load, as it sets the
weights' layout.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from kernels.attention import paged_attention
from kernels.embedding import embed_tokens
from kernels.gemm import DecodeGemm, RopeOut, cublas
from kernels.lora import LoraDelta, with_delta
from kernels.rope import rope_and_cache
from kernels.tuning import DEFAULT_TUNING

from ..parallel.group import TensorParallel
from ..parallel.shard import COLUMN_PARALLEL, Shard
from .checkpoint import CheckpointError, DummyTensors, SafetensorsTensors
from .config import ModelConfig
from .forward import ForwardBatch, LoraApplier
from .launch import LaunchChoices
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


@dataclass
class LayerWeights:
    """One decoder layer. Projection weights are kept [in, out] (transposed from the
    checkpoint's [out, in]): at decode batch sizes cuBLAS's kernels for x @ W are faster in
    that layout (measured on an H100: docs/PERFORMANCE.md). With the Triton decode GEMM (kernels/gemm)
    the projections it serves are transposed views of [out, in] matrices instead: each of its
    programs then streams contiguous rows."""

    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


class LlamaModel:
    """Weights and forward pass; holds no per-request state (the KV cache is passed in)."""

    def __init__(self, config: ModelConfig, layers: list[LayerWeights], embed: torch.Tensor,
                 final_norm: torch.Tensor, lm_head: torch.Tensor, device: torch.device,
                 max_positions: int, gemm_groups: frozenset[str] = DEFAULT_TUNING.gemm_groups,
                 tp: TensorParallel | None = None, full_config: ModelConfig | None = None,
                 vocab_start: int = 0) -> None:
        """config: the shapes this process computes with (its shard's, under tensor
        parallelism); full_config: the whole model's, which adapters are checked against.
        gemm_groups: the projections laid out for the decode GEMM (every forward's
        LaunchChoices must name the same: Tuning.gemm_groups)."""
        self.config = config
        self.full_config = full_config or config
        self.tp = tp                # None: one device holds the whole model
        self.vocab_start = vocab_start  # the first vocabulary row of this rank's embedding
        self.gemm_groups = frozenset(gemm_groups)
        self.layers = layers
        self.embed = embed          # [vocab, hidden] (a view of lm_head when the two are tied)
        self.final_norm = final_norm
        self.lm_head = lm_head      # [hidden, vocab]
        self.device = device
        self.dtype = embed.dtype
        self.rope = RotaryEmbedding(config.head_dim, max_positions, config.rope_theta,
                                    config.rope_scaling, device)
        self.scale = config.head_dim ** -0.5
        if device.type == "cuda":
            # cuBLASLt's kernels for the matmuls cuBLAS runs: faster than cuBLAS's own choice
            # at decode batch sizes (docs/PERFORMANCE.md). A process-wide setting: the node
            # serves one model.
            torch.backends.cuda.preferred_blas_library("cublaslt")

    @classmethod
    def load(cls, path: Path, device: torch.device, dtype: torch.dtype,
             max_positions: int | None = None, gemm_groups: frozenset[str] = DEFAULT_TUNING.gemm_groups,
             load_format: str = "safetensors", tp: TensorParallel | None = None) -> "LlamaModel":
        """The model, or with `tp` this rank's shard of it (parallel/shard.py), read from the
        checkpoint's slices so a rank never reads another's part of a weight. gemm_groups: the
        projections whose weights are laid out for the decode GEMM (Tuning.gemm_groups)."""
        full = ModelConfig.from_checkpoint(path)
        shard = tp.shard if tp is not None else Shard()
        config = shard.local_config(full)
        # The projections the decode GEMM serves on this device, whose layout it prefers.
        layout = DecodeGemm(device, DEFAULT_TUNING.replace(gemm_groups=gemm_groups))
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
                               decode_gemm=layout.serves("qkv")),
                qkv_bias=qkv_bias,
                o=projection(part("o_proj", p + "self_attn.o_proj.weight"), decode_gemm=layout.serves("o")),
                post_norm=take(p + "post_attention_layernorm.weight"),
                gate_up=projection(*(part(m, p + f"mlp.{m}.weight") for m in FUSED_MODULES["gate_up"]),
                                   decode_gemm=layout.serves("gate_up")),
                down=projection(part("down_proj", p + "mlp.down_proj.weight"), decode_gemm=layout.serves("down")),
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
        return cls(config, layers, embed, take("norm.weight"), lm_head, device, positions, gemm_groups,
                   tp=tp, full_config=full, vocab_start=vocab_start)

    def num_parameters(self) -> int:
        tensors = [self.embed, self.final_norm]
        if self.lm_head.data_ptr() != self.embed.data_ptr():
            tensors.append(self.lm_head)
        for layer in self.layers:
            tensors += [layer.input_norm, layer.qkv, layer.o, layer.post_norm, layer.gate_up, layer.down]
        return sum(t.numel() for t in tensors)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                launch: LaunchChoices, lora: LoraApplier | None = None) -> torch.Tensor:
        """Runs all layers over the step's tokens with the step's launch choices; returns
        logits [N, vocab] in the model's dtype (the sampler widens only the rows it samples
        from: a greedy argmax needs no float32 copy of 64 x vocab logits). The pieces it runs
        are also run one by one, with attention between CUDA graphs of the rest
        (runner/piecewise_graphs.py)."""
        hidden, x = self.embed_inputs(batch, launch)
        for i in range(len(self.layers)):
            q = self.attention_inputs(i, x, batch, k_caches, v_caches, launch, lora)
            attn = self.attend(i, q, batch, k_caches, v_caches, launch)
            hidden, x = self.after_attention(i, attn, hidden, launch, lora)
        return self.logits(x, batch.logits_indices)

    def embed_inputs(self, batch: ForwardBatch, launch: LaunchChoices) -> tuple[torch.Tensor, torch.Tensor]:
        """(the tokens' embeddings: the residual stream, that normalised for layer 0)."""
        if self.tp is None:
            hidden = embed_tokens(self.embed, batch.input_ids, batch.feedback, batch.feedback_rows)
        else:
            hidden = self._embed_vocab_parallel(batch)
        return hidden, launch.ops.rms_norm(hidden, self.layers[0].input_norm, self.config.rms_norm_eps)

    def attention_inputs(self, i: int, x: torch.Tensor, batch: ForwardBatch,
                         k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                         launch: LaunchChoices, lora: LoraApplier | None,
                         q_out: torch.Tensor | None = None) -> torch.Tensor:
        """Layer i's rotated queries [T, Hq, D] (into q_out where given); its keys and values
        written to their cache slots."""
        cfg, layer, gemm = self.config, self.layers[i], launch.gemm
        q = q_out
        if (layer.qkv_bias is None and (lora is None or not lora.applies_to("qkv"))
                and gemm.serves("qkv")):
            # RoPE and the cache write in q/k/v's GEMM launch (no RoPE launch)
            if q is None:
                q = x.new_empty(x.shape[0], cfg.num_heads, cfg.head_dim)
            rope = RopeOut(q, k_caches[i], v_caches[i], self.rope.cos, self.rope.sin, batch.positions,
                           batch.slot_mapping, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
            if gemm.qkv_rope(x, layer.qkv, rope) is not None:
                return q
        qkv, delta = self._project(launch, lora, i, "qkv", x, layer.qkv, layer.qkv_bias)
        # The LoRA delta added, q and k rotated, k and v written to their cache slots.
        return rope_and_cache(qkv, delta, self.rope.cos, self.rope.sin, batch.positions,
                              batch.slot_mapping, k_caches[i], v_caches[i], cfg.num_heads,
                              cfg.num_kv_heads, cfg.head_dim, launch.tuning, out=q)

    def attend(self, i: int, q: torch.Tensor, batch: ForwardBatch, k_caches: list[torch.Tensor],
               v_caches: list[torch.Tensor], launch: LaunchChoices,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """Layer i's attention output [T, Hq * D] (into out, [T, Hq, D], where given)."""
        attn = paged_attention(q, k_caches[i], v_caches[i], batch.block_tables, batch.query_start_loc,
                               batch.seq_lens, self.scale, batch.max_query_len, batch.max_seq_len,
                               launch.tuning, out=out)
        return attn.reshape(-1, self.config.q_size)

    def after_attention(self, i: int, attn: torch.Tensor, hidden: torch.Tensor, launch: LaunchChoices,
                        lora: LoraApplier | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's o projection and MLP with their residual adds: (the residual stream, that
        normalised for the next layer, or by the final norm after the last)."""
        cfg, ops, layer = self.config, launch.ops, self.layers[i]
        out, delta = self._reduce(*self._project(launch, lora, i, "o", attn, layer.o))
        hidden, x = ops.add_rms_norm(hidden, out, layer.post_norm, cfg.rms_norm_eps, delta)
        act = None
        if lora is None or not lora.applies_to("gate_up"):
            act = launch.gemm.gated_silu(x, layer.gate_up)  # the SiLU in the GEMM's launch
        if act is None:
            gate_up, delta = self._project(launch, lora, i, "gate_up", x, layer.gate_up)
            act = ops.silu_mul(gate_up, delta)
        down, delta = self._reduce(*self._project(launch, lora, i, "down", act, layer.down))
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

    def _project(self, launch: LaunchChoices, lora: LoraApplier | None, layer: int, group: str,
                 x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, LoraDelta | None]:
        """A fused projection with its LoRA: (output, a delta left for the next op or None).
        weight is [in, out]; the decode GEMM serves decode-shaped x where configured."""
        gemm = launch.gemm if launch.gemm.serves(group) else cublas
        if lora is None:
            return gemm(x, weight, bias, group), None
        fold = lora.fold(layer, group)
        if fold is not None:  # the delta added in the matmul, or left for the next op
            y = launch.gemm(x, weight, bias, group, lora=fold)
            return y, None if fold.expand else fold.unexpanded(x.shape[0])
        lora.begin(layer, group, x)  # before the matmul is queued, so the two can overlap
        y = gemm(x, weight, bias, group)
        return y, lora.end(layer, group, x, y)
