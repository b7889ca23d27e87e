"""TLS (and mutual TLS) for the server's port, and bearer-token auth as one server interceptor.

Tokens come from a file, one per line (blank lines and `#` comments skipped), and are compared in constant time
against every configured token. The health service stays open, so Kubernetes' gRPC probes need no token; every
other method (the Worker service and reflection) needs `authorization: Bearer <token>`. A refused call gets
UNAUTHENTICATED before any handler runs: nothing is changed.
"""

import hmac
from pathlib import Path

import grpc
import structlog

from metrale.runtime.errors import InvalidArgument

log = structlog.get_logger()
OPEN_PREFIXES = ("/grpc.health.v1.Health/",)


def read_file(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as error:
        raise InvalidArgument(f"cannot read the {what} {path!r}: {error.strerror}") from None


def server_credentials(cert: str | None, key: str | None, client_ca: str | None) -> grpc.ServerCredentials | None:
    """TLS credentials from PEM files (None: plaintext). client_ca: clients must present a certificate it signed."""
    if cert is None and key is None:
        if client_ca is not None:
            raise InvalidArgument("tls_client_ca needs tls_cert and tls_key (mutual TLS is TLS first)")
        return None
    if cert is None or key is None:
        raise InvalidArgument("tls_cert and tls_key go together")
    pair = (read_file(key, "TLS key"), read_file(cert, "TLS certificate"))
    ca = read_file(client_ca, "TLS client CA") if client_ca is not None else None
    return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)


def read_tokens(path: str) -> list[bytes]:
    tokens = [line.strip() for line in read_file(path, "auth tokens file").decode().splitlines()]
    tokens = [t.encode() for t in tokens if t and not t.startswith("#")]
    if not tokens:
        raise InvalidArgument(f"the auth tokens file {path!r} holds no token")
    return tokens


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for a call without a valid bearer token, except on the health service."""

    def __init__(self, tokens: list[bytes], on_refused=None):
        self.tokens = tokens
        self.on_refused = on_refused       # (method) -> None: the metrics' count of refused calls

    def allows(self, metadata) -> bool:
        header = next((value for key, value in metadata or () if key == "authorization"), None)
        if not isinstance(header, str) or not header.startswith("Bearer "):
            return False
        given = header[len("Bearer "):].encode()
        matched = False
        for token in self.tokens:             # every token compared: the time says nothing about which one
            matched |= hmac.compare_digest(given, token)
        return matched

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method.startswith(OPEN_PREFIXES) or self.allows(handler_call_details.invocation_metadata):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        log.warning("unauthenticated", method=method)
        if self.on_refused is not None:
            self.on_refused(method)
        return _refusing(handler)


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind that aborts with UNAUTHENTICATED without reading the request."""
    message = "missing or invalid bearer token (metadata 'authorization: Bearer <token>')"

    async def unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def streamed(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # an async generator, as a streaming handler must be

    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(streamed if handler.response_streaming else unary,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
