"""Adapter errors, each mapped to the gRPC status a client sees."""
from __future__ import annotations

import grpc


class AdapterError(Exception):
    status = grpc.StatusCode.INTERNAL
    # Whether asking this node again soon may succeed: clients are told not to retry when not
    # (x-should-retry: false), e.g. the source cannot be reached at all.
    retry_may_help = True


class AdapterNotFound(AdapterError):
    status = grpc.StatusCode.NOT_FOUND


class AdapterRejected(AdapterError):
    """Invalid, or not compatible with this base model or this node's limits."""

    status = grpc.StatusCode.FAILED_PRECONDITION


class AdapterUnavailable(AdapterError):
    """The source could not be reached in time; the client may retry."""

    status = grpc.StatusCode.UNAVAILABLE


class SourceUnreachable(AdapterUnavailable):
    """The adapter is on no tier of this node and its source cannot be reached: a retry here
    fails the same way until the source is back."""

    retry_may_help = False


class AdapterCancelled(AdapterError):
    """A fetch nobody waits for any more (its requests ended, the node is stopping)."""

    status = grpc.StatusCode.CANCELLED


class AdapterCorrupt(AdapterError):
    status = grpc.StatusCode.DATA_LOSS


class NoSlotAvailable(AdapterError):
    """Every GPU slot is pinned, so the adapter can never become resident."""

    status = grpc.StatusCode.RESOURCE_EXHAUSTED


class AdapterTooLarge(NoSlotAvailable):
    """It needs more of some module's adapter memory than this node has at all (rank rows of
    an arena, --lora-memory-mb): it can never become resident here."""

    retry_may_help = False


class AdapterNumericalFault(AdapterError):
    """The adapter's forward gave logits that are not finite (NaN or Inf) for a request: its
    weights make the model overflow. Retrying the same version cannot help."""

    status = grpc.StatusCode.DATA_LOSS
