"""Reads a checkpoint of any served family into the node's model: each family's tensor names
(families.py) onto the node's fused groups (q/k/v and gate/up one matrix each), this
tensor-parallel rank's shard of every weight read from the file's slices.

Phi-3 stores q/k/v and gate/up fused already: its matrices are the node's groups as they are
(a rank reads its heads' rows of each part of the fused tensor). Gemma's extra norms and every
family's optional biases and q/k norms are read where the config says they exist.

FP8 projections (model/quant.py: a checkpoint's own, or --quantization fp8 quantizing plain
weights per output channel here) become Fp8Weights (kernels/gemm/fp8_weight.py), fused and
sharded without requantizing. A weight that is not plain floating point is never read as a
plain weight: without a served quantization_config it is refused.
"""
from __future__ import annotations

from itertools import accumulate, pairwise
from pathlib import Path

import torch

from kernels.gemm import DecodeGemm, Fp8Weight, quantize_fp8
from kernels.gemm.fp8_weight import FP8_DTYPE, fuse, slice_columns, slice_rows, stored_scale
from kernels.tuning import DEFAULT_TUNING

from ..parallel.group import TensorParallel
from ..parallel.shard import COLUMN_PARALLEL, Shard
from .checkpoint import CheckpointError, DummyTensors, SafetensorsTensors
from .config import ModelConfig
from .families import FAMILIES, Family, UnsupportedModel
from .llama import FUSED_MODULES, MLP_GROUPS, LayerWeights, LlamaModel
from .moe import ExpertWeights, MoeModel, expert_checkpoint_shapes, read_experts
from .quant import QUANTIZED_AT_LOAD, WeightQuant

_PARENT = {"qkv": "self_attn", "o": "self_attn", "gate_up": "mlp", "down": "mlp"}


