"""Admission: requests wait, fairly and for a bounded time, for decoder buffer credit (admission.py)."""

from __future__ import annotations

import asyncio

import pytest

from lmcache_p2p.config import Role
from lmcache_p2p.proxy.router.admission import AdmissionQueue, CannotAdmit, Outcome

from ..conftest import eventually, make_cluster
from ..fakes import MODEL, generate, token_text

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]


# ---- the queue alone -------------------------------------------------------------------------------


class Grant:
    def __init__(self, pool: Pool, size: int) -> None:
        self.pool, self.size, self.released = pool, size, False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.pool.free += self.size
            self.pool.queue.poke()


class Pool:
    """A buffer of ``free`` slots; ``grant(n)`` is what a flow hands the queue."""

    def __init__(self, free: int, queue: AdmissionQueue) -> None:
        self.free, self.queue = free, queue
        self.order: list[str] = []

    def grant(self, name: str, size: int):
        def take() -> Grant | None:
            if size > 100:
                raise CannotAdmit("too_large", f"{name} needs {size} slots, the buffer holds 100")
            if size > self.free:
                return None
            self.free -= size
            self.order.append(name)
            return Grant(self, size)
        return take


def make(free: int, *, timeout_s: float = 5.0, max_waiting: int = 100, max_overtakes: int = 8) -> Pool:
    return Pool(free, AdmissionQueue(timeout_s, max_waiting, max_overtakes=max_overtakes))


async def start(pool: Pool, name: str, size: int) -> asyncio.Task:
    task = asyncio.ensure_future(pool.queue.admit(pool.grant(name, size)))
    await asyncio.sleep(0)  # it has queued
    return task


async def test_room_now_is_granted_at_once():
    pool = make(4)
    admission = await pool.queue.admit(pool.grant("a", 4))
    assert admission.outcome is Outcome.IMMEDIATE and admission.granted.size == 4 and pool.free == 0
    assert len(pool.queue) == 0


async def test_waiters_are_admitted_in_arrival_order_as_credit_frees():
    pool = make(0)
    tasks = [await start(pool, name, 2) for name in "abcd"]
    assert len(pool.queue) == 4 and not any(t.done() for t in tasks)
    pool.free = 4
    pool.queue.poke()
    assert pool.order == ["a", "b"] and len(pool.queue) == 2  # granted at once, in order
    (await tasks[0]).granted.release()
    assert pool.order == ["a", "b", "c"]
    assert (await tasks[2]).outcome is Outcome.ADMITTED and tasks[2].result().wait_s >= 0
    for t in tasks[1:3]:
        (await t).granted.release()
    assert (await tasks[3]).granted is not None and len(pool.queue) == 0


async def test_a_new_arrival_does_not_jump_the_queue():
    pool = make(0)
    first = await start(pool, "first", 3)
    pool.free = 3  # credit freed but nobody poked yet: the newcomer's own attempt takes turns
    later = await start(pool, "later", 3)
    assert pool.order == ["first"] and len(pool.queue) == 1
    (await first).granted.release()
    assert (await later).granted is not None


async def test_small_requests_overtake_a_large_one_only_up_to_the_bound():
    pool = make(0, max_overtakes=2)
    large = await start(pool, "large", 5)
    smalls = [await start(pool, f"s{i}", 1) for i in range(4)]
    for _ in range(4):  # one slot at a time: never enough for the large one
        pool.free += 1
        pool.queue.poke()
    assert pool.order == ["s0", "s1"]  # two overtook it; then the large one holds the line
    assert len(pool.queue) == 3
    for s in smalls[:2]:
        (await s).granted.release()  # 2 + 2 free = 4 of 5
    assert pool.order == ["s0", "s1"] and pool.free == 4
    pool.free += 1
    pool.queue.poke()
    assert (await large).granted.size == 5 and pool.order == ["s0", "s1", "large"]
    large.result().granted.release()
    await asyncio.gather(*smalls[2:])
    assert pool.order == ["s0", "s1", "large", "s2", "s3"]


