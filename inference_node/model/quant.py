"""Which FP8 weights a checkpoint holds, read from its config.json's `quantization_config`
(plain Python, no torch: the launcher refuses a checkpoint with it before any process starts).

Served: Hugging Face's fine-grained FP8 (`quant_method: "fp8"`: e4m3 `*.weight` with float32
`*.weight_scale_inv` per [block_n, block_k] tile, or one per tensor where `weight_block_size`
is null) and compressed-tensors' float-quantized FP8 (`*.weight` with float32 `*.weight_scale`
per output channel or per tensor), both with activations left unquantized or quantized
dynamically (the node multiplies unquantized activations by the dequantized weights: what a
dynamic scheme approximates). Anything else is refused in one line naming the method or
field: a checkpoint whose weights are not plain must never be read as plain weights.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping

from .families import UnsupportedModel

# The node's decoder projections as a checkpoint names them (the targets a skip-list must not
# name: the node keeps every projection of a layer in one format, fused).
_PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                "self_attn.qkv_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "mlp.gate_up_proj")


@dataclass(frozen=True)
class WeightQuant:
    """How the decoder projections (q, k, v, o, gate, up, down) are held as float8_e4m3fn:
    the scale tensor stored beside each `*.weight` ("" where the node quantizes at load), and
    the tiles one scale covers (None: one per output channel; a per-tensor scale is one value
    the loader spreads over the channels). Embeddings, norms and the LM head stay unquantized."""

    method: str                       # "fp8" (HF fine-grained), "compressed-tensors", "load"
    scale_name: str                   # "weight_scale_inv", "weight_scale", or "" (quantized at load)
    block: tuple[int, int] | None = None

    @property
    def at_load(self) -> bool:
        return not self.scale_name


# `--quantization fp8` on a checkpoint of plain weights: per-channel scales made at load.
QUANTIZED_AT_LOAD = WeightQuant("load", "")


def checkpoint_quant(raw: Mapping[str, Any], num_layers: int) -> WeightQuant | None:
    """The checkpoint's FP8 scheme from config.json's contents, None for plain weights, or
    UnsupportedModel naming the quant_method or field the node does not serve."""
    qc = raw.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, Mapping):
        raise UnsupportedModel(f"quantization_config {qc!r} is not served")
    method = qc.get("quant_method")
    if method == "fp8":
        return _fine_grained(qc, num_layers)
    if method == "compressed-tensors":
        return _compressed_tensors(qc, num_layers)
    raise UnsupportedModel(f"quantization_config quant_method {method!r} is not served (served: 'fp8' "
                           f"fine-grained FP8, 'compressed-tensors' FP8 per channel or per tensor)")


def _fine_grained(qc: Mapping[str, Any], num_layers: int) -> WeightQuant:
    where = "quantization_config (quant_method 'fp8')"
    scheme = str(qc.get("activation_scheme", "dynamic")).lower()
    if scheme != "dynamic":
        raise UnsupportedModel(f"{where}: activation_scheme {scheme!r} is not served (static activation "
                               f"scales; served: 'dynamic')")
    if qc.get("scale_fmt", "float") != "float":
        raise UnsupportedModel(f"{where}: scale_fmt {qc['scale_fmt']!r} is not served (served: 'float')")
    if qc.get("expert_dtype", "fp8") != "fp8":
        raise UnsupportedModel(f"{where}: expert_dtype {qc['expert_dtype']!r} is not served")
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise UnsupportedModel(f"{where}: fmt {fmt!r} is not served (served: 'e4m3')")
    if qc.get("modules_to_convert"):
        raise UnsupportedModel(f"{where}: modules_to_convert {qc['modules_to_convert']!r} is not served "
                               f"(the node quantizes the decoder projections only)")
    skipped = qc.get("modules_to_not_convert") or qc.get("ignored_layers")
    _check_skip_list(f"{where}: modules_to_not_convert", skipped, num_layers, substring=True)
    size = qc.get("weight_block_size", (128, 128))
    if size is None:
        return WeightQuant("fp8", "weight_scale_inv")
    if (not isinstance(size, (list, tuple)) or len(size) != 2
            or not all(isinstance(s, int) and s > 0 for s in size)):
        raise UnsupportedModel(f"{where}: weight_block_size {size!r} is not two positive integers")
    return WeightQuant("fp8", "weight_scale_inv", (int(size[0]), int(size[1])))


def _compressed_tensors(qc: Mapping[str, Any], num_layers: int) -> WeightQuant:
    where = "quantization_config (quant_method 'compressed-tensors')"
    groups = qc.get("config_groups") or {}
    if qc.get("sparsity_config"):
        raise UnsupportedModel(f"{where}: sparsity_config is not served")
    if qc.get("kv_cache_scheme"):
        raise UnsupportedModel(f"{where}: kv_cache_scheme is not served (the KV cache stays unquantized)")
    if len(groups) != 1:
        raise UnsupportedModel(f"{where}: {len(groups)} config_groups are not served (served: one group "
                               f"targeting every Linear)")
    name, group = next(iter(groups.items()))
    at = f"{where}: config_groups.{name}"
    fmt = group.get("format") or qc.get("format")
    if fmt != "float-quantized":
        raise UnsupportedModel(f"{at}: format {fmt!r} is not served (served: 'float-quantized')")
    targets = list(group.get("targets") or [])
    if targets != ["Linear"]:
        raise UnsupportedModel(f"{at}: targets {targets!r} are not served (served: ['Linear'])")
    weights = group.get("weights") or {}
    spec = (weights.get("num_bits"), weights.get("type"))
    strategy = weights.get("strategy")
    if spec != (8, "float") or strategy not in ("channel", "tensor") or weights.get("dynamic"):
        raise UnsupportedModel(f"{at}: weights {{num_bits: {spec[0]}, type: {spec[1]!r}, strategy: {strategy!r}}} "
                               f"are not served (served: num_bits 8, type 'float', strategy 'channel' or 'tensor')")
    if weights.get("symmetric") is False:
        raise UnsupportedModel(f"{at}: asymmetric weights (zero points) are not served")
    acts = group.get("input_activations")
    if acts and not acts.get("dynamic"):
        raise UnsupportedModel(f"{at}: input_activations with static scales (dynamic false) are not served")
    if group.get("output_activations"):
        raise UnsupportedModel(f"{at}: output_activations are not served")
    _check_skip_list(f"{where}: ignore", qc.get("ignore"), num_layers, substring=False)
    return WeightQuant("compressed-tensors", "weight_scale")


def _check_skip_list(field: str, entries: Any, num_layers: int, substring: bool) -> None:
    """Refuse a skip-list naming a decoder projection (each layer's projections are held in
    one format, fused); names of the LM head, embeddings or other modules are honoured as they
    are: the node never quantizes those. substring: Hugging Face's rule (an entry skips every
    module whose name contains it), else compressed-tensors' (a name, or "re:" a pattern)."""
    for entry in entries or ():
        entry = str(entry)
        for i in range(num_layers):
            for projection in _PROJECTIONS:
                module = f"model.layers.{i}.{projection}"
                if entry.startswith("re:"):
                    hit = re.match(entry[3:], module) is not None
                else:
                    hit = entry in module if substring else entry in (module, module.removeprefix("model."))
                if hit:
                    raise UnsupportedModel(f"{field} entry {entry!r} keeps the decoder projection {module} "
                                           f"unquantized, which is not served")