def checkpoint_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of `config`'s family holds (names without "model."), with
    its shape: what a dummy checkpoint makes up and the loader reads."""
    family = FAMILIES[config.family]
    h, fan = config.hidden_size, config.module_shapes()
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (config.vocab_size, h), "norm.weight": (h,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    norms = ["input_layernorm", "post_attention_layernorm"]
    if family.decoder == "gemma":
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    for i in range(config.num_layers):
        p = f"layers.{i}."
        for norm in norms:
            shapes[f"{p}{norm}.weight"] = (h,)
        if config.qk_norm:
            shapes[f"{p}self_attn.q_norm.weight"] = (config.head_dim,)
            shapes[f"{p}self_attn.k_norm.weight"] = (config.head_dim,)
        if config.is_moe_layer(i):
            shapes.update(expert_checkpoint_shapes(config, family, i))
        for group, modules in FUSED_MODULES.items():
            if config.is_moe_layer(i) and group in MLP_GROUPS:
                continue
            fan_in, outs = fan[modules[0]][0], [fan[m][1] for m in modules]
            names = ([family.fused_weights[group]] if group in family.fused_weights
                     else [f"{_PARENT[group]}.{m}" for m in modules])
            sizes = [sum(outs)] if group in family.fused_weights else outs
            for name, out in zip(names, sizes):
                shapes[f"{p}{name}.weight"] = (out, fan_in)
                if _has_bias(config, group):
                    shapes[f"{p}{name}.bias"] = (out,)
    return shapes


def _has_bias(config: ModelConfig, group: str) -> bool:
    return {"qkv": config.attention_bias, "o": config.o_bias}.get(group, config.mlp_bias)


class _Reader:
    """Takes this rank's part of each tensor off the checkpoint, on the device in the dtype."""

    def __init__(self, path: Path, tensors: SafetensorsTensors | DummyTensors, full: ModelConfig,
                 shard: Shard, device: torch.device, dtype: torch.dtype, gemm: DecodeGemm,
                 quant: WeightQuant | None = None) -> None:
        self.path, self.tensors, self.full, self.shard = path, tensors, full, shard
        self.device, self.dtype, self.gemm, self.quant = device, dtype, gemm, quant
        self.fan = full.module_shapes()

    def take(self, name: str, rows: tuple[int, int] | None = None,
             cols: tuple[int, int] | None = None) -> torch.Tensor:
        self._check(name)
        return self._plain(name, self.tensors.pop(name, rows, cols)).to(device=self.device, dtype=self.dtype)

    def _check(self, name: str) -> None:
        if name not in self.tensors:
            raise CheckpointError(f"checkpoint {self.path} lacks tensor {name!r}")

    def _plain(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """t, where it is a plain floating-point tensor: one-byte or integer weights hold
        quantized values whose scales a plain read would drop."""
        if not t.is_floating_point() or t.element_size() == 1:
            raise CheckpointError(f"checkpoint {self.path} holds {name} as {t.dtype}, not plain weights, and its "
                                  f"config.json has no quantization_config the node serves for it")
        return t

    def has(self, name: str) -> bool:
        return name in self.tensors

    def group(self, family: Family, prefix: str, group: str, suffix: str) -> torch.Tensor:
        """The fused group's weights ("weight": [sum(out), in]) or biases ("bias": [sum(out)])
        of this rank, its modules' parts stacked in FUSED_MODULES order. A row-parallel bias
        stays whole: it is added once, after the all-reduce."""
        modules = FUSED_MODULES[group]
        column = modules[0] in COLUMN_PARALLEL
        if group in family.fused_weights:  # one tensor holds every module's rows
            name = f"{prefix}{family.fused_weights[group]}.{suffix}"
            if self.shard.size == 1 or (not column and suffix == "bias"):
                return self.take(name)
            if not column:
                return self.take(name, cols=self.shard.block(self.fan[modules[0]][0]))
            parts, start = [], 0
            for m in modules:  # this rank's rows of each module's part of the fused tensor
                lo, hi = self.shard.block(self.fan[m][1])
                parts.append(self._rows_of(name, start + lo, start + hi))
                start += self.fan[m][1]
            self.tensors.discard(name)
            return torch.cat(parts)
        parts = []
        for m in modules:
            name = f"{prefix}{_PARENT[group]}.{m}.{suffix}"
            if self.shard.size == 1 or (not column and suffix == "bias"):
                parts.append(self.take(name))
            elif column:
                parts.append(self.take(name, rows=self.shard.block(self.fan[m][1])))
            else:
                parts.append(self.take(name, cols=self.shard.block(self.fan[m][0])))
        return torch.cat(parts)

    def _rows_of(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of a tensor still in the checkpoint (not popped: a fused tensor
        is read in several parts, then discarded)."""
        self._check(name)
        return self._plain(name, self.tensors.peek(name, (start, stop))).to(device=self.device, dtype=self.dtype)

    def fp8_group(self, family: Family, prefix: str, group: str) -> Fp8Weight:
        """The fused group's FP8 weight of this rank: its modules' parts (this rank's rows of
        each, or its columns of a row-parallel one) stacked in FUSED_MODULES order with their
        scales (kernels/gemm/fp8_weight.py: exact, never requantized)."""
        modules = FUSED_MODULES[group]
        outs = [self.fan[m][1] for m in modules]
        if group in family.fused_weights:  # one tensor holds every module's rows
            name = f"{prefix}{family.fused_weights[group]}"
            sources = [(name, lo, hi, sum(outs)) for lo, hi in pairwise(accumulate([0, *outs]))]
        else:
            sources = [(f"{prefix}{_PARENT[group]}.{m}", 0, out, out) for m, out in zip(modules, outs)]
        if modules[0] in COLUMN_PARALLEL:
            parts = []
            for name, start, stop, total in sources:
                lo, hi = self.shard.block(stop - start)
                parts.append(self._fp8_rows(name, start + lo, start + hi, total))
        else:
            [(name, _, out, _)] = sources
            fan_in = self.fan[modules[0]][0]
            parts = [self._fp8_columns(name, out, fan_in, *self.shard.block(fan_in))]
        for name in dict.fromkeys(source[0] for source in sources):
            self.tensors.discard(f"{name}.weight")
            if not self.quant.at_load:
                self.tensors.discard(f"{name}.{self.quant.scale_name}")
        return fuse(parts).to(self.device)

    def _fp8_rows(self, name: str, lo: int, hi: int, rows: int) -> Fp8Weight:
        """Rows [lo, hi) of the [rows, K] projection `name` as FP8."""
        quant, weight = self.quant, f"{name}.weight"
        self._check(weight)
        if quant.at_load and quant.block is None:  # a row's scale is its own: read this rank's rows
            return quantize_fp8(self._plain(weight, self.tensors.peek(weight, (lo, hi))).to(self.device))
        if quant.at_load:
            whole = quantize_fp8(self._plain(weight, self.tensors.read(weight)).to(self.device), quant.block)
            return slice_rows(whole.weight[lo:hi], whole.scale, whole.block, rows, lo, hi)
        fp8 = self._fp8(weight, self.tensors.peek(weight, (lo, hi)))
        return slice_rows(fp8, self._scale(name, rows, fp8.shape[1]), quant.block, rows, lo, hi)

    def _fp8_columns(self, name: str, rows: int, cols: int, lo: int, hi: int) -> Fp8Weight:
        """Columns [lo, hi) of the row-parallel projection `name` ([rows, cols]) as FP8: a
        per-channel scale comes from the whole row, so quantizing at load reads it whole."""
        quant, weight = self.quant, f"{name}.weight"
        self._check(weight)
        if quant.at_load:
            whole = quantize_fp8(self._plain(weight, self.tensors.read(weight)).to(self.device), quant.block)
            return slice_columns(whole.weight[:, lo:hi].contiguous(), whole.scale, whole.block, cols, lo, hi)
        fp8 = self._fp8(weight, self.tensors.pop(weight, cols=(lo, hi)))
        return slice_columns(fp8, self._scale(name, rows, cols), quant.block, cols, lo, hi)

    def _fp8(self, name: str, t: torch.Tensor) -> torch.Tensor:
        if t.dtype != FP8_DTYPE:
            raise CheckpointError(f"checkpoint {self.path} holds {name} as {t.dtype}, not {FP8_DTYPE} as its "
                                  f"quantization_config (quant_method {self.quant.method!r}) says")
        return t

    def _scale(self, name: str, rows: int, cols: int) -> torch.Tensor:
        """The float32 scales of the [rows, cols] FP8 projection `name`, as Fp8Weight holds
        them, checked against the shape the checkpoint's scheme gives them."""
        scale_name = f"{name}.{self.quant.scale_name}"
        self._check(scale_name)
        scale, block = self.tensors.read(scale_name), self.quant.block
        expected = ((-(-rows // block[0]), -(-cols // block[1])),) if block else ((rows,), (rows, 1), (1,), ())
        if tuple(scale.shape) not in expected:
            raise CheckpointError(f"checkpoint {self.path}: {scale_name} has shape {list(scale.shape)}, not "
                                  f"{' or '.join(str(list(e)) for e in expected)} for a [{rows}, {cols}] weight")
        return stored_scale(scale, rows, block)

    def projection(self, weights: torch.Tensor, group: str | None) -> torch.Tensor:
        """[out, in] weights as the [in, out] matrix the model multiplies by (a view of the
        [out, in] one where the decode GEMM serves the group and prefers that layout)."""
        if group is not None and self.gemm.serves(group):
            return weights.contiguous().t()
        return weights.t().contiguous()


def read_layer(reader: _Reader, family: Family, config: ModelConfig, i: int) -> LayerWeights:
    """Layer i's weights: the fused groups, their biases and q/k norms where the family has them."""
    p = f"layers.{i}."
    # A routed layer's MLP is its experts (read_experts): its dense groups hold nothing.
    dense = [g for g in FUSED_MODULES if not (config.is_moe_layer(i) and g in MLP_GROUPS)]

    def projection(g: str):
        if g not in dense:
            return torch.empty(0, device=reader.device, dtype=reader.dtype)
        if reader.quant is not None:
            return reader.fp8_group(family, p, g)
        return reader.projection(reader.group(family, p, g, "weight"), g)

    groups = {g: projection(g) for g in FUSED_MODULES}
    biases = {g: reader.group(family, p, g, "bias") if g in dense and _has_bias(config, g) else None
              for g in FUSED_MODULES}
    qk = config.qk_norm
    return LayerWeights(
        input_norm=reader.take(p + "input_layernorm.weight"),
        qkv=groups["qkv"], qkv_bias=biases["qkv"], o=groups["o"],
        post_norm=reader.take(p + ("pre_feedforward_layernorm.weight" if family.decoder == "gemma"
                                   else "post_attention_layernorm.weight")),
        gate_up=groups["gate_up"], down=groups["down"],
        o_bias=biases["o"], gate_up_bias=biases["gate_up"], down_bias=biases["down"],
        q_norm=reader.take(p + "self_attn.q_norm.weight") if qk else None,
        k_norm=reader.take(p + "self_attn.k_norm.weight") if qk else None,
        attn_out_norm=reader.take(p + "post_attention_layernorm.weight") if family.decoder == "gemma" else None,
        mlp_out_norm=reader.take(p + "post_feedforward_layernorm.weight") if family.decoder == "gemma" else None,
    )


def weight_quant(config: ModelConfig, quantization: str, load_format: str) -> WeightQuant | None:
    """How the projections are held: the checkpoint's FP8 (made-up weights quantized in its
    scheme with load_format "dummy"), else quantized per channel at load with
    quantization "fp8" or "fp8-w8a8", else plain (None)."""
    quant = config.weight_quant
    if quantization != "none" and config.num_experts:
        raise UnsupportedModel(f"{config.family}: --quantization fp8 of a mixture-of-experts model is not served")
    if quant is None:
        return QUANTIZED_AT_LOAD if quantization != "none" else None
    return WeightQuant("load", "", quant.block) if load_format == "dummy" else quant


def load_model(path: Path, device: torch.device, dtype: torch.dtype, max_positions: int | None = None,
               gemm_groups: frozenset[str] = DEFAULT_TUNING.gemm_groups, load_format: str = "safetensors",
               tp: TensorParallel | None = None, quantization: str = "none",
               fp8_w8a8: bool = False) -> LlamaModel:
    """The model of the checkpoint's family, or with `tp` this rank's shard of it
    (parallel/shard.py), read from the checkpoint's slices so a rank never reads another's
    part of a weight. gemm_groups: the projections whose weights are laid out for the decode
    GEMM (Tuning.gemm_groups). quantization "fp8" (or "fp8-w8a8"): a checkpoint of plain weights has its
    projections quantized here (an FP8 checkpoint keeps its own scales either way). fp8_w8a8:
    FP8 projections quantize their input per token and multiply in fp8 (kernels/gemm/fp8.py)."""
    from .gemma import GemmaModel

    full = ModelConfig.from_checkpoint(path)
    family = FAMILIES[full.family]
    shard = tp.shard if tp is not None else Shard()
    config = shard.local_config(full)
    if load_format == "dummy":
        norm_value = 0.0 if family.decoder == "gemma" else 1.0  # Gemma's norms scale by (1 + w)
        tensors: SafetensorsTensors | DummyTensors = DummyTensors(checkpoint_shapes(full), device, dtype,
                                                                  norm_value=norm_value)
    else:
        tensors = SafetensorsTensors(path)
    # The projections the decode GEMM serves on this device, whose layout it prefers.
    layout = DecodeGemm(device, DEFAULT_TUNING.replace(gemm_groups=gemm_groups))
    reader = _Reader(path, tensors, full, shard, device, dtype, layout, weight_quant(full, quantization, load_format))
    layers = [read_layer(reader, family, full, i) for i in range(config.num_layers)]
    vocab_start, vocab_stop, vocab_rows = shard.vocab_block(full.vocab_size)

    def vocab_part(name: str) -> torch.Tensor:
        """This rank's block of vocabulary rows, zero-padded to the blocks' common height."""
        if shard.size == 1:
            return reader.take(name)
        rows = reader.take(name, rows=(vocab_start, vocab_stop))
        pad = vocab_rows - rows.shape[0]
        return torch.cat([rows, rows.new_zeros(pad, rows.shape[1])]) if pad else rows

    if reader.has("lm_head.weight"):
        lm_head = reader.projection(vocab_part("lm_head.weight"), None)
        embed = vocab_part("embed_tokens.weight")
    elif config.tie_word_embeddings:
        # One copy serves both: the LM head reads it as [hidden, vocab]; the embedding looks up
        # its columns (a strided gather of a few rows' worth of bytes per step).
        lm_head = reader.projection(vocab_part("embed_tokens.weight"), None)
        embed = lm_head.t()
    else:
        raise CheckpointError(f"checkpoint {path} has no lm_head.weight")
    positions = max_positions or config.max_position_embeddings
    extra = {}
    if family.decoder == "moe":
        experts: list[ExpertWeights | None] = [read_experts(reader, family, full, shard, i)
                                               if full.is_moe_layer(i) else None for i in range(config.num_layers)]
        extra = {"experts": experts}
    cls = {"gemma": GemmaModel, "moe": MoeModel}.get(family.decoder, LlamaModel)
    return cls(config, layers, embed, reader.take("norm.weight"), lm_head, device, positions, gemm_groups,
               tp=tp, full_config=full, vocab_start=vocab_start, fp8_w8a8=fp8_w8a8, **extra)
