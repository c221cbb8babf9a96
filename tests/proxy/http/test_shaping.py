"""Request and response shapes, without any server."""

from __future__ import annotations

import dataclasses

import pytest

from lmcache_p2p.proxy.errors import BadRequest, UpstreamMalformed
from lmcache_p2p.proxy.http.responses import Delta, first_token, renderer_for
from lmcache_p2p.proxy.http.shaping import (Endpoint, calls_tools, chat_decode_body, decode_body, ids_prefill_body,
                                            parse_client_request, prefill_body, tokenize_body, tokenizes_as_chat,
                                            truncate_prompt)

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5,
        "temperature": 0.5, "logprobs": True, "top_logprobs": 2, "tools": [], "min_tokens": 3,
        "stream": True, "stream_options": {"include_usage": True}}


def test_chat_request_maps_onto_completion_decode():
    req = parse_client_request(Endpoint.CHAT, CHAT, chars_per_token=4)
    assert req.max_tokens == 5 and req.stream and req.include_usage and req.top_logprobs == 2
    body = decode_body(req, [1, 2, 3], [9], proxy_text=False)
    assert body["prompt"] == [1, 2, 3, 9] and body["max_tokens"] == 4 and body["min_tokens"] == 2
    assert body["temperature"] == 0.5 and body["logprobs"] == 2 and body["stream"] is True
    assert "messages" not in body and "tools" not in body and "max_completion_tokens" not in body
    # fields both vLLM 0.32 endpoints take go on (a thinking budget counts the thinking in the decode's prompt)
    kept = {"thinking_token_budget": 64, "watermarking": True, "session_id": "s"}
    with_them = parse_client_request(Endpoint.CHAT, {**CHAT, **kept}, chars_per_token=4)
    assert kept.items() <= decode_body(with_them, [1], [2], proxy_text=False).items()
    prefill = prefill_body(req, {"k": 1})
    assert prefill["max_tokens"] == prefill["max_completion_tokens"] == 1 and prefill["min_tokens"] == 1
    assert prefill["stream"] is False and "stream_options" not in prefill and prefill["kv_transfer_params"] == {"k": 1}
    assert CHAT["stream"] is True  # the client's body is not modified


def test_completion_defaults_and_token_prompts():
    req = parse_client_request(Endpoint.COMPLETIONS, {"prompt": [[5, 6, 7]]}, chars_per_token=4)
    assert req.max_tokens == 16 and req.prompt_ids == (5, 6, 7) and req.prompt_tokens_estimate == 3
    assert prefill_body(req, None)["prompt"] == [5, 6, 7]
    chat = parse_client_request(Endpoint.CHAT, {"messages": [{"role": "user", "content": "x"}]}, 4)
    assert chat.max_tokens is None and decode_body(chat, [1], [2], proxy_text=True)["max_tokens"] is None


def test_prefiller_returns_token_ids_only_where_the_proxy_lacks_them():
    kv = {"ret_first_tok": True, "disagg_spec": {}}
    given = parse_client_request(Endpoint.COMPLETIONS, {"prompt": [5, 6, 7], "return_token_ids": True}, 4)
    assert prefill_body(given, kv)["return_token_ids"] is False  # the proxy has the prompt's ids, kv the first's
    assert prefill_body(given, None)["return_token_ids"] is True  # no kv_transfer_params: the first token is in them
    nixl = {"do_remote_decode": True, "do_remote_prefill": False}
    assert prefill_body(given, nixl)["return_token_ids"] is True  # NixlConnector returns no first token of its own
    text = parse_client_request(Endpoint.COMPLETIONS, {"prompt": "some text"}, 4)
    assert prefill_body(text, kv)["return_token_ids"] is True  # not tokenized here: the prompt's ids come back
    tokenized = dataclasses.replace(text, tokenized_ids=(8, 9))
    body = prefill_body(tokenized, kv)
    assert body["prompt"] == [8, 9] and body["return_token_ids"] is False
    chat = parse_client_request(Endpoint.CHAT, CHAT, 4)
    assert prefill_body(chat, kv)["return_token_ids"] is True


