"""Pure validation functions: the bad-adapter corpus, PEFT's own output, fuzzed headers."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from safetensors.numpy import save_file

from adapter_store.push import check_local_adapter
from adapter_store.samples import adapter_config, lora_tensors, write_adapter
from lora_common.validation import (LAYER_MODULES, AdapterInvalid, check_finite, parse_adapter_config,
                                      parse_safetensors_header, validate_adapter, validate_weights)
from store_corpus import BAD_ADAPTERS, raw_safetensors


@pytest.mark.parametrize("case", sorted(BAD_ADAPTERS))
def test_bad_adapter_is_refused_with_its_reason(case: str, tmp_path: Path) -> None:
    build, fragment = BAD_ADAPTERS[case]
    build(tmp_path / case)
    with pytest.raises(AdapterInvalid) as info:
        check_local_adapter(tmp_path / case)
    assert fragment in info.value.reason


def test_good_adapter_spec(tmp_path: Path) -> None:
    folder = write_adapter(tmp_path / "a", rank=8, layers=3, targets=("q_proj", "down_proj", "k_proj"),
                           hidden=64, intermediate=160, kv_dim=32, dtype="float16")
    spec = check_local_adapter(folder)
    assert spec.rank == 8 and spec.num_layers == 3
    assert spec.target_modules == ("q_proj", "k_proj", "down_proj")  # canonical order
    assert spec.module_shapes() == {"q_proj": (64, 64), "k_proj": (64, 32), "down_proj": (160, 64)}
    assert spec.dtypes == ("F16",)
    m = spec.modules[(2, "down_proj")]
    assert (m.in_features, m.out_features, m.rank, m.dtype) == (160, 64, 8, "F16")
    assert m.a.shape == (8, 160) and m.b.shape == (64, 8)
    # the offsets point at the tensor's bytes
    data = (folder / "adapter_model.safetensors").read_bytes()
    a = np.frombuffer(data[m.a.start:m.a.end], dtype=np.float16).reshape(m.a.shape)
    assert np.isfinite(a).all() and a.std() > 0
    assert spec.config.scaling == pytest.approx(16 / 8)


def test_peft_saved_adapter_is_accepted(tmp_path: Path) -> None:
    """What PEFT itself writes (names, shapes, config keys) passes, including rsLoRA."""
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=48,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    config = peft.LoraConfig(r=4, lora_alpha=8, use_rslora=True, init_lora_weights=False,
                             target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"])
    peft.get_peft_model(model, config).save_pretrained(tmp_path / "peft", safe_serialization=True)
    spec = check_local_adapter(tmp_path / "peft")
    assert spec.config.use_rslora and spec.config.scaling == pytest.approx(8 / 2)
    assert spec.target_modules == ("q_proj", "v_proj", "gate_proj", "down_proj")
    assert spec.module_shapes() == {"q_proj": (32, 32), "v_proj": (32, 16), "gate_proj": (32, 48),
                                    "down_proj": (48, 32)}


@pytest.mark.parametrize("family", ["llama", "phi3"])
def test_peft_embedding_and_lm_head_loras_are_accepted(family: str, tmp_path: Path) -> None:
    """PEFT's embedding LoRA (lora_embedding_A/B), an LM head LoRA and Phi-3's fused
    qkv_proj / gate_up_proj pass; a copy of the base embeddings (save_embedding_layers) is
    refused saying how to save without it."""
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    import transformers as tf

    torch.manual_seed(0)
    config_cls, model_cls = ((tf.LlamaConfig, tf.LlamaForCausalLM) if family == "llama"
                             else (tf.Phi3Config, tf.Phi3ForCausalLM))
    model = model_cls(config_cls(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, pad_token_id=0,
                                 bos_token_id=1, eos_token_id=2))
    layer = ["q_proj", "v_proj"] if family == "llama" else ["qkv_proj", "gate_up_proj"]
    config = peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                             target_modules=layer + ["embed_tokens", "lm_head"])
    peft_model = peft.get_peft_model(model, config)
    peft_model.save_pretrained(tmp_path / "lean", safe_serialization=True, save_embedding_layers=False)
    spec = check_local_adapter(tmp_path / "lean")
    assert spec.target_modules == tuple(layer) + ("embed_tokens", "lm_head")
    shapes = spec.module_shapes()
    assert shapes["embed_tokens"] == (128, 32) and shapes["lm_head"] == (32, 128)
    if family == "phi3":
        assert shapes["qkv_proj"] == (32, 32 + 2 * 16) and shapes["gate_up_proj"] == (32, 2 * 48)
    peft_model.save_pretrained(tmp_path / "copies", safe_serialization=True)  # save_embedding_layers "auto"
    with pytest.raises(AdapterInvalid, match="save_embedding_layers=False"):
        check_local_adapter(tmp_path / "copies")


def test_config_normalizes_targets() -> None:
    full = adapter_config(4, ["model.layers.0.self_attn.q_proj", "v_proj", "q_proj"])
    assert parse_adapter_config(json.dumps(full)).target_modules == ("q_proj", "v_proj")
    assert parse_adapter_config(adapter_config(4, "all-linear")).target_modules == LAYER_MODULES
    pattern = parse_adapter_config(adapter_config(4, r".*\.(q_proj|up_proj)"))
    assert pattern.target_modules == ("q_proj", "up_proj") and pattern.targets_from_pattern


@pytest.mark.parametrize("change, fragment", [
    ({"peft_type": None}, "no peft_type"),
    ({"r": 0}, "positive integer"),
    ({"r": "8"}, "positive integer"),
    ({"r": 100_000}, "largest supported rank"),
    ({"lora_alpha": -1}, "lora_alpha"),
    ({"use_rslora": "yes"}, "use_rslora"),
    ({"rank_pattern": {"q_proj": 16}}, "rank_pattern"),
    ({"alpha_pattern": {"q_proj": 16}}, "alpha_pattern"),
    ({"target_modules": ["router"]}, "not supported"),
    ({"target_modules": []}, "non-empty list"),
    ({"target_modules": "embed.*"}, "names none"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"lora_bias": True}, "biases"),
])
def test_config_refusals(change: dict, fragment: str) -> None:
    config = adapter_config(4, ("q_proj",))
    config.update(change)
    if change.get("peft_type", "") is None:
        del config["peft_type"]
    with pytest.raises(AdapterInvalid, match=fragment):
        parse_adapter_config(json.dumps(config))


def test_config_size_limit() -> None:
    config = adapter_config(4, ("q_proj",), note="x" * 5000)
    with pytest.raises(AdapterInvalid, match="limit"):
        parse_adapter_config(json.dumps(config), max_bytes=1000)


def test_header_size_limit_applies_before_reading(tmp_path: Path) -> None:
    header = {f"t{i}": {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]} for i in range(100)}
    blob = raw_safetensors(header, b"\x00" * 400)
    assert len(parse_safetensors_header(blob).tensors) == 100
    with pytest.raises(AdapterInvalid, match="exceeds the limit of 1000"):
        parse_safetensors_header(blob, max_header_bytes=1000)
    # only the prefix is needed when the file size is known
    n = struct.unpack("<Q", blob[:8])[0]
    assert parse_safetensors_header(blob[:8 + n], file_size=len(blob)).file_size == len(blob)


@pytest.mark.parametrize("dtype, bits", [("F16", np.uint16(0x7C00)), ("BF16", np.uint16(0x7F80)),
                                         ("F32", np.uint32(0x7F800000))])
def test_inf_in_every_float_dtype(dtype: str, bits: np.integer) -> None:
    values = np.zeros(64, dtype=bits.dtype)
    header = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight":
              {"dtype": dtype, "shape": [4, values.size // 4], "data_offsets": [0, values.nbytes]}}
    ok = raw_safetensors(header, values.tobytes())
    check_finite(parse_safetensors_header(ok), ok)
    values[37] = bits
    bad = raw_safetensors(header, values.tobytes())
    with pytest.raises(AdapterInvalid, match="NaN or Inf"):
        check_finite(parse_safetensors_header(bad), bad)


def test_layers_must_agree_on_shapes(tmp_path: Path) -> None:
    tensors = lora_tensors(4, 2, ("q_proj",), 64, 160, 32)
    tensors["base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"] = np.zeros((4, 32), np.float32)
    save_file(tensors, str(tmp_path / "w.safetensors"))
    data = (tmp_path / "w.safetensors").read_bytes()
    with pytest.raises(AdapterInvalid, match="in layer 1"):
        validate_adapter(json.dumps(adapter_config(4, ("q_proj",))), data)


def test_values_unchecked_on_request(tmp_path: Path) -> None:
    tensors = lora_tensors(4, 1, ("q_proj",), 64, 160, 32)
    tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"][0, 0] = np.inf
    save_file(tensors, str(tmp_path / "w.safetensors"))
    data = (tmp_path / "w.safetensors").read_bytes()
    config = parse_adapter_config(adapter_config(4, ("q_proj",)))
    validate_weights(config, parse_safetensors_header(data))  # shapes only
    with pytest.raises(AdapterInvalid, match="NaN or Inf"):
        validate_weights(config, parse_safetensors_header(data), data)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_arbitrary_bytes_are_refused_cleanly(data: bytes) -> None:
    try:
        header = parse_safetensors_header(data)
    except AdapterInvalid:
        return
    assert header.data_offset <= len(data)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.text(max_size=20), st.one_of(
    st.none(), st.integers(), st.text(max_size=10),
    st.fixed_dictionaries({"dtype": st.sampled_from(["F32", "F16", "X"]),
                           "shape": st.lists(st.integers(-2, 5), max_size=3),
                           "data_offsets": st.lists(st.integers(-5, 200), max_size=3)})), max_size=4),
       st.integers(0, 300))
def test_fuzzed_headers_are_refused_cleanly(header: dict, data_len: int) -> None:
    blob = raw_safetensors(header, b"\x00" * data_len)
    try:
        parsed = parse_safetensors_header(blob)
    except AdapterInvalid:
        return
    covered = sum(t.nbytes for t in parsed.tensors.values())
    assert parsed.data_offset + covered == len(blob)  # exact tiling is the only way through
