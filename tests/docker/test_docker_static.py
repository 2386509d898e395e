"""The docker files, checked statically (no Docker engine here) so they cannot drift from
the code: services, ports, environment variable names, copied paths, health checks."""
from __future__ import annotations

import argparse
import importlib
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"


def env_names(parser: argparse.ArgumentParser) -> set[str]:
    """Every environment variable an EnvArgumentParser (and its subcommands) reads."""
    names = set()
    stack = [parser]
    while stack:
        p = stack.pop()
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                stack.extend(action.choices.values())
            for match in re.finditer(r"\[env ([A-Z0-9_]+)\]", action.help or ""):
                names.add(match.group(1))
    return names


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


@pytest.fixture(scope="module")
def known_env() -> set[str]:
    from inference_node.cli import parser as node_parser
    names = env_names(node_parser())
    store_cli = importlib.import_module("adapter_store.cli")
    names |= env_names(store_cli.build_parser())
    return names


def test_stack_has_its_services(compose) -> None:
    assert {"minio", "create-bucket", "seed-adapters", "adapter-store", "inference-node"} <= set(compose["services"])
    node = compose["services"]["inference-node"]
    assert node["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]


def test_every_service_env_name_is_read_by_the_code(compose, known_env) -> None:
    standard = {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "MINIO_ROOT_USER",
                "MINIO_ROOT_PASSWORD", "ADAPTER_BUCKET"}
    for name, service in compose["services"].items():
        for var in (service.get("environment") or {}):
            if var.startswith(("INFERENCE_NODE_", "ADAPTER_STORE_")):
                assert var in known_env, f"service {name} sets {var}, which no flag reads"
            else:
                assert var in standard, f"service {name} sets unexpected {var}"


def test_ports_agree_with_the_services_settings(compose) -> None:
    services = compose["services"]
    node_env, store_env = services["inference-node"]["environment"], services["adapter-store"]["environment"]
    assert services["inference-node"]["ports"] == [f"{node_env['INFERENCE_NODE_PORT']}:{node_env['INFERENCE_NODE_PORT']}"]
    assert services["adapter-store"]["ports"] == [f"{store_env['ADAPTER_STORE_PORT']}:{store_env['ADAPTER_STORE_PORT']}"]
    assert node_env["INFERENCE_NODE_ADAPTER_STORE"] == f"adapter-store:{store_env['ADAPTER_STORE_PORT']}"


@pytest.mark.parametrize("dockerfile", ["adapter-store.Dockerfile", "inference-node.Dockerfile"])
def test_dockerfiles_copy_existing_paths_run_as_non_root_and_check_health(dockerfile) -> None:
    text = (DOCKER / dockerfile).read_text()
    for line in text.splitlines():
        if line.startswith("COPY") and "--from=" not in line:
            for src in line.split()[1:-1]:
                assert (ROOT / src).exists(), f"{dockerfile} copies missing {src}"
    users = re.findall(r"^USER (\S+)", text, re.M)
    assert users and users[-1] != "root"
    health = re.search(r'HEALTHCHECK .*?CMD \["python", "-m", "([\w.]+)", "127.0.0.1:(\d+)"\]', text, re.S)
    assert health, "no gRPC health check"
    importlib.import_module(health.group(1))
    exposed = re.search(r"^EXPOSE (\d+)", text, re.M).group(1)
    assert health.group(2) == exposed
    port_env = re.search(r"_PORT=(\d+)", text).group(1)
    assert port_env == exposed


def test_entrypoints_are_console_scripts() -> None:
    scripts = (ROOT / "pyproject.toml").read_text()
    for dockerfile in DOCKER.glob("*.Dockerfile"):
        entry = re.search(r'ENTRYPOINT \["([\w-]+)"\]', dockerfile.read_text()).group(1)
        assert f'{entry} = "' in scripts
