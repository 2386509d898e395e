"""Adapter errors, each mapped to the gRPC status a client sees."""
from __future__ import annotations

import grpc


class AdapterError(Exception):
    status = grpc.StatusCode.INTERNAL


class AdapterNotFound(AdapterError):
    status = grpc.StatusCode.NOT_FOUND


class AdapterRejected(AdapterError):
    """Invalid, or not compatible with this base model or this node's limits."""

    status = grpc.StatusCode.FAILED_PRECONDITION


class AdapterUnavailable(AdapterError):
    """The source could not be reached in time; the client may retry."""

    status = grpc.StatusCode.UNAVAILABLE


class AdapterCorrupt(AdapterError):
    status = grpc.StatusCode.DATA_LOSS


class NoSlotAvailable(AdapterError):
    """Every GPU slot is pinned, so the adapter can never become resident."""

    status = grpc.StatusCode.RESOURCE_EXHAUSTED


class AdapterNumericalFault(AdapterError):
    """The adapter's forward gave logits that are not finite (NaN or Inf) for a request: its
    weights make the model overflow. Retrying the same version cannot help."""

    status = grpc.StatusCode.DATA_LOSS
