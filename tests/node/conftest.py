"""Clients of a module's `node` fixture (an InProcessNode with HTTP on) that the OpenAI API's
tests share: the model's name, the openai client and a gRPC client. openai is imported by its
fixture: the GPU machines' image has no openai, and the folder's GPU tests need none."""
from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from lora_client.node_client import NodeClient

if TYPE_CHECKING:
    import openai


@pytest.fixture(scope="module")
def base(node) -> str:
    return node.node.model_name


@pytest.fixture()
def api(node) -> openai.OpenAI:
    import openai

    with openai.OpenAI(base_url=node.http_url, api_key="unused", max_retries=0, timeout=120) as client:
        yield client


@pytest.fixture()
def grpc_client(node):
    with NodeClient(node.address) as c:
        yield c
