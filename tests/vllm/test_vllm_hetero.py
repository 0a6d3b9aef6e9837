"""End to end with real vLLM on the CPU, prefill and decode engines with different block sizes
(P 64 / D 32 and P 32 / D 64), in pull and in push: D's answers equal a plain instance's and D's
prompt was loaded from the transfer, converted by the sidecars (vLLM's CPU layout, CPU_VEC_LBHNC:
K is transposed inside each head, so every token's K moves element by element through staging).

vLLM's CPU attention supports only its own layout (``supported_kv_cache_layouts`` is LBHNC only),
so the layout half of issue 11 cannot run on vLLM here; the simulated engines cover it.

Processes per direction (module-scoped, killed at the end): sidecars ``a`` and ``b``, a plain
``baseline``, a producer on ``a`` and a consumer on ``b`` with the two block sizes.
"""

from __future__ import annotations

import shutil
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import count
from pathlib import Path
from typing import Any

import pytest

from tests.support.processes import SidecarProcess
from tests.support.tiny_models import build_tiny_llama, prompt_words
from tests.support.vllm_engine import VllmEngineProcess, remove_engine_shm_files, remove_orphaned_shm

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

MAX_TOKENS = 12
PROMPT_LENGTHS = (100, 230)  # partial last blocks for both block sizes
_seeds = count(5000)


@pytest.fixture(autouse=True)
def no_leaked_shm() -> Iterator[None]:
    """As in test_vllm_e2e: this module's engines' files are checked by engine id at the end."""
    yield


@dataclass
class Pair:
    baseline: VllmEngineProcess
    prefill: VllmEngineProcess
    decode: VllmEngineProcess
    a: SidecarProcess
    b: SidecarProcess


@pytest.fixture(scope="module", params=[(64, 32), (32, 64)], ids=["P64-D32", "P32-D64"])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    p_block, d_block = request.param
    model = build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    workdir = Path(tempfile.mkdtemp(prefix="kvsh-", dir="/tmp"))
    token = uuid.uuid4().hex[:8]
    shm_before = {path.name for path in Path("/dev/shm").iterdir()}
    args = ["--integrity", "digest"]
    a, b = SidecarProcess(workdir, "a", args), SidecarProcess(workdir, "b", args)
    engines: list[VllmEngineProcess] = []
    ids = [f"prefill-{token}", f"decode-{token}"]
    try:
        a.start()
        b.start()
        engines.append(VllmEngineProcess(workdir, "baseline", model, cpu=0, block_size=d_block))
        engines.append(
            VllmEngineProcess(
                workdir, "prefill", model, cpu=0, sidecar=a.socket, engine_id=ids[0], role="kv_producer",
                block_size=p_block,
            )
        )  # fmt: skip
        engines.append(
            VllmEngineProcess(
                workdir, "decode", model, cpu=1, sidecar=b.socket, engine_id=ids[1], role="kv_consumer",
                block_size=d_block,
            )
        )  # fmt: skip
        for engine in engines:
            engine.wait_ready(240.0)
        yield Pair(engines[0], engines[1], engines[2], a, b)
    finally:
        for engine in engines:
            engine.request_exit()
        for engine in engines:
            engine.stop(timeout=20.0)
        for sidecar in (a, b):
            sidecar.kill()
        leaked = [path for engine_id in ids for path in remove_engine_shm_files(engine_id)]
        remove_orphaned_shm(shm_before)
        shutil.rmtree(workdir, ignore_errors=True)
        assert not leaked, f"KV shared-memory files left behind: {leaked}"


def _leg(pair: Pair, prompt: str, mode: str) -> dict[str, Any]:
    answer = pair.prefill.generate(
        prompt, 1, {"do_remote_decode": True, "transfer_id": uuid.uuid4().hex, "transfer_mode": mode}
    )
    params: dict[str, Any] = answer["kv_transfer_params"]
    assert params and params["do_remote_prefill"], answer
    return {key: value for key, value in params.items() if key != "remote_prefill_cached_tokens"}


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_decode_with_converted_prefill_kv_equals_single_instance(pair: Pair, mode: str) -> None:
    for length in PROMPT_LENGTHS:
        prompt = prompt_words(length, next(_seeds))
        params = _leg(pair, prompt, mode)
        answer = pair.decode.generate(prompt, MAX_TOKENS, params)
        reference = pair.baseline.generate(prompt, MAX_TOKENS)["token_ids"]
        assert answer["token_ids"] == reference, f"{mode}, {length} tokens: {answer}"
        transfer = answer["transfer"]
        assert transfer is not None and transfer["outcome"] == "received", answer
        loaded = length - 1 if transfer["inline"] else length  # an inline load computes its last token
        assert answer["external_tokens"] == loaded and answer["num_cached_tokens"] == loaded, answer
