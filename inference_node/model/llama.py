"""Llama-family causal LM (Llama 2/3, SmolLM2, Mistral, Qwen2/2.5, Qwen3, Phi-3) over a paged
KV cache; the families differ by switches of the config (model/families.py): biases, per-head
q/k norms, sliding windows. Gemma 2 and 3 run the same attention with their own embedding,
norms and MLP (model/gemma.py). Checkpoints are read by model/loader.py.

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
from functools import partial
from typing import Any

import torch

from kernels.attention import paged_attention
from kernels.embedding import embed_tokens
from kernels.gemm import Fp8Weight, RopeOut, cublas, fp8_gated_silu_linear, fp8_linear
from kernels.gemm.fp8 import Fp8Rows, SplitSums, plain_rows
from kernels.lora import LoraDelta, with_delta
from kernels.rope import QKNorm, rope_and_cache
from kernels.tuning import DEFAULT_TUNING, Tuning

from ..parallel.group import TensorParallel
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
# The dense MLP's groups: a mixture of experts' routed layers have none (model/moe.py).
MLP_GROUPS: tuple[str, ...] = ("gate_up", "down")
MLP_MODULES = frozenset(m for group in MLP_GROUPS for m in FUSED_MODULES[group])


@dataclass
class LayerWeights:
    """One decoder layer. Projection weights are kept [in, out] (transposed from the
    checkpoint's [out, in]): at decode batch sizes cuBLAS's kernels for x @ W are faster in
    that layout (measured on an H100: docs/PERFORMANCE.md). With the Triton decode GEMM (kernels/gemm)
    the projections it serves are transposed views of [out, in] matrices instead: each of its
    programs then streams contiguous rows. FP8 projections (an FP8 checkpoint, or
    --quantization fp8) are Fp8Weights instead, [out, in] with their scales: fp8_matmul's
    layout, whichever GEMM the step's choices name for the group."""

    input_norm: torch.Tensor
    qkv: torch.Tensor | Fp8Weight
    qkv_bias: torch.Tensor | None
    o: torch.Tensor | Fp8Weight
    post_norm: torch.Tensor         # the norm of the residual stream before the MLP
    gate_up: torch.Tensor | Fp8Weight
    down: torch.Tensor | Fp8Weight
    # What some families have (None where the config says not): biases of o (whole under
    # tensor parallelism: added after the all-reduce), gate/up and down; per-head q/k norms
    # (Qwen3, Gemma 3); Gemma's norms of the attention's and the MLP's outputs.
    o_bias: torch.Tensor | None = None
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    attn_out_norm: torch.Tensor | None = None
    mlp_out_norm: torch.Tensor | None = None

    def tensors(self) -> list[torch.Tensor]:
        """Every weight tensor (an FP8 projection's fp8 matrix, not its scales)."""
        return [t.weight if isinstance(t, Fp8Weight) else t for t in vars(self).values() if t is not None]


class LlamaModel:
    """Weights and forward pass; holds no per-request state (the KV cache is passed in)."""

    def __init__(self, config: ModelConfig, layers: list[LayerWeights], embed: torch.Tensor,
                 final_norm: torch.Tensor, lm_head: torch.Tensor, device: torch.device,
                 max_positions: int, gemm_groups: frozenset[str] = DEFAULT_TUNING.gemm_groups,
                 tp: TensorParallel | None = None, full_config: ModelConfig | None = None,
                 vocab_start: int = 0, fp8_w8a8: bool = False) -> None:
        """config: the shapes this process computes with (its shard's, under tensor
        parallelism); full_config: the whole model's, which adapters are checked against.
        gemm_groups: the projections laid out for the decode GEMM (every forward's
        LaunchChoices must name the same: Tuning.gemm_groups). fp8_w8a8: FP8 projections
        multiply e4m3 activations quantized per token (--quantization fp8-w8a8)."""
        self.config = config
        self.full_config = full_config or config
        self.tp = tp                # None: one device holds the whole model
        self.vocab_start = vocab_start  # the first vocabulary row of this rank's embedding
        self.gemm_groups = frozenset(gemm_groups)
        self.fp8_w8a8 = fp8_w8a8
        # W8A8: the add + norms write the next GEMM's rows in e4m3 too (Fp8Rows); off, each
        # FP8 GEMM quantizes its own rows, the same bits (tests compare the two).
        self.norms_quantize = fp8_w8a8
        self.fp8_gemm = partial(fp8_linear, w8a8=fp8_w8a8)
        self.fp8_gated_silu = partial(fp8_gated_silu_linear, w8a8=fp8_w8a8)
        self.layers = layers
        self.embed = embed          # [vocab, hidden] (a view of lm_head when the two are tied)
        self.final_norm = final_norm
        self.lm_head = lm_head      # [hidden, vocab]
        self.device = device
        self.dtype = embed.dtype
        self.rope = RotaryEmbedding(config.head_dim, max_positions, config.rope_theta,
                                    config.rope_scaling, device)
        self.layer_ropes = [self.rope] * config.num_layers  # Gemma 3's windowed layers have their own
        self.scale = config.attention_scale
        if device.type == "cuda":
            # cuBLASLt's kernels for the matmuls cuBLAS runs: faster than cuBLAS's own choice
            # at decode batch sizes (docs/PERFORMANCE.md). A process-wide setting: the node
            # serves one model.
            torch.backends.cuda.preferred_blas_library("cublaslt")

    def num_parameters(self) -> int:
        tensors = [self.embed, self.final_norm]
        if self.lm_head.data_ptr() != self.embed.data_ptr():
            tensors.append(self.lm_head)
        for layer in self.layers:
            tensors += layer.tensors()
        return sum(t.numel() for t in tensors)

    @property
    def fp8_projections(self) -> bool:
        """Whether the decoder's projections are held as FP8 (model/quant.py)."""
        return isinstance(self.layers[0].qkv, Fp8Weight)

    def unfoldable_groups(self) -> frozenset[str]:
        """The fused groups whose matmul cannot add its LoRA itself (kernels/gemm/fold.py):
        those with a bias (the fold kernel adds none). Over FP8 projections the matmul only
        shrinks (Tuning.for_fp8_projections)."""
        layer = self.layers[0]
        biases = {"qkv": layer.qkv_bias, "o": layer.o_bias, "gate_up": layer.gate_up_bias,
                  "down": layer.down_bias}
        return frozenset(group for group, bias in biases.items() if bias is not None)

    def step_tuning(self, tuning: Tuning) -> Tuning:
        """`tuning` as this model's matmuls can run it: over FP8 projections only the shrink
        folds into the GEMM (Tuning.for_fp8_projections), and a biased group folds nothing.
        The node and the profiler map every bucket's tuning through here."""
        if self.fp8_projections:
            tuning = tuning.for_fp8_projections()
        unfoldable = self.unfoldable_groups()
        return tuning.without_folds(unfoldable) if unfoldable else tuning

    def weight_bytes(self) -> int:
        """Bytes of weights this process holds (an FP8 projection's fp8 bytes and scales; a
        tied LM head once): what the KV cache does not get."""
        tensors = [self.embed, self.final_norm]
        if self.lm_head.data_ptr() != self.embed.data_ptr():
            tensors.append(self.lm_head)
        for layer in self.layers:
            for t in vars(layer).values():
                tensors += [t.weight, t.scale] if isinstance(t, Fp8Weight) else [t] if t is not None else []
        return sum(t.numel() * t.element_size() for t in tensors)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                launch: LaunchChoices, lora: LoraApplier | None = None) -> torch.Tensor:
        """Runs all layers over the step's tokens with the step's launch choices; returns
        logits [N, vocab] in the model's dtype (the sampler widens only the rows it samples
        from: a greedy argmax needs no float32 copy of 64 x vocab logits). The pieces it runs
        are also run one by one, with attention between CUDA graphs of the rest
        (runner/piecewise_graphs.py)."""
        hidden, x = self.embed_inputs(batch, launch, lora)
        for i in range(len(self.layers)):
            q = self.attention_inputs(i, x, batch, k_caches, v_caches, launch, lora)
            attn = self.attend(i, q, batch, k_caches, v_caches, launch)
            hidden, x = self.after_attention(i, attn, hidden, launch, lora)
        return self.logits(x, batch.logits_indices, lora=lora)

    def embed_inputs(self, batch: ForwardBatch, launch: LaunchChoices, lora: LoraApplier | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the tokens' embeddings: the residual stream, that normalised for layer 0)."""
        hidden = self._embed(batch, lora)
        return hidden, launch.ops.rms_norm(hidden, self.layers[0].input_norm, self.config.rms_norm_eps)

    def _embed(self, batch: ForwardBatch, lora: LoraApplier | None,
               scale: torch.Tensor | None = None) -> torch.Tensor:
        """The tokens' embeddings (times `scale` where given, Gemma's), with their adapters'
        embedding LoRA (scaled alike, as PEFT scales it with the embedding's own scale)."""
        if self.tp is None:
            hidden = embed_tokens(self.embed, batch.input_ids, batch.feedback, batch.feedback_rows)
        else:
            hidden = self._embed_vocab_parallel(batch)
        if scale is not None:
            hidden = hidden * scale
        edge = lora.edge if lora is not None else None
        delta = edge.embedding(self._token_ids(batch)) if edge is not None else None
        if delta is not None:
            hidden = with_delta(hidden, delta if scale is None else delta * scale.float())
        return hidden

    @staticmethod
    def _token_ids(batch: ForwardBatch) -> torch.Tensor:
        """The step's token ids, those the previous step sampled on the device included."""
        if batch.feedback is None or batch.feedback_rows is None:
            return batch.input_ids
        from_feedback = batch.feedback_rows >= 0
        return torch.where(from_feedback, batch.feedback[batch.feedback_rows.clamp(min=0)], batch.input_ids)

    def qk_norm(self, i: int) -> QKNorm | None:
        """Layer i's per-head q/k norm (None where the family has none)."""
        layer = self.layers[i]
        if layer.q_norm is None:
            return None
        return QKNorm(layer.q_norm, layer.k_norm, self.config.rms_norm_eps)

    def attention_inputs(self, i: int, x: torch.Tensor | Fp8Rows, batch: ForwardBatch,
                         k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                         launch: LaunchChoices, lora: LoraApplier | None,
                         q_out: torch.Tensor | None = None) -> torch.Tensor:
        """Layer i's rotated queries [T, Hq, D] (into q_out where given); its keys and values
        written to their cache slots. x: the normed rows (with their e4m3 copy under W8A8)."""
        cfg, layer, gemm, rope_table = self.config, self.layers[i], launch.gemm, self.layer_ropes[i]
        q = q_out
        qk_norm = self.qk_norm(i)
        if (layer.qkv_bias is None and qk_norm is None and (lora is None or not lora.applies_to("qkv"))
                and gemm.serves("qkv")):
            # RoPE and the cache write in q/k/v's GEMM launch (no RoPE launch)
            rows = plain_rows(x)
            if q is None:
                q = rows.new_empty(rows.shape[0], cfg.num_heads, cfg.head_dim)
            rope = RopeOut(q, k_caches[i], v_caches[i], rope_table.cos, rope_table.sin, batch.positions,
                           batch.slot_mapping, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
            if gemm.qkv_rope(rows, layer.qkv, rope) is not None:
                return q
        qkv, delta = self._project(launch, lora, i, "qkv", x, layer.qkv, layer.qkv_bias)
        # The LoRA delta added, q and k normalised (where the family does) and rotated, k and
        # v written to their cache slots.
        return rope_and_cache(qkv, delta, rope_table.cos, rope_table.sin, batch.positions,
                              batch.slot_mapping, k_caches[i], v_caches[i], cfg.num_heads,
                              cfg.num_kv_heads, cfg.head_dim, launch.tuning, out=q, qk_norm=qk_norm)

    def attend(self, i: int, q: torch.Tensor, batch: ForwardBatch, k_caches: list[torch.Tensor],
               v_caches: list[torch.Tensor], launch: LaunchChoices,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """Layer i's attention output [T, Hq * D] (into out, [T, Hq, D], where given)."""
        attn = paged_attention(q, k_caches[i], v_caches[i], batch.block_tables, batch.query_start_loc,
                               batch.seq_lens, self.scale, batch.max_query_len, batch.max_seq_len,
                               launch.tuning, out=out, window=self.config.layer_window(i),
                               softcap=self.config.attn_logit_softcap)
        return attn.reshape(-1, self.config.q_size)

    def after_attention(self, i: int, attn: torch.Tensor, hidden: torch.Tensor, launch: LaunchChoices,
                        lora: LoraApplier | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's o projection and MLP with their residual adds: (the residual stream, that
        normalised for the next layer, or by the final norm after the last)."""
        layer = self.layers[i]
        # A row-parallel bias is added after the ranks' partial outputs are summed (_add_norm).
        tp, o_bias = self.tp is not None, layer.o_bias
        out, delta = self._project(launch, lora, i, "o", attn, layer.o, None if tp else o_bias,
                                   leave_sums=not tp)
        # Under W8A8 the norms before gate/up and the next q/k/v write their rows in e4m3 too.
        hidden, x = self._add_norm(launch, out, delta, hidden, layer.post_norm, o_bias if tp else None,
                                   quantize=self.norms_quantize)
        # The last layer's residual add comes with the final norm (rows are independent,
        # so the logits rows are picked after it).
        last_layer = i + 1 == len(self.layers)
        norm = self.final_norm if last_layer else self.layers[i + 1].input_norm
        down, delta, bias = self.mlp(i, x, launch, lora)
        return self._add_norm(launch, down, delta, hidden, norm, bias,
                              quantize=self.norms_quantize and not last_layer)

    def mlp(self, i: int, x: torch.Tensor | Fp8Rows, launch: LaunchChoices, lora: LoraApplier | None
            ) -> tuple[torch.Tensor, LoraDelta | None, torch.Tensor | None]:
        """Layer i's MLP over the normed residual stream x: (its output, this rank's partial
        sum under tensor parallelism; a LoRA delta left for the add + norm after it or None; a
        bias to add after the sum or None), for _add_norm. The MoE decoder's routed layers
        have their own (model/moe.py)."""
        layer, tp, down_bias = self.layers[i], self.tp is not None, self.layers[i].down_bias
        act = None
        if (lora is None or not lora.applies_to("gate_up")) and layer.gate_up_bias is None:
            # the SiLU in the GEMM's launch
            if isinstance(layer.gate_up, Fp8Weight):
                act = (self.fp8_gated_silu(x, layer.gate_up, tilings=launch.tuning.fp8_choices(self.fp8_w8a8),
                                           pdl=lora is None and launch.tuning.fp8_pdl_on(),
                                           trigger=launch.tuning.fp8_trigger)
                       if launch.tuning.gate_up_silu else None)
            else:
                act = launch.gemm.gated_silu(plain_rows(x), layer.gate_up)
        if act is None:
            gate_up, delta = self._project(launch, lora, i, "gate_up", x, layer.gate_up, layer.gate_up_bias)
            act = launch.ops.silu_mul(gate_up, delta)
        out, delta = self._project(launch, lora, i, "down", act, layer.down, None if tp else down_bias,
                                   leave_sums=not tp)
        return out, delta, down_bias if tp else None

    def logits(self, x: torch.Tensor, rows: torch.Tensor | None, out: torch.Tensor | None = None,
               lora: LoraApplier | None = None) -> torch.Tensor:
        """The LM head over the final-normed rows `rows` (None: all), with their adapters' LM
        head LoRA, into `out` where given."""
        last = x if rows is None else x[rows]
        edge = lora.edge if lora is not None else None
        if self.tp is not None:  # each rank's block of the vocabulary, then all of them
            part = torch.mm(last, self.lm_head)
            if edge is not None:
                part = self._lm_head_lora(edge, last, part)
            logits = self.tp.gather_columns(part)
            if logits.shape[1] != self.config.vocab_size:  # the last block's padding rows
                logits = logits[:, :self.config.vocab_size].contiguous()
        elif edge is not None:
            logits = self._lm_head_lora(edge, last, torch.mm(last, self.lm_head))
        else:
            logits = torch.mm(last, self.lm_head, out=out) if out is not None else torch.mm(last, self.lm_head)
        cap = self.config.final_logit_softcap
        if cap:  # as transformers: in the logits' dtype, op by op
            logits = torch.tanh(logits / cap) * cap
        if out is None or logits is out:
            return logits
        return out.copy_(logits)

    def _lm_head_lora(self, edge: Any, last: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """logits (this rank's block of the vocabulary) plus the rows' LM head LoRA delta."""
        stop = min(self.vocab_start + logits.shape[1], self.config.vocab_size)
        delta = edge.lm_head(last, (self.vocab_start, stop))
        if delta is None:
            return logits
        if delta.shape[1] < logits.shape[1]:  # the last block's padding columns
            delta = torch.nn.functional.pad(delta, (0, logits.shape[1] - delta.shape[1]))
        return with_delta(logits, delta)

    def _embed_vocab_parallel(self, batch: ForwardBatch) -> torch.Tensor:
        """Each rank looks up the tokens of its vocabulary block (zeros for the others); the
        all-reduce sums every token's one real row."""
        ids = batch.input_ids
        if batch.feedback is not None:
            # Only rank 0 holds the tokens the previous step sampled: its ids go to every rank
            # (inside a decode graph, where the other ranks cannot be sent them beforehand).
            ids = self.tp.broadcast(self._token_ids(batch), 0)
        local = ids - self.vocab_start
        inside = (local >= 0) & (local < self.embed.shape[0])
        hidden = self.embed[torch.where(inside, local, 0)].masked_fill(~inside[:, None], 0)
        return self.tp.all_reduce(hidden)

    def _add_norm(self, launch: LaunchChoices, out: torch.Tensor | SplitSums, delta: LoraDelta | None,
                  hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  unit_offset: bool = False, out_norm: torch.Tensor | None = None, quantize: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor | Fp8Rows]:
        """(hidden + a row-parallel projection's output, that normalised by weight; quantize:
        with its e4m3 copy where one launch makes both, ElementwiseOps.add_rms_norm). Under tensor
        parallelism `out` is this rank's partial sum: its LoRA delta is added into it, the ranks'
        are summed, then the bias (whole on every rank: added once, after the sum), in one
        kernel with the add + norm where the group fuses them (parallel/group.py)."""
        eps, add_norm = self.config.rms_norm_eps, launch.ops.add_rms_norm
        if self.tp is None:
            return add_norm(hidden, out, weight, eps, delta, unit_offset=unit_offset, out_norm=out_norm,
                            quantize=quantize)
        if delta is not None:  # expanded beside the matmul (parallel.shard.tensor_parallel_tuning)
            if delta.expanded is None:
                raise RuntimeError("a row-parallel projection's LoRA delta must be expanded before its "
                                   "all-reduce (parallel.shard.tensor_parallel_tuning)")
            out = with_delta(out, delta.expanded)
        return self.tp.all_reduce_add_norm(out, hidden, weight, eps, add_norm, bias, unit_offset=unit_offset,
                                           out_norm=out_norm)

    def _project(self, launch: LaunchChoices, lora: LoraApplier | None, layer: int, group: str,
                 x: torch.Tensor | Fp8Rows, weight: torch.Tensor | Fp8Weight, bias: torch.Tensor | None = None,
                 leave_sums: bool = False) -> tuple[torch.Tensor | SplitSums, LoraDelta | None]:
        """A fused projection with its LoRA: (output, a delta left for the next op or None).
        weight is [in, out] (or an Fp8Weight, which takes x's e4m3 copy where x comes with
        one); the decode GEMM serves decode-shaped x where configured. leave_sums: the caller's
        add + norm takes a K-split GEMM's partials unsummed (SplitSums), in steps whose LoRA it
        adds too (not into the output after the matmul)."""
        fp8 = isinstance(weight, Fp8Weight)
        operand, x = (x if fp8 else plain_rows(x)), plain_rows(x)
        if fp8:
            gemm = partial(self.fp8_gemm, tilings=launch.tuning.fp8_choices(self.fp8_w8a8),
                           trigger=launch.tuning.fp8_trigger)
        else:
            gemm = launch.gemm if launch.gemm.serves(group) else cublas
        if lora is None:
            if fp8:  # steps without LoRA: FP8 GEMMs under PDL where chosen (Tuning.fp8_pdl)
                gemm = partial(gemm, pdl=launch.tuning.fp8_pdl_on())
            if leave_sums and launch.tuning.split_sums_in_norm:
                return gemm(operand, weight, bias, group, leave_sums=True), None
            return gemm(operand, weight, bias, group), None
        fold = lora.fold(layer, group)
        if fold is not None:  # the delta added in the matmul, or left for the next op
            if fp8:  # only the shrink, in the FP8 GEMM's launch (Tuning.for_fp8_projections)
                sums = leave_sums and launch.tuning.split_sums_in_norm and not lora.adds_into_output
                y = gemm(operand, weight, bias, group, leave_sums=sums, lora=fold)
            else:
                y = launch.gemm(x, weight, bias, group, lora=fold)
            return y, None if fold.expand else fold.unexpanded(x.shape[0])
        lora.begin(layer, group, x)  # before the matmul is queued, so the two can overlap
        sums = leave_sums and launch.tuning.split_sums_in_norm and not lora.adds_into_output
        y = gemm(operand, weight, bias, group, leave_sums=True) if sums else gemm(operand, weight, bias, group)
        return y, lora.end(layer, group, x, y)
