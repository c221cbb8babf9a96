"""One request end to end through the proxy, against fake vLLM instances (see fakes.py)."""

from __future__ import annotations

import asyncio
import re

import pytest

from lmcache_p2p.config import Role
from lmcache_p2p.proxy.flow import prompt as prompt_module
from lmcache_p2p.proxy.router.registry import Instance

from .. import fakes
from ..conftest import eventually, make_cluster
from ..fakes import MESSAGES, MODEL, PROMPT, chat_prompt, expected_text, generate, token_text, tokenize

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]
# a test that loads the folder's tokenizer imports transformers in this process: on a loaded 2-core machine that
# alone took 30 s
TOKENIZER_TIMEOUT_S = 120

def assert_idle(cluster) -> None:
    """Every lease released, every waiter dropped."""
    assert len(cluster.proxy.waiters) == 0
    for inst in cluster.proxy.registry.instances():
        assert (inst.inflight_requests, inst.inflight_tokens) == (0, 0), inst.instance_id


# ---- the happy paths -------------------------------------------------------------------------------


async def test_completion_matches_single_instance_and_shapes_both_calls():
    async with make_cluster() as c:
        resp = await c.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 8,
                                                "temperature": 0})
        assert resp.status_code == 200, resp.text
        answer = resp.json()
        ids = tokenize(PROMPT)
        assert answer["choices"][0]["text"] == expected_text(ids, 8)  # first token included
        assert answer["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 8, "total_tokens": len(ids) + 8}
        assert answer["object"] == "text_completion" and answer["choices"][0]["finish_reason"] == "length"

        prefill, = c.prefillers[0].vllm.calls("/v1/completions")
        assert prefill["max_tokens"] == 1 and prefill["stream"] is False and prefill["return_token_ids"] is True
        decoder = c.decoders[0].agent
        spec = prefill["kv_transfer_params"]["disagg_spec"]
        assert prefill["kv_transfer_params"]["ret_first_tok"] is True
        assert re.fullmatch(r"[0-9a-f]{32}", spec["req_id"])
        assert spec["receiver_host"] == "127.0.0.1"
        assert spec["receiver_alloc_port"] == [decoder.control_port(0)]
        assert spec["receiver_init_port"] == [decoder.transport_port(0)]

        decode, = c.decoders[0].vllm.calls("/v1/completions")
        first = generate(ids, 1)[0]
        assert decode["prompt"] == ids + [first]
        assert decode["max_tokens"] == 7 and decode["temperature"] == 0 and decode["stream"] is True
        assert "kv_transfer_params" not in decode
        assert c.metric("lmcache_p2p_proxy_kv_outcomes_total", outcome="ready") == 1
        assert c.metric("lmcache_p2p_proxy_kv_bytes_total") == 3 << 20
        assert_idle(c)


async def test_completion_stream_sends_first_token_then_decode_then_usage():
    async with make_cluster() as c:
        events = await c.stream("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 6,
                                                    "stream": True, "stream_options": {"include_usage": True},
                                                    "return_token_ids": True})
        assert events[-1] == "[DONE]"
        chunks = [e for e in events[:-1] if e["choices"]]
        ids = tokenize(PROMPT)
        assert "".join(ch["choices"][0]["text"] for ch in chunks) == expected_text(ids, 6)
        assert chunks[0]["choices"][0]["text"] == token_text(generate(ids, 1)[0])
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert [t for ch in chunks for t in ch["choices"][0]["token_ids"]] == generate(ids, 6)
        assert chunks[0]["choices"][0]["prompt_token_ids"] == ids
        assert all("prompt_token_ids" not in ch["choices"][0] for ch in chunks[1:])
        assert len({ch["id"] for ch in events[:-1]}) == 1
        usage = events[-2]["usage"]
        assert usage["completion_tokens"] == 6 and usage["prompt_tokens"] == len(ids)
        assert c.metric("lmcache_p2p_proxy_handover_seconds_count") == 1
        assert c.metric("lmcache_p2p_proxy_ttft_seconds_count", endpoint="/v1/completions") == 1
        assert_idle(c)


async def test_chat_non_stream_decodes_token_ids_on_completions():
    async with make_cluster() as c:
        resp = await c.post("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 5,
                                                     "return_token_ids": True})
        assert resp.status_code == 200, resp.text
        answer = resp.json()
        ids = tokenize(chat_prompt(MESSAGES))
        assert answer["object"] == "chat.completion"
        assert answer["choices"][0]["message"] == {"role": "assistant", "content": expected_text(ids, 5)}
        assert answer["choices"][0]["token_ids"] == generate(ids, 5)
        assert answer["prompt_token_ids"] == ids
        prefill, = c.prefillers[0].vllm.calls("/v1/chat/completions")
        assert prefill["max_tokens"] == 1 and prefill["max_completion_tokens"] == 1
        decode, = c.decoders[0].vllm.calls("/v1/completions")
        assert decode["prompt"] == ids + generate(ids, 1) and decode["max_tokens"] == 4
        assert "messages" not in decode
        assert not c.prefillers[0].vllm.calls("/tokenize")  # ids came with the prefill answer


async def test_chat_stream_role_then_content_then_usage():
    async with make_cluster() as c:
        events = await c.stream("/v1/chat/completions", {
            "model": MODEL, "messages": MESSAGES, "max_completion_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}})
        assert events[-1] == "[DONE]"
        assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert all(e["object"] == "chat.completion.chunk" for e in events[:-1])
        text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1] if e["choices"])
        ids = tokenize(chat_prompt(MESSAGES))
        assert text == expected_text(ids, 4)
        assert events[-2]["usage"]["completion_tokens"] == 4


