# The pdserve image: the operator, the PD router, the CLI and the engine simulator (`pdserve operator|router|sim`),
# and the endpoint picker's ext_proc relay (`pdserve-picker-relay`, Go: runtime/picker-relay/).
# The development tooling (devtools/: local cluster, process node) is a separate distribution and is not in it.
FROM golang:1.26-bookworm AS relay
WORKDIR /src
COPY runtime/picker-relay ./
RUN CGO_ENABLED=0 GOFLAGS=-mod=readonly go build -trimpath -ldflags="-s -w" -o /out/pdserve-picker-relay .

FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY pdserve ./pdserve
COPY operator ./operator
COPY runtime ./runtime
COPY sim ./sim
RUN pip install --no-cache-dir --prefix=/install .

FROM python:3.11-slim
COPY --from=build /install /usr/local
COPY --from=relay /out/pdserve-picker-relay /usr/local/bin/pdserve-picker-relay
COPY crds /opt/pdserve/crds
# Non-root, matching the router Deployment's securityContext (runAsUser 65532).
USER 65532:65532
ENTRYPOINT ["pdserve"]
CMD ["--help"]
