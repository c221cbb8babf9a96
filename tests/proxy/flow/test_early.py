"""An early decode's race (``flow/early.py``) and the decode session's side of it (``flow/decode.py``): what the
owner learns first decides once, and a first output the owner did not take never reaches the client."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from lmcache_p2p.proxy.flow.decode import DecodeSession
from lmcache_p2p.proxy.flow.early import Early, EarlyRace
from lmcache_p2p.proxy.flow.steps import Target
from lmcache_p2p.proxy.handover.waiters import KvOutcome, KvStatus
from lmcache_p2p.proxy.http.shaping import Endpoint, decode_body, parse_client_request
from lmcache_p2p.proxy.upstream import Upstream

from ..conftest import eventually
from ..fakes import MODEL, FakeVllm, generate, tokenize

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]


class Race:
    def __init__(self) -> None:
        self.outcome: asyncio.Future[KvOutcome] = asyncio.get_running_loop().create_future()
        self.decided: list[Early] = []
        self.race = EarlyRace(self._wait(), self.decided.append, "test-race")

    async def _wait(self) -> KvOutcome:
        return await self.outcome


async def test_a_kv_failure_decides_once_and_gives_the_decode_up():
    r = Race()
    r.outcome.set_result(KvOutcome(KvStatus.FAILED, 0.01, reason="refused"))
    failed = await r.race.decided()
    assert failed is not None and failed.reason == "refused"
    assert await r.race.decided() is None  # told once: the failure's path is taken once
    assert r.race.decode_first() is False  # a first output after it is not the request's
    assert r.decided == [Early.KV_FAILED]


async def test_a_first_output_before_the_kv_outcome_wins_and_a_later_failure_changes_nothing():
    r = Race()
    asking = asyncio.ensure_future(r.race.decided())
    await asyncio.sleep(0)
    assert r.race.decode_first() is True
    assert await asking is None
    r.outcome.set_result(KvOutcome(KvStatus.TIMEOUT, 10.0))
    await asyncio.sleep(0)
    assert await r.race.decided() is None and r.decided == [Early.DECODE_FIRST]


async def test_a_ready_kv_that_nobody_asked_for_yet_counts_as_first():
    r = Race()
    r.outcome.set_result(KvOutcome(KvStatus.READY, 0.002))
    await asyncio.sleep(0)
    assert r.race.decode_first() is True and r.decided == [Early.KV_READY]


async def test_a_stopped_race_decides_nothing():
    r = Race()
    asking = asyncio.ensure_future(r.race.decided())
    await asyncio.sleep(0)
    r.race.stop()
    assert await asyncio.wait_for(asking, 1) is None and r.decided == []


class FailsAfterTheFirstOutput:
    """A request's steps whose owner committed the KV's failure before it heard of the early decode's first
    output (the ``started`` of a relay worker can arrive after it): ``settled`` names another decoder."""

    def __init__(self, early: Target, instead: Target) -> None:
        self.early, self.instead = early, instead
        self.started_calls: list[bool] = []
        self._output_seen = asyncio.Event()

    async def plan(self) -> Target:
        return self.early

    async def settled(self) -> Target | None:
        await self._output_seen.wait()
        return self.instead

    def started(self, decode_sent_s: float, first_decoded_s: float, decode_accepted_s: float | None = None,
                kv_pending: bool = False) -> None:
        self.started_calls.append(kv_pending)
        self._output_seen.set()

    async def unreachable(self, exc: Any) -> Target | None:
        raise AssertionError("no step while settled() is pending")

    async def broken(self, *args: Any) -> Target | None:
        raise AssertionError("no step while settled() is pending")


async def test_a_first_output_the_owner_did_not_take_is_dropped_and_the_next_decoder_streams_everything():
    ids = tokenize("an early decode given up after its first output")
    first = generate(ids, 1)
    given_up, serving = FakeVllm("given-up"), FakeVllm("serving")
    given_up.token_delay_s = 0.05  # its second token comes after the owner answered
    req = parse_client_request(Endpoint.COMPLETIONS, {"model": MODEL, "prompt": ids, "max_tokens": 6}, 4.0)
    upstream = Upstream(connect_timeout_s=2.0)
    await given_up.server.start()
    await serving.server.start()
    try:
        marked = decode_body(req, ids, first, proxy_text=False, kv_params={"lmcache_p2p": {"req_id": "r",
                                                                                           "prompt_tokens": len(ids)}})
        steps = FailsAfterTheFirstOutput(Target(given_up.url, marked, kv_pending=True),
                                         Target(serving.url, decode_body(req, ids, first, proxy_text=False)))
        session = DecodeSession(steps, upstream, req, {}, 5.0, None, list(first))  # type: ignore[arg-type]
        out = [t async for delta in session.deltas(False, "") for t in delta.token_ids]
        assert first + out == generate(ids, 6)  # the given-up decoder's first output is not in it: nothing twice
        assert session.output_ids == generate(ids, 6)
        assert steps.started_calls == [True, False]  # its output reported (not taken), then the next decoder's
        await eventually(lambda: given_up.cancelled_streams == 1)  # its stream closed: vLLM aborts the request
        assert serving.finished_streams == 1
    finally:
        await upstream.aclose()
        await given_up.server.stop()
        await serving.server.stop()