async def test_tokenize_is_the_fallback_when_prefill_returns_no_prompt_ids():
    async with make_cluster() as c:
        c.prefillers[0].vllm.omit_prompt_ids = True
        resp = await c.post("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 3})
        ids = tokenize(chat_prompt(MESSAGES))
        assert resp.json()["choices"][0]["message"]["content"] == expected_text(ids, 3)
        tokenize_call, = c.prefillers[0].vllm.calls("/tokenize")
        assert tokenize_call["messages"] == MESSAGES


async def test_one_output_token_needs_no_decoder_and_no_kv():
    async with make_cluster() as c:
        for stream in (False, True):
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "stream": stream}
            if stream:
                events = await c.stream("/v1/completions", body)
                text = "".join(e["choices"][0]["text"] for e in events[:-1])
            else:
                text = (await c.post("/v1/completions", body)).json()["choices"][0]["text"]
            assert text == expected_text(tokenize(PROMPT), 1)
        assert all("kv_transfer_params" not in b for b in c.prefillers[0].vllm.calls("/v1/completions"))
        assert not c.decoders[0].vllm.requests
        assert_idle(c)


async def test_first_token_eos_ends_without_decode():
    async with make_cluster() as c:
        c.prefillers[0].vllm.eos_at = 0
        resp = await c.post("/v1/completions", {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 10})
        choice = resp.json()["choices"][0]
        assert choice["finish_reason"] == "stop" and resp.json()["usage"]["completion_tokens"] == 1
        assert not c.decoders[0].vllm.requests
        assert_idle(c)


async def test_first_token_with_held_back_text_is_regenerated_by_the_decoder():
    async with make_cluster() as c:
        c.prefillers[0].vllm.hold_back_text = True  # e.g. the first byte of a multi-byte character
        ids = tokenize(PROMPT)
        resp = await c.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 5,
                                                "return_token_ids": True})
        choice = resp.json()["choices"][0]
        assert choice["text"] == expected_text(ids, 5) and choice["token_ids"] == generate(ids, 5)
        assert resp.json()["usage"]["completion_tokens"] == 5
        decode, = c.decoders[0].vllm.calls("/v1/completions")
        assert decode["prompt"] == ids and decode["max_tokens"] == 5

        events = await c.stream("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 3,
                                                         "stream": True, "stream_options": {"include_usage": True}})
        chat_ids = tokenize(chat_prompt(MESSAGES))
        assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1] if e["choices"])
        assert text == expected_text(chat_ids, 3) and events[-2]["usage"]["completion_tokens"] == 3
        assert_idle(c)


async def test_completion_logprobs_cover_every_token_with_continuous_offsets():
    async with make_cluster() as c:
        resp = await c.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "logprobs": 1})
        choice = resp.json()["choices"][0]
        lp = choice["logprobs"]
        assert "".join(lp["tokens"]) == choice["text"]
        assert lp["text_offset"] == [choice["text"].index(t, o) for t, o in zip(lp["tokens"], lp["text_offset"])]
        assert lp["text_offset"][1] == len(lp["tokens"][0])


async def test_concurrent_requests_spread_over_decoders_and_all_match():
    async with make_cluster(n_prefill=2, n_decode=2) as c:
        prompts = [f"prompt number {i}" for i in range(8)]
        answers = await asyncio.gather(*(
            c.post("/v1/completions", {"model": MODEL, "prompt": p, "max_tokens": 5}) for p in prompts))
        for prompt, resp in zip(prompts, answers):
            assert resp.json()["choices"][0]["text"] == expected_text(tokenize(prompt), 5)
        assert all(node.vllm.calls("/v1/completions") for node in c.prefillers + c.decoders)
        assert_idle(c)


async def test_tensor_parallel_decoder_needs_every_rank_ready():
    # the short KV timeout is for the second request's wait: the first one's KvReady is heard before its prefill answers
    async with make_cluster(tp_size=2, kv_timeout_s=0.3, on_kv_failure="recompute", kv_before_answers=True) as c:
        spec_ports = c.decoders[0].agent
        await c.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 3})
        spec = c.network.specs[-1]
        assert spec["receiver_alloc_port"] == [spec_ports.control_port(0), spec_ports.control_port(1)]
        assert c.metric("lmcache_p2p_proxy_kv_outcomes_total", outcome="ready") == 1
        c.decoders[0].agent.kv_mode = "one_rank"
        resp = await c.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 3})
        assert resp.status_code == 200
        assert c.metric("lmcache_p2p_proxy_kv_outcomes_total", outcome="timeout") == 1


# ---- KV failures -----------------------------------------------------------------------------------


async def test_kv_failed_retries_once_on_the_other_pair():
    async with make_cluster(n_prefill=2, n_decode=2) as c:
        for node in c.decoders:
            node.agent.kv_mode = "fail"
        # Whichever decoder is picked first fails; the retry goes to the other one, which succeeds.
        failing = []

        def fail_once(spec):
            agent = next(n.agent for n in c.decoders if n.agent.control_port(0) == spec["receiver_alloc_port"][0])
            failing.append(agent)
            agent.kv_mode = "fail" if len(failing) == 1 else "ready"

        orig = c.network.deliver

        async def deliver(spec):
            fail_once(spec)
            await orig(spec)

        for node in c.prefillers:
            node.vllm.kv_sink = deliver
        resp = await c.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 4})
        assert resp.json()["choices"][0]["text"] == expected_text(tokenize(PROMPT), 4)
        assert failing[0] is not failing[1]
        first_prefills = [n for n in c.prefillers if n.vllm.calls("/v1/completions")]
        assert len(first_prefills) == 2  # the retry went to the other prefiller
        retry, = [b for n in c.prefillers for b in n.vllm.calls("/v1/completions") if isinstance(b["prompt"], list)]
        assert retry["prompt"] == tokenize(PROMPT) and retry["max_tokens"] == 1
        decoded_on = [n.agent for n in c.decoders if n.vllm.calls("/v1/completions")]
        assert decoded_on == [failing[1]]
        assert c.metric("lmcache_p2p_proxy_kv_outcomes_total", outcome="failed") == 1
        assert c.metric("lmcache_p2p_proxy_kv_outcomes_total", outcome="ready") == 1
        assert_idle(c)


