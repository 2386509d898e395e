"""The store's own use of the shared bearer-token checks: every AdapterStore RPC needs its token."""
from __future__ import annotations

from lora.v1 import adapter_store_pb2 as pb
from lora_common.auth import BearerAuth

STORE_SERVICE = pb.DESCRIPTOR.services_by_name["AdapterStore"].full_name


def store_token_auth(token: str) -> BearerAuth:
    """Every AdapterStore RPC needs the store's token (nodes: --store-token)."""
    prefix = f"/{STORE_SERVICE}/"
    return BearerAuth(lambda method: token if method.startswith(prefix) else None,
                      lambda method: f"{method.rsplit('/', 1)[-1]} needs 'authorization: Bearer <token>' "
                                     "metadata with this store's token (a node sends it with --store-token)")
