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


def test_counting() -> None:
    tries = Tries().prefill_failed().prefill_succeeded().decode_failed("status")
    assert (tries.prefill, tries.decode, tries.have_kv, tries.only_connect_failures) == (2, 1, True, False)