@pytest.mark.parametrize("endpoint, body, message", [
    (Endpoint.COMPLETIONS, {"prompt": "x", "n": 3}, "n > 1"),
    (Endpoint.COMPLETIONS, {"prompt": "x", "echo": True}, "echo"),
    (Endpoint.COMPLETIONS, {"prompt": ["a", "b"]}, "batched prompts"),
    (Endpoint.COMPLETIONS, {"prompt": ""}, "non-empty"),
    (Endpoint.COMPLETIONS, {"prompt": "x", "max_tokens": 0}, "positive integer"),
    (Endpoint.CHAT, {"messages": []}, "messages"),
    (Endpoint.CHAT, {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}},
     "structured outputs"),
    (Endpoint.CHAT, {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}],
                     "tool_choice": "required"}, "tool_choice 'required' or a named tool"),
    (Endpoint.CHAT, {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}],
                     "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    (Endpoint.CHAT, ["not", "an", "object"], "JSON object"),
    (Endpoint.CHAT, {"messages": [{"role": "system", "content": "x"}, {"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "data:,"}}]}]},
     r"messages\[1\]\.content\[1\] is of type 'image_url': only text content parts"),
    (Endpoint.CHAT, {"messages": [{"role": "user", "content": [{"image_url": {"url": "data:,"}}]}]},
     r"messages\[0\]\.content\[0\] has 'image_url'"),  # vLLM reads media by its key, typed or not
    (Endpoint.CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "input_audio": {}}]}]},
     r"messages\[0\]\.content\[0\] has 'input_audio'"),
    (Endpoint.CHAT, {"messages": [{"role": "user", "content": [{"type": 3}]}]}, r"is of type 3"),
    (Endpoint.COMPLETIONS, {"prompt": "x", "truncate_prompt_tokens": -2}, "truncate_prompt_tokens must be"),
    (Endpoint.COMPLETIONS, {"prompt": "x", "truncate_prompt_tokens": "5"}, "truncate_prompt_tokens must be"),
    (Endpoint.COMPLETIONS, {"prompt": "x", "truncation_side": "middle"}, "truncation_side must be"),
])
def test_unsplittable_or_invalid_requests_are_400(endpoint, body, message):
    with pytest.raises(BadRequest, match=message) as info:
        parse_client_request(endpoint, body, 4)
    assert info.value.status_code == 400


def test_chat_text_content_parts_are_split():
    # the part types vLLM 0.32 renders as text (renderers/chat_utils.py): an assistant's refusal or thinking
    # sent back in the history, the Responses API's input_text, an untyped part, a bare string
    parts = [{"type": "text", "text": "a"}, {"type": "input_text", "text": "b"}, {"type": "output_text", "text": "c"},
             {"type": "refusal", "refusal": "d"}, {"type": "thinking", "thinking": "e"}, {"text": "f"}, "g"]
    body = {"messages": [{"role": "user", "content": parts}]}
    assert parse_client_request(Endpoint.CHAT, body, 4).is_chat


def test_tools_with_tool_choice_none_are_split():
    body = {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}], "tool_choice": "none"}
    assert parse_client_request(Endpoint.CHAT, body, 4).is_chat


@pytest.mark.parametrize("choice, calls", [
    ({"tool_choice": "auto"}, True), ({}, True), ({"tool_choice": None}, True), ({"tool_choice": "none"}, False)])
def test_tools_a_parser_may_turn_into_tool_calls_decode_on_the_chat_endpoint(choice, calls):
    body = {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}], **choice}
    assert calls_tools(parse_client_request(Endpoint.CHAT, body, 4)) is calls
    assert not calls_tools(parse_client_request(Endpoint.CHAT, {"messages": body["messages"]}, 4))


def test_a_chat_decode_is_the_clients_request_prompted_with_the_prefills_ids():
    body = {**CHAT, "tools": [{"type": "function"}], "stream": False, "stream_options": {"continuous_usage_stats": 1},
            "kv_transfer_params": {"from": "client"}, "request_id": "mine", "max_completion_tokens": 9}
    req = parse_client_request(Endpoint.CHAT, body, 4)
    decode = chat_decode_body(req, [1, 2, 3], {"remote_engine_id": "e"})
    assert decode["kv_transfer_params"] == {"remote_engine_id": "e", "prompt_token_ids": [1, 2, 3]}
    assert decode["stream"] is True and decode["stream_options"] == {"include_usage": True}
    assert decode["return_token_ids"] is True and "request_id" not in decode
    assert decode["messages"] == CHAT["messages"] and decode["tools"] == body["tools"]
    assert decode["max_completion_tokens"] == 9 and decode["temperature"] == CHAT["temperature"]
    assert "kv_transfer_params" not in chat_decode_body(req, None)  # colocated: the instance renders the messages


