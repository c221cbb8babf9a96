"""The decode stream's relay: SSE split per read, token events already read merged into one.

The client's output (text, token ids, finish, logprobs) must not depend on how the decoder's
events arrived: one per read (the slow path) or many in one read (merged, ``upstream.coalesce``).
"""

from __future__ import annotations

import json

import pytest


from lmcache_p2p.proxy.errors import UpstreamStatus
from lmcache_p2p.proxy.upstream import SseLines, _sse_events, coalesce

from ..conftest import make_cluster
from ..fakes import MODEL, PROMPT
from ..flow.test_flow import assert_idle, cycling_model, use_model

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


# ---- splitting -----------------------------------------------------------------------------------

def _event(i: int, text: str, finish: str | None = None) -> dict:
    return {"id": "x", "object": "text_completion", "created": 1, "model": MODEL,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None,
                         "token_ids": [i]}]}


_STREAM = ("".join(f"data: {json.dumps(_event(i, t))}\n\n" for i, t in enumerate(["a", "中", " ☃", "\\n"]))
           + ": a comment line\n\nevent: message\r\ndata: {\"k\": 1}\r\n\r\n"
           + "data:{\"no_space\": true}\rdata: [DONE]\n\n").encode()


def _split(pieces: list[bytes]) -> list[bytes]:
    lines = SseLines()
    return [data for piece in pieces for data in lines.feed(piece)]


def test_events_are_the_same_however_the_bytes_are_cut():
    whole = _split([_STREAM])
    assert len(whole) == 7 and whole[-1] == b"[DONE]" and whole[-2] == b'{"no_space": true}'
    assert json.loads(whole[1]) == _event(1, "中") and json.loads(whole[4]) == {"k": 1}
    for cut in range(1, len(_STREAM)):  # every boundary, mid-line, mid-"\r\n" and mid-character included
        assert _split([_STREAM[:cut], _STREAM[cut:]]) == whole, cut
    assert _split([_STREAM[i:i + 1] for i in range(len(_STREAM))]) == whole


def test_a_line_not_ended_yet_is_held_until_its_end_arrives():
    lines = SseLines()
    assert lines.feed(b'data: {"a": 1}\n\ndata: {"b"') == [b'{"a": 1}']
    assert lines.feed(b": 2}") == []
    assert lines.feed(b"\n\n") == [b'{"b": 2}']


# ---- merging -------------------------------------------------------------------------------------

