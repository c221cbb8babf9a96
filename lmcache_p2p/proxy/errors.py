"""Errors the proxy turns into HTTP responses (a branch of :mod:`lmcache_p2p.errors`).

    P2PError
    └── ProxyError                 carries the HTTP status and an OpenAI error type
        ├── BadRequest             400: a request the proxy cannot serve as asked
        ├── NoInstanceAvailable    503: no routable prefiller / decoder
        │   └── NoCapacity         503: no decoder buffer can hold the request's KV now
        ├── KvNotReady             502/504: KV failed or timed out and --on-kv-failure=fail
        └── UpstreamError          an instance's HTTP answer was not usable
            ├── UpstreamStatus     its 4xx (passed through) or 5xx (as 502)
            ├── UpstreamUnreachable  502: connect / read failed
            │   └── UpstreamConnectError  502: no connection (refused / connect timeout): nothing was sent,
            │                             so the call may be retried on another instance
            ├── UpstreamTimeout    504: no answer within the deadline
            ├── UpstreamMalformed  502: an answer without what the proxy needs
            └── ContinuationMismatch  502: an instance continuing a broken stream did not regenerate
                                      the tokens the client already has

Every one renders as ``{"error": {"message", "type", "param", "code"}}`` (vLLM's shape; ``code`` is
the HTTP status).
"""

from __future__ import annotations

from typing import Any

from lmcache_p2p.errors import P2PError


class ProxyError(P2PError):
    status_code: int = 500
    error_type: str = "InternalServerError"

    def __init__(self, message: str, *, status_code: int | None = None, body: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        if status_code is not None:
            self.status_code = status_code
        self._body = body

    def to_body(self) -> dict[str, Any]:
        """The JSON body the client receives (an upstream's own error body is kept as it was)."""
        if self._body is not None:
            return self._body
        return error_body(self.message, self.error_type, self.status_code)


def error_body(message: str, error_type: str, status_code: int) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": None, "code": status_code}}


class BadRequest(ProxyError):
    status_code = 400
    error_type = "BadRequestError"


class NoInstanceAvailable(ProxyError):
    status_code = 503
    error_type = "ServiceUnavailableError"


class NoCapacity(NoInstanceAvailable):
    pass


class KvNotReady(ProxyError):
    status_code = 502
    error_type = "KvTransferError"


class UpstreamError(ProxyError):
    status_code = 502
    error_type = "BadGatewayError"


class UpstreamStatus(UpstreamError):
    """An instance answered with an HTTP error; 4xx keep their status and body."""


class UpstreamUnreachable(UpstreamError):
    pass


class UpstreamConnectError(UpstreamUnreachable):
    """The connection was never established (refused, connect timeout): the instance got no byte."""


class UpstreamTimeout(UpstreamError):
    status_code = 504
    error_type = "GatewayTimeoutError"


class UpstreamMalformed(UpstreamError):
    pass


class ContinuationMismatch(UpstreamError):
    """A continued stream did not start with what the client already has: its output cannot be sent on
    without repeating positions (never retried elsewhere: a migration is for broken streams)."""

    error_type = "ContinuationMismatchError"


class ClientDisconnected(P2PError):
    """The client went away; the request's upstream work was cancelled."""
