"""Pull vouchers: a producer engine's signed word that a request's blocks stay held until a time.

A consumer's sidecar must not READ a producer's blocks unless it knows two things: the blocks are
the ones the producer submitted for the request (not another request's KV), and the producer will
not hand them back to its engine before the READ ends. Without a voucher it asks the producer's
sidecar first (a heartbeat: a round trip between nodes on every pull's critical path). With one,
it knows both from the request's ``kv_transfer_params`` alone:

- the producer engine signs ``(engine_id, request_id, block_ids, until_ms)`` with the key its
  sidecar gave it (``SubmitBlocksResponse.voucher_key``); the consumer's sidecar checks it with the
  same key from its handshake with the producer's sidecar (``EngineDescriptor.voucher_key``).
  Routers and clients carry the voucher but cannot forge one;
- the producer keeps vouched blocks until ``until_ms`` (+ the clock skew allowance) whatever
  happens, unless a consumer's READ notified: its sidecar holds them even through a release, and
  its engine holds them even if the submission fails. The consumer's READ must end by
  ``until_ms`` (- the allowance) on its own clock.

The key changes with every (re-)registration of the engine, so a voucher from before a restart
verifies against no current handshake and takes the confirming path.

Pure functions; both sides import this module (the contract package imports neither side).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

KEY_BYTES = 32
# kv_transfer_params keys the producer engine adds (hex voucher, Unix ms); routers pass them through.
PARAM_VOUCHER = "kvsidecar_voucher"
PARAM_VOUCHED_UNTIL_MS = "kvsidecar_vouched_until_ms"


def _message(engine_id: str, request_id: str, block_ids: Sequence[Sequence[int]], until_ms: int) -> bytes:
    # map() rather than a generator: the same text at half the cost (~0.15 ms for 1,024 blocks).
    groups = ";".join(",".join(map(str, map(int, group))) for group in block_ids)
    return f"kvsidecar-voucher-v1\n{engine_id}\n{request_id}\n{int(until_ms)}\n{groups}".encode()


def sign(key: bytes, engine_id: str, request_id: str, block_ids: Sequence[Sequence[int]], until_ms: int) -> bytes:
    """The voucher for these blocks of ``request_id`` on ``engine_id``, valid until ``until_ms``."""
    # hmac.digest: OpenSSL's one-shot HMAC, the same bytes as hmac.new(...).digest() at a fraction
    # of its cost (no Python HMAC object, no key padding in Python) on both engines' and sidecars' hot paths.
    return hmac.digest(key, _message(engine_id, request_id, block_ids, until_ms), hashlib.sha256)


def verify(
    key: bytes, voucher: bytes, engine_id: str, request_id: str, block_ids: Sequence[Sequence[int]], until_ms: int
) -> bool:
    """Whether ``voucher`` was signed with ``key`` for exactly these values (validity not checked)."""
    if len(key) != KEY_BYTES or not voucher:
        return False
    return hmac.compare_digest(voucher, sign(key, engine_id, request_id, block_ids, until_ms))
