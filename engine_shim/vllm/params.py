"""Reading vLLM's ``kv_transfer_params`` (router-supplied, so read defensively). Pure functions."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from engine_shim.vllm.config import BlockIds
from kvsidecar.voucher import PARAM_VOUCHED_UNTIL_MS, PARAM_VOUCHER


def flat(block_ids: Sequence[Sequence[int]]) -> list[int]:
    return [block for group in block_ids for block in group]


def blocks_from_params(value: Any) -> BlockIds:
    """Block ids from kv_transfer_params (``remote_block_ids``): a list per group, or (older
    routers) one flat list. Not the proto's: ``engine_shim.messages`` converts those."""
    if not value:
        return ()
    items = list(value)
    if all(isinstance(item, int) for item in items):
        return (list(items),)
    return tuple([int(block) for block in group] for group in items)


def peer_address(params: Mapping[str, Any]) -> str | None:
    host, port = params.get("remote_host"), params.get("remote_port")
    if not host or port in (None, ""):
        return None
    host = str(host)
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # a bare IPv6 address
    return f"{host}:{int(port)}"


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def voucher_of(params: Mapping[str, Any]) -> tuple[bytes, int]:
    """The producer's pull voucher in ``params`` (kvsidecar.voucher) as (voucher, until_ms);
    (b"", 0) if there is none or it is malformed (the sidecar then confirms with the producer)."""
    try:
        return bytes.fromhex(str(params.get(PARAM_VOUCHER) or "")), int(params.get(PARAM_VOUCHED_UNTIL_MS) or 0)
    except (TypeError, ValueError):
        return b"", 0
