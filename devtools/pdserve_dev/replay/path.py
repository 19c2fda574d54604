"""What a request's path costs outside the engines' modelled steps: the hops the replay charges besides the cost model.

The engines (`engines`) charge the cost model's steps and the KV pull at the modelled link rate. A real request
also crosses the network and processes on its way, and each crossing costs time that grows with the prompt (its
body is sent, parsed and tokenized again at every hop). Each hop is `Hop`: fixed seconds plus seconds per prompt
token. Where the replay charges them (`cluster.ReplayCluster`):

- ``router``: the router's own work (parsing, prompt hashing, routing), charged with the first engine request;
- ``engine_requests``: the PD route's two engine requests (the router's wait on engines less the engines' own
  TTFT: HTTP to and from each engine, each engine parsing and tokenizing the body before its clock starts), half
  between binding and the prefill engine's arrival, half between prefill's end and the decode engine's arrival:
  each of the two carries the prompt's body once and makes one engine parse and tokenize it. While a request is in
  transit its engine counts it as the router's in-flight count does (a prefill engine's outstanding tokens, a
  decode engine's load), so the router's budget sees it as the product's does;
- ``decode_request``: the decode-only route's one engine request, between binding and the decode engine's arrival;
- ``kv_transfer``: on top of the modelled link time of a PD pull (the simulator moves its KV payload over a
  socket before it sleeps the link time);
- ``client``: the client's upload and the relay of the first chunk to it: the client's TTFT is the router's first
  byte plus this (the router's own TTFT, which the autoscaler reads, does not include it).

`IDEAL` (all zero) is the replay of an H200 service whose hops are below the cost model's resolution (the main
scenarios of `bench/autoscaler_bench.py`: a TTFT target of 800 ms against hops of milliseconds). `LOOPBACK` is the
path of the closed loop's processes on this machine's loopback, measured by `bench/path_costs.py` (one request at
a time, so no queue or contention adds: the hops' own cost).
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["IDEAL", "LOOPBACK", "Hop", "PathCosts"]


@dataclass(frozen=True, slots=True)
class Hop:
    """One hop's cost: `fixed_s` plus `per_token_s` per prompt token."""

    fixed_s: float = 0.0
    per_token_s: float = 0.0

    def seconds(self, tokens: int) -> float:
        return max(0.0, self.fixed_s + self.per_token_s * tokens)


@dataclass(frozen=True, slots=True)
class PathCosts:
    """The hops of a request's path (module docstring); all zero: the engines' cost model alone."""

    router: Hop = field(default_factory=Hop)
    engine_requests: Hop = field(default_factory=Hop)
    decode_request: Hop = field(default_factory=Hop)
    kv_transfer: Hop = field(default_factory=Hop)
    client: Hop = field(default_factory=Hop)

    def dispatch_s(self, route: str, tokens: int) -> float:
        """Seconds from binding to the first engine's arrival: the router's work and the first engine request."""
        request = self.engine_requests.seconds(tokens) / 2 if route == "pd" else self.decode_request.seconds(tokens)
        return self.router.seconds(tokens) + request

    def handoff_s(self, tokens: int) -> float:
        """PD route: seconds from prefill's end to the decode engine's arrival (the second engine request)."""
        return self.engine_requests.seconds(tokens) / 2


IDEAL = PathCosts()

#: The closed loop's path on loopback (`bench/path_costs.py --repeat 10`, 2026-12-03 21:55 UTC, the 2-core development
#: machine idle but for it): least-squares lines over the medians of 10 requests at each of 256-12000 prompt tokens
#: (PD) and 16-1024 (decode-only), measured less the replay's own times for the same request. Three runs of it
#: (3, 5, 10 requests per length) put a 3000-token PD request's hops at 19.0-20.3 ms. Left out: the engines' own
#: excess over their model (0.4 ms prefill, 0.8 ms decode: the simulators' event loops), within the noise.
LOOPBACK = PathCosts(
    router=Hop(0.00054, 0.048e-6),
    engine_requests=Hop(0.00140, 3.117e-6),
    decode_request=Hop(0.00095, 1.447e-6),
    kv_transfer=Hop(0.00253, 0.890e-6),
    client=Hop(0.00144, 0.029e-6),
)
