"""Fixtures shared by the whole suite."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from family_checkpoints import FAMILIES, MOE_FAMILIES, make_tiny_family  # noqa: E402
from harness import make_tiny_llama  # noqa: E402


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def no_kernel_tuning_at_start(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU node that finds no tuning table for its GPU, shape and dtype tunes its kernels at
    its first start (minutes per shape, and a bare GPU machine's cache starts empty): the
    suite's in-process nodes run the defaults instead, as where tuning cannot run, unless a
    test is marked `tunes`. (A test that starts a GPU node as a process passes --tune-budget 0.)"""
    if not torch.cuda.is_available() or request.node.get_closest_marker("tunes"):
        return
    from inference_node.tuner import tune

    monkeypatch.setattr(tune, "why_not", lambda device: "the test suite runs the defaults (tests/conftest.py)")


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from inference_node.model.embedded import default_checkpoint

    return default_checkpoint()


@pytest.fixture(scope="session")
def tokenizer_dir(request: pytest.FixtureRequest) -> Path:
    """A real tokenizer for random test models: SmolLM2's, or LORA_TEST_TOKENIZER_DIR's copy
    of it (on machines without the embedded model, such as the GPU machine)."""
    env = os.environ.get("LORA_TEST_TOKENIZER_DIR")
    return Path(env) if env else request.getfixturevalue("smollm2_path")


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), tokenizer_dir)


@pytest.fixture(scope="session")
def llama_8b_widths_path(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    """Llama-3.1-8B's widths (hidden 4096, MLP 14336, 32/8 heads of 128) in 2 layers, float32:
    the shapes whose decode kernels and tuning table the node picks for 8B models (GPU tests)."""
    return make_tiny_llama(tmp_path_factory.mktemp("llama-8b-widths"), tokenizer_dir, hidden_size=4096,
                           intermediate_size=14336, num_hidden_layers=2, num_attention_heads=32,
                           num_key_value_heads=8, initializer_range=0.02, rope_theta=500000.0)


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tiny_llama_hf(tiny_llama_path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()


def _tiny_family_fixture(family: str):
    @pytest.fixture(scope="session")
    def path(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
        return make_tiny_family(family, tmp_path_factory.mktemp(f"tiny-{family}"), tokenizer_dir)

    path.__doc__ = f"A tiny random {family} checkpoint with its family's quirks on (tests/family_checkpoints.py)."
    return path


for _family in FAMILIES + MOE_FAMILIES:  # tiny_llama_path is the one above (the suite's own tiny Llama)
    if _family != "llama":
        globals()[f"tiny_{_family}_path"] = _tiny_family_fixture(_family)