def test_a_chat_prompt_prefilled_as_ids_is_a_completion_with_its_sampling_and_its_first_token_in_chat_shape():
    req = parse_client_request(Endpoint.CHAT, {**CHAT, "truncate_prompt_tokens": 4}, chars_per_token=4)
    body = ids_prefill_body(req, [1, 2, 3], {"do_remote_decode": True})
    assert body["prompt"] == [1, 2, 3] and body["max_tokens"] == 1 and body["stream"] is False
    assert body["temperature"] == 0.5 and body["logprobs"] == 2 and body["min_tokens"] == 1
    assert body["return_token_ids"] is True and body["kv_transfer_params"] == {"do_remote_decode": True}
    assert body["truncate_prompt_tokens"] == 4  # idempotent on ids cut already
    assert not {"messages", "tools", "max_completion_tokens", "top_logprobs", "stream_options"} & body.keys()
    answer = {"model": "m", "created": 1, "kv_transfer_params": {"transfer_mode": "push"},
              "choices": [{"text": "A", "token_ids": [5], "prompt_token_ids": [1, 2, 3], "finish_reason": "length",
                           "logprobs": {"tokens": ["A"], "token_logprobs": [-0.1], "top_logprobs": [{"A": -0.1,
                                                                                                     "B": -2.0}],
                                        "text_offset": [0]}}]}
    first = first_token(req, answer)
    assert first.token_id == 5 and first.text == "A" and first.prompt_ids == [1, 2, 3]
    assert first.logprobs == {"content": [{"token": "A", "logprob": -0.1, "bytes": [65], "top_logprobs": [
        {"token": "A", "logprob": -0.1, "bytes": [65]}, {"token": "B", "logprob": -2.0, "bytes": [66]}]}]}


@pytest.mark.parametrize("fields, kwargs", [
    ({}, None),  # nothing the chat endpoint adds: the client's own kwargs, or none
    ({"reasoning_effort": "none"}, {"reasoning_effort": "none", "enable_thinking": False}),
    ({"reasoning_effort": "high", "chat_template_kwargs": {"x": 1}}, {"x": 1, "reasoning_effort": "high",
                                                                      "enable_thinking": True}),
    ({"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}},
     {"enable_thinking": True, "reasoning_effort": "none"}),  # the client's own enable_thinking stands
    ({"documents": [{"title": "t", "text": "d"}]}, {"documents": [{"title": "t", "text": "d"}]}),
])
def test_a_chat_prompt_is_tokenized_with_what_vllms_chat_endpoint_adds_to_the_template(fields, kwargs):
    # vLLM 0.32's /tokenize takes no reasoning_effort or documents; its chat endpoint passes them (and
    # enable_thinking) to the chat template (ChatCompletionRequest.build_chat_params)
    req = parse_client_request(Endpoint.CHAT, {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}, 4)
    body = tokenize_body(req)
    assert body.get("chat_template_kwargs") == kwargs
    assert not {"reasoning_effort", "documents"} & body.keys()


@pytest.mark.parametrize("fields, alike", [
    ({}, True),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none"}, False),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                                                                        "function": {"name": "f", "arguments": "{}"}}]},
                   {"role": "tool", "tool_call_id": "call_1", "content": "42"}]}, False),
])
def test_only_a_chat_without_tools_is_tokenized_as_its_chat_endpoint_renders_it(fields, alike):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    assert tokenizes_as_chat(parse_client_request(Endpoint.CHAT, body, 4)) is alike
    assert not tokenizes_as_chat(parse_client_request(Endpoint.COMPLETIONS, {"prompt": "hi"}, 4))


def test_first_token_needs_a_token_id():
    req = parse_client_request(Endpoint.COMPLETIONS, {"prompt": "x"}, 4)
    with pytest.raises(UpstreamMalformed, match="first_tok"):
        first_token(req, {"choices": [{"text": "a", "finish_reason": "length"}]})
    first = first_token(req, {"choices": [{"text": "a", "token_ids": [7]}], "kv_transfer_params": {"first_tok": 7}})
    assert first.token_id == 7 and first.text == "a"


@pytest.mark.parametrize("key", ["reasoning", "reasoning_content"])
def test_a_chat_first_token_a_reasoning_parser_answered_keeps_its_text(key):
    # a prefiller with --reasoning-parser answers a thinking token there, not in content (vLLM 0.32: reasoning)
    req = parse_client_request(Endpoint.CHAT, CHAT, 4)
    answer = {"choices": [{"message": {"role": "assistant", "content": None, key: "Let"}, "token_ids": [7]}],
              "kv_transfer_params": {"first_tok": 7}}
    assert first_token(req, answer).text == "Let"


