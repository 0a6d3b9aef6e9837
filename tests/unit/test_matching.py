"""Push matching in either order, by transfer id, exact producer id or vLLM base id."""

import random

from sidecar.core.matching import PushMatcher, Registration, Submission, base_request_id


def reg(request_id: str, transfer_id: str = "", prefill_request_id: str = "", engine: str = "P") -> Registration:
    return Registration(engine, "D", request_id, transfer_id, prefill_request_id, order=request_id)


def sub(request_id: str, transfer_id: str = "", engine: str = "P") -> Submission:
    return Submission(engine, request_id, transfer_id)


def test_base_request_id_strips_only_the_random_suffix() -> None:
    assert base_request_id("cmpl-abc-0-1a2b3c4d") == "cmpl-abc-0"
    assert base_request_id("cmpl-abc-0") == "cmpl-abc-0"
    assert base_request_id("req-DEADBEEF") == "req"
    assert base_request_id("req-1a2b3c4") == "req-1a2b3c4"  # 7 hex digits: not a suffix


def test_registration_first_then_blocks() -> None:
    matcher = PushMatcher()
    assert matcher.add_registration(reg("cmpl-x-0-aaaaaaaa")) is None
    found = matcher.add_submission(sub("cmpl-x-0-bbbbbbbb"))
    assert found is not None and found.request_id == "cmpl-x-0-aaaaaaaa"
    assert matcher.pending_registrations == 0 and matcher.unmatched_submissions == 0


def test_blocks_first_then_registration() -> None:
    matcher = PushMatcher()
    assert matcher.add_submission(sub("cmpl-x-0-bbbbbbbb")) is None
    found = matcher.add_registration(reg("cmpl-x-0-aaaaaaaa"))
    assert found is not None and found.request_id == "cmpl-x-0-bbbbbbbb"


def test_transfer_id_wins_over_base_id() -> None:
    matcher = PushMatcher()
    matcher.add_submission(sub("cmpl-x-0-11111111", transfer_id="t1"))
    matcher.add_submission(sub("cmpl-x-0-22222222", transfer_id="t2"))
    found = matcher.add_registration(reg("cmpl-x-0-33333333", transfer_id="t2"))
    assert found is not None and found.request_id == "cmpl-x-0-22222222"


def test_different_transfer_ids_never_match_even_with_equal_base_ids() -> None:
    matcher = PushMatcher()
    matcher.add_submission(sub("cmpl-x-0-11111111", transfer_id="t1"))
    assert matcher.add_registration(reg("cmpl-x-0-33333333", transfer_id="t9")) is None


def test_exact_producer_id_when_the_consumer_knows_it() -> None:
    matcher = PushMatcher()
    matcher.add_submission(sub("p-request-7"))
    found = matcher.add_registration(reg("d-request-unrelated", prefill_request_id="p-request-7"))
    assert found is not None and found.request_id == "p-request-7"


def test_different_base_ids_and_engines_do_not_match() -> None:
    matcher = PushMatcher()
    matcher.add_submission(sub("cmpl-a-0-11111111"))
    assert matcher.add_registration(reg("cmpl-b-0-22222222")) is None
    assert matcher.add_registration(reg("cmpl-a-0-33333333", engine="other-P")) is None
    assert matcher.pending_registrations == 2


def test_duplicate_registration_is_idempotent() -> None:
    matcher = PushMatcher()
    assert matcher.add_registration(reg("cmpl-x-0-aaaaaaaa")) is None
    assert matcher.add_registration(reg("cmpl-x-0-aaaaaaaa")) is None
    assert matcher.pending_registrations == 1
    assert matcher.add_submission(sub("cmpl-x-0-bbbbbbbb")) is not None
    assert matcher.add_submission(sub("cmpl-x-0-cccccccc")) is None  # the registration was consumed once


def test_random_interleavings_pair_every_request_with_its_own_partner() -> None:
    rng = random.Random(5)
    for _ in range(50):
        matcher = PushMatcher()
        events = [("reg", i) for i in range(40)] + [("sub", i) for i in range(40)]
        rng.shuffle(events)
        pairs = {}
        for side, index in events:
            if side == "reg":
                found = matcher.add_registration(
                    reg(f"cmpl-{index}-0-aaaaaaaa", transfer_id=f"t{index}" if index % 2 else "")
                )
                if found is not None:
                    pairs[index] = found.request_id
            else:
                found_reg = matcher.add_submission(
                    sub(f"cmpl-{index}-0-bbbbbbbb", transfer_id=f"t{index}" if index % 2 else "")
                )
                if found_reg is not None:
                    pairs[index] = found_reg.request_id
        assert len(pairs) == 40
        for index, partner in pairs.items():
            assert partner.startswith(f"cmpl-{index}-0-")
        assert matcher.pending_registrations == 0 and matcher.unmatched_submissions == 0
