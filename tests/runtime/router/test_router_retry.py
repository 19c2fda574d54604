"""The retry and fallback decisions as pure step functions: one table row per situation."""

from __future__ import annotations

import pytest

from pdserve_runtime.router.retry import (
    RetryPolicy,
    Step,
    Tries,
    after_decode_failure,
    after_prefill_failure,
    give_up_status,
)

POLICY = RetryPolicy(max_prefill_attempts=2, max_decode_attempts=2, fallback_to_decode=True)
STRICT = RetryPolicy(max_prefill_attempts=2, max_decode_attempts=2, fallback_to_decode=False)


@pytest.mark.parametrize(
    ("tries", "policy", "another", "step"),
    [
        (Tries(prefill=1), POLICY, True, Step.PREFILL_ELSEWHERE),
        (Tries(prefill=1), POLICY, False, Step.FALLBACK),  # nobody else to ask
        (Tries(prefill=2), POLICY, True, Step.FALLBACK),  # attempts spent
        (Tries(prefill=2), STRICT, True, Step.REFUSE),  # decode-only forbidden: 503
        (Tries(prefill=0), STRICT, False, Step.REFUSE),  # no prefill engine at all
    ],
)
def test_after_a_prefill_failure(tries: Tries, policy: RetryPolicy, another: bool, step: Step) -> None:
    assert after_prefill_failure(tries, policy, another_prefill=another) is step


@pytest.mark.parametrize(
    ("tries", "another", "same_usable", "step"),
    [
        # Attempts left: another engine (same KV), else a fresh prefill when the KV may be at fault, else the same.
        (Tries(decode=1, have_kv=True), True, True, Step.DECODE_ELSEWHERE),
        (Tries(decode=1, have_kv=True), False, True, Step.REPREFILL),
        (Tries(decode=1, have_kv=True, reprefilled=True), False, True, Step.DECODE_SAME),
        (Tries(decode=1), False, True, Step.DECODE_SAME),  # a pool of one still gets its retry
        (Tries(decode=1), False, False, Step.GIVE_UP),
        (Tries(decode=1), True, False, Step.DECODE_ELSEWHERE),
        # Attempts spent: one fresh prefill if not done yet, else give up.
        (Tries(decode=2, have_kv=True), True, True, Step.REPREFILL),
        (Tries(decode=2, have_kv=True, reprefilled=True), True, True, Step.GIVE_UP),
        (Tries(decode=2), True, True, Step.GIVE_UP),
    ],
)
def test_after_a_decode_failure(tries: Tries, another: bool, same_usable: bool, step: Step) -> None:
    assert after_decode_failure(tries, POLICY, another_decode=another, same_usable=same_usable) is step


STORE = RetryPolicy(max_prefill_attempts=2, max_decode_attempts=2, fallback_to_decode=True, kv_store=True)


@pytest.mark.parametrize(
    ("tries", "step"),
    [
        # With a store, the first decode failure after prefill reads the prompt from the store: no new prefill.
        (Tries(decode=1, have_kv=True), Step.DECODE_FROM_STORE),
        (Tries(decode=2, have_kv=True), Step.DECODE_FROM_STORE),  # even with the attempts spent: it costs no prefill
        # Once tried, the usual steps follow.
        (Tries(decode=2, have_kv=True, from_store=True), Step.REPREFILL),
        (Tries(decode=1, have_kv=True, from_store=True), Step.DECODE_ELSEWHERE),
        # Without prefill's KV (a decode-only request) the store is no different from the engine's own cache.
        (Tries(decode=1), Step.DECODE_ELSEWHERE),
    ],
)
def test_after_a_decode_failure_with_a_store(tries: Tries, step: Step) -> None:
    assert after_decode_failure(tries, STORE, another_decode=True, same_usable=True) is step


@pytest.mark.parametrize(
    ("kinds", "status"),
    [(["connect"], 503), (["connect", "connect"], 503), (["connect", "status"], 502), (["timeout"], 502)],
)
def test_giving_up_says_come_back_later_only_when_engines_are_down(kinds: list[str], status: int) -> None:
    tries = Tries()
    for kind in kinds:
        tries = tries.decode_failed(kind)
    assert give_up_status(tries) == status


@pytest.mark.parametrize(
    ("failures", "step"),
    [
        ([("connect", False)], Step.DECODE_ELSEWHERE),  # never arrived: the KV is untouched
        ([("status", True)], Step.DECODE_ELSEWHERE),  # the engine's own error answer (a failed load keeps the KV)
        ([("stream", True)], Step.DECODE_ELSEWHERE),  # an error event first, the same
        ([("timeout", False)], Step.REPREFILL),  # silent past the deadline: it may have read the KV
        ([("stream", False)], Step.REPREFILL),  # cut before answering: the same
        ([("protocol", False)], Step.REPREFILL),
        ([("connect", False), ("timeout", False)], Step.REPREFILL),  # doubt stays, whatever came before
        ([("timeout", False), ("connect", False)], Step.REPREFILL),
    ],
)
def test_kv_a_failed_decode_engine_may_have_read_is_never_reused(failures: list[tuple[str, bool]], step: Step) -> None:
    many = RetryPolicy(max_prefill_attempts=2, max_decode_attempts=5, fallback_to_decode=True)
    tries = Tries(prefill=1, have_kv=True)
    for kind, answered in failures:
        tries = tries.decode_failed(kind, answered=answered)
    assert after_decode_failure(tries, many, another_decode=True, same_usable=True) is step


def test_kv_in_doubt_after_the_fresh_prefill_too_is_given_up_and_a_fresh_prefill_clears_the_doubt() -> None:
    many = RetryPolicy(max_prefill_attempts=2, max_decode_attempts=5, fallback_to_decode=True)
    doubt = Tries(prefill=1, have_kv=True, reprefilled=True).decode_failed("timeout")
    assert after_decode_failure(doubt, many, another_decode=True, same_usable=True) is Step.GIVE_UP
    fresh = doubt.prefill_succeeded()
    assert not fresh.kv_in_doubt
    assert after_decode_failure(fresh, many, another_decode=True, same_usable=True) is Step.DECODE_ELSEWHERE
    # Without KV (decode-only) there is nothing to doubt.
    assert not Tries().decode_failed("timeout").kv_in_doubt


def test_counting() -> None:
    tries = Tries().prefill_failed().prefill_succeeded().decode_failed("status")
    assert (tries.prefill, tries.decode, tries.have_kv, tries.only_connect_failures) == (2, 1, True, False)