async def test_kv_failed_twice_falls_back_to_recompute():
    async with make_cluster() as c:
        c.decoders[0].agent.kv_mode = "fail"
        resp = await c.post("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 4})
        ids = tokenize(chat_prompt(MESSAGES))
        assert resp.json()["choices"][0]["message"]["content"] == expected_text(ids, 4)
        assert len(c.prefillers[0].vllm.requests) == 2  # the first prefill and one retry
        decode, = c.decoders[0].vllm.calls("/v1/completions")
        assert decode["prompt"] == ids + generate(ids, 1)
        assert c.metric("lmcache_p2p_proxy_kv_outcomes_total", outcome="failed") == 2
        assert_idle(c)


async def test_kv_timeout_is_bounded_and_recomputes():
    async with make_cluster(kv_timeout_s=0.3, on_kv_failure="recompute") as c:
        c.decoders[0].agent.kv_mode = "silent"
        events = await c.stream("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 3,
                                                    "stream": True})
        # the wait the proxy timed (the request's own time stretches with a loaded machine): its 0.3 s, far from the
        # 10 s of the default --kv-timeout-s and of the client's timeout
        assert 0.25 <= c.metric("lmcache_p2p_proxy_kv_wait_seconds_sum") < 5.0
        assert "".join(e["choices"][0]["text"] for e in events[:-1]) == expected_text(tokenize(PROMPT), 3)
        assert len(c.prefillers[0].vllm.requests) == 1  # recompute: no retry
        assert c.metric("lmcache_p2p_proxy_kv_outcomes_total", outcome="timeout") == 1
        assert_idle(c)


async def test_kv_timeout_with_fail_policy_answers_504():
    async with make_cluster(kv_timeout_s=0.2, on_kv_failure="fail") as c:
        c.decoders[0].agent.kv_mode = "silent"
        resp = await c.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 3})
        assert resp.status_code == 504
        assert "--kv-timeout-s" in resp.json()["error"]["message"]
        assert not c.decoders[0].vllm.requests
        assert_idle(c)


async def test_late_kv_ready_is_ignored():
    async with make_cluster(kv_timeout_s=0.2, on_kv_failure="recompute") as c:
        agent = c.decoders[0].agent
        # its KvReady is sent once the wait gave up: one sent after a fixed delay could still land within a wait
        # that a loaded machine started late
        agent.kv_mode = "silent"
        resp = await c.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 2})
        assert resp.status_code == 200
        assert c.metric("lmcache_p2p_proxy_kv_outcomes_total", outcome="timeout") == 1
        await agent.report_ready(c.network.specs[-1]["req_id"])
        await eventually(lambda: c.proxy.waiters.unmatched == 1)
        assert_idle(c)


# ---- errors ----------------------------------------------------------------------------------------


async def test_upstream_400_passes_through_as_json():
    async with make_cluster() as c:
        error = {"error": {"message": "max_tokens is too large", "type": "BadRequestError", "param": None,
                           "code": 400}}
        c.prefillers[0].vllm.errors.append((400, error))
        resp = await c.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 99999})
        assert resp.status_code == 400 and resp.json() == error
        assert c.metric("lmcache_p2p_proxy_requests_total", endpoint="/v1/completions", status="400") == 1
        assert_idle(c)


async def test_upstream_500_becomes_502():
    async with make_cluster() as c:
        c.prefillers[0].vllm.errors.append((500, {"error": {"message": "engine died"}}))
        resp = await c.post("/v1/completions", {"model": MODEL, "prompt": PROMPT})
        assert resp.status_code == 502
        assert "engine died" in resp.json()["error"]["message"] and resp.json()["error"]["code"] == 502


async def test_no_instance_at_all_answers_503():
    async with make_cluster(n_prefill=0, n_decode=0) as c:
        resp = await c.post("/v1/completions", {"model": MODEL, "prompt": PROMPT})
        assert resp.status_code == 503
        error = resp.json()["error"]
        assert "no prefiller or decoder" in error["message"] and error["code"] == 503 and error["type"]


async def test_unreachable_prefiller_leaves_the_prompt_to_the_decoder():
    async with make_cluster(n_prefill=0, static_instances=()) as c:
        dead = await c.add_node(Role.SENDER)
        await dead.vllm.server.stop()
        resp = await c.post("/v1/completions", {"model": MODEL, "prompt": PROMPT})
        assert resp.json()["choices"][0]["text"] == expected_text(tokenize(PROMPT), 16)
        assert c.metric("lmcache_p2p_proxy_colocated_total", reason="no_prefiller", role="receiver") == 1
        assert_idle(c)


async def test_unsplittable_request_is_refused_with_400():
    async with make_cluster() as c:
        resp = await c.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "n": 2})
        assert resp.status_code == 400 and "n > 1" in resp.json()["error"]["message"]
        resp = await c.client.post("/v1/completions", content=b"{not json")
        assert resp.status_code == 400
        assert not c.prefillers[0].vllm.requests


