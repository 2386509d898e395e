"""An engine and its model runner, built from a loaded model: what the node, benchmarks and
tests start from."""
from __future__ import annotations

from ..adapters.manager import AdapterManager
from ..model.forward import Decoder
from ..runner.launches import StepLaunches
from ..runner.lora.plan import LoraStepPlan
from ..runner.runner import ModelRunner, OtherRanks
from .config import EngineConfig
from .engine import Engine
from .grammar import GrammarCompiler


def build_engine(model: Decoder, config: EngineConfig, lora: AdapterManager | None = None,
                 launches: StepLaunches | None = None, ranks: OtherRanks | None = None,
                 grammars: GrammarCompiler | None = None) -> Engine:
    """lora: the adapter manager, whose slot buffers the LoRA step plan reads (None: base
    model only). launches: each step's launch choices (None: the default Tuning for every
    step). ranks: a tensor-parallel node's other ranks, which run every step with this one.
    grammars: structured output's compiler (None: requests with a grammar are refused)."""
    launches = launches or StepLaunches.fixed(model.device)
    plan = LoraStepPlan(lora.buffers, launches.base.tuning) if lora is not None else None
    return Engine(ModelRunner(model, launches, config, plan, ranks), config, lora, grammars)
