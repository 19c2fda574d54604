"""The Gateway API Inference Extension's endpoint picker protocol, as messages of Envoy's ext_proc API (pure).

What a gateway and its endpoint picker (EPP) say to each other, per the extension's protocol (proposal 004):

- The gateway opens one ext_proc stream per HTTP request and sends the request's headers, then its body in chunks
  (`FULL_DUPLEX_STREAMED`), then later the response's headers and body chunks.
- The picker answers the request headers with the pick: the `x-gateway-destination-endpoint` header AND the same
  value under `envoy.lb` in the dynamic metadata: one `ip:port`, or an ordered fallback list `ip:port,ip:port`
  (the gateway tries them in order when retries are configured). Nothing ready: an immediate 503; shedding: 429.
- In full-duplex streaming the picker owns the body: every body chunk it is sent must be sent back (as a
  `streamed_response`), or the upstream (or the client) never gets it. In the other body modes (STREAMED,
  BUFFERED; the gateway says which in the first message's `protocol_config`) the gateway keeps the body and each
  chunk is answered with an empty "continue"; a gateway that streams chunks must then buffer the body before
  ext_proc (Envoy's buffer filter), since the pick needs the whole body and the headers are answered first.
- The gateway may narrow the candidates (`envoy.lb.subset_hint` / `x-gateway-destination-endpoint-subset` in the
  request's metadata) and reports the endpoint that served the request (`envoy.lb` /
  `x-gateway-destination-endpoint-served`); plain Envoy can report it as the `upstream.address` attribute.

pdserve adds `x-prefiller-host-port` (the name llm-d uses): the prefill engine the PD sidecar on the chosen decode
pod must prefill on. The picker always removes a client's copy and sets its own, so only the picker decides it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import orjson
from google.protobuf.struct_pb2 import Struct

from pdserve_runtime.gateway.proto import ext_proc_pb2 as pb
from pdserve_runtime.router.errors import error_payload

DESTINATION_HEADER = "x-gateway-destination-endpoint"
PREFILLER_HEADER = "x-prefiller-host-port"
LB_NAMESPACE = "envoy.lb"
SERVED_KEY = "x-gateway-destination-endpoint-served"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
# Envoy's ext_proc filter name: the namespace of the attributes it sends (e.g. `upstream.address`).
ATTRIBUTES_NAMESPACE = "envoy.filters.http.ext_proc"
UPSTREAM_ADDRESS = "upstream.address"
# The PD sidecar says which route it took; the picker reads it back to learn which engines now hold the prompt.
ROUTE_HEADER = "x-pdserve-route"
# Headers a client may not set on its way to a decode pod: only the picker says where prefill happens.
STRIPPED_HEADERS = (PREFILLER_HEADER,)
OVERWRITE = pb.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def headers_of(message: pb.HttpHeaders) -> dict[str, str]:
    """Header name (lower case) -> value; Envoy sends values as `raw_value` bytes (older versions as `value`)."""
    result: dict[str, str] = {}
    for header in message.headers.headers:
        value = header.raw_value.decode("latin-1") if header.raw_value else header.value
        result[header.key.lower()] = value
    return result


def _header(name: str, value: str) -> pb.HeaderValueOption:
    return pb.HeaderValueOption(
        header=pb.HeaderValue(key=name, raw_value=value.encode("latin-1")), append_action=OVERWRITE
    )


def pick_response(destinations: Sequence[str], prefill: str | None) -> pb.ProcessingResponse:
    """The answer to the request headers: where the gateway sends the request (and where the sidecar prefills).

    The header and the metadata carry the same value, as the protocol requires.
    """
    value = ",".join(destinations)
    set_headers = [_header(DESTINATION_HEADER, value)]
    remove = [name for name in STRIPPED_HEADERS]
    if prefill is not None:
        set_headers.append(_header(PREFILLER_HEADER, prefill))
        remove.remove(PREFILLER_HEADER)
    metadata = Struct()
    metadata.get_or_create_struct(LB_NAMESPACE)[DESTINATION_HEADER] = value
    common = pb.CommonResponse(
        header_mutation=pb.HeaderMutation(set_headers=set_headers, remove_headers=remove), clear_route_cache=True
    )
    return pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common), dynamic_metadata=metadata)


def immediate(status: int, message: str, headers: Iterable[tuple[str, str]] = ()) -> pb.ProcessingResponse:
    """An answer the gateway sends to the client itself (no endpoint): the OpenAI error shape, as the router's."""
    body = orjson.dumps(error_payload(status, message))
    mutation = pb.HeaderMutation(
        set_headers=[_header("content-type", "application/json"), *(_header(k, v) for k, v in headers)]
    )
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=pb.HttpStatus(code=status), headers=mutation, body=body, details=f"pdserve_picker_{status}"
        )
    )


