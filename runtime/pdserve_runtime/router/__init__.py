"""The PD router: an OpenAI-compatible proxy that pairs prefill and decode engines.

Layers, each importable and testable on its own:

- `endpoints` / `breaker`: the endpoint table (what discovery found, plus per-endpoint load and health);
- `discovery/`: fills the table (static URLs, or a Kubernetes EndpointSlice + Pod watch);
- `tokens` / `prefix`: the router-side prompt model (approximate tokens, block hashes, who holds which prefix);
- `policy/`: pure routing decisions as small plugins (filters, scorers in [0, 1], a picker) composed into
  profiles by `policy.scheduler`;
- `proxy`: all request IO (the 3-step PD flow, streaming relay, retries, fallbacks);
- `app` / `cli`: wiring into an aiohttp application and the `pdserve router` command.
"""
