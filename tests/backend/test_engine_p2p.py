"""Engine level: a real LMCache engine stores on the prefiller, another looks up and retrieves.

Both engines load the plugin from YAML through ``storage_plugins``; KV moves over NIXL (UCX tcp on
loopback) between two processes. Assertions: hit = all tokens, KV bit-exact, every slot FREE after.
"""

from __future__ import annotations

import time


def store(sender, port, seed, n, req_id, *, end=None, skip=0, last=True):
    reply = sender.call(op="store", seed=seed, num_tokens=n, end=end or n, skip=skip, req_id=req_id,
                        last=last, port=port)
    assert reply == {"ok": True}


def assert_received(receiver, seed, n):
    assert receiver.call(op="wait_ready", seed=seed, num_tokens=n, timeout_s=20) == {"hit_tokens": n}
    assert receiver.call(op="retrieve", seed=seed, num_tokens=n) == {"retrieved": n, "equal": True}


def wait_all_free(receiver, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while True:
        slots = receiver.call(op="slots")
        if slots["free"] == slots["capacity"] or time.monotonic() > deadline:
            return slots
        time.sleep(0.05)


def test_one_request_with_partial_last_chunk(engine_pair):
    receiver, sender, port = engine_pair()
    store(sender, port, seed=1, n=650, req_id="req-1")  # 256 + 256 + 138 tokens
    assert_received(receiver, seed=1, n=650)
    slots = wait_all_free(receiver)
    assert slots["free"] == slots["capacity"]
    assert sender.call(op="slots") == {"sent": 1, "failed": 0, "pending": 0}


def test_two_concurrent_requests(engine_pair):
    receiver, sender, port = engine_pair()
    store(sender, port, seed=10, n=700, req_id="req-a")
    store(sender, port, seed=20, n=1024, req_id="req-b")
    assert_received(receiver, seed=20, n=1024)
    assert_received(receiver, seed=10, n=700)
    slots = wait_all_free(receiver)
    assert slots["free"] == slots["capacity"]


def test_request_stored_in_three_steps_with_a_resent_chunk(engine_pair):
    receiver, sender, port = engine_pair()
    # Like chunked prefill: each step stores the prefix so far; step 2 re-sends chunk 1 (tokens 256..512).
    store(sender, port, seed=5, n=900, req_id="req-steps", end=512, last=False)
    store(sender, port, seed=5, n=900, req_id="req-steps", end=768, skip=256, last=False)
    assert receiver.call(op="lookup", seed=5, num_tokens=900)["hit_tokens"] < 900
    store(sender, port, seed=5, n=900, req_id="req-steps", end=900, skip=768, last=True)
    assert_received(receiver, seed=5, n=900)
    slots = wait_all_free(receiver)
    assert slots["free"] == slots["capacity"]


def test_buffer_smaller_than_request_is_refused_fast_and_frees_everything(engine_pair):
    # 3 slots of 128 KiB; a 900-token request needs 4 chunks.
    receiver, sender, port = engine_pair(buffer_size="384KB", alloc_timeout_s=30)
    started = time.monotonic()
    store(sender, port, seed=7, n=900, req_id="req-big")
    deadline = time.monotonic() + 10
    while sender.call(op="slots")["failed"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sender.call(op="slots")["failed"] == 1
    assert time.monotonic() - started < 10  # refused at once, not after alloc_timeout_s=30
    assert receiver.call(op="lookup", seed=7, num_tokens=900) == {"hit_tokens": 0}
    slots = wait_all_free(receiver)
    assert slots == {"free": 3, "capacity": 3}
    # The engines keep working: a request that fits goes through.
    store(sender, port, seed=8, n=300, req_id="req-small")
    assert_received(receiver, seed=8, n=300)
    assert wait_all_free(receiver)["free"] == 3
