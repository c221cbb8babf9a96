"""Chats whose answer vLLM's output parsers make, behind our proxy, for real: ``lmcache-p2p launch`` 1P1D (our
backend) with every instance run as ``--enable-auto-tool-choice --tool-call-parser pythonic`` and the proxy as
``--chat-parsers``. The decode goes to the decoder's chat endpoint prompted with the prefill's ids
(``kv_transfer_params.prompt_token_ids``), so the answer is its parsers' and equals the decoder's own answer to
the same request sent straight to it afterwards (one instance, the same flags), plain and streamed; and the
decoder loaded the prompt's KV from the prefiller rather than computing it (its LMCache lookups, before it had
computed the prompt itself). The tiny model's random weights never write a tool call the parser recognizes, so
this checks the path (and that it changes no answer), not the parsing: the fakes check that
(tests/proxy/flow/test_instance_renders.py).
"""

from __future__ import annotations

import httpx
import pytest

from cluster import lookups_by_request  # tests/ is on sys.path
from test_launch_nixl_vllm import launch_1p1d, stop, wait_serving  # tests/e2e is on sys.path
from test_nixl_backend_vllm import stream_events
from vllm_server import free_cluster_base_port

# Two vLLM servers for ~2 min: in `make test-long`.
pytestmark = [pytest.mark.vllm, pytest.mark.long]

SERVING_TIMEOUT_S = 600.0
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "look a word up",
                                           "parameters": {"type": "object", "properties": {
                                               "word": {"type": "string"}}}}}]
WORDS = "the quick brown fox jumps over the lazy dog while seven wise owls count silver stars"


def messages(i: int) -> list[dict]:
    text = " ".join(WORDS.split()[i:] + WORDS.split()[:i]) * 30  # several of LMCache's 256-token chunks
    return [{"role": "user", "content": f"{i}: {text}"}]


def answer(url: str, model: str, body: dict, stream: bool) -> dict:
    """The chat's message (a stream's deltas added up as a client would) and its finish reason."""
    body = {"model": model, "max_tokens": 12, "temperature": 0, **body, "stream": stream}
    if not stream:
        resp = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        message = choice["message"]
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or ()]
        return {"content": message.get("content") or "", "reasoning": message.get("reasoning") or "",
                "tool_calls": calls, "finish": choice["finish_reason"], "prompt_tokens": resp.json()["usage"][
                    "prompt_tokens"]}
    content, reasoning, calls, finish = "", "", {}, None
    for event in stream_events(url, body, path="/v1/chat/completions"):
        for choice in event.get("choices") or ():
            delta = choice["delta"]
            content += delta.get("content") or ""
            reasoning += delta.get("reasoning") or ""
            for call in delta.get("tool_calls") or ():
                name, args = calls.get(call["index"], ("", ""))
                function = call.get("function") or {}
                calls[call["index"]] = (name + (function.get("name") or ""), args + (function.get("arguments") or ""))
            finish = choice.get("finish_reason") or finish
    return {"content": content, "reasoning": reasoning, "tool_calls": [calls[i] for i in sorted(calls)],
            "finish": finish}


def test_a_chat_with_tools_is_answered_by_the_decoders_parser_from_the_prefillers_kv(tiny_model_dir, tmp_path):
    base = free_cluster_base_port(prefill=1, decode=1, tp_size=2)
    flags = ("--vllm-arg=--enable-auto-tool-choice", "--vllm-arg=--tool-call-parser=pythonic",
             "--proxy-arg=--chat-parsers")
    proc, out = launch_1p1d(base, tiny_model_dir, tmp_path, *flags)
    try:
        wait_serving(proc, out, SERVING_TIMEOUT_S)
        front, decoder, model = f"http://127.0.0.1:{base}", f"http://127.0.0.1:{base + 30}", str(tiny_model_dir.resolve())
        cases = [{"messages": messages(0), "tools": TOOLS}, {"messages": messages(3), "tools": TOOLS,
                                                              "tool_choice": "auto"}, {"messages": messages(5)}]
        decoder_log = tmp_path / "logs" / "decoder-0.log"
        for i, case in enumerate(cases):
            answers, loaded = [], []
            for stream in (False, True):  # first: the decoder has not computed this prompt itself
                before = set(lookups_by_request(decoder_log))
                answers.append(answer(front, model, case, stream))
                loaded.append([lookup for req, lookup in lookups_by_request(decoder_log).items() if req not in before])
            reference = answer(decoder, model, case, stream=False)  # one instance, the same flags
            prompt_tokens = reference.pop("prompt_tokens")
            for stream, got, new in zip((False, True), answers, loaded):
                assert {k: v for k, v in got.items() if k != "prompt_tokens"} == reference, (i, stream)
                # a decode of the prompt alone (the chat endpoint's: a completion decode is prompt + first token)
                # that loaded every full chunk of it (vLLM computes the last token itself, so LMCache's lookup
                # leaves the partial last chunk out)
                assert [total for total, _ in new] == [prompt_tokens], (i, stream, new)
                assert all(hit > 0 and hit >= (total - 1) // 256 * 256 for total, hit in new), (i, stream, new)
        recent = httpx.get(f"{front}/stats", timeout=10).json()["recent"]
        assert len(recent) == 2 * len(cases)
    finally:
        code = stop(proc)
    assert code == 0, open(out).read()[-4000:]
