"""The voucher's signed text is a contract between a producer engine's shim (which signs) and a
consumer's sidecar (which verifies), possibly of different versions: it must not change."""

from __future__ import annotations

import hashlib
import hmac

import numpy as np

from kvsidecar import voucher

KEY = bytes(range(32))


def test_the_signed_text_is_the_v1_format_for_python_and_numpy_ids() -> None:
    text = b"kvsidecar-voucher-v1\nengine-P\nreq-1\n1700000000123\n3,1,2;7;"
    expected = hmac.new(KEY, text, hashlib.sha256).digest()
    blocks = [[3, 1, 2], [7], []]
    assert voucher.sign(KEY, "engine-P", "req-1", blocks, 1700000000123) == expected
    as_numpy = [np.asarray(group, dtype=np.int64) for group in blocks]
    assert voucher.sign(KEY, "engine-P", "req-1", as_numpy, 1700000000123) == expected


def test_a_voucher_verifies_only_for_the_blocks_it_names() -> None:
    blocks = [list(range(1024))]
    signed = voucher.sign(KEY, "engine-P", "req-1", blocks, 5)
    assert voucher.verify(KEY, signed, "engine-P", "req-1", blocks, 5)
    assert not voucher.verify(KEY, signed, "engine-P", "req-1", [list(range(1, 1025))], 5)
    assert not voucher.verify(KEY, signed, "engine-P", "req-1", blocks, 6)
