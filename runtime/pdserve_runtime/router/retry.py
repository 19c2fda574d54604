"""What the proxy does after an engine failed a request: the retry and fallback decision as pure step functions.

The proxy (all IO) reports what happened and what it could do next (is another engine available?); these
functions say which step comes next. Everything here happens before the client saw a byte, so a retry is invisible.

After a prefill failure (connect error, 5xx, timeout, a bad answer):

- another prefill engine, while `maxPrefillAttempts` allows and one is available;
- else decode-only on the chosen decode engine ("fallback") when `fallbackToDecode`, else refuse with 503.

After a decode failure before the first byte:

- with a shared KV store (`kvStore`), once: a decode engine (another one if there is one, else the same) gets the
  request without prefill's `kv_transfer_params` and loads the prompt from the store, where prefill wrote it before
  answering ("decode-from-store"): no new prefill, whether the failure was the KV pull (prefill gone, lease expired)
  or the decode engine itself; later failures continue as below;
- while `maxDecodeAttempts` allows: another decode engine (kv-compatible with the KV holder, so the prefill's KV is
  reused: prefill holds it for its lease); without one, a fresh prefill if the failure may lie in the KV itself
  (it was pulled, and no prefill was redone yet); without that, the same decode engine again (a pool of one
  engine still gets its retry: one transient 500 must not reach the client);
- when the attempts are spent: one fresh prefill if none was redone yet, else give up.

Reusing the KV is safe only while no decode engine can have read it. vLLM's prefill frees KV blocks when a reader
notifies that its READ completed (or when the lease runs out), never because a read failed: after a refused or
unreachable connection (the request never arrived) or an engine's own error answer (a 5xx, or an error event
first: a failed KV load ends that way, and leaves the KV held), the KV is still there. After a decode engine went
silent past the first-byte deadline, cut the connection or answered garbage, it may have read the KV before it
failed: its params could then make the next engine read freed blocks (in vLLM: silently wrong output once they are
reused). Such KV is in doubt: the only next step is a fresh prefill, else give up (the store's one decode attempt
comes first all the same: it reads the store, never the prefill's KV).

Giving up is 503 with Retry-After when every decode failure was a refused or unreachable connection (the
engines are down: come back later), 502 otherwise (engines answered, badly).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum


class Step(StrEnum):
    PREFILL_ELSEWHERE = "prefill-elsewhere"
    FALLBACK = "fallback"
    REFUSE = "refuse"  # 503: nothing can prefill and the configuration forbids decode-only
    DECODE_ELSEWHERE = "decode-elsewhere"
    DECODE_FROM_STORE = "decode-from-store"
    REPREFILL = "reprefill"
    DECODE_SAME = "decode-same"
    GIVE_UP = "give-up"


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    max_prefill_attempts: int
    max_decode_attempts: int
    fallback_to_decode: bool
    kv_store: bool = False


@dataclass(frozen=True, slots=True)
class Tries:
    """What has happened to one request so far."""

    prefill: int = 0  # prefill attempts made
    decode: int = 0  # decode attempts made
    have_kv: bool = False  # the decode attempts work from a prefill's KV
    reprefilled: bool = False
    from_store: bool = False  # a decode attempt already loaded the prompt from the KV store
    only_connect_failures: bool = True  # every decode failure so far was a refused or unreachable connection
    kv_in_doubt: bool = False  # a decode engine that failed may have read (and so freed) the KV

    def prefill_failed(self) -> Tries:
        return replace(self, prefill=self.prefill + 1)

    def prefill_succeeded(self) -> Tries:
        return replace(self, prefill=self.prefill + 1, have_kv=True, kv_in_doubt=False)

    def decode_failed(self, kind: str, *, answered: bool = False) -> Tries:
        """Count a decode failure of `kind`; `answered`: the engine itself answered with an error (a status or an
        error event), so it did not read the KV (see the module docstring)."""
        untouched = kind == "connect" or answered
        return replace(
            self,
            decode=self.decode + 1,
            only_connect_failures=self.only_connect_failures and kind == "connect",
            kv_in_doubt=self.have_kv and (self.kv_in_doubt or not untouched),
        )


def after_prefill_failure(tries: Tries, policy: RetryPolicy, *, another_prefill: bool) -> Step:
    """The next step once a prefill attempt failed (`tries` already counts it)."""
    if tries.prefill < policy.max_prefill_attempts and another_prefill:
        return Step.PREFILL_ELSEWHERE
    return Step.FALLBACK if policy.fallback_to_decode else Step.REFUSE


def after_decode_failure(tries: Tries, policy: RetryPolicy, *, another_decode: bool, same_usable: bool) -> Step:
    """The next step once a decode attempt failed before its first byte (`tries` already counts it)."""
    may_reprefill = tries.have_kv and not tries.reprefilled
    if policy.kv_store and tries.have_kv and not tries.from_store:
        # The store has the prompt: one more decode attempt costs a store read, never a prefill. (It reads the
        # store, not the prefill's KV, so whether a failed engine read that KV does not matter.)
        return Step.DECODE_FROM_STORE
    if tries.have_kv and tries.kv_in_doubt:
        return Step.REPREFILL if may_reprefill else Step.GIVE_UP
    if tries.decode < policy.max_decode_attempts:
        if another_decode:
            return Step.DECODE_ELSEWHERE
        if may_reprefill:
            return Step.REPREFILL
        if same_usable:
            return Step.DECODE_SAME
        return Step.GIVE_UP
    return Step.REPREFILL if may_reprefill else Step.GIVE_UP


def give_up_status(tries: Tries) -> int:
    """503 (come back later) when the decode engines were unreachable, else 502."""
    return 503 if tries.only_connect_failures else 502
