"""``bench.engine_timeline``: D's time to first token split into phases from a merged trace (the
client's leg times and the engine trace's step lines), per configuration and size, warm-ups
skipped, whichever connector reported the KV loaded."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import engine_timeline


def _request(t: float, request_id: str, connector: str) -> list[str]:
    """One sequential P/D request's lines as bench/vllm_pd.py and bench/engine_trace write them."""
    return [
        f"{t + 0.004:.6f} 11 core add {request_id}",
        f"{t + 0.0045:.6f} 11 shim alloc {request_id} n=512",
        f"{t + 0.012:.6f} 12 {connector} results recv=['{request_id}'] send=[]",
        f"{t + 0.014:.6f} 12 worker execute start={t + 0.0142:.6f} dur_ms=7.00 tokens=1",
        f"{t + 0.025:.6f} client client P-leg {t - 0.1:.6f}->{t:.6f} D-leg sent {t:.6f} first {t + 0.025:.6f}",
    ]


def test_phases_per_configuration_skip_warm_ups_and_add_up_to_the_ttft(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = ["100.000000 client starting kvsidecar-pull", *_request(100.5, "warm-0", "shim")]
    lines += ["101.000000 client measuring kvsidecar-pull 512", *_request(101.5, "warm-1", "shim")]
    lines += [*_request(102.0, "req-a", "shim"), *_request(102.5, "req-b", "shim")]
    lines += ["103.000000 client starting nixl-pull-fixed", "103.100000 client measuring nixl-pull-fixed 512"]
    lines += [*_request(103.5, "warm-2", "nixl"), *_request(104.0, "req-c", "nixl")]
    trace = tmp_path / "trace.log"
    trace.write_text("\n".join(lines) + "\n")
    parsed = [(float(line.split(" ", 1)[0]), " " + line.split(" ", 1)[1]) for line in lines]

    found = engine_timeline.phases(parsed, 102.0, 102.025)
    assert found is not None
    assert found["to_engine"] == pytest.approx(4.0, abs=0.01)
    assert found["to_loaded"] == pytest.approx(8.0, abs=0.01)
    assert found["to_scheduled"] == pytest.approx(2.2, abs=0.01)
    assert found["step"] == pytest.approx(7.0)
    parts = sum(found[name] for name in ("to_engine", "to_loaded", "to_scheduled", "step", "to_client"))
    assert parts == pytest.approx(found["ttft"], abs=0.01)

    engine_timeline.main([str(trace)])
    table = capsys.readouterr().out
    # Two measured requests for kvsidecar (its warm-ups skipped), one for vLLM's NIXL.
    assert "| kvsidecar-pull 512 | 2 | 4.0 | 8.0 |" in table, table
    assert "| nixl-pull-fixed 512 | 1 | 4.0 | 8.0 |" in table, table
