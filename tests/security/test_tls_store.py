"""The node fetching from the adapter store over mutual TLS with a store token, on a real
SeaweedFS: the adapter loads; a wrong token reaches the Generate caller as
FAILED_PRECONDITION naming the store and the flag to fix; the store's RPCs need the token
but its health check does not; no token ever reaches a log, a message or --help."""
from __future__ import annotations

import logging
import uuid

import grpc
import pytest

from adapter_store import cli as store_cli
from adapter_store.client import AdapterStoreClient, StoreError, StoreTLSRefused
from adapter_store.push import push_adapter
from adapter_store.s3 import S3Store
from adapter_store.seaweedfs import SeaweedFS
from adapter_store.server import BackgroundStore, StoreSettings
from lora_common.tls import ClientTLS, ServerTLS
from harness import InProcessNode, make_peft_adapter, peft_greedy
from inference_node.config import NodeConfig
from lora_client import healthcheck
from lora_client.node_client import NodeClient

STORE_TOKEN = "store-t0ken-do-not-log"
WRONG_TOKEN = "wr0ng-t0ken-do-not-log"
PROMPT = [101, 2002, 3003, 4004]


@pytest.fixture(scope="module")
def secure_store(tmp_path_factory, tiny_llama_path, pki):
    root = tmp_path_factory.mktemp("secure-store")
    seaweed = SeaweedFS(root / "seaweedfs")
    seaweed.start()
    bucket = seaweed.create_bucket(f"tls-{uuid.uuid4().hex[:8]}")
    s3 = S3Store(bucket, seaweed.boto3_client())
    folder = make_peft_adapter(tiny_llama_path, root / "tenant", 4, 8.0, ["q_proj", "v_proj"], seed=3, scale=3.0)
    push_adapter(folder, "tenant", s3, "adapters/", progress=False)
    store = BackgroundStore(StoreSettings(
        bucket=bucket, s3_endpoint=seaweed.endpoint_url, region=seaweed.region, cache_dir=str(root / "cache"),
        port=0, poll_interval_s=0.3, token=STORE_TOKEN,
        tls=ServerTLS(cert=pki.server.cert, key=pki.server.key, client_ca=pki.ca)), s3=s3)
    yield store, folder
    store.stop()
    seaweed.close()


def node_settings(tiny_llama_path, store: BackgroundStore, pki, token: str | None) -> NodeConfig:
    return NodeConfig.of(checkpoint=str(tiny_llama_path), device="cpu", num_kv_blocks=64, max_loras=1, max_lora_rank=8,
                         adapter_store=store.address, store_token=token, adapter_disk_tier=False,
                         store_tls=ClientTLS(ca=pki.ca, cert=pki.client.cert, key=pki.client.key, flag="--store-tls"))


def adapter_request_error(settings: NodeConfig, timeout_s: float) -> grpc.RpcError:
    """The error a Generate for the store's adapter ends with on a node with these settings
    (within `timeout_s`); the base model must keep serving and the node end idle."""
    node = InProcessNode(settings)
    try:
        with NodeClient(node.address) as client:
            with pytest.raises(grpc.RpcError) as err:
                client.generate(client.request(adapter="tenant", prompt_token_ids=PROMPT, max_tokens=4),
                                timeout_s)
            assert len(client.generate(client.request(prompt_token_ids=PROMPT, max_tokens=2,
                                                      ignore_eos=True), 60).token_ids) == 2
        node.check_idle()
    finally:
        node.stop()
    return err.value


def test_node_loads_from_the_store_over_mtls_with_its_token(secure_store, tiny_llama_path, pki, caplog) -> None:
    store, folder = secure_store
    expected = peft_greedy(tiny_llama_path, folder, [PROMPT], 8)[0]
    with caplog.at_level(logging.DEBUG):
        node = InProcessNode(node_settings(tiny_llama_path, store, pki, STORE_TOKEN))
        try:
            with NodeClient(node.address) as client:
                reply = client.generate(client.request(adapter="tenant", prompt_token_ids=PROMPT, max_tokens=8,
                                                       ignore_eos=True), 60)
            assert reply.token_ids == expected
            node.check_idle()
        finally:
            node.stop()
    assert STORE_TOKEN not in caplog.text
    assert STORE_TOKEN not in repr(node.node.config)


def test_a_wrong_store_token_is_a_clear_error_for_the_caller(secure_store, tiny_llama_path, pki, caplog) -> None:
    store, _ = secure_store
    with caplog.at_level(logging.DEBUG):
        err = adapter_request_error(node_settings(tiny_llama_path, store, pki, WRONG_TOKEN), 60)
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    details = err.details()
    assert store.address in details and "UNAUTHENTICATED" in details and "--store-token" in details
    assert WRONG_TOKEN not in details and STORE_TOKEN not in details
    assert WRONG_TOKEN not in caplog.text and STORE_TOKEN not in caplog.text


