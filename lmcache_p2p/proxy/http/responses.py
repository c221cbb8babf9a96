"""Response shapes: the first token from the prefill answer, decode events, and what the client sees.

The decoder answers in ``/v1/completions`` stream format (or chat chunks, when its chat endpoint renders the
answer); a renderer turns the prefiller's first token plus those events into the client's format
(``text_completion`` or ``chat.completion``, chunks when streaming), so the client receives the whole output,
first token included, exactly once. Chat output is plain ``content`` (no reasoning / tool-call parsing), except
from a decode on the decoder's chat endpoint, whose parsers' deltas are kept (``ChatRenderer``). The text of
every chunk is the one ``flow/flow.py`` gives (made in the proxy from token ids when it has the tokenizer). Usage is recomputed: prompt = the prompt's ids, completion = the
output's token ids (first token included). Completion logprobs' ``text_offset`` is recomputed as
vLLM does: the running length of the token strings reported so far.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec

from lmcache_p2p.proxy.errors import UpstreamMalformed
from lmcache_p2p.proxy.http.shaping import ClientRequest

SSE_DONE = b"data: [DONE]\n\n"


def sse(event: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(event) + b"\n\n"


@dataclasses.dataclass(frozen=True)
class FirstToken:
    """The prefiller's one output token, as the client's endpoint rendered it."""

    token_id: int
    text: str
    finish_reason: str | None
    stop_reason: Any
    logprobs: Any  # in the client's format
    prompt_ids: list[int] | None
    model: str
    created: int


@dataclasses.dataclass(frozen=True)
class Delta:
    """One decode event's output (completion format; a chat decode's: ``message`` and chat logprobs)."""

    text: str
    token_ids: list[int]
    logprobs: dict[str, Any] | None
    finish_reason: str | None
    stop_reason: Any
    # a decode on the decoder's chat endpoint: its delta as its parsers made it (content, reasoning, tool_calls)
    message: dict[str, Any] | None = None


def first_token(req: ClientRequest, answer: dict[str, Any]) -> FirstToken:
    choices = answer.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise UpstreamMalformed(f"prefill answer without choices: {str(answer)[:300]}")
    choice = choices[0]
    kv_params = answer.get("kv_transfer_params")
    token_id = kv_params.get("first_tok") if isinstance(kv_params, dict) else None
    if token_id is None and choice.get("token_ids"):
        token_id = choice["token_ids"][0]
    if not isinstance(token_id, int):
        raise UpstreamMalformed("prefill answer carries no first token (kv_transfer_params.first_tok): is the "
                                "prefiller running LMCacheConnectorV1 as kv_producer?")
    logprobs = choice.get("logprobs")
    if "message" in choice:  # the chat endpoint answered
        message = choice.get("message") or {}
        # a reasoning parser's (vLLM 0.32: ``reasoning``; earlier ``reasoning_content``)
        text = message.get("content") or message.get("reasoning") or message.get("reasoning_content") or ""
        prompt_ids = answer.get("prompt_token_ids")
    else:  # the completions endpoint: the client's, or a chat prompt's ids prefilled there
        text = choice.get("text") or ""
        prompt_ids = choice.get("prompt_token_ids")
        if req.is_chat:
            logprobs = chat_logprobs(logprobs, req.top_logprobs or 0)
    return FirstToken(
        token_id=token_id,
        text=text,
        finish_reason=choice.get("finish_reason"),
        stop_reason=choice.get("stop_reason"),
        logprobs=logprobs,
        prompt_ids=prompt_ids if isinstance(prompt_ids, list) and prompt_ids else None,
        model=str(answer.get("model", "")),
        created=int(answer.get("created") or 0),
    )


def decode_delta(event: dict[str, Any]) -> Delta | None:
    """The output of one decode stream event (None for the usage-only event)."""
    choices = event.get("choices") or []
    if not choices:
        return None
    choice = choices[0]
    message = choice.get("delta")  # a chat decode's chunk
    if isinstance(message, dict):
        opening = "role" in message  # the role chunk vLLM opens a chat stream with: the client has the proxy's
        message = {k: v for k, v in message.items() if k != "role"}
        if (not message or opening and not any(message.values())) and not choice.get("token_ids") \
                and choice.get("finish_reason") is None:
            return None
    return Delta(
        text=(message.get("content") or "") if isinstance(message, dict) else choice.get("text") or "",
        token_ids=list(choice.get("token_ids") or ()),
        logprobs=choice.get("logprobs"),
        finish_reason=choice.get("finish_reason"),
        stop_reason=choice.get("stop_reason"),
        message=message if isinstance(message, dict) else None,
    )


def held_back(delta: Delta, return_token_ids: bool) -> bool:
    """A rendered chat delta with nothing for a client that asked for no ids: tokens its parsers held back, whose
    ids vLLM sends in an empty delta (it sends such a client nothing)."""
    return not delta.message and delta.logprobs is None and delta.finish_reason is None and not return_token_ids


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class Renderer:
    """Turns a first token and decode deltas into the client's format."""

    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def __init__(self, req: ClientRequest, response_id: str, first: FirstToken, prompt_ids: list[int],
                 include_first: bool = True) -> None:
        """``include_first=False``: the decoder regenerates the first token (see ``flow/flow.py``)."""
        self._req = req
        self._id = response_id
        self._first = first
        self._prompt_ids = prompt_ids
        self._include_first = include_first
        self._text: list[str] = [first.text] if include_first else []
        self._token_ids: list[int] = [first.token_id] if include_first else []
        self._logprob_parts: list[Any] = [first.logprobs] if include_first else []
        self._finish_reason = first.finish_reason
        self._stop_reason = first.stop_reason
        self._prompt_ids_sent = not req.return_token_ids  # the first chunk carries them
        self._text_offset = _token_strings_length(first.logprobs) if include_first else 0

    # ---- streaming -----------------------------------------------------------------------------

    def first_chunks(self) -> list[dict[str, Any]]:
        if not self._include_first:
            return []
        first = self._first
        return [self._chunk([self._stream_choice(first.text, first.logprobs, [first.token_id], first.finish_reason,
                                                 first.stop_reason)])]

    def delta_chunk(self, delta: Delta) -> dict[str, Any] | None:
        """The client's chunk of ``delta`` (None: nothing to send)."""
        logprobs = self._convert_logprobs(delta.logprobs)
        return self._chunk([self._stream_choice(delta.text, logprobs, delta.token_ids, delta.finish_reason,
                                                delta.stop_reason)])

    def usage_chunk(self, usage_info: dict[str, int]) -> dict[str, Any]:
        return {**self._chunk([]), "usage": usage_info}

    # ---- whole answer --------------------------------------------------------------------------

    def add(self, delta: Delta) -> None:
        """Keep a delta for ``response``."""
        self._text.append(delta.text)
        self._token_ids.extend(delta.token_ids)
        self._logprob_parts.append(self._convert_logprobs(delta.logprobs))
        if delta.finish_reason is not None:
            self._finish_reason = delta.finish_reason
            self._stop_reason = delta.stop_reason

    def response(self, usage_info: dict[str, int]) -> dict[str, Any]:
        logprobs = self._merge_logprobs([p for p in self._logprob_parts if p])
        choice: dict[str, Any] = {"index": 0, **self._final_content(), "logprobs": logprobs,
                                  "finish_reason": self._finish_reason, "stop_reason": self._stop_reason}
        if self._req.return_token_ids:
            choice["token_ids"] = self._token_ids
        answer = {"id": self._id, "object": self.object_name, "created": self._first.created,
                  "model": self._first.model, "choices": [choice], "usage": usage_info}
        if self._req.return_token_ids:
            self._place_prompt_ids(answer, choice)
        return answer

    # ---- per format ----------------------------------------------------------------------------

    def _stream_choice(self, text: str, logprobs: Any, token_ids: list[int], finish_reason: str | None,
                       stop_reason: Any) -> dict[str, Any]:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
                  "stop_reason": stop_reason}
        if self._req.return_token_ids:
            choice["token_ids"] = token_ids
            if not self._prompt_ids_sent:
                choice["prompt_token_ids"] = self._prompt_ids
                self._prompt_ids_sent = True
        return choice

    def _final_content(self) -> dict[str, Any]:
        return {"text": "".join(self._text)}

    def _place_prompt_ids(self, answer: dict[str, Any], choice: dict[str, Any]) -> None:
        choice["prompt_token_ids"] = self._prompt_ids

    def _convert_logprobs(self, logprobs: dict[str, Any] | None) -> Any:
        """Completion logprobs of the decoder's output, ``text_offset`` continuing the client's output."""
        if not logprobs:
            return None
        offsets = []
        for token in logprobs.get("tokens") or ():
            offsets.append(self._text_offset)
            self._text_offset += len(token)
        return {**logprobs, "text_offset": offsets}

    def _merge_logprobs(self, parts: list[Any]) -> Any:
        if not parts:
            return None
        keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
        return {k: [item for part in parts for item in part.get(k) or ()] for k in keys}

    # ---- helpers -------------------------------------------------------------------------------

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self._id, "object": self.chunk_object_name, "created": self._first.created,
                "model": self._first.model, "choices": choices}


