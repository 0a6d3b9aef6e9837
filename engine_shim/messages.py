"""The EngineService request messages as the shim builds them from vLLM-style arguments (block
ids as a tuple of lists): one builder per RPC, named by ``SidecarClient``'s table
(``engine_shim.client``). Pure: no I/O, any thread."""

from __future__ import annotations

from collections.abc import Sequence

# The shim's converters between vLLM's block ids and the proto, shared with the sidecar.
from kvsidecar.block_ids import BlockIdsLike as BlockIdsLike
from kvsidecar.block_ids import block_ids_of as block_ids_of
from kvsidecar.block_ids import grouped as grouped
from kvsidecar.v1 import common_pb2, engine_pb2


def remote(
    address: str,
    engine_id: str,
    request_id: str = "",
    block_ids: BlockIdsLike | None = None,
    tp_size: int = 0,
    num_tokens: int = 0,
    voucher: bytes = b"",
    vouched_until_ms: int = 0,
) -> engine_pb2.RemoteBlocks:
    return engine_pb2.RemoteBlocks(
        address=address,
        engine_id=engine_id,
        request_id=request_id,
        block_ids=grouped(block_ids),
        tp_size=tp_size,
        num_tokens=num_tokens,
        voucher=voucher,
        vouched_until_ms=vouched_until_ms,
    )


def given_registration(request: engine_pb2.RegisterWorkerRequest) -> engine_pb2.RegisterWorkerRequest:
    return request


def unregister_request(engine_id: str, tp_rank: int = 0, pp_rank: int = 0) -> engine_pb2.UnregisterWorkerRequest:
    return engine_pb2.UnregisterWorkerRequest(engine_id=engine_id, tp_rank=tp_rank, pp_rank=pp_rank)


def submit_request(
    engine_id: str,
    request_id: str,
    block_ids: BlockIdsLike,
    transfer_id: str = "",
    num_tokens: int = 0,
    lease_seconds: float = 0.0,
    mode: int = common_pb2.TRANSFER_MODE_UNSPECIFIED,
    vouched_until_ms: int = 0,
) -> engine_pb2.SubmitBlocksRequest:
    return engine_pb2.SubmitBlocksRequest(
        engine_id=engine_id,
        request_id=request_id,
        transfer_id=transfer_id,
        block_ids=grouped(block_ids),
        num_tokens=num_tokens,
        lease_seconds=lease_seconds,
        mode=mode,  # type: ignore[arg-type]
        vouched_until_ms=vouched_until_ms,
    )


def pull_request(
    engine_id: str,
    request_id: str,
    local_block_ids: BlockIdsLike,
    remote_blocks: engine_pb2.RemoteBlocks,
    transfer_id: str = "",
    timeout_seconds: float = 0.0,
) -> engine_pb2.PullRequest:
    return engine_pb2.PullRequest(
        engine_id=engine_id,
        request_id=request_id,
        transfer_id=transfer_id,
        local_block_ids=grouped(local_block_ids),
        remote=remote_blocks,
        timeout_seconds=timeout_seconds,
    )


def keep_alive_request(
    engine_id: str,
    request_id: str,
    remote_blocks: engine_pb2.RemoteBlocks,
    transfer_id: str = "",
    timeout_seconds: float = 0.0,
) -> engine_pb2.KeepAliveRequest:
    return engine_pb2.KeepAliveRequest(
        engine_id=engine_id,
        request_id=request_id,
        transfer_id=transfer_id,
        remote=remote_blocks,
        timeout_seconds=timeout_seconds,
    )


def expect_push_request(
    engine_id: str,
    request_id: str,
    block_ids: BlockIdsLike,
    remote_blocks: engine_pb2.RemoteBlocks,
    transfer_id: str = "",
    timeout_seconds: float = 0.0,
) -> engine_pb2.ExpectPushRequest:
    return engine_pb2.ExpectPushRequest(
        engine_id=engine_id,
        request_id=request_id,
        transfer_id=transfer_id,
        block_ids=grouped(block_ids),
        remote=remote_blocks,
        timeout_seconds=timeout_seconds,
    )


def release_request(
    engine_id: str, request_id: str, transfer_id: str = "", reason: str = ""
) -> engine_pb2.ReleaseRequest:
    return engine_pb2.ReleaseRequest(engine_id=engine_id, request_id=request_id, transfer_id=transfer_id, reason=reason)


def hold_blocks_request(
    engine_id: str,
    request_id: str,
    block_ids: BlockIdsLike,
    conversation_id: str = "",
    num_tokens: int = 0,
    ttl_seconds: float = 0.0,
    block_hashes: Sequence[bytes] = (),
) -> engine_pb2.HoldBlocksRequest:
    return engine_pb2.HoldBlocksRequest(
        engine_id=engine_id,
        request_id=request_id,
        conversation_id=conversation_id,
        block_ids=grouped(block_ids),
        num_tokens=num_tokens,
        ttl_seconds=ttl_seconds,
        block_hashes=list(block_hashes),
    )


def query_cache_request(
    engine_id: str,
    address: str = "",
    conversation_id: str = "",
    request_id: str = "",
    block_hashes: Sequence[bytes] = (),
    known_peers: bool = False,
    timeout_seconds: float = 0.0,
) -> engine_pb2.QueryCacheRequest:
    return engine_pb2.QueryCacheRequest(
        engine_id=engine_id,
        address=address,
        conversation_id=conversation_id,
        request_id=request_id,
        block_hashes=list(block_hashes),
        known_peers=known_peers,
        timeout_seconds=timeout_seconds,
    )


def status_request(include_requests: bool = False) -> engine_pb2.GetStatusRequest:
    return engine_pb2.GetStatusRequest(include_requests=include_requests)
