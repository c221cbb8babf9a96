"""A chat whose answer vLLM's parsers make (tools with tool_choice auto; every chat under --chat-parsers) is decoded
on the decoder's chat endpoint, prompted with the prefill's ids: the client gets the parsers' tool_calls and
reasoning as one instance would answer them, and the decoder still takes the prefill's KV."""

from __future__ import annotations

import asyncio

import pytest

from lmcache_p2p.vllm_plugin.router_addressing import MARKER_KEY

from ..conftest import eventually, make_cluster
from ..fakes import MESSAGES, MODEL, chat_prompt, generate, token_text, tokenize

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {}}}]


def chat_decode(c) -> dict:
    """The one decode the decoder got, on its chat endpoint (none on /v1/completions)."""
    assert not c.decoders[0].vllm.calls("/v1/completions")
    decode, = c.decoders[0].vllm.calls("/v1/chat/completions")
    return decode


async def test_a_chat_with_tools_gets_the_decoders_tool_calls_and_its_kv_from_the_prefill():
    async with make_cluster() as c:
        ids = tokenize(chat_prompt(MESSAGES))
        body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 5, "return_token_ids": True}
        answer = (await c.post("/v1/chat/completions", body)).json()
        choice = answer["choices"][0]
        arguments = "".join(token_text(t) for t in generate(ids, 5))
        assert choice["message"]["tool_calls"] == [{"id": "call_f", "type": "function",
                                                    "function": {"name": "f", "arguments": arguments}}]
        assert choice["message"]["content"] is None and choice["finish_reason"] == "tool_calls"
        assert choice["token_ids"] == generate(ids, 5) and answer["usage"]["completion_tokens"] == 5
        decode = chat_decode(c)
        # the prefill's ids, as its chat endpoint rendered them; the whole output; the client's own fields
        assert decode["kv_transfer_params"] == {"prompt_token_ids": ids}
        assert decode["max_tokens"] == 5 and decode["tools"] == TOOLS and decode["stream"] is True
        prefill, = c.prefillers[0].vllm.calls("/v1/chat/completions")
        assert prefill["max_tokens"] == 1 and prefill["tools"] == TOOLS
        assert c.metric("lmcache_p2p_proxy_kv_outcomes_total", outcome="ready") == 1


async def test_a_streamed_chat_with_tools_passes_the_decoders_deltas_on():
    async with make_cluster() as c:
        ids = tokenize(chat_prompt(MESSAGES))
        events = await c.stream("/v1/chat/completions", {
            "model": MODEL, "messages": MESSAGES, "tools": TOOLS, "tool_choice": "auto", "max_tokens": 4,
            "stream": True, "stream_options": {"include_usage": True}})
        assert events[-1] == "[DONE]" and events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        deltas = [e["choices"][0]["delta"] for e in events[1:-2]]
        assert [d["tool_calls"][0]["function"]["arguments"] for d in deltas] == [token_text(t) for t in
                                                                                 generate(ids, 4)]
        assert deltas[0]["tool_calls"][0]["id"] == "call_f" and "role" not in deltas[0]  # one role chunk
        assert events[-3]["choices"][0]["finish_reason"] == "tool_calls"
        assert events[-2]["usage"]["completion_tokens"] == 4
        assert chat_decode(c)["kv_transfer_params"] == {"prompt_token_ids": ids}


