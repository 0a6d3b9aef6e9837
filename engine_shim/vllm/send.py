"""P's half of the scheduler role: offering a finished request's KV to a consumer.

``request_finished`` of a producer request (``do_remote_decode``): after a normal finish its
blocks go to the sidecar (``SubmitBlocks``), signed with a pull voucher once the sidecar gave a key
(``kvsidecar.voucher``), and the kv_transfer_params that tell the router where the consumer reads
them; after an abort the sidecar releases the transfer. A decode engine with multi-turn holds its
finished turn for the next one (``HoldBlocks``, ``engine_shim.vllm.multiturn``). Each step the
workers hear which sends started and which were abandoned (a failed submission; a vouched one only
once its voucher ran out), and vLLM which blocks it may free.

Threads: vLLM's scheduler thread calls every method and owns every dict and set here. gRPC
callback threads only append to the deque ``_failures`` and set ``_voucher_terms``.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger

from engine_shim.client import Future
from engine_shim.vllm import multiturn
from engine_shim.vllm.config import MODES, BlockIds
from engine_shim.vllm.link import SidecarLink, ignore, rpc_error
from engine_shim.vllm.metadata import SidecarConnectorMetadata
from engine_shim.vllm.params import split_address
from kvsidecar import voucher
from kvsidecar.voucher import PARAM_VOUCHED_UNTIL_MS, PARAM_VOUCHER

if TYPE_CHECKING:
    from vllm.v1.request import Request

logger = init_logger("vllm.kvsidecar.scheduler")


def _finished_normally(request: Request) -> bool:
    from vllm.v1.request import RequestStatus

    return request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)


class Sender:
    """P's send side; runs on vLLM's scheduler thread (see module doc)."""

    def __init__(self, link: SidecarLink, turns: multiturn.MultiTurn | None, holds_turns: bool) -> None:
        self.link = link
        self.multiturn = turns
        self._holds_turns = holds_turns  # multi-turn hook: a decode engine keeps finished turns
        self._sends: set[str] = set()  # producer requests whose blocks the sidecar holds
        self._push_sends: set[str] = set()  # the subset a consumer's registration makes us WRITE
        # Pull vouchers (kvsidecar.voucher): the key and terms from the sidecar's last SubmitBlocks
        # answer (set by gRPC callback threads; b"" until the first answer, or when vouchers are off),
        # and until when (monotonic) each vouched request's blocks must stay held even if its
        # submission fails: a consumer may read them without asking the sidecar.
        self._voucher_terms: tuple[bytes, float, float] = (b"", 0.0, 0.0)  # key, seconds, skew
        self._vouched_until: dict[str, float] = {}
        self._held_failures: list[tuple[str, str]] = []  # (request id, reason) of vouched sends that failed
        # Announced to the workers in the next metadata, with the time.monotonic() of the call.
        self._new_sends: dict[str, float] = {}
        # Filled by gRPC callback threads: (request id, reason) of sends that failed.
        self._failures: collections.deque[tuple[str, str]] = collections.deque()

    # gRPC threads ------------------------------------------------------------------------------

    def _on_submit_done(self, request_id: str, future: Future[Any], what: str = "SubmitBlocks") -> None:
        exc = future.exception()
        if exc is not None:
            _, text = rpc_error(exc)
            # The blocks were never offered (or the sidecar is gone): vLLM may free them (a vouched
            # request's only once its voucher ran out, see build_meta).
            self._failures.append((request_id, f"{what} failed: {text}"))
        elif what == "SubmitBlocks":
            response = future.result()
            self._voucher_terms = (response.voucher_key, response.voucher_seconds, response.voucher_clock_skew_seconds)

    # vLLM scheduler thread ---------------------------------------------------------------------

    def request_finished(
        self, request: Request, params: dict[str, Any], block_ids: Sequence[Sequence[int]]
    ) -> tuple[bool, dict[str, Any] | None]:
        """P's part of a request's end (D's found nothing of its own): offer the blocks or free them."""
        if not params.get("do_remote_decode"):
            if self._holds_turns:  # multi-turn hook: a decode engine keeps the turn for the next one
                return self._hold_for_next_turn(request, block_ids)
            return False, None
        link = self.link
        request_id = request.request_id
        # Producer: keep the blocks for the consumer only after a normal finish.
        if not _finished_normally(request):
            transfer_id = str(params.get("transfer_id") or "")
            if transfer_id and not link.down:
                # A router that dispatched both legs at once has a consumer waiting for this
                # prefill: ask the sidecar to release the transfer everywhere it exists.
                link.client.release_async(
                    link.engine_id, request_id, transfer_id, reason=f"prefill ended with {request.status.name}"
                ).add_done_callback(ignore)
            return False, None
        blocks = link.transfer_blocks(block_ids)
        if not any(blocks):
            return False, None
        address = link.address
        if address is None or link.down:
            link._refresh_address()
            # No sidecar to hold them: free now; without params the router sends the decode leg
            # as a plain request and the consumer computes the prompt itself.
            logger.warning("SidecarConnector: sidecar unavailable; %s is not offered to a consumer", request_id)
            return False, None
        return True, self._submit(request, params, blocks, address)

    def _submit(self, request: Request, params: dict[str, Any], blocks: BlockIds, address: str) -> dict[str, Any]:
        """Hand the blocks to the sidecar (SubmitBlocks, a future) and answer the router's params."""
        link = self.link
        request_id = request.request_id
        mode = link.mode(params)
        transfer_id = str(params.get("transfer_id") or "")
        key, seconds, skew = self._voucher_terms
        until_ms = int((time.time() + seconds) * 1000) if key else 0
        future = link.client.submit_blocks_async(
            link.engine_id,
            request_id,
            blocks,
            transfer_id=transfer_id,
            num_tokens=request.num_computed_tokens,
            lease_seconds=link.config.lease_seconds,
            mode=MODES[mode],
            vouched_until_ms=until_ms,
        )
        future.add_done_callback(lambda f: self._on_submit_done(request_id, f))
        self._sends.add(request_id)
        if mode == "push":
            self._push_sends.add(request_id)
        self._new_sends[request_id] = time.monotonic()
        host, port = split_address(address)
        result: dict[str, Any] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [list(group) for group in blocks],
            "remote_engine_id": link.engine_id,
            "remote_request_id": request_id,
            "remote_host": host,
            "remote_port": port,
            "tp_size": link.tp_size,
            "pp_size": link.pp_size,
            "dcp_size": 1,
            "remote_num_tokens": request.num_computed_tokens,
            "transfer_mode": mode,
        }
        if transfer_id:
            result["transfer_id"] = transfer_id
        if until_ms:
            # Consumers may read these blocks without asking our sidecar until then (kvsidecar.voucher).
            result[PARAM_VOUCHER] = voucher.sign(key, link.engine_id, request_id, blocks, until_ms).hex()
            result[PARAM_VOUCHED_UNTIL_MS] = until_ms
            self._vouched_until[request_id] = time.monotonic() + seconds + skew
        if params.get("conversation_id"):  # multi-turn hook: D's hold is indexed by it
            result["conversation_id"] = params["conversation_id"]
        return result

    def _hold_for_next_turn(
        self, request: Request, block_ids: Sequence[Sequence[int]]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Multi-turn hook (engine_shim.vllm.multiturn): keep a finished decode request's blocks on
        the sidecar until a prefill engine reads them for the next turn, their TTL ends, or the hold
        cap releases them; vLLM frees them at the FINISHED_SENDING / LEASE_EXPIRED that follows."""
        assert self.multiturn is not None
        if not _finished_normally(request):
            return False, None
        link = self.link
        blocks = link.transfer_blocks(block_ids)
        address = link.address
        if not any(blocks) or address is None or link.down:
            return False, None
        request_id = request.request_id
        host, port = split_address(address)
        future, result = self.multiturn.hold(request, blocks, host, port, link.tp_size, link.pp_size)
        future.add_done_callback(lambda f: self._on_submit_done(request_id, f, "HoldBlocks"))
        self._sends.add(request_id)
        self._new_sends[request_id] = time.monotonic()
        return True, result

    def build_meta(self, meta: SidecarConnectorMetadata) -> None:
        """This step's send news for the workers: started, and abandoned (failed submissions)."""
        if self._new_sends:
            meta.send_started, self._new_sends = self._new_sends, {}
        failures = self._failures
        now = time.monotonic()
        held, self._held_failures = self._held_failures, []
        failures.extend(held)
        while failures:
            request_id, reason = failures.popleft()
            if self._vouched_until.get(request_id, 0.0) > now:
                # A consumer may still read these blocks on the strength of our voucher: keep them
                # until it ran out (its submission failed, so our sidecar cannot hold them for us).
                self._held_failures.append((request_id, reason))
                continue
            if request_id in self._sends:
                self._forget(request_id)
                meta.send_abandoned[request_id] = reason
                logger.warning("SidecarConnector: %s; freeing the blocks of %s", reason, request_id)

    def finished_sending(self, request_ids: set[str]) -> None:
        for request_id in request_ids:
            self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        self._sends.discard(request_id)
        self._push_sends.discard(request_id)
        self._vouched_until.pop(request_id, None)

    def has_pending_work(self) -> bool:
        # Failures wait for delivery or pushed blocks wait for their WRITEs (vLLM's push semantics);
        # pulled blocks are freed at the next step, as in vLLM.
        return bool(self._failures or self._held_failures or self._push_sends)