# ---- disconnects -----------------------------------------------------------------------------------


async def test_client_disconnect_mid_stream_cancels_the_decode():
    async with make_cluster() as c:
        decoder = c.decoders[0].vllm
        decoder.token_delay_s = 0.05
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 200, "stream": True}
        async with c.client.stream("POST", "/v1/completions", json=body) as resp:
            seen = 0
            async for line in resp.aiter_lines():
                seen += line.startswith("data: ")
                if seen >= 3:
                    break
        await eventually(lambda: decoder.cancelled_streams == 1)
        assert decoder.finished_streams == 0
        await eventually(lambda: len(c.proxy.waiters) == 0 and all(
            i.inflight_requests == 0 for i in c.proxy.registry.instances()))


async def test_client_disconnect_during_prefill_drops_the_waiter():
    async with make_cluster() as c:
        prefiller = c.prefillers[0].vllm
        prefiller.prefill_delay_s = 30.0  # it answers long after the client left
        post = asyncio.ensure_future(c.client.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT}))
        # the client leaves once its request is in the prefill (a client timeout could end it before it was sent)
        await eventually(lambda: prefiller.calls("/v1/completions"))
        post.cancel()
        await asyncio.gather(post, return_exceptions=True)
        await eventually(lambda: c.metric("lmcache_p2p_proxy_requests_total", endpoint="/v1/completions",
                                          status="499") == 1)
        assert_idle(c)
        assert not c.decoders[0].vllm.requests


# ---- every prompt's KV is used: prompt ids + first token, text made in the proxy ---------------------


def cycling_model(cycle: list[int]):
    """A greedy "model" that emits ``cycle`` over and over (the next token depends on the last one only)."""
    def model(ids: list[int]) -> int:
        return cycle[(cycle.index(ids[-1]) + 1) % len(cycle)] if ids[-1] in cycle else cycle[0]
    return model


def use_model(cluster, model, hf) -> None:
    for node in cluster.prefillers + cluster.decoders:
        node.vllm.model = model
        node.vllm.encode = hf.encode


@pytest.mark.timeout(TOKENIZER_TIMEOUT_S)
async def test_a_first_token_without_text_still_sends_prompt_plus_first_and_the_text_is_the_single_instances(
        tokenizer_dir):
    path, hf = tokenizer_dir
    cycle = hf.encode("中文☃", add_special_tokens=False)
    assert len(cycle) == 9  # one token per byte: the first token is an incomplete UTF-8 character
    async with make_cluster(tokenizer=str(path)) as c:
        use_model(c, cycling_model(cycle), hf)
        c.prefillers[0].vllm.hold_back_text = True  # the prefiller's first token has no text of its own
        ids = hf.encode(PROMPT)
        resp = await c.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 7,
                                                "return_token_ids": True})
        choice = resp.json()["choices"][0]
        assert choice["text"] == "中文" and choice["token_ids"] == cycle[:7]  # the 7th byte is not a character yet
        assert resp.json()["usage"]["completion_tokens"] == 7
        decode, = c.decoders[0].vllm.calls("/v1/completions")
        assert decode["prompt"] == ids + [cycle[0]] and decode["max_tokens"] == 6  # the whole prompt's KV is used

        events = await c.stream("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 9,
                                                         "stream": True, "stream_options": {"include_usage": True}})
        chunks = [e for e in events[:-1] if e["choices"]]
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert chunks[1]["choices"][0]["delta"]["content"] == "" and chunks[1]["choices"][0]["finish_reason"] is None
        assert "".join(e["choices"][0]["delta"].get("content", "") for e in chunks) == "中文☃"
        assert chunks[-1]["choices"][0]["finish_reason"] == "length" and events[-2]["usage"]["completion_tokens"] == 9
        decode = c.decoders[0].vllm.calls("/v1/completions")[-1]
        assert decode["prompt"] == hf.encode(chat_prompt(MESSAGES)) + [cycle[0]]
        assert_idle(c)


async def restart_prefiller(c, node) -> Instance:
    """``node``'s vLLM restarted (goodbye, announced again): its instance once it is routable again."""
    await node.agent.goodbye()
    await eventually(lambda: not c.proxy.registry.routable(Role.SENDER))
    await node.agent.announce()
    await eventually(lambda: c.proxy.registry.routable(Role.SENDER))
    return c.proxy.registry.routable(Role.SENDER)[0]


