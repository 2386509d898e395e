"""The node over TLS and mutual TLS: real gRPC (and the OpenAI-compatible HTTP API) on
loopback with a throwaway CA. A TLS node serves TLS clients and refuses plaintext ones; an
mTLS node refuses clients without a certificate its CA signed; health checks and lora-client
speak TLS from flags or env."""
from __future__ import annotations

import ssl

import grpc
import httpx
import pytest

from lora_common.tls import ClientTLS, ServerTLS, TLSConfigError
from harness import InProcessNode
from inference_node.config import NodeConfig
from lora_client import cli, healthcheck
from lora_client.node_client import NodeClient

REQUEST = NodeClient.request(prompt_token_ids=[5, 6, 7], max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def tls_node(pki, tiny_llama_path):
    node = InProcessNode(NodeConfig.of(checkpoint=str(tiny_llama_path), device="cpu", num_kv_blocks=32, max_loras=0,
                                       tls=ServerTLS(cert=pki.server.cert, key=pki.server.key)), http=True)
    yield node
    node.stop()


@pytest.fixture(scope="module")
def mtls_node(pki, tiny_llama_path):
    node = InProcessNode(NodeConfig.of(checkpoint=str(tiny_llama_path), device="cpu", num_kv_blocks=32, max_loras=0,
                                       tls=ServerTLS(cert=pki.server.cert, key=pki.server.key, client_ca=pki.ca)),
                         http=True)
    yield node
    node.stop()


def refused(client: NodeClient) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        client.generate(REQUEST, timeout=10)
    return err.value


def test_tls_node_serves_a_tls_client(tls_node, pki) -> None:
    with NodeClient(tls_node.address, tls=ClientTLS(ca=pki.ca)) as client:
        assert len(client.generate(REQUEST, timeout=30).token_ids) == 3
    # The name checked against the certificate can be set apart from the host dialled.
    with NodeClient(tls_node.address, tls=ClientTLS(ca=pki.ca, server_name="localhost")) as client:
        assert len(client.generate(REQUEST, timeout=30).token_ids) == 3
    with NodeClient(tls_node.address, tls=ClientTLS(ca=pki.ca, server_name="node.example")) as client:
        assert refused(client).code() == grpc.StatusCode.UNAVAILABLE


def test_tls_node_refuses_plaintext_and_untrusting_clients(tls_node, pki) -> None:
    with NodeClient(tls_node.address) as plaintext:
        assert refused(plaintext).code() == grpc.StatusCode.UNAVAILABLE
    with NodeClient(tls_node.address, tls=ClientTLS(ca=pki.other_ca)) as wrong_ca:
        assert refused(wrong_ca).code() == grpc.StatusCode.UNAVAILABLE


def test_mtls_node_needs_a_client_certificate_its_ca_signed(mtls_node, pki) -> None:
    with NodeClient(mtls_node.address, tls=ClientTLS(ca=pki.ca)) as no_cert:
        assert refused(no_cert).code() == grpc.StatusCode.UNAVAILABLE
    impostor = ClientTLS(ca=pki.ca, cert=pki.impostor.cert, key=pki.impostor.key)
    with NodeClient(mtls_node.address, tls=impostor) as client:
        assert refused(client).code() == grpc.StatusCode.UNAVAILABLE
    with NodeClient(mtls_node.address, tls=ClientTLS(ca=pki.ca, cert=pki.client.cert, key=pki.client.key)) as client:
        assert len(client.generate(REQUEST, timeout=30).token_ids) == 3


def test_healthcheck_speaks_tls_from_the_environment(mtls_node, pki, monkeypatch, capsys) -> None:
    assert healthcheck.main([mtls_node.address]) == 1  # plaintext to a TLS server
    monkeypatch.setenv("LORA_CLIENT_TLS_CA", pki.ca)
    assert healthcheck.main([mtls_node.address]) == 1  # no client certificate
    monkeypatch.setenv("LORA_CLIENT_TLS_CERT", pki.client.cert)
    monkeypatch.setenv("LORA_CLIENT_TLS_KEY", pki.client.key)
    assert healthcheck.main([mtls_node.address]) == 0
    assert "SERVING" in capsys.readouterr().out


def test_lora_client_cli_over_mtls(mtls_node, pki, monkeypatch, capsys) -> None:
    flags = ["--node", mtls_node.address, "--tls-ca", pki.ca, "--tls-cert", pki.client.cert,
             "--tls-key", pki.client.key]
    assert cli.main([*flags, "generate", "hello", "--max-tokens", "3"]) == 0
    assert cli.main(["--node", mtls_node.address, "--tls-ca", pki.ca, "--timeout", "10", "stats"]) == 1
    assert "UNAVAILABLE" in capsys.readouterr().err
    monkeypatch.setenv("LORA_CLIENT_TLS_CA", pki.ca)
    monkeypatch.setenv("LORA_CLIENT_TLS_CERT", pki.client.cert)
    monkeypatch.setenv("LORA_CLIENT_TLS_KEY", pki.client.key)
    assert cli.main(["--node", mtls_node.address, "stats"]) == 0
    assert "kv_blocks_total: 32" in capsys.readouterr().out
    assert cli.main(["--node", mtls_node.address, "--tls-cert", pki.client.key, "stats"]) == 2
    assert "--tls-cert" in capsys.readouterr().err


def test_incomplete_or_wrong_tls_settings_name_their_flag(pki, tmp_path) -> None:
    cases = [(ServerTLS(cert=pki.server.cert), "--tls-key"),
             (ServerTLS(client_ca=pki.ca), "--tls-client-ca alone"),
             (ServerTLS(cert=str(tmp_path / "missing.crt"), key=pki.server.key), "--tls-cert"),
             (ServerTLS(cert=pki.server.key, key=pki.server.key), "not a PEM certificate"),
             (ServerTLS(cert=pki.server.cert, key=pki.server.cert), "not a PEM private key"),
             (ClientTLS(cert=pki.client.cert, flag="--store-tls"), "--store-tls-key")]
    for tls, words in cases:
        with pytest.raises(TLSConfigError, match=words):
            tls.credentials()


def test_node_cli_refuses_a_bad_tls_setting_before_loading_the_model(pki, capsys) -> None:
    from inference_node.cli import main

    assert main(["serve", "--tls-cert", pki.server.cert, "--port", "0"]) == 2
    assert "--tls-key" in capsys.readouterr().err


def _models(url: str, ca: str | None = None, cert=None) -> int:
    """The status of GET /v1/models over HTTPS trusting `ca` (and presenting `cert`)."""
    context = ssl.create_default_context(cafile=ca)
    if cert is not None:
        context.load_cert_chain(cert.cert, cert.key)
    with httpx.Client(verify=context, timeout=10) as client:
        return client.get(f"{url}/models").status_code


def test_the_http_api_serves_tls_with_the_nodes_certificate(tls_node, pki) -> None:
    assert tls_node.http_url.startswith("https://")
    assert _models(tls_node.http_url, pki.ca) == 200
    with pytest.raises(httpx.ConnectError):
        _models(tls_node.http_url, pki.other_ca)
    with pytest.raises(httpx.HTTPError):  # plaintext HTTP to the TLS port
        httpx.get(tls_node.http_url.replace("https://", "http://") + "/models", timeout=10)


def test_the_http_api_of_an_mtls_node_needs_a_client_certificate(mtls_node, pki) -> None:
    assert _models(mtls_node.http_url, pki.ca, pki.client) == 200
    for cert in (None, pki.impostor):
        with pytest.raises(httpx.HTTPError):
            _models(mtls_node.http_url, pki.ca, cert)
