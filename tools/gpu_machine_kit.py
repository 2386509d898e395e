"""Prepares what a bare GPU machine needs to run this project's GPU tests and benchmarks from a
copy of the working tree, where its image has torch, triton, transformers and peft but not the
rest, and no network.

Three things do not travel with the tracked files or are missing there:
- the generated protobuf modules (`lora/v1/*_pb2*.py`, ignored by git: generated here);
- wheels of the Python packages the image lacks or has too old for the generated code
  (grpcio and protobuf at this environment's versions, the health and reflection services,
  boto3, Starlette, uvicorn, httpx and what they need), downloaded for the GPU machine's Python;
- SmolLM2's tokenizer files, which the tests' random models use (`LORA_TEST_TOKENIZER_DIR`),
  copied from the converted embedded checkpoint.

    .venv/bin/python tools/gpu_machine_kit.py                # writes .whl/ and .tok/, prints what to carry
    .venv/bin/python tools/gpu_machine_kit.py --python 3.12  # the GPU machine's Python version

(Run with the project's environment: it imports the installed inference_node.)

Both folders are added to this clone's git exclude file, so they never reach a commit. The
script prints the folders to carry and the line to start each command with.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The packages the GPU image lacks, or has older than the generated protobuf code accepts.
WHEELS = ("grpcio", "protobuf", "grpcio-health-checking", "grpcio-reflection", "blake3", "boto3", "botocore",
          "s3transfer", "jmespath", "pyzmq", "msgspec", "prometheus-client", "python-dateutil", "urllib3",
          "six",
          # The OpenAI-compatible HTTP API (server, and bench.serving's HTTP clients).
          "starlette", "uvicorn", "httptools", "click", "h11", "anyio", "sniffio", "idna", "typing_extensions",
          "httpx", "httpcore", "certifi",
          # Structured output's grammars (an abi3 wheel: one for every Python).
          "llguidance")
PLATFORMS = ("manylinux_2_31_x86_64", "manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "any")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "config.json", "generation_config.json")


def exclude(*names: str) -> None:
    """Adds /name/ lines to this clone's git exclude file (once each)."""
    path = Path(subprocess.check_output(["git", "rev-parse", "--git-path", "info/exclude"],
                                        cwd=ROOT, text=True).strip())
    path = path if path.is_absolute() else ROOT / path
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = path.read_text().splitlines() if path.exists() else []
    with path.open("a") as f:
        for name in names:
            if f"/{name}/" not in lines:
                f.write(f"/{name}/\n")


def download_wheels(dest: Path, python: str) -> list[str]:
    """This environment's version of each package in WHEELS, as a wheel for `python` on x86-64
    Linux; returns the pinned names."""
    dest.mkdir(exist_ok=True)
    pins = [f"{name}=={importlib.metadata.version(name)}" for name in WHEELS]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", python, "--implementation", "cp", "-d", str(dest)]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    subprocess.run(cmd + pins, check=True)
    return pins


def copy_tokenizer(dest: Path) -> Path:
    """SmolLM2's tokenizer files from the converted embedded checkpoint (converted on first use)."""
    from inference_node.model.embedded import default_checkpoint

    source = default_checkpoint()
    dest.mkdir(exist_ok=True)
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy2(source / name, dest / name)
    return source


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--python", default="3.12", help="the GPU machine's Python version")
    args = p.parse_args()
    generated = sorted((ROOT / "lora" / "v1").glob("*_pb2*.py"))
    if not generated:
        sys.exit("lora/v1 holds no generated modules: install the project first (make env)")
    exclude(".whl", ".tok")
    pins = download_wheels(ROOT / ".whl", args.python)
    copy_tokenizer(ROOT / ".tok")
    print("wheels:", " ".join(pins))
    print('carry: ["lora/v1", ".whl", ".tok"]')
    print("start each command with:")
    print("python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade "
          "--target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD "
          "LORA_TEST_TOKENIZER_DIR=$PWD/.tok || exit;")
    # The image lacks the test-only packages of a few CPU-only modules (openai, cryptography):
    # their collection errors must not stop the GPU tests.
    print("the GPU tests: python3 -m pytest -q -m gpu tests/ --continue-on-collection-errors")
    # The whole suite outlasts one call (11 tests in 450 s on an H100, compiles included):
    # one job per folder, each with its own cap, keeps what finished.
    print("  in parts: " + " ".join(
        f"'gpu-{part}@280:python3 -m pytest -q -m gpu tests/{part} --durations=5 "
        f"--continue-on-collection-errors'"
        for part in ("adapters", "kernels", "node", "bench")))
    print("or several jobs in one call, in turn: OUT=$OUT bash tools/gpu_jobs.sh DEADLINE_S 'NAME:COMMAND' ...")


if __name__ == "__main__":
    main()