@pytest.mark.timeout(TOKENIZER_TIMEOUT_S)
async def test_an_empty_first_text_is_taken_only_from_a_prefiller_known_to_tokenize_as_the_proxy(tokenizer_dir):
    """vLLM run without a tokenizer answers "" for every token, one with it "" for a token that ends no character:
    the proxy makes the first token's text unless the prefiller's /tokenize agreed with its tokenizer when it came
    up, or it has answered some text since; it asks again after the prefiller restarted."""
    path, hf = tokenizer_dir
    cycle = hf.encode("ab中", add_special_tokens=False)
    assert len(cycle) == 5  # "a", "b" and the three bytes of "中"
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5}
    async with make_cluster(tokenizer=str(path)) as c:
        use_model(c, cycling_model(cycle), hf)
        prefiller = c.prefillers[0]
        prefiller.vllm.text_of = hf.decode
        prefiller.vllm.can_tokenize = False
        prefiller.vllm.hold_back_text = True  # "" for every token, as without a tokenizer
        assert not (await restart_prefiller(c, prefiller)).makes_text
        assert (await c.post("/v1/completions", body)).json()["choices"][0]["text"] == "ab中"
        assert not c.proxy.registry.routable(Role.SENDER)[0].makes_text
        prefiller.vllm.hold_back_text = False
        assert (await c.post("/v1/completions", body)).json()["choices"][0]["text"] == "ab中"
        assert c.proxy.registry.routable(Role.SENDER)[0].makes_text
        after_b = {**body, "prompt": hf.encode(PROMPT) + cycle[1:2]}  # the first token starts "中": no text of its own
        prefiller.vllm.hold_back_text = True
        events = await c.stream("/v1/completions", {**after_b, "stream": True})
        texts = [e["choices"][0]["text"] for e in events[:-1]]
        assert texts[0] == "" and "".join(texts) == "中ab"  # the prefiller's "" taken as the first token's text

        assert not (await restart_prefiller(c, prefiller)).makes_text  # perhaps without its tokenizer now
        assert (await c.post("/v1/completions", body)).json()["choices"][0]["text"] == "ab中"
        prefiller.vllm.can_tokenize = True  # restarted with its tokenizer: known from its /tokenize, no text needed
        inst = await restart_prefiller(c, prefiller)
        await eventually(lambda: inst.makes_text)
        events = await c.stream("/v1/completions", {**after_b, "stream": True})
        assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "中ab"
        assert_idle(c)


@pytest.mark.timeout(TOKENIZER_TIMEOUT_S)
async def test_stop_strings_are_applied_to_the_proxys_text_not_the_decoders(tokenizer_dir):
    path, hf = tokenizer_dir
    cycle = hf.encode("中文☃", add_special_tokens=False)
    async with make_cluster(tokenizer=str(path)) as c:
        use_model(c, cycling_model(cycle), hf)
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 30, "stop": ["☃"], "return_token_ids": True}
        choice = (await c.post("/v1/completions", body)).json()["choices"][0]
        assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == ("中文", "stop", "☃")
        assert choice["token_ids"] == cycle  # up to the token that completed the stop string
        decode, = c.decoders[0].vllm.calls("/v1/completions")
        assert "stop" not in decode  # the decoder's own text starts mid-context
        events = await c.stream("/v1/completions", {**body, "stream": True})
        assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "中文"
        assert events[-2]["choices"][0]["finish_reason"] == "stop"
        assert_idle(c)


@pytest.mark.timeout(TOKENIZER_TIMEOUT_S)
async def test_the_router_gets_the_exact_prompt_token_count(tokenizer_dir):
    path, hf = tokenizer_dir
    async with make_cluster(tokenizer=str(path)) as c:
        seen = []
        router = c.proxy.orchestrator.router
        pick = router.decoder_with_room

        def recording(decoders, cost, *args, **kwargs):
            seen.append(cost.prompt_tokens)
            return pick(decoders, cost, *args, **kwargs)

        router.decoder_with_room = recording  # admission asks it for a decoder with room
        await c.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 3})
        await c.post("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 3})
        rendered = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
        assert seen == [len(hf.encode(PROMPT)), len(hf.encode(rendered, add_special_tokens=False))]


@pytest.mark.timeout(TOKENIZER_TIMEOUT_S)
@pytest.mark.parametrize("inline_max_tokens", [2048, 0], ids=["on-the-event-loop", "in-a-thread"])
async def test_a_text_completion_reaches_the_prefiller_as_the_tokenizers_ids(tokenizer_dir, monkeypatch,
                                                                             inline_max_tokens):
    """The proxy tokenizes the prompt anyway (count, prefix): the prefiller gets the ids, not the text again."""
    path, hf = tokenizer_dir
    monkeypatch.setattr(prompt_module, "INLINE_TOKENIZE_MAX_TOKENS", inline_max_tokens)
    async with make_cluster(tokenizer=str(path)) as c:
        resp = await c.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 3,
                                                "add_special_tokens": True, "return_token_ids": True})
        ids = hf.encode(PROMPT)
        prefill, = c.prefillers[0].vllm.calls("/v1/completions")
        assert prefill["prompt"] == ids and "add_special_tokens" not in prefill
        assert prefill["return_token_ids"] is False  # the proxy has them: not serialized back (16k: ~2 ms of TTFT)
        choice = resp.json()["choices"][0]
        assert choice["token_ids"] == generate(ids, 3) and choice["prompt_token_ids"] == ids
        assert PROMPT not in [call.get("prompt") for call in c.prefillers[0].vllm.calls("/tokenize")]  # nor this way
        await c.post("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 3})
        chat_prefill, = c.prefillers[0].vllm.calls("/v1/chat/completions")
        assert chat_prefill["messages"] == MESSAGES and "prompt" not in chat_prefill  # vLLM renders chat itself


async def test_token_id_prompts_without_a_tokenizer_send_prompt_plus_first():
    """--skip-tokenizer-init instances: no text anywhere, token ids still complete, the whole prompt's KV used."""
    async with make_cluster(tokenizer="none") as c:
        c.prefillers[0].vllm.hold_back_text = True
        ids = [5, 6, 7, 8, 9]
        resp = await c.post("/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 5,
                                                "return_token_ids": True})
        assert resp.json()["choices"][0]["token_ids"] == generate(ids, 5)
        decode, = c.decoders[0].vllm.calls("/v1/completions")
        assert decode["prompt"] == ids + generate(ids, 1) and decode["max_tokens"] == 4
        assert resp.json()["usage"]["completion_tokens"] == 5


# ---- a prompt that fills the context ------------------------------------------------------------------


