"""The docker files, checked statically (no Docker engine here) so they cannot drift from
the code: services, ports, environment variable names, copied paths, health checks."""
from __future__ import annotations

import argparse
import importlib
import json
import re
import shutil
import subprocess
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


NODES = ("inference-node", "inference-node-2")


def test_stack_has_its_services(compose) -> None:
    assert {"minio", "create-bucket", "seed-adapters", "adapter-store", *NODES, "haproxy"} <= set(compose["services"])
    gpus = []
    for name in NODES:
        device = compose["services"][name]["deploy"]["resources"]["reservations"]["devices"][0]
        assert device["capabilities"] == ["gpu"]
        gpus.append(device["device_ids"])
    assert gpus[0] != gpus[1]  # one GPU each by default
    assert compose["services"]["inference-node-2"]["environment"] == compose["services"]["inference-node"]["environment"]


def test_every_node_keeps_its_disk_tier_and_kernels_on_a_volume_of_its_own(compose) -> None:
    """A recreated node container serves its adapters from its disk tier and reuses its
    compiled kernels: both live under one named volume per node, owned by the node's user in
    the image (a new named volume takes the image directory's owner)."""
    services = compose["services"]
    nodes = [*NODES, "inference-node-tp"]
    mounts = {}
    for name in nodes:
        env = services[name]["environment"]
        [volume] = services[name]["volumes"]
        source, target = volume.split(":")
        assert source in compose["volumes"], f"{name}: {source} is not a named volume"
        for path in (env["INFERENCE_NODE_ADAPTER_DISK_DIR"], env["TRITON_CACHE_DIR"]):
            assert path.startswith(target + "/"), f"{name}: {path} is not on its volume {target}"
        mounts[name] = source
    assert len(set(mounts.values())) == len(nodes), f"nodes share a cache volume: {mounts}"
    dockerfile = (DOCKER / "inference-node.Dockerfile").read_text()
    assert re.search(rf"install -d -o node {re.escape(target)}\b", dockerfile)


def test_multi_gpu_node_reserves_a_gpu_per_tensor_parallel_rank(compose) -> None:
    """The multi-GPU node: the first node's settings, split over as many GPUs as it reserves,
    none of them the other nodes', on ports of its own; started only with its profile."""
    services = compose["services"]
    tp = services["inference-node-tp"]
    assert tp["profiles"] == ["multi-gpu"]
    size = int(tp["environment"]["INFERENCE_NODE_TENSOR_PARALLEL_SIZE"])
    device = tp["deploy"]["resources"]["reservations"]["devices"][0]
    assert size == len(device["device_ids"]) == 2 and device["capabilities"] == ["gpu"]
    others = {gpu for name in NODES for gpu in services[name]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]}
    assert not others & set(device["device_ids"])
    extra = {k: v for k, v in tp["environment"].items() if k not in services["inference-node"]["environment"]}
    assert extra == {"INFERENCE_NODE_TENSOR_PARALLEL_SIZE": "2", "NCCL_NVLS_ENABLE": "0"}
    assert [p.split(":")[1] for p in tp["ports"]] == [p.split(":")[1] for p in services["inference-node"]["ports"]]
    assert tp["shm_size"]


def test_every_service_env_name_is_read_by_the_code(compose, known_env) -> None:
    standard = {"NCCL_NVLS_ENABLE", "TRITON_CACHE_DIR", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "MINIO_ROOT_USER",
                "MINIO_ROOT_PASSWORD", "ADAPTER_BUCKET", "GF_AUTH_ANONYMOUS_ENABLED", "GF_AUTH_ANONYMOUS_ORG_ROLE"}
    for name, service in compose["services"].items():
        for var in (service.get("environment") or {}):
            if var.startswith(("INFERENCE_NODE_", "ADAPTER_STORE_")):
                assert var in known_env, f"service {name} sets {var}, which no flag reads"
            else:
                assert var in standard, f"service {name} sets unexpected {var}"