def test_token_events_read_together_merge_into_one_in_order():
    logprobs = [{"tokens": [t], "token_logprobs": [-0.5], "top_logprobs": [{t: -0.5}], "text_offset": [i]}
                for i, t in enumerate(["a", "b", "c"])]
    events = [_event(i, t, "length" if i == 2 else None) for i, t in enumerate("abc")]
    for event, lp in zip(events, logprobs):
        event["choices"][0]["logprobs"] = lp
    usage = {"id": "x", "object": "text_completion", "created": 1, "model": MODEL, "choices": [],
             "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}}
    merged = coalesce([*events, usage])
    assert len(merged) == 2 and merged[1] is usage
    choice = merged[0]["choices"][0]
    assert (choice["text"], choice["token_ids"], choice["finish_reason"]) == ("abc", [0, 1, 2], "length")
    assert choice["logprobs"] == {"tokens": ["a", "b", "c"], "token_logprobs": [-0.5] * 3,
                                  "top_logprobs": [{"a": -0.5}, {"b": -0.5}, {"c": -0.5}], "text_offset": [0, 1, 2]}


def test_events_that_cannot_merge_stay_apart():
    finished, after = _event(0, "a", "stop"), _event(1, "b")
    assert coalesce([finished, after]) == [finished, after]  # nothing merges past a finish
    with_logprobs = _event(2, "c")
    with_logprobs["choices"][0]["logprobs"] = {"tokens": ["c"], "token_logprobs": [-1.0], "top_logprobs": [None],
                                               "text_offset": [0]}
    plain = _event(3, "d")
    assert len(coalesce([plain, with_logprobs])) == 2  # logprobs on one only
    odd = _event(4, "e")
    odd["choices"][0]["unknown_field"] = 1
    assert len(coalesce([_event(5, "f"), odd])) == 2  # a field this proxy does not know how to merge
    two_choices = _event(6, "g")
    two_choices["choices"].append({**two_choices["choices"][0], "index": 1})
    assert len(coalesce([_event(7, "h"), two_choices])) == 2


# ---- the stream: what one read brings is yielded in order, before an error or [DONE] ---------------

async def _chunks(chunks: list[bytes]):
    for chunk in chunks:
        yield chunk


async def _read(chunks: list[bytes]) -> list[dict]:
    return [event async for event in _sse_events("http://decoder/v1/completions", _chunks(chunks))]


def _sse(event: dict) -> bytes:
    return f"data: {json.dumps(event, ensure_ascii=False)}\n\n".encode()


async def test_tokens_read_with_an_error_event_reach_the_client_before_the_error():
    error = {"error": {"message": "engine dead", "code": 500}}
    got: list[dict] = []
    with pytest.raises(UpstreamStatus, match="engine dead"):
        async for event in _sse_events("http://decoder/v1/completions",
                                       _chunks([_sse(_event(0, "a")) + _sse(_event(1, "b")) + _sse(error)])):
            got.append(event)
    assert [e["choices"][0]["text"] for e in got] == ["ab"] and got[0]["choices"][0]["token_ids"] == [0, 1]


async def test_done_ends_the_stream_after_the_tokens_read_with_it_and_a_cut_event_is_joined():
    stream = _sse(_event(0, "a")) + _sse(_event(1, "中")) + b"data: [DONE]\n\n" + _sse(_event(2, "never"))
    cut = stream.index(b"\xe4") + 1  # inside the multibyte character of the second event
    got = await _read([stream[:cut], stream[cut:]])
    assert [e["choices"][0]["text"] for e in got] == ["a", "中"]  # one per read: nothing waits to be merged


# ---- end to end: merged events give the slow path's output ---------------------------------------

def _one_write(vllm) -> None:
    """The fake decoder writes its whole stream at once: the proxy reads every event in one read."""
    original = vllm._stream

    async def stream(body, ids, tokens, finish):
        yield "".join([part async for part in original(body, ids, tokens, finish)])

    vllm._stream = stream


async def _outputs(c, body: dict) -> tuple:
    """(text, token ids, finish, stop reason, logprob tokens, content chunks) as the client gets them."""
    if not body.get("stream"):
        choice = (await c.post("/v1/completions", body)).json()["choices"][0]
        lp = choice["logprobs"] or {}
        return (choice["text"], choice["token_ids"], choice["finish_reason"], choice["stop_reason"],
                lp.get("tokens"), lp.get("text_offset"), 1)
    events = await c.stream("/v1/completions", body)
    chunks = [e for e in events if isinstance(e, dict) and e["choices"]]
    lps = [e["choices"][0]["logprobs"] for e in chunks if e["choices"][0]["logprobs"]]
    return ("".join(e["choices"][0]["text"] for e in chunks),
            [t for e in chunks for t in e["choices"][0]["token_ids"]],
            chunks[-1]["choices"][0]["finish_reason"], chunks[-1]["choices"][0]["stop_reason"],
            [t for lp in lps for t in lp["tokens"]] or None, [o for lp in lps for o in lp["text_offset"]] or None,
            len(chunks))


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("extra", [{}, {"stop": ["☃"]}, {"stop": ["文☃中"], "include_stop_str_in_output": True},
                                   {"logprobs": 1}])
async def test_merged_decode_events_give_the_text_of_one_event_per_read(tokenizer_dir, stream, extra):
    path, hf = tokenizer_dir
    cycle = hf.encode("中文☃ ok", add_special_tokens=False)  # byte-level tokens: characters cut across tokens
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "return_token_ids": True, "stream": stream, **extra}
    async with make_cluster(tokenizer=str(path)) as c:
        use_model(c, cycling_model(cycle), hf)
        c.decoders[0].vllm.token_delay_s = 0.005  # one event per read (unless the proxy lags that much)
        slow = await _outputs(c, body)
        c.decoders[0].vllm.token_delay_s = 0.0
        _one_write(c.decoders[0].vllm)
        merged = await _outputs(c, body)
        assert merged[:-1] == slow[:-1]
        if stream:
            assert merged[-1] < 24 - 1  # the decoder's events (one per token) did reach the client merged
        assert_idle(c)