class ChatRenderer(Renderer):
    """Chat shape. A decode on the decoder's chat endpoint (``Delta.message``) keeps its parsers' delta as it
    is; the whole answer then merges them as vLLM's stream would add up: content, reasoning, and each
    tool call by its index."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._reasoning: list[str] = []
        self._tool_calls: dict[int, dict[str, Any]] = {}

    def delta_chunk(self, delta: Delta) -> dict[str, Any] | None:
        if delta.message is None:
            return super().delta_chunk(delta)
        if held_back(delta, self._req.return_token_ids):
            return None
        choice = {"index": 0, "delta": delta.message, "logprobs": delta.logprobs,
                  "finish_reason": delta.finish_reason, "stop_reason": delta.stop_reason}
        if self._req.return_token_ids:
            choice["token_ids"] = delta.token_ids
        return self._chunk([choice])

    def add(self, delta: Delta) -> None:
        super().add(delta)
        message = delta.message or {}
        reasoning = message.get("reasoning") or message.get("reasoning_content")
        if reasoning:
            self._reasoning.append(reasoning)
        for call in message.get("tool_calls") or ():
            merged = self._tool_calls.setdefault(int(call.get("index", len(self._tool_calls))),
                                                 {"id": None, "type": "function",
                                                  "function": {"name": "", "arguments": ""}})
            for key in ("id", "type"):
                if call.get(key):
                    merged[key] = call[key]
            function = call.get("function") or {}
            merged["function"]["name"] += function.get("name") or ""
            merged["function"]["arguments"] += function.get("arguments") or ""

    def first_chunks(self) -> list[dict[str, Any]]:
        role = self._chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}])
        if not self._prompt_ids_sent:
            role["prompt_token_ids"] = self._prompt_ids
            self._prompt_ids_sent = True
        return [role, *super().first_chunks()]

    def _stream_choice(self, text: str, logprobs: Any, token_ids: list[int], finish_reason: str | None,
                       stop_reason: Any) -> dict[str, Any]:
        choice = {"index": 0, "delta": {"content": text}, "logprobs": logprobs, "finish_reason": finish_reason,
                  "stop_reason": stop_reason}
        if self._req.return_token_ids:
            choice["token_ids"] = token_ids
        return choice

    def _final_content(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self._text)}
        if self._reasoning:
            message["reasoning"] = "".join(self._reasoning)
        if self._tool_calls:
            message["tool_calls"] = [self._tool_calls[i] for i in sorted(self._tool_calls)]
        if (self._reasoning or self._tool_calls) and not message["content"]:
            message["content"] = None  # as vLLM's message: no content beside the parsed parts
        return {"message": message}

    def _place_prompt_ids(self, answer: dict[str, Any], choice: dict[str, Any]) -> None:
        answer["prompt_token_ids"] = self._prompt_ids

    def _convert_logprobs(self, logprobs: dict[str, Any] | None) -> Any:
        if isinstance(logprobs, dict) and "content" in logprobs:
            return logprobs  # a chat decode's: in chat shape already
        return chat_logprobs(logprobs, self._req.top_logprobs or 0)

    def _merge_logprobs(self, parts: list[Any]) -> Any:
        if not parts:
            return None
        return {"content": [item for part in parts for item in part.get("content") or ()]}


def chat_logprobs(logprobs: dict[str, Any] | None, top_n: int) -> Any:
    """Completion-format logprobs -> chat ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    if not logprobs:
        return None
    content = []
    for i, token in enumerate(logprobs.get("tokens") or []):
        top = (logprobs.get("top_logprobs") or [None] * (i + 1))[i] or {}
        ranked = sorted(top.items(), key=lambda kv: kv[1], reverse=True)[:top_n]
        content.append({
            "token": token,
            "logprob": (logprobs.get("token_logprobs") or [None] * (i + 1))[i],
            "bytes": list(token.encode()),
            "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in ranked],
        })
    return {"content": content}


def _token_strings_length(logprobs: Any) -> int:
    """Characters of the completion-format token strings in ``logprobs`` (0 for chat or none)."""
    tokens = logprobs.get("tokens") if isinstance(logprobs, dict) else None
    return sum(len(t) for t in tokens) if isinstance(tokens, list) else 0


def renderer_for(req: ClientRequest, response_id: str, first: FirstToken, prompt_ids: list[int],
                 include_first: bool = True) -> Renderer:
    cls = ChatRenderer if req.is_chat else Renderer
    return cls(req, response_id, first, prompt_ids, include_first)