def test_ports_agree_with_the_services_settings(compose) -> None:
    services = compose["services"]
    node_env, store_env = services["inference-node"]["environment"], services["adapter-store"]["environment"]
    node_ports = [node_env["INFERENCE_NODE_PORT"], node_env["INFERENCE_NODE_HTTP_PORT"],
                  node_env["INFERENCE_NODE_METRICS_PORT"]]
    store_ports = [store_env["ADAPTER_STORE_PORT"], store_env["ADAPTER_STORE_METRICS_PORT"]]
    assert services["inference-node"]["ports"] == [f"{p}:{p}" for p in node_ports]
    assert [p.split(":")[1] for p in services["inference-node-2"]["ports"]] == node_ports
    assert services["adapter-store"]["ports"] == [f"{p}:{p}" for p in store_ports]
    assert node_env["INFERENCE_NODE_ADAPTER_STORE"] == f"adapter-store:{store_env['ADAPTER_STORE_PORT']}"
    published = [p.split(":")[0] for name in ("inference-node", "inference-node-2", "inference-node-tp",
                                               "adapter-store", "haproxy")
                 for p in services[name]["ports"]]
    assert len(published) == len(set(published)), published


def test_haproxy_config_is_the_rendered_one_for_the_compose_nodes(compose) -> None:
    """docker/haproxy.cfg is what lora_client.haproxy writes for the compose file's nodes,
    ports and Docker's DNS; the official image reads it; HAProxy accepts it (where installed)."""
    from inference_node.model.embedded import CHECKPOINT_NAME
    from lora_client.haproxy import ProxySettings, haproxy_binary, render_config

    services = compose["services"]
    proxy = services["haproxy"]
    assert proxy["image"].startswith("haproxy:")
    assert "./haproxy.cfg:/usr/local/etc/haproxy/haproxy.cfg:ro" in proxy["volumes"]
    port, stats_port, http_port = (int(p.split(":")[1]) for p in proxy["ports"])
    servers = tuple((name, f"{name}:{services[name]['environment']['INFERENCE_NODE_PORT']}") for name in NODES)
    http_servers = tuple((name, f"{name}:{services[name]['environment']['INFERENCE_NODE_HTTP_PORT']}")
                         for name in NODES)
    assert not any("INFERENCE_NODE_MODEL" in services[name]["environment"] for name in NODES)  # the embedded one
    expected = render_config(ProxySettings(servers, port=port, stats_port=stats_port, host="0.0.0.0",
                                           dns_resolver="127.0.0.11:53", http_port=http_port,
                                           http_servers=http_servers, base_model=CHECKPOINT_NAME))
    assert (DOCKER / "haproxy.cfg").read_text() == expected, \
        "regenerate: python -m lora_client.haproxy --server inference-node=inference-node:50051 " \
        "--server inference-node-2=inference-node-2:50051 --host 0.0.0.0 --dns-resolver 127.0.0.11:53 " \
        "--http-port 8080 --http-server inference-node=inference-node:8000 " \
        f"--http-server inference-node-2=inference-node-2:8000 --base-model {CHECKPOINT_NAME}"
    assert set(proxy["depends_on"]) == set(NODES)
    if haproxy_binary() is not None:
        done = subprocess.run([haproxy_binary(), "-c", "-f", str(DOCKER / "haproxy.cfg")], capture_output=True,
                              text=True, timeout=30)
        assert done.returncode == 0, done.stdout + done.stderr


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


# ---------------------------------------------------------------------------------------------
# The mutual-TLS override (docker/compose.tls.yaml) and the certificates docker/make-certs.sh
# makes for it

def _make_certs(out: Path) -> Path:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    subprocess.run(["sh", str(DOCKER / "make-certs.sh"), str(out)], check=True, capture_output=True,
                   timeout=60)
    return out


