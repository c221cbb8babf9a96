"""Engine level: a real LMCache engine stores on the prefiller, another looks up and retrieves.

Both engines load the plugin from YAML through ``storage_plugins``; KV moves over NIXL (UCX tcp on
loopback) between two processes. Assertions: hit = all tokens, KV bit-exact, every slot FREE after.
"""

from __future__ import annotations

import signal
import time

from engines import EngineProc

# Deadlines, generous for a busy 2-core machine: they bound a wait, they are not what is tested.
READY_TIMEOUT_S = 60.0
FREE_TIMEOUT_S = 30.0
STATS_TIMEOUT_S = 60.0
SHORT_READY_LEASE_S = 10.0  # chunks never loaded return after this: waited out by a test, never a step's bound


def store(sender, port, seed, n, req_id, *, end=None, skip=0, last=True, spec=True):
    reply = sender.call(op="store", seed=seed, num_tokens=n, end=end or n, skip=skip, req_id=req_id,
                        last=last, port=port, spec=spec)
    assert reply == {"ok": True}


def assert_received(receiver, seed, n):
    assert receiver.call(op="wait_ready", seed=seed, num_tokens=n, timeout_s=READY_TIMEOUT_S) == {"hit_tokens": n}
    assert receiver.call(op="retrieve", seed=seed, num_tokens=n) == {"retrieved": n, "equal": True}