async def test_under_chat_parsers_every_chat_gets_the_decoders_reasoning_split():
    async with make_cluster(chat_parsers=True) as c:
        for node in c.prefillers + c.decoders:
            node.vllm.reasoning_tokens = 2
        ids = tokenize(chat_prompt(MESSAGES))
        out = generate(ids, 5)
        message = (await c.post("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES,
                                                         "max_tokens": 5})).json()["choices"][0]["message"]
        assert message == {"role": "assistant", "reasoning": "".join(map(token_text, out[:2])),
                           "content": "".join(map(token_text, out[2:]))}
        events = await c.stream("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 5,
                                                         "stream": True})
        deltas = [e["choices"][0]["delta"] for e in events[1:-1]]
        assert deltas == [{"reasoning": token_text(t)} for t in out[:2]] + [{"content": token_text(t)}
                                                                             for t in out[2:]]
        # a completion is split as before
        await c.post("/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 3})
        assert len(c.decoders[0].vllm.calls("/v1/completions")) == 1


@pytest.mark.parametrize("return_token_ids", [False, True])
async def test_tokens_a_parser_holds_back_send_the_client_nothing_unless_it_asked_for_ids(return_token_ids):
    # vLLM streams a chunk with an empty delta for them only to carry their ids; the usage is the decoder's
    async with make_cluster(chat_parsers=True) as c:
        c.decoders[0].vllm.held_deltas = 2
        ids = tokenize(chat_prompt(MESSAGES))
        events = await c.stream("/v1/chat/completions", {
            "model": MODEL, "messages": MESSAGES, "max_tokens": 5, "stream": True, "return_token_ids": return_token_ids,
            "stream_options": {"include_usage": True}})
        chunks = [e for e in events[1:-2]]
        assert [ch["choices"][0]["delta"] for ch in chunks] == [{}] * 2 * return_token_ids + [
            {"content": token_text(t)} for t in generate(ids, 5)[2:]]
        if return_token_ids:
            assert [t for ch in chunks for t in ch["choices"][0]["token_ids"]] == generate(ids, 5)
        assert events[-2]["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 5,
                                       "total_tokens": len(ids) + 5}


async def test_tools_with_tool_choice_none_are_decoded_as_token_ids():
    async with make_cluster() as c:
        ids = tokenize(chat_prompt(MESSAGES))
        body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "tool_choice": "none", "max_tokens": 4}
        message = (await c.post("/v1/chat/completions", body)).json()["choices"][0]["message"]
        assert message == {"role": "assistant", "content": "".join(map(token_text, generate(ids, 4)))}
        decode, = c.decoders[0].vllm.calls("/v1/completions")
        assert decode["prompt"] == ids + generate(ids, 1)
        assert not c.decoders[0].vllm.calls("/v1/chat/completions")


async def test_a_decoder_that_breaks_before_output_is_left_but_after_output_the_answer_ends_with_an_error():
    async with make_cluster(n_decode=2) as c:
        ids = tokenize(chat_prompt(MESSAGES))
        body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 4, "stream": True}
        for d in c.decoders:
            d.vllm.break_next = 1  # the connection drops with the request in hand, before any output
        events = await c.stream("/v1/chat/completions", body)
        arguments = [e["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"] for e in events[1:-1]]
        assert arguments == [token_text(t) for t in generate(ids, 4)]
        assert all(d.vllm.break_next == 0 for d in c.decoders)  # both broke: the prefiller decoded it whole
        prefill, decode = c.prefillers[0].vllm.calls("/v1/chat/completions")
        assert decode["kv_transfer_params"] == {"prompt_token_ids": ids} and decode["max_tokens"] == 4

        for d in c.decoders:
            d.vllm.break_next, d.vllm.die_after = 0, 2  # two output tokens, then it dies
        events = await c.stream("/v1/chat/completions", body)
        assert len(events) == 1 + 2 + 1 + 1  # role, two deltas, the error, [DONE]: nothing continued elsewhere
        assert "error" in events[-2] and events[-1] == "[DONE]"
        assert sum(len(d.vllm.calls("/v1/chat/completions")) for d in c.decoders) == 3
        assert len(c.prefillers[0].vllm.calls("/v1/chat/completions")) == 3  # its prefills, and one decode


