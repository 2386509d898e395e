"""The mixture-of-experts families (Qwen3-MoE, Mixtral) through the node against transformers
+ PEFT: the forward's logits on tiny random checkpoints (experts routed top-k, a dense layer,
windows), and mixed batches of adapters on attention, on the experts (PEFT's
target_parameters over transformers 5's fused experts), on the embedding and the LM head,
with the base model, token for token under greedy decoding, eagerly and through the graphs'
paths."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from family_checkpoints import MOE_FAMILIES, make_family_adapter
from inference_node.model.loader import load_model
from inference_node.model.moe import MoeModel
from inference_node.runner.decode_graphs import EXPERTS
from inference_node.runner.piecewise_graphs import EXPERTS as PIECES_EXPERTS
from test_family_forward import run_chunks
from test_family_parity import run_family_parity


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_logits_match_transformers(family: str, request: pytest.FixtureRequest) -> None:
    from transformers import AutoModelForCausalLM

    path = request.getfixturevalue(f"tiny_{family}_path")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model = load_model(path, torch.device("cpu"), torch.float32)
    assert isinstance(model, MoeModel) and model.config.family == family
    assert model.config.dense_layers == ((1,) if family == "qwen3_moe" else ())
    tokens = torch.randint(100, 40000, (45,), generator=torch.Generator().manual_seed(0)).tolist()
    ours = run_chunks(model, tokens, [17, 9, 1, 1, 16, 1])
    with torch.no_grad():
        theirs = hf(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_reads_fused_expert_checkpoints(family: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """A checkpoint holding transformers 5's in-memory 3D experts (gate_up_proj, down_proj)
    loads to the same model as the per-expert one it was made from."""
    from safetensors.torch import save_file

    path = request.getfixturevalue(f"tiny_{family}_path")
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    fused: dict[str, torch.Tensor] = {}
    names = ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    for key, value in tensors.items():
        if ".experts." not in key:
            fused[key.replace("block_sparse_moe", "mlp")] = value
    layers = {k.split(".experts.")[0] for k in tensors if ".experts." in k}
    for prefix in layers:
        count = 1 + max(int(k.split(".experts.")[1].split(".")[0]) for k in tensors if k.startswith(prefix + ".experts."))
        get = lambda e, n: tensors[f"{prefix}.experts.{e}.{n}.weight"]  # noqa: E731
        out = prefix.replace("block_sparse_moe", "mlp")
        fused[f"{out}.experts.gate_up_proj"] = torch.stack([torch.cat([get(e, names[0]), get(e, names[1])])
                                                            for e in range(count)])
        fused[f"{out}.experts.down_proj"] = torch.stack([get(e, names[2]) for e in range(count)])
    for name in path.iterdir():
        if name.name != "model.safetensors":
            (tmp_path / name.name).write_bytes(name.read_bytes())
    save_file(fused, str(tmp_path / "model.safetensors"))
    ours, theirs = (load_model(p, torch.device("cpu"), torch.float32) for p in (path, tmp_path))
    for a, b in zip(ours.experts, theirs.experts):
        if a is not None:
            assert torch.equal(a.gate_up, b.gate_up) and torch.equal(a.down, b.down) and torch.equal(a.router, b.router)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_peft_writes_expert_lora_as_target_parameters(family: str, request: pytest.FixtureRequest,
                                                      tmp_path: Path) -> None:
    """What the node reads: PEFT 0.21 on transformers 5 turns the experts' module names into
    target_parameters (gate_up_proj at twice the rank and alpha), nested wrappers whose
    tensors are every expert's pairs in one matrix."""
    path = request.getfixturevalue(f"tiny_{family}_path")
    mlp = ["w1", "w3", "w2"] if family == "mixtral" else ["gate_proj", "up_proj", "down_proj"]
    out = make_family_adapter(path, tmp_path / "a", 4, 8.0, ["q_proj"] + mlp)
    config = json.loads((out / "adapter_config.json").read_text())
    # (saved in a set's order: which is nested in which follows the experts' parameters' order)
    assert sorted(config["target_parameters"]) == ["down_proj", "gate_up_proj"]
    assert config["rank_pattern"] == {r".*\.gate_up_proj": 8} and config["alpha_pattern"] == {r".*\.gate_up_proj": 16}
    with safe_open(str(out / "adapter_model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys() if ".layers.0." in k and "experts" in k}
    experts = 8 if family == "qwen3_moe" else 4
    inter = 48 if family == "qwen3_moe" else 96
    p = "base_model.model.model.layers.0.mlp.experts."
    assert shapes == {p + "base_layer.lora_A.weight": (8 * experts, 64), p + "base_layer.lora_B.weight": (2 * inter, 8 * experts),
                      p + "lora_A.weight": (4 * experts, inter), p + "lora_B.weight": (64, 4 * experts)}


@pytest.mark.parametrize("graphs", ["eager", "graphs"])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_mixed_batch_matches_peft(family: str, graphs: str, request: pytest.FixtureRequest,
                                      tmp_path: Path) -> None:
    """Adapters on attention, on the experts (rsLoRA included: PEFT's doubled gate_up rank and
    alpha give it a scaling of its own), on the embedding and the LM head, and the base model,
    in one mixed batch through gRPC with evictions. graphs: the decode and piecewise graphs'
    paths (run without capture on CPU): steps with expert LoRA in the decode graphs' and the
    piecewise graphs' experts variants (eager: also edge LoRA, which runs eagerly)."""
    base = request.getfixturevalue(f"tiny_{family}_path")
    mode = "on" if graphs == "graphs" else "off"
    node = run_family_parity(base, family, tmp_path / "adapters", "cpu", "float32", num_prompts=3,
                             max_new=12, scale=3.0, edges=graphs == "eager", decode_graphs=mode, mixed_graphs=mode)
    if graphs == "graphs":
        stats = node.engine.snapshot()
        assert stats["graph_steps"] > 0, stats
        decode = node.engine.runner.decode_graphs
        experts = len(decode.group_variants) - 1
        assert EXPERTS in decode.group_variants[experts]
        assert any(variant == experts for (_, _, variant) in decode.replays), decode.replays
        pieces = node.engine.runner.piecewise_graphs
        assert any(variant == PIECES_EXPERTS for (_, variant, _) in pieces.replays), pieces.replays


def _adapter_bytes(folder: Path) -> tuple[bytes, bytes]:
    return (folder / "adapter_config.json").read_bytes(), (folder / "adapter_model.safetensors").read_bytes()


def test_expert_adapters_are_validated_and_refused_in_one_line(request: pytest.FixtureRequest,
                                                               tmp_path: Path) -> None:
    """The store's rules accept PEFT's expert layout (every expert's pairs, gate_up at its own
    rank) and refuse what the node cannot serve, each in one line: transformers 4's
    per-expert tensors, a rank_pattern on a module that is not an expert parameter, the
    router as a target parameter; a dense base model refuses expert LoRA."""
    from lora_common.validation import AdapterInvalid, validate_adapter
    from safetensors.torch import save_file
    from inference_node.adapters.weights import never_servable
    from inference_node.model.families import FAMILIES

    path = request.getfixturevalue("tiny_qwen3_moe_path")
    out = make_family_adapter(path, tmp_path / "a", 4, 8.0, ["q_proj", "gate_proj", "up_proj", "down_proj"])
    config, weights = _adapter_bytes(out)
    spec = validate_adapter(config, weights)
    assert spec.target_modules == ("q_proj", "experts.gate_up_proj", "experts.down_proj")
    gate_up = spec.modules[(0, "experts.gate_up_proj")]
    assert (gate_up.rank, gate_up.experts, gate_up.in_features, gate_up.out_features) == (8, 8, 64, 96)
    assert spec.config.expert_scaling("gate_up_proj") == spec.config.scaling == 2.0

    raw = json.loads(config)
    refusals = {
        "rank_pattern": ({**raw, "rank_pattern": {"q_proj": 8}}, weights),
        "router": ({**raw, "target_parameters": ["mlp.gate.weight"]}, weights),
    }
    per_expert = {f"base_model.model.model.layers.0.mlp.experts.{e}.gate_proj.lora_{w}.weight":
                  torch.zeros((4, 64) if w == "A" else (48, 4)) for e in range(2) for w in "AB"}
    save_file(per_expert, str(tmp_path / "v4.safetensors"))
    refusals["transformers 4"] = ({**raw, "target_parameters": None, "target_modules": ["gate_proj"],
                                   "rank_pattern": {}, "alpha_pattern": {}},
                                  (tmp_path / "v4.safetensors").read_bytes())
    for what, (cfg, data) in refusals.items():
        with pytest.raises(AdapterInvalid) as caught:
            validate_adapter(json.dumps(cfg), data)
        assert "\n" not in str(caught.value), what
    assert "transformers 5" in str(caught.value)
    refusal = never_servable("a", 4, spec.target_modules, 16, family=FAMILIES["qwen3"])
    assert refusal is not None and "experts.gate_up_proj" in refusal and "\n" not in refusal
    assert never_servable("a", 4, spec.target_modules, 16, family=FAMILIES["qwen3_moe"]) is None