def continue_body(phase: str) -> pb.ProcessingResponse:
    """A body chunk passed on unchanged, in the modes where the gateway keeps the body (STREAMED, BUFFERED)."""
    response = pb.ProcessingResponse()
    getattr(response, phase).response.SetInParent()
    return response


def request_body_response(body: bytes, end_of_stream: bool) -> pb.ProcessingResponse:
    streamed = pb.StreamedBodyResponse(body=body, end_of_stream=end_of_stream)
    common = pb.CommonResponse(body_mutation=pb.BodyMutation(streamed_response=streamed))
    return pb.ProcessingResponse(request_body=pb.BodyResponse(response=common))


def response_body_response(body: bytes, end_of_stream: bool) -> pb.ProcessingResponse:
    streamed = pb.StreamedBodyResponse(body=body, end_of_stream=end_of_stream)
    common = pb.CommonResponse(body_mutation=pb.BodyMutation(streamed_response=streamed))
    return pb.ProcessingResponse(response_body=pb.BodyResponse(response=common))


def continue_headers(phase: str) -> pb.ProcessingResponse:
    """Headers passed on unchanged (`phase`: request_headers or response_headers)."""
    response = pb.ProcessingResponse()
    getattr(response, phase).response.SetInParent()
    return response


def continue_trailers(phase: str) -> pb.ProcessingResponse:
    response = pb.ProcessingResponse()
    getattr(response, phase).SetInParent()
    return response


def _struct_string(structs: Mapping[str, Struct], namespace: str, key: str) -> str | None:
    if namespace not in structs:
        return None
    fields = structs[namespace].fields
    if key not in fields or fields[key].WhichOneof("kind") != "string_value":
        return None
    value: str = fields[key].string_value
    return value


def served_endpoint(request: pb.ProcessingRequest) -> str | None:
    """The `ip:port` that served the request, as the gateway reports it (metadata first, then the attribute)."""
    served = _struct_string(request.metadata_context.filter_metadata, LB_NAMESPACE, SERVED_KEY)
    if served:
        return served
    return _struct_string(request.attributes, ATTRIBUTES_NAMESPACE, UPSTREAM_ADDRESS) or None


def endpoint_subset(request: pb.ProcessingRequest) -> frozenset[str] | None:
    """The endpoints the gateway allows for this request, or None when it sets no subset."""
    structs = request.metadata_context.filter_metadata
    if SUBSET_NAMESPACE not in structs:
        return None
    fields = structs[SUBSET_NAMESPACE].fields
    if SUBSET_KEY not in fields:
        return None
    value = fields[SUBSET_KEY]
    # A list of `ip:port` strings, or (as header-to-metadata filters write it) one comma-separated string.
    if value.WhichOneof("kind") == "string_value":
        texts = [value.string_value]
    elif value.WhichOneof("kind") == "list_value":
        texts = [item.string_value for item in value.list_value.values if item.WhichOneof("kind") == "string_value"]
    else:
        return frozenset()
    return frozenset(part.strip() for text in texts for part in text.split(",") if part.strip())