async def test_the_wait_is_bounded():
    pool = make(0, timeout_s=0.05)
    admission = await pool.queue.admit(pool.grant("a", 1))
    assert admission.outcome is Outcome.TIMEOUT and admission.granted is None and len(pool.queue) == 0
    pool.free = 1
    pool.queue.poke()
    assert pool.order == [] and pool.free == 1  # nothing granted to a request that left


async def test_a_full_queue_turns_the_next_request_away_at_once():
    pool = make(0, max_waiting=1)
    waiting = await start(pool, "a", 1)
    admission = await pool.queue.admit(pool.grant("b", 1))
    assert admission.outcome is Outcome.QUEUE_FULL and len(pool.queue) == 1
    waiting.cancel()
    pool.free = 1  # a request that fits is granted even with max_waiting 0
    zero = make(1, max_waiting=0)
    assert (await zero.queue.admit(zero.grant("c", 1))).outcome is Outcome.IMMEDIATE


async def test_a_request_that_can_never_fit_leaves_at_once():
    pool = make(0)
    admission = await pool.queue.admit(pool.grant("huge", 1000))
    assert admission.outcome is Outcome.REFUSED and admission.refusal.reason == "too_large"
    assert "buffer holds 100" in admission.message and len(pool.queue) == 0


async def test_a_cancelled_waiter_leaves_and_a_late_grant_is_released():
    pool = make(0)
    gone = await start(pool, "gone", 1)
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert len(pool.queue) == 0

    raced = await start(pool, "raced", 1)
    pool.free = 1
    pool.queue.poke()  # granted ...
    raced.cancel()  # ... but its task is cancelled before it runs again
    with pytest.raises(asyncio.CancelledError):
        await raced
    assert pool.free == 1 and len(pool.queue) == 0


# ---- through the proxy -----------------------------------------------------------------------------


TOKEN_DELAY_S = 0.005


def ids_prompt(i: int, n_tokens: int) -> list[int]:
    return [(i * 13 + k) % 150 + 3 for k in range(n_tokens)]


def expected(prompt: list[int], n: int) -> str:
    return "".join(token_text(t) for t in generate(prompt, n))


async def test_concurrent_requests_beyond_the_buffer_wait_for_credit_and_all_get_their_kv():
    """24 concurrent prompts of 4 chunks into one decoder buffer of 8 slots: none refused, none recomputed."""
    # the last waits for eleven pairs to prefill and decode: under 1 s here, on a loaded machine far beyond the
    # default 5 s admission timeout and the client's own (CI once took more than 10 s), so both are a minute
    wait_s = 60.0
    async with make_cluster(n_decode=0, admission_timeout_s=wait_s) as c:
        decoder = await c.add_node(Role.RECEIVER, capacity_slots=8)
        decoder.vllm.token_delay_s = TOKEN_DELAY_S
        prompts = [ids_prompt(i, 64) for i in range(24)]  # 64 tokens = 4 chunks of 16
        answers = await asyncio.gather(*(
            c.post("/v1/completions", {"model": MODEL, "prompt": p, "max_tokens": 4}, timeout_s=wait_s)
            for p in prompts))
        assert [r.status_code for r in answers] == [200] * 24
        for prompt, resp in zip(prompts, answers):
            assert resp.json()["choices"][0]["text"] == expected(prompt, 4)
        assert c.metric("lmcache_p2p_proxy_kv_outcomes_total", outcome="ready") == 24
        assert c.metric("lmcache_p2p_proxy_admission_total", outcome="admitted") > 0
        assert c.proxy.metrics.registry.get_sample_value("lmcache_p2p_proxy_colocated_total", {
            "reason": "admission_timeout", "role": "receiver"}) is None
        inst, = c.proxy.registry.routable(Role.RECEIVER)
        assert inst.free_slots() == 8 and len(c.proxy.orchestrator.admission) == 0