def test_a_store_refusing_the_nodes_tls_is_a_clear_error_not_a_wait_for_the_deadline(
        secure_store, tiny_llama_path, pki) -> None:
    """A node without a client certificate for a store that requires one: the store closes
    each handshake. The caller gets FAILED_PRECONDITION naming the flags to fix, well before
    the node's fetch deadline (60 s) and its own (30 s: a wait would end DEADLINE_EXCEEDED)."""
    store, _ = secure_store
    settings = node_settings(tiny_llama_path, store, pki, STORE_TOKEN).replace(
        store_tls=ClientTLS(ca=pki.ca, flag="--store-tls"))
    err = adapter_request_error(settings, 30)
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, err.details()
    details = err.details()
    assert store.address in details and "TLS handshake" in details and "--store-tls-cert" in details


def test_fetch_gives_up_on_a_refused_tls_handshake(secure_store, pki) -> None:
    """The store client's side of the same: no client certificate (the store closes the
    socket) and an untrusted store certificate (this client's verification fails) both end
    the fetch with StoreTLSRefused, not after its deadline."""
    store, _ = secure_store
    untrusting = ClientTLS(ca=pki.other_ca, cert=pki.client.cert, key=pki.client.key, flag="--store-tls")
    for tls in (ClientTLS(ca=pki.ca, flag="--store-tls"), untrusting):
        with AdapterStoreClient(store.address, tls=tls, token=STORE_TOKEN) as client:
            with pytest.raises(StoreTLSRefused) as err:
                client.fetch("tenant", deadline_s=60)
        assert err.value.code == grpc.StatusCode.UNAVAILABLE and "--store-tls-ca" in err.value.details


def test_an_adapter_above_the_nodes_size_limit_is_refused_before_download(secure_store, tiny_llama_path,
                                                                           pki) -> None:
    store, _ = secure_store
    settings = node_settings(tiny_llama_path, store, pki, STORE_TOKEN).replace(max_adapter_bytes=1000)
    node = InProcessNode(settings)
    try:
        with NodeClient(node.address) as client:
            with pytest.raises(grpc.RpcError) as err:
                client.generate(client.request(adapter="tenant", prompt_token_ids=PROMPT, max_tokens=4), 60)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "'tenant'" in err.value.details() and "(--max-adapter-mb)" in err.value.details()
        node.check_idle()
    finally:
        node.stop()


def test_store_rpcs_need_the_token_and_a_client_certificate(secure_store, pki, monkeypatch, capsys) -> None:
    store, _ = secure_store
    mtls = ClientTLS(ca=pki.ca, cert=pki.client.cert, key=pki.client.key)
    for token in (None, WRONG_TOKEN):
        with AdapterStoreClient(store.address, tls=mtls, token=token) as client:
            with pytest.raises(StoreError) as err:
                client.list_adapters()
            assert err.value.code == grpc.StatusCode.UNAUTHENTICATED and "token" in err.value.details
    with AdapterStoreClient(store.address, tls=ClientTLS(ca=pki.ca), token=STORE_TOKEN) as no_cert:
        with pytest.raises(StoreError) as err:
            no_cert.get_manifest("tenant")
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
    with AdapterStoreClient(store.address, token=STORE_TOKEN) as plaintext:
        with pytest.raises(StoreError) as err:
            plaintext.list_adapters()
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
    with AdapterStoreClient(store.address, tls=mtls, token=STORE_TOKEN) as client:
        assert [a.name for a in client.list_adapters()] == ["tenant"]

    # The CLI's view of the same store; health checks need TLS but no token.
    flags = ["--store", store.address, "--store-tls-ca", pki.ca, "--store-tls-cert", pki.client.cert,
             "--store-tls-key", pki.client.key]
    assert store_cli.main(["ls", *flags, "--store-token", STORE_TOKEN, "--json"]) == 0
    assert '"name": "tenant"' in capsys.readouterr().out
    assert store_cli.main(["ls", *flags]) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    for name, value in (("CA", pki.ca), ("CERT", pki.client.cert), ("KEY", pki.client.key)):
        monkeypatch.setenv(f"LORA_CLIENT_TLS_{name}", value)
    assert healthcheck.main([store.address]) == 0


def test_tokens_stay_out_of_help_and_reprs(monkeypatch) -> None:
    monkeypatch.setenv("ADAPTER_STORE_TOKEN", STORE_TOKEN)
    monkeypatch.setenv("ADAPTER_STORE_STORE_TOKEN", STORE_TOKEN)
    monkeypatch.setenv("INFERENCE_NODE_STORE_TOKEN", STORE_TOKEN)
    monkeypatch.setenv("LORA_CLIENT_TOKEN", STORE_TOKEN)
    from inference_node.cli import parser as node_parser
    from lora_client.cli import parser as client_parser

    store_subs = store_cli.build_parser()._subparsers._group_actions[0].choices
    texts = [store_subs["serve"].format_help(), store_subs["ls"].format_help(), client_parser().format_help(),
             node_parser()._subparsers._group_actions[0].choices["serve"].format_help()]
    for text in texts:
        assert STORE_TOKEN not in text
    assert "ADAPTER_STORE_TOKEN" in texts[0] and "INFERENCE_NODE_STORE_TOKEN" in texts[3]
    assert STORE_TOKEN not in repr(StoreSettings(bucket="b", token=STORE_TOKEN))
    assert STORE_TOKEN not in repr(NodeConfig.of(store_token=STORE_TOKEN))
