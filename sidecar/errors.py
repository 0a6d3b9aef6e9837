"""Domain errors raised by the core and mapped to gRPC status codes at the servicer boundary.

The core raises these plain exceptions; ``sidecar.api.interceptor.CallInterceptor`` turns them
into a gRPC status with the message, so every servicer stays thin and tests can drive the core
without gRPC. The peer client (``sidecar.peers.client``) maps a peer's status back to them.
"""

from __future__ import annotations

import grpc


class SidecarError(Exception):
    """Base class: an error whose message is safe to return to the caller."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class InvalidArgument(SidecarError):
    """A request field is missing or malformed. The message starts with the field's path."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field


class PeerInvalidArgument(SidecarError):
    """A peer sidecar answered INVALID_ARGUMENT; the message is the peer's, field name included."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(SidecarError):
    code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(SidecarError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class PermissionDenied(SidecarError):
    """A caller acted on what is not its own: a peer on a transfer it is not a party to (mTLS
    identity), an engine-socket user on another user's engine or file; the message says whose."""

    code = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhausted(SidecarError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(SidecarError):
    code = grpc.StatusCode.UNAVAILABLE


DRAINING = "the sidecar is draining for shutdown"


class Draining(Unavailable):
    """A stopping sidecar refused new work before any of it took effect. Its message starts with
    ``DRAINING``, which is how a peer's client tells it from an UNAVAILABLE that may have reached
    the peer (a connection lost mid-call)."""


class DeadlineExceeded(SidecarError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unimplemented(SidecarError):
    """A peer answered UNIMPLEMENTED: it is a version without this RPC, so the feature is absent
    there (docs/compatibility.md); an answer, not a failure of the peer."""

    code = grpc.StatusCode.UNIMPLEMENTED
