"""Numerically broken adapters are refused by the shared validation (store and node): finite
weights scaled far past anything trained (x1e30 in F32, x1e38 in BF16) by the magnitude
bound, and weights under a raised bound whose LoRA update still overflows by the probe."""
from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from adapter_store.samples import adapter_config, lora_tensors
from lora_common.validation import DEFAULT_MAX_WEIGHT_ABS, AdapterInvalid, validate_adapter

TARGETS = ("q_proj", "down_proj")


def adapter_bytes(tmp_path, scale: float, dtype: str = "float32") -> tuple[str, bytes]:
    tensors = lora_tensors(4, 2, TARGETS, 64, 160, 32, dtype="float32", seed=3)
    scaled = {k: v.astype(np.float64) * scale for k, v in tensors.items()}
    if dtype == "bfloat16":  # numpy has no bfloat16: round float32 bits to their top half
        blobs = {k: (np.asarray(v, np.float32).view(np.uint32) >> 16).astype(np.uint16) for k, v in scaled.items()}
        path = tmp_path / "w.safetensors"
        header, offset, data = {}, 0, b""
        for name, bits in blobs.items():
            header[name] = {"dtype": "BF16", "shape": list(bits.shape), "data_offsets": [offset, offset + bits.nbytes]}
            offset += bits.nbytes
            data += bits.tobytes()
        raw = json.dumps(header).encode()
        path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)
    else:
        path = tmp_path / "w.safetensors"
        save_file({k: v.astype(dtype) for k, v in scaled.items()}, str(path))
    return json.dumps(adapter_config(4, TARGETS)), path.read_bytes()


def test_trained_scale_weights_pass(tmp_path) -> None:
    config, data = adapter_bytes(tmp_path, 1.0)
    assert validate_adapter(config, data).rank == 4


@pytest.mark.parametrize("scale, dtype", [(1e30, "float32"), (1e38 / 0.1, "bfloat16"), (1e5, "float16")])
def test_huge_finite_weights_are_refused_naming_the_bound(tmp_path, scale, dtype) -> None:
    config, data = adapter_bytes(tmp_path, scale, dtype)
    with pytest.raises(AdapterInvalid) as err:
        validate_adapter(config, data)
    assert f"above {DEFAULT_MAX_WEIGHT_ABS:g}" in err.value.reason and "--max-weight-abs" in err.value.reason


def test_the_bound_is_a_setting(tmp_path) -> None:
    config, data = adapter_bytes(tmp_path, 200.0)  # values up to about 200 * 0.02 * 4 sigma
    validate_adapter(config, data)
    with pytest.raises(AdapterInvalid, match="above 1"):
        validate_adapter(config, data, max_weight_abs=1.0)


def test_without_a_bound_the_probe_still_refuses_an_overflowing_update(tmp_path) -> None:
    """Each weight is a finite float32 (about 1e18), but A x then B (A x) passes 3.4e38."""
    config, data = adapter_bytes(tmp_path, 1e20)
    with pytest.raises(AdapterInvalid, match="overflows float32"):
        validate_adapter(config, data, max_weight_abs=0)
    config, data = adapter_bytes(tmp_path, 1e15)  # large, but its update is finite in float32
    validate_adapter(config, data, max_weight_abs=0)


def test_opposite_signs_do_not_hide_an_overflow(tmp_path) -> None:
    tensors = {k: np.full(v.shape, 1e19, np.float32) for k, v in lora_tensors(4, 1, ("q_proj",), 64, 160, 32).items()}
    a = next(k for k in tensors if "lora_A" in k)
    tensors[a][:, 1::2] *= -1  # A @ ones is exactly 0; A @ x is not for other x
    save_file(tensors, str(tmp_path / "w.safetensors"))
    with pytest.raises(AdapterInvalid, match="overflows float32"):
        validate_adapter(json.dumps(adapter_config(4, ("q_proj",))), (tmp_path / "w.safetensors").read_bytes(),
                         max_weight_abs=0)


@pytest.mark.parametrize("dtype", ["F16", "BF16", "F32", "F64"])
def test_the_bound_holds_to_the_value_in_every_float_dtype(dtype) -> None:
    """The largest magnitude (here a negative weight, beside -0.0 and a subnormal) is found
    exactly: a bound at it passes, one just under it is refused naming it."""
    from lora_common.validation import check_finite, parse_safetensors_header
    from store_corpus import raw_safetensors

    values = np.array([0.5, -3.0, -0.0, 1e-40, 2.0, 1.0], np.float64)
    if dtype == "BF16":
        blob = (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes()
    else:
        blob = values.astype({"F16": np.float16, "F32": np.float32, "F64": np.float64}[dtype]).tobytes()
    header = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight":
              {"dtype": dtype, "shape": [2, 3], "data_offsets": [0, len(blob)]}}
    data = raw_safetensors(header, blob)
    check_finite(parse_safetensors_header(data), data, max_abs=3.0)
    with pytest.raises(AdapterInvalid, match="magnitude 3; LoRA weights above 2.99"):
        check_finite(parse_safetensors_header(data), data, max_abs=2.99)


def test_under_the_bound_a_scaling_too_large_for_it_is_still_probed(tmp_path) -> None:
    """Weights within the bound prove nothing when lora_alpha / r is huge: the update of
    weights near 1 times a scaling of 1e37 overflows float32, and the probe refuses it."""
    config, data = adapter_bytes(tmp_path, 40.0)  # weights up to a few units, under the bound
    validate_adapter(config, data)
    huge = json.loads(config)
    huge["lora_alpha"] = 4e37
    with pytest.raises(AdapterInvalid, match="overflows float32"):
        validate_adapter(json.dumps(huge), data)