@pytest.mark.parametrize("card", [{"max_model_len": 40}, {}], ids=["context-known", "context-unknown"])
@pytest.mark.parametrize("stream", [False, True])
async def test_a_prompt_one_token_short_of_the_context_never_sends_a_decode_of_max_tokens_0(card, stream):
    def context_40(vllm):  # before the proxy reads the card (once, as soon as an instance is up)
        vllm.max_model_len, vllm.models_card = 40, card

    async with make_cluster(setup_vllm=context_40) as c:
        ids = list(range(10, 49))  # 39 tokens: the first output token fills the 40-token context
        body = {"model": MODEL, "prompt": ids, "max_tokens": 10, "return_token_ids": True, "stream": stream}
        if stream:
            events = await c.stream("/v1/completions", body)
            assert all("error" not in e for e in events[:-1])
            chunks = [e["choices"][0] for e in events[:-1] if e["choices"]]
            assert [t for ch in chunks for t in ch["token_ids"]] == generate(ids, 1)
            assert chunks[-1]["finish_reason"] == "length"
        else:
            resp = await c.post("/v1/completions", body)
            assert resp.status_code == 200, resp.text
            choice = resp.json()["choices"][0]
            assert choice["token_ids"] == generate(ids, 1) and choice["finish_reason"] == "length"
        if card:
            assert not c.decoders[0].vllm.requests  # known context: no decode at all
        assert_idle(c)


# ---- a decoder that dies mid-stream ------------------------------------------------------------------


async def completion(c, body, stream: bool) -> tuple[str, list[int]]:
    """The text and token ids of a completion that succeeded, streamed or not."""
    if stream:
        events = await c.stream("/v1/completions", body)
        assert all("error" not in e for e in events[:-1])
        chunks = [e["choices"][0] for e in events[:-1] if e["choices"]]
        text = "".join(ch["text"] for ch in chunks)
        token_ids = [t for ch in chunks for t in ch["token_ids"]]
    else:
        resp = await c.post("/v1/completions", body)
        assert resp.status_code == 200, resp.text
        text, token_ids = resp.json()["choices"][0]["text"], resp.json()["choices"][0]["token_ids"]
    return text, token_ids


@pytest.mark.parametrize("stream", [False, True])
async def test_a_decoder_dying_mid_stream_continues_elsewhere_with_nothing_twice(stream):
    async with make_cluster(n_decode=2) as c:
        for node in c.decoders:
            node.vllm.die_after = 3  # each decoder breaks after 3 tokens: the prefiller finishes colocated
        ids = tokenize(PROMPT)
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "return_token_ids": True, "stream": stream}
        text, token_ids = await completion(c, body, stream)
        assert token_ids == generate(ids, 12) and text == expected_text(ids, 12)
        first_decoder, second_decoder = sorted(c.decoders, key=lambda n: n.vllm.requests[0][1]["max_tokens"],
                                               reverse=True)
        assert first_decoder.vllm.calls("/v1/completions")[0]["prompt"] == ids + generate(ids, 1)
        assert second_decoder.vllm.calls("/v1/completions")[0]["prompt"] == ids + generate(ids, 4)
        assert second_decoder.vllm.calls("/v1/completions")[0]["max_tokens"] == 8
        colocated = c.prefillers[0].vllm.calls("/v1/completions")[-1]
        assert colocated["prompt"] == ids + generate(ids, 7) and colocated["max_tokens"] == 5
        assert "kv_transfer_params" not in colocated
        assert c.metric("lmcache_p2p_proxy_failovers_total", phase="migrate") == 2
        assert_idle(c)


async def test_stats_name_where_each_part_of_a_moved_output_was_decoded():
    """A moved stream's record: the instance of each decode request and the output token it starts at."""
    async with make_cluster(n_decode=2) as c:
        for node in c.decoders:
            node.vllm.die_after = 3
        events = await c.stream("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 12,
                                                    "return_token_ids": True, "stream": True})
        assert all("error" not in e for e in events[:-1])
        first_decoder, second_decoder = sorted(c.decoders, key=lambda n: n.vllm.requests[0][1]["max_tokens"],
                                               reverse=True)
        await eventually(lambda: c.proxy.metrics.stats()["recent_decodes"])
        record, = (await c.client.get("/stats")).json()["recent_decodes"]
        assert "cmpl-" + record["id"] == events[0]["id"]
        assert record["parts"] == [{"instance": first_decoder.agent.instance_id, "from_token": 1},
                                   {"instance": second_decoder.agent.instance_id, "from_token": 4},
                                   {"instance": c.prefillers[0].agent.instance_id, "from_token": 7}]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_stream_broken_after_a_held_back_character_continues_with_its_text(stream):
    """Without a proxy tokenizer the text comes from the instances: a token whose text the decoder held
    back (an incomplete character) when its stream broke is not lost on the next instance (greedy)."""
    async with make_cluster(n_decode=2, tokenizer="none") as c:
        ids = tokenize(PROMPT)
        out = generate(ids, 10)
        for node in c.decoders:
            node.vllm.die_after = 3  # the last token a decoder's first stream sends is out[3]
        for node in c.prefillers + c.decoders:
            node.vllm.held_tokens = {out[3]}
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 10, "return_token_ids": True, "stream": stream,
                "temperature": 0}
        text, token_ids = await completion(c, body, stream)
        assert text == expected_text(ids, 10) and token_ids == out
        assert c.metric("lmcache_p2p_proxy_failovers_total", phase="migrate") == 2
        assert_idle(c)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_continuation_that_regenerates_other_tokens_ends_with_an_error_and_nothing_twice(stream):
    """Without a proxy tokenizer a greedy continuation generates the last delta's tokens again; an instance
    that generates others (numerics that differ) must not have them sent: the client holds those positions."""
    async with make_cluster(n_decode=1, tokenizer="none") as c:
        ids = tokenize(PROMPT)
        out = generate(ids, 10)
        c.decoders[0].vllm.die_after = 3  # it sends out[1:4], out[3] without text: regenerated with out[2] at least
        for node in c.prefillers + c.decoders:
            node.vllm.held_tokens = {out[3]}
        prefiller = c.prefillers[0].vllm  # the first token as one instance, then other tokens than the decoder's
        prefiller.model = lambda t: fakes.next_token(t) if len(t) <= len(ids) else fakes.next_token(t) % 89 + 11
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 10, "return_token_ids": True, "stream": stream,
                "temperature": 0}
        if stream:
            events = await c.stream("/v1/completions", body)
            assert events[-2]["error"]["type"] == "ContinuationMismatchError" and events[-1] == "[DONE]"
            chunks = [e["choices"][0] for e in events[:-2] if e.get("choices")]
            assert [t for ch in chunks for t in ch["token_ids"]] == out[:4]
            assert "".join(ch["text"] for ch in chunks) == expected_text(ids, 3)  # out[3]'s text was held back
        else:
            resp = await c.post("/v1/completions", body)
            assert resp.status_code == 502 and resp.json()["error"]["type"] == "ContinuationMismatchError"
        continuation = prefiller.calls("/v1/completions")[-1]
        done = continuation["prompt"][len(ids):]  # out[0] at least; what the client has after it is regenerated
        assert continuation["prompt"] == ids + out[:len(done)] and 1 <= len(done) <= 2
        assert continuation["max_tokens"] == 10 - len(done)
        assert_idle(c)


