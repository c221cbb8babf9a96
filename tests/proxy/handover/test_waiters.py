"""KV waiters: a wait ends at every rank's KvReady, the first KvFailed (with its cause), its decoder known
down, or the timeout."""

from __future__ import annotations

import pytest

from lmcache_p2p.protocol import KvFailCause, KvFailed, KvReady
from lmcache_p2p.proxy.handover import waiters as waiters_module
from lmcache_p2p.proxy.handover.waiters import KvStatus, KvWaiters

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(10)]
LONG_S = 60.0  # a wait that is not ended by what it was told runs into the test's timeout


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_a_decoder_known_down_ends_only_the_waits_on_it_and_a_later_notice_changes_nothing():
    waiters = KvWaiters()
    on_down = waiters.register("r1", 2, "decoder-a")
    elsewhere = waiters.register("r2", 1, "decoder-b")
    waiters.deliver(KvReady("r1", "decoder-a", 0, 1, 10))
    assert waiters.decoder_down("decoder-a", "decoder-a was forgotten") == 1
    waiters.deliver(KvReady("r1", "decoder-a", 1, 1, 10))
    outcome = await on_down.wait(LONG_S)
    assert (outcome.status, outcome.reason) == (KvStatus.DECODER_DOWN, "decoder-a was forgotten")
    waiters.deliver(KvReady("r2", "decoder-b", 0, 1, 10))
    assert (await elsewhere.wait(LONG_S)).status is KvStatus.READY


async def test_a_kv_failed_carries_its_cause_and_a_later_down_does_not_replace_it():
    waiters = KvWaiters()
    waiter = waiters.register("r1", 1, "decoder-a")
    waiters.deliver(KvFailed("r1", "prefiller-p", 0, "receiver sent nothing", KvFailCause.UNREACHABLE))
    waiters.decoder_down("decoder-a", "forgotten")
    outcome = await waiter.wait(LONG_S)
    assert (outcome.status, outcome.cause) == (KvStatus.FAILED, KvFailCause.UNREACHABLE)
    assert "receiver sent nothing" in outcome.reason


async def test_a_ready_wait_is_not_ended_by_its_decoder_going_down_afterwards():
    waiters = KvWaiters()
    waiter = waiters.register("r1", 1, "decoder-a")
    waiters.deliver(KvReady("r1", "decoder-a", 0, 1, 10))
    waiters.decoder_down("decoder-a", "forgotten")
    assert (await waiter.wait(LONG_S)).status is KvStatus.READY


async def test_a_notice_that_lands_while_the_timed_out_wait_is_cancelled_counts(monkeypatch):
    """``wait_for`` gives the loop a turn while it cancels a timed-out wait: a KvReady delivered then is the
    outcome (it landed), not a timeout whose reason lists every rank ready."""
    waiters = KvWaiters()
    waiter = waiters.register("r1", 1, "decoder-a")

    async def late_wait_for(aw, timeout_s):
        aw.close()
        waiters.deliver(KvReady("r1", "decoder-a", 0, 1, 10))
        raise TimeoutError

    monkeypatch.setattr(waiters_module.asyncio, "wait_for", late_wait_for)
    outcome = await waiter.wait(0.01)
    assert (outcome.status, outcome.nbytes) == (KvStatus.READY, 10)
