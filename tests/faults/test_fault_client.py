"""The fault suite's client classifies how a request ended (no processes: a mock transport)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from fault_client import Kind, Prompt, send

PROMPT = Prompt((1, 2, 3), 3)


def sse(*events: object) -> bytes:
    return b"".join(b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n" for e in events)


def tokens(*ids: int) -> dict:
    return {"choices": [{"text": "x", "token_ids": list(ids)}]}


def outcome(handler, deadline_s: float = 5.0):
    async def main():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await send(client, "http://proxy", PROMPT, deadline_s)

    return asyncio.run(main())


@pytest.mark.parametrize("status, body, kind", [
    (200, sse(tokens(7), tokens(8, 9), b"[DONE]"), Kind.OK),
    (200, sse(tokens(7), {"error": {"message": "decoder died"}}, b"[DONE]"), Kind.CLEAN_ERROR),
    (503, json.dumps({"error": {"message": "busy"}}).encode(), Kind.CLEAN_ERROR),
    (200, sse(tokens(7)), Kind.UNCLEAN_ERROR),  # cut without [DONE]
    (200, sse(tokens(7), {"error": {"message": "x"}}), Kind.UNCLEAN_ERROR),  # error, then cut
    (200, sse(tokens(7), b"[DONE]"), Kind.UNCLEAN_ERROR),  # short output, no error
    (502, b"<html>bad gateway</html>", Kind.UNCLEAN_ERROR),
])
def test_how_a_request_ended(status, body, kind):
    got = outcome(lambda request: httpx.Response(status, content=body))
    assert got.kind is kind, got
    if kind is Kind.OK:
        assert got.ids == (7, 8, 9)


def test_a_reset_connection_is_unclean():
    def handler(request):
        raise httpx.RemoteProtocolError("peer closed connection", request=request)

    assert outcome(handler).kind is Kind.UNCLEAN_ERROR


def test_no_end_within_the_deadline_is_hung():
    async def handler(request):
        await asyncio.sleep(30)
        return httpx.Response(200, content=sse(b"[DONE]"))

    got = outcome(handler, deadline_s=0.2)
    assert got.kind is Kind.HUNG and "no end within" in got.error


def test_outputs_are_compared_with_the_reference_of_any_allowed_model():
    p = Prompt((1,), 2, {"a": (5, 6), "b": (7, 8)})
    assert p.matches((5, 6)) and not p.matches((7, 8))
    assert p.matches((7, 8), ("a", "b")) and not p.matches((5, 8), ("a", "b"))