@pytest.mark.parametrize("form", ["ids", "text", "chat"])
@pytest.mark.parametrize("stream", [False, True])
async def test_truncate_prompt_tokens_cuts_the_prompt_once_as_one_instance_does(form, stream):
    """vLLM keeps the prompt's last N tokens. A decoder given the field with prompt + output would cut the
    output's context as well: every decode and continuation gets the truncated prompt's ids, never the field."""
    async with make_cluster(n_decode=2) as c:
        for node in c.decoders:
            node.vllm.die_after = 3  # two migrations: the prefiller finishes the output colocated
        if form == "chat":
            path, body, kept = "/v1/chat/completions", {"messages": MESSAGES}, tokenize(chat_prompt(MESSAGES))[-20:]
        elif form == "text":  # vLLM truncates a text as its tokenizer does: the BOS it adds is kept
            path, body, kept = "/v1/completions", {"prompt": PROMPT}, tokenize(PROMPT)[:1] + tokenize(PROMPT)[-19:]
        else:
            path, body, kept = "/v1/completions", {"prompt": tokenize(PROMPT)}, tokenize(PROMPT)[-20:]
        body.update(model=MODEL, max_tokens=10, truncate_prompt_tokens=20, return_token_ids=True, stream=stream,
                    stream_options={"include_usage": True} if stream else None)
        if stream:
            events = await c.stream(path, body)
            assert all("error" not in e for e in events[:-1])
            chunks = [e["choices"][0] for e in events[:-1] if e.get("choices")]
            token_ids = [t for ch in chunks for t in ch.get("token_ids") or ()]
            prompt_ids = next(ch.get("prompt_token_ids") for e in events[:-1] if e.get("choices")
                              for ch in [e["choices"][0], e] if ch.get("prompt_token_ids"))
            usage = events[-2]["usage"]
        else:
            resp = await c.post(path, body)
            assert resp.status_code == 200, resp.text
            answer = resp.json()
            token_ids, usage = answer["choices"][0]["token_ids"], answer["usage"]
            prompt_ids = answer["prompt_token_ids"] if form == "chat" else answer["choices"][0]["prompt_token_ids"]
        assert token_ids == generate(kept, 10)
        assert prompt_ids == kept and usage["prompt_tokens"] == 20
        prefill, *continued = c.prefillers[0].vllm.requests
        assert prefill[1]["truncate_prompt_tokens"] == 20  # a text or chat prompt is truncated where it is tokenized
        decodes = [b for n in c.decoders for b in n.vllm.calls("/v1/completions")] + [b for _, b in continued]
        assert len(decodes) == 3 and all("truncate_prompt_tokens" not in b for b in decodes)
        assert sorted(len(b["prompt"]) for b in decodes) == [21, 24, 27]
        assert all(b["prompt"] == kept + token_ids[:len(b["prompt"]) - 20] for b in decodes)
        assert_idle(c)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_seeded_sampled_request_gets_its_seed_on_every_decode_and_equals_one_instance(stream):
    """vLLM's default GPU model runner draws a seeded token from the seed and the token's position: a decoder
    (or a continuation) prompted with prompt + output and the same seed draws what one instance would."""
    async with make_cluster(n_decode=2) as c:
        for node in c.decoders:
            node.vllm.die_after = 3  # two migrations: the prefiller finishes the output colocated
        ids = tokenize(PROMPT)
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 10, "temperature": 0.8, "seed": 7,
                "return_token_ids": True, "stream": stream}
        _, token_ids = await completion(c, body, stream)
        assert fakes.generate_seeded(ids, 10, 7) != generate(ids, 10)  # the seed matters here
        assert token_ids == fakes.generate_seeded(ids, 10, 7)
        bodies = [b for n in c.prefillers + c.decoders for b in n.vllm.calls("/v1/completions")]
        assert len(bodies) == 4 and all(b["seed"] == 7 and b["temperature"] == 0.8 for b in bodies)
        assert_idle(c)


