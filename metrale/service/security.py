"""TLS (and mutual TLS) for the server's port, and bearer-token auth as one server interceptor.

Tokens come from a file, one per line (blank lines and `#` comments skipped), and are compared in constant time
against every configured token. The health service stays open, so Kubernetes' gRPC probes need no token; every
other method (the Worker service and reflection) needs `authorization: Bearer <token>`. A refused call gets
UNAUTHENTICATED before any handler runs: nothing is changed.
"""

import asyncio
import hmac
import ssl
import time
from collections import Counter
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
    """TLS credentials from PEM files, checked (None: plaintext). client_ca: clients must present a certificate it
    signed."""
    if cert is None and key is None:
        if client_ca is not None:
            raise InvalidArgument("tls_client_ca needs tls_cert and tls_key (mutual TLS is TLS first)")
        return None
    if cert is None or key is None:
        raise InvalidArgument("tls_cert and tls_key go together")
    pair = (read_file(key, "TLS key"), read_file(cert, "TLS certificate"))
    ca = read_file(client_ca, "TLS client CA") if client_ca is not None else None
    check_tls_files(cert, key, client_ca)
    return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)


def check_tls_files(cert: str, key: str, client_ca: str | None) -> None:
    """The PEM files parse and the key is the certificate's. grpc checks them only when the port binds, after the
    model load, and then says no more than "Failed to bind"."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    _load_certificates(context, cert, "TLS certificate")
    if client_ca is not None:
        _load_certificates(context, client_ca, "TLS client CA")

    def no_password():                    # without a callback OpenSSL would prompt on the terminal
        raise InvalidArgument(f"the TLS key {key!r} is encrypted; give it unencrypted (grpc takes no password)")

    try:
        context.load_cert_chain(cert, key, password=no_password)
    except ssl.SSLError as error:
        if error.reason == "KEY_VALUES_MISMATCH":
            raise InvalidArgument(f"the TLS key {key!r} is not the key of the TLS certificate {cert!r}") from None
        raise InvalidArgument(f"the TLS key {key!r} is not a PEM private key") from None


def _load_certificates(context: ssl.SSLContext, path: str, what: str) -> None:
    try:
        context.load_verify_locations(cafile=path)
    except ssl.SSLError:
        raise InvalidArgument(f"the {what} {path!r} holds no PEM certificate") from None


def read_tokens(path: str) -> list[bytes]:
    try:
        text = read_file(path, "auth tokens file").decode("utf-8")
    except UnicodeDecodeError as error:
        raise InvalidArgument(f"the auth tokens file {path!r} is not UTF-8 text "
                              f"(byte {error.start}: {error.reason})") from None
    tokens = [line.strip() for line in text.splitlines()]
    tokens = [t.encode() for t in tokens if t and not t.startswith("#")]
    if not tokens:
        raise InvalidArgument(f"the auth tokens file {path!r} holds no token")
    return tokens


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for a call without a valid bearer token, except on the health service. A refused call's
    body is never read, and refusals are logged as one line per log_every seconds, counted by method."""

    def __init__(self, tokens: list[bytes], on_refused=None, log_every: float = 10.0):
        self.tokens = tokens
        self.on_refused = on_refused       # (method) -> None: the metrics' count of refused calls
        self.log_every = log_every         # seconds between two refusal lines: a flood of bad calls logs little
        self.unlogged = Counter()          # method -> refusals since the last line
        self.logged_at = -float("inf")     # time.monotonic() of the last line
        self.next_line = None              # the loop's timer for the line that is due, if any

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
        self.count_refusal(method)
        return _refusing(handler)

    def count_refusal(self, method: str) -> None:
        if self.on_refused is not None:
            self.on_refused(method)
        self.unlogged[method] += 1
        if self.next_line is not None:
            return
        wait = self.logged_at + self.log_every - time.monotonic()
        if wait <= 0:                         # the first refusal after a quiet spell is logged at once
            self.log_refusals()
        else:
            self.next_line = asyncio.get_running_loop().call_later(wait, self.log_refusals)

    def log_refusals(self) -> None:
        log.warning("unauthenticated", refused=dict(self.unlogged), total=sum(self.unlogged.values()))
        self.unlogged.clear()
        self.logged_at = time.monotonic()
        self.next_line = None


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A request-streaming handler that aborts with UNAUTHENTICATED without reading the request.

    grpc.aio reads and deserializes a unary request before it calls the handler, so a unary refusal would still
    take the whole body (up to --max-message-mb) into memory and answer malformed bytes with a parse error. A
    request-streaming handler is called before any message is read, and a unary client looks the same on the
    wire, so the body is never read: only what HTTP/2 flow control let in before the answer is held."""
    message = "missing or invalid bearer token (metadata 'authorization: Bearer <token>')"

    async def unary(request_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def streamed(request_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # an async generator, as a streaming handler must be

    if handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(streamed, request_deserializer=_unparsed,
                                                     response_serializer=handler.response_serializer)
    return grpc.stream_unary_rpc_method_handler(unary, request_deserializer=_unparsed,
                                                response_serializer=handler.response_serializer)


def _unparsed(data: bytes) -> bytes:
    return data  # never called, as the request is never read; a parser here could only fail