@pytest.mark.parametrize("stream", [False, True])
async def test_served_colocated_the_instance_renders_the_messages_itself(stream):
    async with make_cluster(n_prefill=0) as c:
        ids = tokenize(chat_prompt(MESSAGES))
        body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 3, "stream": stream}
        if stream:
            await c.stream("/v1/chat/completions", body)
        else:
            message = (await c.post("/v1/chat/completions", body)).json()["choices"][0]["message"]
            assert message["tool_calls"][0]["function"]["arguments"] == "".join(map(token_text, generate(ids, 3)))
        assert "kv_transfer_params" not in chat_decode(c)


async def test_with_early_decode_the_chat_decode_carries_the_marker_and_waits_for_its_kv():
    async with make_cluster(early_decode=True) as c:
        decoder = c.decoders[0]
        decoder.agent.kv_mode = "silent"  # reported below, once the decode is parked on the decoder
        ids = tokenize(chat_prompt(MESSAGES))
        body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 4, "stream": True}
        request = asyncio.ensure_future(c.stream("/v1/chat/completions", body))
        await eventually(lambda: decoder.vllm.calls("/v1/chat/completions"))
        await asyncio.sleep(0.1)
        assert not request.done()  # held by the decoder while its KV is missing
        decode = chat_decode(c)
        req_id = c.network.specs[-1]["req_id"]
        assert decode["kv_transfer_params"]["prompt_token_ids"] == ids
        assert decode["kv_transfer_params"][MARKER_KEY]["req_id"] == req_id
        await decoder.agent.report_ready(req_id)
        events = await request
        arguments = [e["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"] for e in events[1:-1]]
        assert arguments == [token_text(t) for t in generate(ids, 4)]
        assert c.metric("lmcache_p2p_proxy_early_decodes_total", first="kv_ready") == 1


@pytest.mark.parametrize("stream", [False, True])
async def test_one_token_of_a_rendered_chat_is_answered_whole_by_one_chat_endpoint(stream):
    async with make_cluster() as c:
        ids = tokenize(chat_prompt(MESSAGES))
        body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 1, "stream": stream}
        if stream:
            events = await c.stream("/v1/chat/completions", body)
            call = events[1]["choices"][0]["delta"]["tool_calls"][0]
        else:
            resp = await c.post("/v1/chat/completions", body)
            assert resp.status_code == 200, resp.text
            call, = resp.json()["choices"][0]["message"]["tool_calls"]
        assert call["function"]["arguments"] == token_text(generate(ids, 1)[0])
        decode = chat_decode(c)
        assert decode["max_tokens"] == 1 and "kv_transfer_params" not in decode  # it renders the messages itself
        assert not c.prefillers[0].vllm.requests and c.metric(
            "lmcache_p2p_proxy_colocated_total", reason="one_token_rendered", role="receiver") == 1


async def test_with_reasoning_hidden_the_decoders_usage_counts_and_a_break_after_output_is_not_continued():
    # include_reasoning false: vLLM with a parser sends no token ids at all, so the proxy knows the output only by
    # what it passed on
    async with make_cluster(chat_parsers=True, n_decode=2) as c:
        for node in c.prefillers + c.decoders:
            node.vllm.reasoning_tokens = 2
        ids = tokenize(chat_prompt(MESSAGES))
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "stream": True, "include_reasoning": False,
                "stream_options": {"include_usage": True}}
        events = await c.stream("/v1/chat/completions", body)
        prefill, = c.prefillers[0].vllm.calls("/v1/chat/completions")
        assert "include_reasoning" not in prefill  # the proxy reads its ids
        assert events[-2]["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 4,
                                       "total_tokens": len(ids) + 4,
                                       "completion_tokens_details": {"reasoning_tokens": 2}}  # the decoder's
        for d in c.decoders:
            d.vllm.die_after = 2
        events = await c.stream("/v1/chat/completions", body)
        deltas = [e["choices"][0]["delta"] for e in events[1:-1] if "choices" in e]
        out = generate(ids, 4)
        assert deltas == [{"reasoning": token_text(t)} for t in out[:2]]  # once: nothing continued elsewhere
        assert "error" in events[-2]
