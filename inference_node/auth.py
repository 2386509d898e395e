"""Bearer-token authentication of the node's RPCs.

Loading and unloading adapters is an administrative act: when an admin token is set,
LoadAdapter and UnloadAdapter need `authorization: Bearer <token>` metadata. Generate can
require its own token. Tokens are compared in constant time and never logged (the
mechanics are shared with the store, in lora_common.auth).
"""
from __future__ import annotations

from lora_common.auth import BearerAuth, method_tokens

ADMIN_METHODS = frozenset({"LoadAdapter", "UnloadAdapter"})
GENERATE_METHODS = frozenset({"Generate"})


class TokenAuth(BearerAuth):
    def __init__(self, admin_token: str | None, generate_token: str | None) -> None:
        required: dict[str, str] = {}
        for methods, token in ((ADMIN_METHODS, admin_token), (GENERATE_METHODS, generate_token)):
            if token:
                required.update({m: token for m in methods})
        super().__init__(method_tokens(required), _message)


def _message(method: str) -> str:
    name = method.rsplit("/", 1)[-1]
    return (f"{name} needs 'authorization: Bearer <token>' metadata with this node's "
            f"{'admin' if name in ADMIN_METHODS else 'generate'} token")