def test_tls_override_sets_only_flags_the_code_reads_and_files_the_script_makes(
        compose, known_env, tmp_path: Path) -> None:
    from lora_client.healthcheck import parser as healthcheck_parser

    override = yaml.safe_load((DOCKER / "compose.tls.yaml").read_text())
    client_env = env_names(healthcheck_parser())
    made = {p.name for p in _make_certs(tmp_path).iterdir()}
    for name, service in override["services"].items():
        assert name in compose["services"], f"the override configures unknown service {name}"
        assert service["volumes"] == ["./certs:/certs:ro"]
        for var, value in service["environment"].items():
            assert var in known_env | client_env, f"service {name} sets {var}, which no flag reads"
            assert value.startswith("/certs/") and value.removeprefix("/certs/") in made, \
                f"service {name}: {var}={value} is not a file docker/make-certs.sh writes"
    node_env = override["services"]["inference-node"]["environment"]
    assert {"INFERENCE_NODE_TLS_CLIENT_CA", "INFERENCE_NODE_STORE_TLS_CERT"} <= set(node_env)


def test_made_certificates_carry_mutual_tls_for_a_health_check(tmp_path: Path) -> None:
    """The store's certificate from the script serves TLS that requires client certificates;
    the container health check (lora_client.healthcheck) passes with the script's client
    certificate and is refused without one."""
    import grpc
    from concurrent import futures
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from lora_common.tls import ServerTLS, add_port
    from lora_client.healthcheck import main as healthcheck

    certs = _make_certs(tmp_path / "certs")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    tls = ServerTLS(cert=str(certs / "adapter-store.crt"), key=str(certs / "adapter-store.key"),
                    client_ca=str(certs / "ca.crt"))
    port = add_port(server, "127.0.0.1:0", tls)
    server.start()
    try:
        target = f"127.0.0.1:{port}"
        trust = ["--tls-ca", str(certs / "ca.crt")]
        client = ["--tls-cert", str(certs / "client.crt"), "--tls-key", str(certs / "client.key")]
        assert healthcheck([target, *trust, *client]) == 0
        assert healthcheck([target, *trust]) == 1  # no client certificate: refused
    finally:
        server.stop(None)


# Metrics: on by default in compose, scraped by Prometheus, read by the Grafana dashboard.

def test_prometheus_scrapes_the_metrics_ports_compose_sets(compose) -> None:
    services = compose["services"]
    config = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    targets = {job["job_name"]: [t for c in job["static_configs"] for t in c["targets"]]
               for job in config["scrape_configs"]}
    node_port = services["inference-node"]["environment"]["INFERENCE_NODE_METRICS_PORT"]
    store_port = services["adapter-store"]["environment"]["ADAPTER_STORE_METRICS_PORT"]
    assert targets == {"inference-node": [f"{name}:{node_port}" for name in NODES],
                       "adapter-store": [f"adapter-store:{store_port}"]}
    assert "./prometheus.yml:/etc/prometheus/prometheus.yml:ro" in services["prometheus"]["volumes"]


def test_grafana_provisions_the_dashboard_and_its_datasource(compose) -> None:
    mounts = dict(v.rsplit(":", 1)[0].split(":", 1) for v in compose["services"]["grafana"]["volumes"])
    assert mounts == {"./grafana/provisioning": "/etc/grafana/provisioning",
                      "./grafana/dashboards": "/var/lib/grafana/dashboards"}
    provider = yaml.safe_load((DOCKER / "grafana/provisioning/dashboards/lora-serving.yaml").read_text())
    assert provider["providers"][0]["options"]["path"] == mounts["./grafana/dashboards"]
    datasource = yaml.safe_load((DOCKER / "grafana/provisioning/datasources/prometheus.yaml").read_text())
    uid = datasource["datasources"][0]["uid"]
    dashboard = json.loads((DOCKER / "grafana/dashboards/lora-serving.json").read_text())
    assert all(p["datasource"]["uid"] == uid and all(t["datasource"]["uid"] == uid for t in p["targets"])
               for p in dashboard["panels"])


