"""The PD router: an OpenAI-compatible proxy that pairs prefill and decode engines.

Layers, each importable and testable on its own:

- `endpoints` / `breaker`: the endpoint table (what discovery found, plus per-endpoint load and health);
- `discovery/`: fills the table (static URLs, or Kubernetes EndpointSlice watches; no Pods);
- `tokens` / `prefix`: the router-side prompt model (prompt keys, the exact uncached decision, who holds which
  prefix);
- `policy/`: pure routing decisions as small plugins (filters, scorers in [0, 1], a picker) composed into
  profiles by `policy.scheduler`;
- `validate` / `messages` / `retry`: pure checks of requests and prefill answers, the spliced PD bodies, and the
  retry and fallback decisions;
- `proxy`: all request IO (the 3-step PD flow, streaming relay, retries, fallbacks);
- `app` / `cli`: wiring and the `pdserve router` command.

HTTP itself (the client-facing server with its limits, the pooled engine client) is `pdserve_runtime.transport`.
"""