async def test_migration_is_bounded_by_the_migration_limit():
    async with make_cluster(n_decode=2, migration_limit=0) as c:
        for node in c.decoders:
            node.vllm.die_after = 2
        events = await c.stream("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 8,
                                                    "stream": True})
        assert "error" in events[-2] and events[-1] == "[DONE]"
        assert sum(len(n.vllm.calls("/v1/completions")) for n in c.decoders) == 1
        assert_idle(c)


async def test_a_decoder_answering_5xx_moves_the_decode_and_a_4xx_does_not():
    async with make_cluster(n_decode=2) as c:
        for node in c.decoders:
            node.vllm.errors.append((500, {"error": {"message": "engine dead"}}))
        ids = tokenize(PROMPT)
        resp = await c.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 6})
        assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == expected_text(ids, 6)
        colocated = c.prefillers[0].vllm.calls("/v1/completions")[-1]
        assert colocated["prompt"] == ids + generate(ids, 1) and colocated["max_tokens"] == 5
        error = {"error": {"message": "bad logit_bias", "type": "BadRequestError", "param": None, "code": 400}}
        for node in c.decoders:
            node.vllm.errors.append((400, error))
        resp = await c.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 6})
        assert resp.status_code == 400 and resp.json() == error
        assert sum(len(n.vllm.errors) for n in c.decoders) == 1  # one decoder was asked, once
        assert_idle(c)


# ---- sampling that counts the output's tokens --------------------------------------------------------


@pytest.mark.parametrize("sampling", [{"frequency_penalty": 0.5}, {"presence_penalty": 0.5},
                                      {"bad_words": ["fox jumps"]}])
@pytest.mark.parametrize("stream", [False, True])
async def test_output_aware_sampling_is_served_by_one_instance_and_equals_its_output(sampling, stream):
    """vLLM applies presence / frequency penalties and bad_words to the request's OUTPUT tokens only:
    a decoder prompted with prompt + first token does not count that token, so its output differs
    from one instance's even at temperature 0. Such a request is served whole by one instance."""
    async with make_cluster() as c:
        ids = tokenize(PROMPT)
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, **sampling,
                "return_token_ids": True, "stream": stream}
        if stream:
            events = await c.stream("/v1/completions", body)
            chunks = [e["choices"][0] for e in events[:-1] if e["choices"]]
            token_ids = [t for ch in chunks for t in ch["token_ids"]]
        else:
            resp = await c.post("/v1/completions", body)
            assert resp.status_code == 200, resp.text
            token_ids = resp.json()["choices"][0]["token_ids"]
        assert generate(ids, 12, penalized=True) != generate(ids, 1) + generate(ids + generate(ids, 1), 11,
                                                                                 penalized=True)  # it matters here
        assert token_ids == generate(ids, 12, penalized=True)
        assert not any("kv_transfer_params" in b for n in [*c.prefillers, *c.decoders]
                       for b in n.vllm.calls("/v1/completions"))
        assert c.metric("lmcache_p2p_proxy_colocated_total", reason="output_aware_sampling", role="receiver") == 1
        assert_idle(c)


async def test_a_penalized_stream_that_breaks_after_output_ends_with_an_error_not_another_output():
    """Continuing it elsewhere (prompt + the output so far) would lose the penalty on that output."""
    async with make_cluster(n_decode=2) as c:
        for node in c.decoders:
            node.vllm.die_after = 3
        events = await c.stream("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 12,
                                                    "frequency_penalty": 0.5, "return_token_ids": True,
                                                    "stream": True})
        assert "error" in events[-2] and events[-1] == "[DONE]"
        chunks = [e["choices"][0] for e in events[:-2] if e.get("choices")]
        assert [t for ch in chunks for t in ch["token_ids"]] == generate(tokenize(PROMPT), 3, penalized=True)
        calls = [b for n in [*c.prefillers, *c.decoders] for b in n.vllm.calls("/v1/completions")]
        assert len(calls) == 1, "the stream was continued on another instance"
        assert_idle(c)


# ---- the proxy's tokenizer must be the instances' -----------------------------------------------------


@pytest.mark.timeout(TOKENIZER_TIMEOUT_S)
async def test_a_tokenizer_other_than_the_instances_is_not_used(tokenizer_dir):
    """vLLM started with its own --tokenizer: the proxy's prompt ids and text would be wrong, so it goes without."""
    path, hf = tokenizer_dir
    async with make_cluster(tokenizer=str(path)) as c:
        agreeing = await c.proxy.orchestrator.tokenizers.get(
            c.proxy.registry.routable(Role.SENDER), wait_s=None)
        assert agreeing is not None  # the fakes tokenize as the folder's tokenizer does
    async with make_cluster(tokenizer="none") as ref:  # the fakes' own tokenizer, no proxy tokenizer
        expected = (await ref.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 4})).json()
    async with make_cluster() as c:  # the fakes keep fakes.tokenize: another tokenizer than the folder's
        # a probe of the fakes' /tokenize that timed out would leave the tokenizer used unchecked
        c.proxy.orchestrator.tokenizers = type(c.proxy.orchestrator.tokenizers)(
            str(path), c.proxy.orchestrator.upstream, timeout_s=30.0, load_timeout_s=60.0)
        assert await c.proxy.orchestrator.tokenizers.get(c.proxy.registry.routable(Role.SENDER), wait_s=None) is None
        answer = (await c.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 4})).json()
        prefill, = c.prefillers[0].vllm.calls("/v1/completions")
        assert prefill["prompt"] == PROMPT  # the text, which the instance tokenizes itself
        assert answer["choices"][0]["text"] == expected["choices"][0]["text"] == expected_text(tokenize(PROMPT), 4)