async def test_a_decoder_that_never_frees_credit_computes_the_prompt_after_the_admission_timeout():
    async with make_cluster(admission_timeout_s=0.3) as c:
        decoder = c.decoders[0]
        decoder.agent.free_slots = 0  # its buffer is held by someone else
        await decoder.agent.announce()
        inst, = c.proxy.registry.routable(Role.RECEIVER)
        await eventually(lambda: inst.free_slots() == 0)
        prompt = ids_prompt(1, 20)
        resp = await c.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 5})
        assert resp.json()["choices"][0]["text"] == expected(prompt, 5)
        assert not c.prefillers[0].vllm.requests  # no prefill: the decoder computed the prompt
        decode, = decoder.vllm.calls("/v1/completions")
        assert decode["prompt"] == prompt and decode["max_tokens"] == 5 and "kv_transfer_params" not in decode
        assert c.metric("lmcache_p2p_proxy_colocated_total", reason="admission_timeout", role="receiver") == 1
        assert c.metric("lmcache_p2p_proxy_admission_total", outcome="timeout") == 1
        assert c.metric("lmcache_p2p_proxy_admission_wait_seconds_count") == 1
        assert c.metric("lmcache_p2p_proxy_ttft_seconds_count", endpoint="/v1/completions") == 1


async def test_a_prompt_larger_than_every_buffer_is_computed_by_a_decoder_at_once():
    async with make_cluster(n_decode=0, admission_timeout_s=20) as c:
        decoder = await c.add_node(Role.RECEIVER, capacity_slots=2)
        prompt = ids_prompt(2, 40)  # 3 chunks
        events = await c.stream("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 3,
                                                    "stream": True, "stream_options": {"include_usage": True}})
        text = "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])
        assert text == expected(prompt, 3) and events[-2]["usage"]["completion_tokens"] == 3
        assert not c.prefillers[0].vllm.requests and decoder.vllm.calls("/v1/completions")
        assert c.metric("lmcache_p2p_proxy_colocated_total", reason="too_large", role="receiver") == 1
        assert c.metric("lmcache_p2p_proxy_admission_total", outcome="refused") == 1


async def test_a_full_admission_queue_sends_the_request_to_a_decoder_not_a_503():
    async with make_cluster(admission_queue_max=0) as c:
        c.decoders[0].agent.free_slots = 0
        await c.decoders[0].agent.announce()
        inst, = c.proxy.registry.routable(Role.RECEIVER)
        await eventually(lambda: inst.free_slots() == 0)
        resp = await c.post("/v1/chat/completions", {"model": MODEL, "max_tokens": 3,
                                                     "messages": [{"role": "user", "content": "hi"}]})
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 3
        assert c.metric("lmcache_p2p_proxy_colocated_total", reason="admission_queue_full", role="receiver") == 1
        assert c.decoders[0].vllm.calls("/tokenize")  # the decoder learnt the chat prompt's ids itself


async def test_a_heartbeat_with_free_slots_admits_the_waiting_request():
    async with make_cluster(admission_timeout_s=20) as c:
        decoder = c.decoders[0]
        decoder.agent.free_slots = 0
        await decoder.agent.announce()
        inst, = c.proxy.registry.routable(Role.RECEIVER)
        await eventually(lambda: inst.free_slots() == 0)
        prompt = ids_prompt(3, 20)
        pending = asyncio.ensure_future(c.post("/v1/completions", {"model": MODEL, "prompt": prompt,
                                                                   "max_tokens": 4}))
        await eventually(lambda: len(c.proxy.orchestrator.admission) == 1)
        assert c.metric("lmcache_p2p_proxy_admission_waiting") == 1
        decoder.agent.free_slots = 8  # the decoder loaded someone else's KV
        await decoder.agent.announce()
        resp = await pending
        assert resp.json()["choices"][0]["text"] == expected(prompt, 4)
        assert c.metric("lmcache_p2p_proxy_kv_outcomes_total", outcome="ready") == 1
        assert c.metric("lmcache_p2p_proxy_admission_total", outcome="admitted") == 1
        assert c.prefillers[0].vllm.calls("/v1/completions")[0]["kv_transfer_params"]["disagg_spec"]