def exported_metric_names() -> set[str]:
    """Every family and sample name the node and the store export, the node's engine
    collector fed a snapshot holding every key Node.snapshot() fills."""
    from adapter_store.metrics import StoreMetrics
    from inference_node.adapters.manager import AdapterCounters
    from inference_node.metrics import NodeMetrics

    snapshot = {key: 1 for key in ("kv_blocks_total", "kv_blocks_free", "kv_blocks_cached", "running", "waiting",
                                   "adapters_gpu", "adapters_host", "adapter_loads", "adapter_evictions",
                                   "adapter_fetch_errors", "preemptions", "cached_prompt_tokens", "non_finite_rows")}
    snapshot["prefix_cache"] = {"a": {"hit_tokens": 1, "hits": 1, "lookups": 1, "blocks": 1}}
    snapshot["adapter_counters"] = {"a": AdapterCounters().as_dict()}
    node = NodeMetrics(lambda: snapshot)
    node.first_token("a", 0.1)
    node.tokens_streamed("a", 1, 0.01)
    node.request_finished("a", "stop", 3, 2)
    store = StoreMetrics()
    names = set()
    for registry in (node.registry, store.registry):
        for family in registry.collect():
            names.add(family.name)
            names.update(s.name for s in family.samples)
    # Counters with labels have no sample until used: their exported name is <family>_total.
    names.update(f"{n}_total" for n in list(names))
    return names


def test_every_metric_the_dashboard_queries_is_exported() -> None:
    dashboard = json.loads((DOCKER / "grafana/dashboards/lora-serving.json").read_text())
    queried = {name for panel in dashboard["panels"] for target in panel["targets"]
               for name in re.findall(r"\b((?:lora_node|adapter_store)_[a-z_]+)", target["expr"])}
    queried |= set(re.findall(r"\b(lora_node_[a-z_]+)", json.dumps(dashboard["templating"])))
    assert len(queried) > 15
    assert queried - exported_metric_names() == set()


_IMPORTS_SCRIPT = """
import ast, json, pathlib, sys
modules = set()
for package in sys.argv[1:]:
    for path in pathlib.Path(package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules.add(node.module.split(".")[0])
print(json.dumps(sorted(modules)))
"""


def _third_party_imports(*packages: str) -> set[str]:
    """Top-level modules the packages import (anywhere, lazily too), the standard library's
    and the project's own left out. Parsed in a process of its own: CPython 3.11's ast keeps
    one recursion depth per interpreter (cpython gh-106905), and with other threads of the
    test worker about, ast.parse here failed now and then with SystemError."""
    import sys

    found = subprocess.run([sys.executable, "-c", _IMPORTS_SCRIPT, *packages], cwd=ROOT, check=True,
                           capture_output=True, text=True, timeout=120)
    modules = set(json.loads(found.stdout))
    return {m for m in modules if m not in sys.stdlib_module_names and m not in ("lora", "lora_common")}


def _normalised(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_the_store_image_installs_every_package_the_store_imports() -> None:
    """The slim store image lists its dependencies by hand (no torch): a new import of the
    store's must be installed there too, or the container fails at its first request."""
    import importlib.metadata as md

    text = (DOCKER / "adapter-store.Dockerfile").read_text()
    listed = {_normalised(m.group(1)) for m in re.finditer(r'"([A-Za-z0-9_.\-]+)[<>=!~]', text)}
    installed = set(listed)
    stack = list(listed)
    while stack:  # what the listed packages pull in themselves (botocore with boto3, ...)
        try:
            requires = md.requires(stack.pop()) or []
        except md.PackageNotFoundError:
            continue
        for req in requires:
            if "extra ==" in req:
                continue
            name = _normalised(re.match(r"[A-Za-z0-9_.\-]+", req).group(0))
            if name not in installed:
                installed.add(name)
                stack.append(name)
    distributions = md.packages_distributions()
    needed = {m: {_normalised(d) for d in distributions.get(m, [m])}
              for m in _third_party_imports("adapter_store", "lora_common")}
    missing = {m for m, dists in needed.items() if not dists & installed}
    assert not missing, f"adapter-store.Dockerfile does not install what these imports need: {sorted(missing)}"
