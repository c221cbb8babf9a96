"""bench/e2e_gpu_pd_proxy.py: LMCache PD proxy's stamps kept for streamed requests too (no server)."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pd_proxy():
    spec = importlib.util.spec_from_file_location("e2e_gpu_pd_proxy", REPO / "bench" / "e2e_gpu_pd_proxy.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["e2e_gpu_pd_proxy"] = module
    spec.loader.exec_module(module)
    return module


def fake_proxy_namespace() -> dict:
    """The two functions the wrapper replaces, shaped like pd_proxy.py's, and its streamed caller."""
    async def prefill(rid, base, tok, stamps):
        stamps["t_prefill_done"] = 1.0
        stamps["t_kv_ready"] = 1.5
        return {"first": 42}, 42

    async def decoder_chunks(body, stamps=None):
        for i in range(3):
            if stamps is not None and "t_decode_first_byte" not in stamps:
                stamps["t_decode_first_byte"] = 2.0
            yield {"i": i}

    namespace = {"prefill": prefill, "decoder_chunks": decoder_chunks}

    async def run_streamed(tok):  # pd_proxy.run_pd: prefill(..., T), then decoder_chunks(d) without T when streamed
        stamps = {"t_arrive": 0.5}
        _, first = await namespace["prefill"]("rid", {}, tok, stamps)
        return [c async for c in namespace["decoder_chunks"]({"prompt": tok + [first]})]

    return namespace, run_streamed


def test_a_streamed_request_s_stamps_reach_pd_stats(pd_proxy) -> None:
    namespace, run_streamed = fake_proxy_namespace()
    timings = pd_proxy.PdTimings()
    pd_proxy.wrap(namespace, timings)
    assert len(asyncio.run(run_streamed([1, 2, 3]))) == 3
    assert len(timings.done) == 1
    got = timings.done[0]
    assert (got["t_arrive"], got["t_prefill_done"], got["t_kv_ready"], got["t_decode_first_byte"]) == (0.5, 1.0, 1.5, 2.0)
    assert "t_done" in got
    assert timings.reset() == 1 and timings.done == []


def test_a_decode_leg_with_no_matching_prefill_is_kept_without_prefill_stamps(pd_proxy) -> None:
    timings = pd_proxy.PdTimings(pending_max=1)
    timings.prefilled([1], {"t_prefill_done": 1.0})
    timings.prefilled([2], {"t_prefill_done": 2.0})  # pushes [1] out (bounded)
    assert timings.decoding([1, 99], None) == {}
    assert timings.decoding([2, 99], None) == {"t_prefill_done": 2.0}
    own = {"t_prefill_done": 3.0}
    assert timings.decoding([5, 6], own) is own  # a non-streamed request passes its own stamps
