"""Why the engine refuses or ends a request; the front ends map each to a status code."""
from __future__ import annotations


class InvalidRequest(ValueError):
    """The request can never run as given (the caller answers INVALID_ARGUMENT)."""


class QueueFull(RuntimeError):
    """Too many requests in flight; the caller answers RESOURCE_EXHAUSTED."""


class EngineStopped(RuntimeError):
    """The engine is shutting down and takes no new work (UNAVAILABLE)."""


class NotStarted(EngineStopped):
    """A drain refused a request that had streamed nothing yet: safe to retry on another node."""


class CutShort(EngineStopped):
    """The drain deadline ended a request that had already streamed part of its answer."""


class RankLost(EngineStopped):
    """A step failed because another tensor-parallel rank died (its collective broke): the
    node is going down (parallel/workers.py ends it), so its requests end UNAVAILABLE, and
    the engine logs it in one line."""


class NonFiniteLogits(RuntimeError):
    """The base model's logits were not finite for a request (INTERNAL: a fault of the node
    or its checkpoint, not of the request)."""
