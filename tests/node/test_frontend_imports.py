"""The front ends load neither torch nor the engine: the launcher's process (front end 0 and
the command line up to its parsed config), the extra front-end processes and the wire
import none of it, so a front end's memory and start-up are its own. Only the engine core
process loads the model (through inference_node.llm)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# What only the engine core may load: torch and Triton, and the node's modules built on them.
FORBIDDEN = ("torch", "triton", "inference_node.node", "inference_node.llm", "inference_node.engine",
             "inference_node.model", "inference_node.parallel", "inference_node.runner",
             "inference_node.adapters", "inference_node.core.engine_core", "inference_node.tuner", "kernels.host")

PROBE = """
import importlib, json, pkgutil, sys
import inference_node.frontend as frontend
modules = ["inference_node.server", "inference_node.launcher", "inference_node.cli", "inference_node.config",
           "inference_node.core.protocol"]
modules += [f"inference_node.frontend.{m.name}" for m in pkgutil.iter_modules(frontend.__path__)]
for name in modules:
    importlib.import_module(name)
from inference_node.cli import checked, parser
from inference_node.config import from_args
config = checked(from_args(parser().parse_args(
    ["serve", "--device", "cpu", "--tune", "pdl=off", "--tune", "gemm_groups=o,down", "--http-port", "0",
     "--api-processes", "2", "--tuning-table", "off"])))
assert config.kernels.tuning.pdl is False and config.server.api_processes == 2
print(json.dumps({"imported": modules, "loaded": sorted(sys.modules)}))
"""


def test_server_launcher_cli_and_every_frontend_module_load_no_torch() -> None:
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    frontends = [m for m in report["imported"] if m.startswith("inference_node.frontend.")]
    assert {"inference_node.frontend.engine_client", "inference_node.frontend.generation",
            "inference_node.frontend.openai_api", "inference_node.frontend.http_server"} <= set(frontends)
    loaded = [m for m in report["loaded"] if any(m == f or m.startswith(f + ".") for f in FORBIDDEN)]
    assert loaded == [], f"front-end imports loaded {loaded}"
    assert "torch" not in report["loaded"]