def wait_for(call, predicate, timeout_s):
    deadline = time.monotonic() + timeout_s
    while True:
        value = call()
        if predicate(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


def all_free(receiver, timeout_s=FREE_TIMEOUT_S):
    slots = wait_for(lambda: receiver.call(op="slots"), lambda s: s["free"] == s["capacity"], timeout_s)
    return slots["free"] == slots["capacity"]


def test_one_request_with_partial_last_chunk(pair):
    store(pair.sender, pair.port, seed=1, n=650, req_id="req-1")  # 256 + 256 + 138 tokens
    assert_received(pair.receiver, seed=1, n=650)
    assert all_free(pair.receiver)
    stats = wait_for(lambda: pair.sender.call(op="slots"), lambda s: s["pending"] == 0, STATS_TIMEOUT_S)
    assert stats["failed"] == 0 and stats["pending"] == 0


def test_two_concurrent_requests(pair):
    store(pair.sender, pair.port, seed=10, n=700, req_id="req-a")
    store(pair.sender, pair.port, seed=20, n=1024, req_id="req-b")
    assert_received(pair.receiver, seed=20, n=1024)
    assert_received(pair.receiver, seed=10, n=700)
    assert all_free(pair.receiver)


def test_request_stored_in_three_steps_with_a_resent_chunk(pair):
    # Like chunked prefill: each step stores the prefix so far; step 2 re-sends chunk 1 (tokens 256..512).
    store(pair.sender, pair.port, seed=5, n=900, req_id="req-steps", end=512, last=False)
    store(pair.sender, pair.port, seed=5, n=900, req_id="req-steps", end=768, skip=256, last=False)
    assert pair.receiver.call(op="lookup", seed=5, num_tokens=900)["hit_tokens"] < 900
    store(pair.sender, pair.port, seed=5, n=900, req_id="req-steps", end=900, skip=768, last=True)
    assert_received(pair.receiver, seed=5, n=900)
    assert all_free(pair.receiver)


def test_store_without_disagg_spec_is_a_no_op(pair):
    store(pair.sender, pair.port, seed=3, n=300, req_id="unrouted", spec=False)
    time.sleep(0.3)
    assert pair.receiver.call(op="lookup", seed=3, num_tokens=300) == {"hit_tokens": 0}
    # The engine keeps working afterwards.
    store(pair.sender, pair.port, seed=4, n=300, req_id="routed")
    assert_received(pair.receiver, seed=4, n=300)


def test_buffer_smaller_than_request_is_refused_fast_and_frees_everything(make_pair):
    # 3 slots of 128 KiB; a 900-token request needs 4 chunks.
    # alloc_timeout_s is far beyond the wait below: a failure seen in time was a refusal, not a timeout.
    pair = make_pair(buffer_size="384KB", alloc_timeout_s=900)
    store(pair.sender, pair.port, seed=7, n=900, req_id="req-big")
    stats = wait_for(lambda: pair.sender.call(op="slots"), lambda s: s["failed"] == 1, STATS_TIMEOUT_S)
    assert stats["failed"] == 1
    # the failure is counted, then logged: the log may lag the count by a moment
    log = wait_for(pair.sender.log_path.read_text, lambda text: "raise p2p.buffer_size" in text, STATS_TIMEOUT_S)
    assert "raise p2p.buffer_size" in log
    assert pair.receiver.call(op="lookup", seed=7, num_tokens=900) == {"hit_tokens": 0}
    assert pair.receiver.call(op="slots") == {"free": 3, "capacity": 3}
    # The engines keep working: a request that fits goes through.
    store(pair.sender, pair.port, seed=8, n=300, req_id="req-small")
    assert_received(pair.receiver, seed=8, n=300)
    assert all_free(pair.receiver)


def test_dead_sender_slots_return_and_restarted_receiver_is_found_again(make_pair):
    # A ready lease the test waits out, yet far longer than a loaded machine takes from a chunk's arrival to its
    # load: a lease of a second or two took the orphan's chunks back before the test looked, or a later request's
    # between its wait and its retrieve. The write window keeps its defaults: no write here has to be quick.
    pair = make_pair(ready_lease_s=SHORT_READY_LEASE_S)
    # A request whose last store never comes: its sender dies mid-request, its 2 chunks landed (counted: a
    # READY chunk itself lasts only the lease).
    store(pair.sender, pair.port, seed=11, n=900, req_id="orphan", end=512, last=False)
    landed = wait_for(lambda: detail(pair.receiver)["counters"]["bytes_received"], lambda n: n >= 512 * BYTES_PER_TOKEN,
                      READY_TIMEOUT_S)
    assert landed == 512 * BYTES_PER_TOKEN
    pair.sender.proc.send_signal(signal.SIGKILL)
    pair.sender.close()
    assert all_free(pair.receiver, timeout_s=FREE_TIMEOUT_S)  # the leases return every slot to the pool
    # A new prefiller, then the decoder is killed and restarted on the same port: no hang, KV flows again.
    pair.sender = pair.start_sender()
    store(pair.sender, pair.port, seed=12, n=300, req_id="before-restart")
    assert_received(pair.receiver, seed=12, n=300)
    pair.receiver.proc.send_signal(signal.SIGKILL)
    pair.receiver.close()
    pair.receiver = pair.start_receiver()
    store(pair.sender, pair.port, seed=13, n=600, req_id="after-restart")
    assert_received(pair.receiver, seed=13, n=600)
    assert all_free(pair.receiver)


def test_prefiller_of_another_model_is_refused_and_nothing_is_loaded(make_pair):
    pair = make_pair()
    pair.sender.close()
    pair.sender = EngineProc("prefiller", pair.scfg, pair.tmp / "prefiller-other-model.log",
                             env_extra={"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "lo",
                                        "ENGINE_PROC_MODEL_NAME": "other-model"})
    store(pair.sender, pair.port, seed=21, n=300, req_id="other-model")
    stats = wait_for(lambda: pair.sender.call(op="slots"), lambda s: s["failed"] == 1, STATS_TIMEOUT_S)
    assert stats["failed"] == 1
    assert pair.receiver.call(op="lookup", seed=21, num_tokens=300) == {"hit_tokens": 0}
    assert pair.receiver.call(op="slots")["free"] == pair.receiver.call(op="slots")["capacity"]
    log = pair.sender.log_path.read_text()
    assert "KV fingerprint mismatch in model" in log and "'tiny'" in log and "'other-model'" in log


def test_nccl_on_gloo_real_sender_writes_pass_the_receivers_write_guard(make_pair):
    # Every doorbell of the real sender is checked against its grants (ReceiveService.admit_write).
    pair = make_pair(transport="nccl", sender_opts={"transport": "nccl"})
    store(pair.sender, pair.port, seed=31, n=650, req_id="nccl-1")
    store(pair.sender, pair.port, seed=32, n=1024, req_id="nccl-2")
    assert_received(pair.receiver, seed=31, n=650)
    assert_received(pair.receiver, seed=32, n=1024)
    assert all_free(pair.receiver)
    stats = wait_for(lambda: pair.sender.call(op="slots"), lambda s: s["pending"] == 0, 5)
    assert stats["failed"] == 0


# ---- prefix sharing: the decoder's buffer cache, only the missing chunks move --------------------

BYTES_PER_TOKEN = 2 * 2 * 64 * 2  # K and V, 2 layers, 2 KV heads x 32, bf16 (engine_proc's tiny shape)


def detail(receiver):
    return receiver.call(op="slots", detail=True)


def sent(sender):
    return wait_for(lambda: sender.call(op="slots"), lambda s: s["pending"] == 0, STATS_TIMEOUT_S)


def test_second_turn_sends_only_the_chunks_the_decoder_lacks_and_loads_bit_exact(pair):
    # A conversation: turn 1 is 600 tokens (256 + 256 + 88), turn 2 = turn 1's tokens + 300 more
    # (256 + 256 + 256 + 132). Turn 2 shares turn 1's two full chunks; the partial one differs
    # (its hash covers 88 tokens, turn 2's third chunk 256).
    s0, r0 = sent(pair.sender), detail(pair.receiver)
    store(pair.sender, pair.port, seed=41, n=900, end=600, req_id="conv-turn-1")
    assert pair.receiver.call(op="wait_ready", seed=41, num_tokens=900, end=600, timeout_s=READY_TIMEOUT_S) == \
        {"hit_tokens": 600}
    assert pair.receiver.call(op="load", seed=41, num_tokens=900, end=600, req_id="conv-turn-1") == \
        {"hit_tokens": 600, "retrieved": 600, "equal": True}
    s1, r1 = sent(pair.sender), detail(pair.receiver)
    assert s1["bytes_sent"] - s0["bytes_sent"] == 600 * BYTES_PER_TOKEN
    assert r1["counters"]["bytes_received"] - r0["counters"]["bytes_received"] == 600 * BYTES_PER_TOKEN
    # Loaded chunks stay cached, unpinned and evictable: the credit is the whole buffer.
    assert r1["cached"] - r0["cached"] == 3 and r1["pinned"] == 0 and r1["free"] == r1["capacity"]

    store(pair.sender, pair.port, seed=41, n=900, end=900, req_id="conv-turn-2")
    assert pair.receiver.call(op="wait_ready", seed=41, num_tokens=900, timeout_s=READY_TIMEOUT_S) == \
        {"hit_tokens": 900}
    assert pair.receiver.call(op="load", seed=41, num_tokens=900, req_id="conv-turn-2") == \
        {"hit_tokens": 900, "retrieved": 900, "equal": True}
    s2, r2 = sent(pair.sender), detail(pair.receiver)
    moved = (900 - 512) * BYTES_PER_TOKEN  # chunks 2 and 3 only
    print(f"turn 1 moved {600 * BYTES_PER_TOKEN} bytes; turn 2 moved {s2['bytes_sent'] - s1['bytes_sent']} "
          f"of {900 * BYTES_PER_TOKEN} (2 chunks held)")
    assert s2["bytes_sent"] - s1["bytes_sent"] == moved
    assert s2["chunks_skipped"] - s1["chunks_skipped"] == 2
    assert r2["counters"]["bytes_received"] - r1["counters"]["bytes_received"] == moved
    assert r2["counters"]["chunks_held"] - r1["counters"]["chunks_held"] == 2
    assert r2["counters"]["bytes_held"] - r1["counters"]["bytes_held"] == 512 * BYTES_PER_TOKEN
    assert r2["counters"]["chunks_loaded_from_cache"] - r1["counters"]["chunks_loaded_from_cache"] == 2
    assert r2["cached"] - r1["cached"] == 2 and r2["pinned"] == 0 and r2["free"] == r2["capacity"]


def test_decoder_with_a_local_prefix_hit_loads_only_the_rest(pair):
    # The decoder's vLLM holds the first 512 tokens itself: LMCache still looks up from token 0
    # (the cached chunks count), but retrieves only from the first chunk vLLM lacks.
    store(pair.sender, pair.port, seed=43, n=900, end=600, req_id="local-1")
    pair.receiver.call(op="wait_ready", seed=43, num_tokens=900, end=600, timeout_s=READY_TIMEOUT_S)
    assert pair.receiver.call(op="load", seed=43, num_tokens=900, end=600, req_id="local-1")["equal"]
    r1 = detail(pair.receiver)
    store(pair.sender, pair.port, seed=43, n=900, end=900, req_id="local-2")
    pair.receiver.call(op="wait_ready", seed=43, num_tokens=900, timeout_s=READY_TIMEOUT_S)
    got = pair.receiver.call(op="load", seed=43, num_tokens=900, vllm_hit=600, req_id="local-2")
    assert got == {"hit_tokens": 900, "retrieved": 900 - 512, "equal": True}
    r2 = detail(pair.receiver)
    # The held chunks were not read, and their pins went with the lookup's unpin: nothing stays pinned.
    assert r2["counters"]["chunks_loaded_from_cache"] == r1["counters"]["chunks_loaded_from_cache"]
    assert r2["pinned"] == 0 and r2["free"] == r2["capacity"]


def test_pinned_cached_chunks_are_never_evicted_by_another_request(make_pair):
    # 4 slots. Turn 1 leaves 2 chunks cached; turn 2 pins them (held) and takes 1 slot; a third
    # request needing 2 slots finds only 1 (the pinned ones are not credit) and is refused, the
    # KV of turn 2 stays bit-exact; once turn 2 is loaded, the third request fits (evicting).
    # "other" runs into the credit timeout, which also bounds each Grant of this pair (a normal step, that a loaded
    # machine can hold for a second or more): the engine pairs' 5 s
    pair = make_pair(buffer_size="512KB", alloc_timeout_s=5.0)
    store(pair.sender, pair.port, seed=45, n=768, end=512, req_id="pin-1")
    pair.receiver.call(op="wait_ready", seed=45, num_tokens=768, end=512, timeout_s=READY_TIMEOUT_S)
    assert pair.receiver.call(op="load", seed=45, num_tokens=768, end=512, req_id="pin-1")["equal"]
    store(pair.sender, pair.port, seed=45, n=768, end=768, req_id="pin-2")
    pair.receiver.call(op="wait_ready", seed=45, num_tokens=768, timeout_s=READY_TIMEOUT_S)
    assert detail(pair.receiver)["free"] == 1
    store(pair.sender, pair.port, seed=46, n=512, req_id="other")
    stats = wait_for(lambda: pair.sender.call(op="slots"), lambda s: s["failed"] == 1, STATS_TIMEOUT_S)
    assert stats["failed"] == 1
    assert pair.receiver.call(op="load", seed=45, num_tokens=768, req_id="pin-2") == \
        {"hit_tokens": 768, "retrieved": 768, "equal": True}
    store(pair.sender, pair.port, seed=46, n=512, req_id="other-again")
    assert_received(pair.receiver, seed=46, n=512)
    assert detail(pair.receiver)["free"] == 4
