"""HTTP/1.1 on asyncio protocols over llhttp: the router's transport, with no knowledge of routing.

- `server`: the client-facing server (limits a shared proxy needs, pipelining, streamed answers with flow
  control, graceful close, half-close);
- `budget`: what request bodies may hold in memory, in total and per client address, and who gives way;
- `client`: the pooled client to upstream servers (engines), with deadlines and relay by callback.

The router builds on it; nothing here imports the router (an import-linter contract holds it).
"""