def test_chat_renderer_converts_completion_logprobs():
    req = parse_client_request(Endpoint.CHAT, {**CHAT, "stream": False}, 4)
    answer = {"model": "m", "created": 1, "prompt_token_ids": [1, 2],
              "choices": [{"message": {"content": "A"}, "token_ids": [5], "finish_reason": "length",
                           "logprobs": {"content": [{"token": "A", "logprob": -0.1, "bytes": [65],
                                                     "top_logprobs": []}]}}]}
    renderer = renderer_for(req, "chatcmpl-1", first_token(req, answer), [1, 2])
    renderer.add(Delta("B", [6], {"tokens": ["B"], "token_logprobs": [-0.2], "top_logprobs": [
        {"B": -0.2, "C": -1.5, "D": -3.0}], "text_offset": [0]}, "length", None))
    out = renderer.response({"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4})
    assert out["choices"][0]["message"]["content"] == "AB"
    content = out["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == ["A", "B"]
    assert content[1]["logprob"] == -0.2 and [t["token"] for t in content[1]["top_logprobs"]] == ["B", "C"]
    assert content[1]["bytes"] == [66]


def test_decode_continues_after_the_output_so_far_with_what_is_left():
    req = parse_client_request(Endpoint.COMPLETIONS, {"prompt": "x", "max_tokens": 6, "min_tokens": 4,
                                                      "stop": ["ab"], "include_stop_str_in_output": True,
                                                      "temperature": 0}, 4)
    body = decode_body(req, [1, 2], [7, 8, 9], proxy_text=False)
    assert body["prompt"] == [1, 2, 7, 8, 9] and body["max_tokens"] == 3 and body["min_tokens"] == 1
    assert body["stop"] == ["ab"] and body["include_stop_str_in_output"] is True
    # The proxy applies stop strings to its own text: the decoder's text starts mid-context.
    body = decode_body(req, [1, 2], [7], proxy_text=True)
    assert "stop" not in body and "include_stop_str_in_output" not in body and body["temperature"] == 0
    with pytest.raises(ValueError, match="no output left"):
        decode_body(req, [1, 2], [7] * 6, proxy_text=True)


def test_exact_prompt_tokens_win_over_the_estimate():
    req = parse_client_request(Endpoint.COMPLETIONS, {"prompt": "x" * 400}, chars_per_token=4)
    assert req.exact_prompt_tokens is None and req.prompt_tokens == req.prompt_tokens_estimate == 100
    ids = parse_client_request(Endpoint.COMPLETIONS, {"prompt": [4, 5, 6]}, chars_per_token=4)
    assert ids.exact_prompt_tokens == ids.prompt_tokens == 3


@pytest.mark.parametrize("fields, max_model_len, kept", [
    ({}, None, list(range(10))),
    ({"truncate_prompt_tokens": 4}, None, [6, 7, 8, 9]),  # vLLM truncates a generation's prompt on the left
    ({"truncate_prompt_tokens": 4, "truncation_side": "left"}, None, [6, 7, 8, 9]),
    ({"truncate_prompt_tokens": 4, "truncation_side": "right"}, None, [0, 1, 2, 3]),
    ({"truncate_prompt_tokens": 40}, None, list(range(10))),
    ({"truncate_prompt_tokens": 0}, None, []),
    ({"truncate_prompt_tokens": -1}, 6, [5, 6, 7, 8, 9]),  # the context less one token
    ({"truncate_prompt_tokens": -1}, None, list(range(10))),  # the prefill truncates them (it gets the field)
])
def test_prompt_ids_are_truncated_as_vllm_truncates_a_token_prompt(fields, max_model_len, kept):
    req = parse_client_request(Endpoint.COMPLETIONS, {"prompt": list(range(10)), **fields}, 4)
    assert truncate_prompt(req, list(range(10)), max_model_len) == kept
    assert truncate_prompt(req, kept, max_model_len) == kept  # ids a prefiller truncated stay as they are


@pytest.mark.parametrize("endpoint, body", [(Endpoint.COMPLETIONS, {"prompt": [1, 2, 3]}), (Endpoint.CHAT, CHAT)])
def test_prompt_truncation_goes_to_the_prefill_never_to_a_decode(endpoint, body):
    """On a decoder it would cut prompt + output; the prefill truncates a text or chat prompt and names its ids."""
    req = parse_client_request(endpoint, {**body, "truncate_prompt_tokens": 2, "truncation_side": "right"}, 4)
    prefill = prefill_body(req, {"k": 1})
    assert prefill["truncate_prompt_tokens"] == 2 and prefill["return_token_ids"] is True
    decode = decode_body(req, [1, 2], [9], proxy_text=False)
    assert "truncate_prompt_tokens" not in decode and "truncation_side" not in decode
