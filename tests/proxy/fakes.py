"""Test doubles for the layer under test (the proxy): fake vLLM instances and their plugin side.

``FakeVllm`` is a small Starlette app speaking the part of vLLM's OpenAI API the proxy uses, with
a deterministic "model" (``generate``) so that a disaggregated answer can be compared token for
token with a single instance. ``FakeAgent`` is an instance's control-plane side: it announces
itself to the proxy and, on a decoder, pushes KvReady / KvFailed when a fake prefiller "sent" it
a request's KV (``KvNetwork``). ``FakeReceiverControl`` is a decoder's receiver control socket (a
ROUTER per TP rank) as far as the proxy's ``Cancel`` goes. Real vLLM end-to-end tests live elsewhere.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import uvicorn
import zmq
import zmq.asyncio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from lmcache_p2p.protocol import (
    PROTOCOL_VERSION,
    Ack,
    Announce,
    Cancel,
    Codec,
    Fingerprint,
    Goodbye,
    KvFailCause,
    KvFailed,
    KvReady,
    dialled_name,
)
from lmcache_p2p.vllm_plugin.router_addressing import MARKER_KEY

EOS = 2
MODEL = "fake-model"
START_TIMEOUT_S = 30.0  # a fake server starts at once, unless a loaded machine stalls this event loop for seconds


def fingerprint(model: str = MODEL, **changes: Any) -> Fingerprint:
    """A KV fingerprint as an instance of the fake model announces it."""
    fields: dict[str, Any] = dict(model=model, num_layers=2, kv_heads=2, head_size=32, dtype="bfloat16",
                                  chunk_tokens=16, tp_size=1, tp_rank=0, kv_format="KV_2LTD")
    return Fingerprint(**{**fields, **changes})


# ---- the fake model ----------------------------------------------------------------------------


def tokenize(text: str) -> list[int]:
    return [1] + [ord(c) % 200 + 3 for c in text]


def chat_prompt(messages: list[dict[str, Any]]) -> str:
    return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


def next_token(ids: list[int]) -> int:
    return (sum(ids[-4:]) * 7 + len(ids)) % 90 + 10


def token_text(token: int) -> str:
    return f" t{token}"


def generate(prompt_ids: list[int], n: int, penalized: bool = False) -> list[int]:
    """What a single instance outputs (greedy); ``penalized``: with a presence / frequency penalty."""
    ids = list(prompt_ids)
    for _ in range(n):
        ids.append(penalized_token(ids, ids[len(prompt_ids):]) if penalized else next_token(ids))
    return ids[len(prompt_ids):]


def penalized_token(ids: list[int], output: list[int]) -> int:
    """The next token under sampling that reads the request's own output (presence / frequency penalties,
    bad_words). As in vLLM, only the OUTPUT's tokens count (the request's prompt, whatever it holds, does
    not): the fake's greedy choice moves off any token this request already output."""
    token = next_token(ids)
    while token in output:
        token = token + 1 if token < 99 else 10
    return token


def penalized(body: dict[str, Any]) -> bool:
    return any(body.get(k) for k in ("presence_penalty", "frequency_penalty", "bad_words"))


def sampled_token(ids: list[int], seed: int) -> int:
    """The next token of seeded sampling as vLLM's default GPU model runner (V2) draws it: its noise is a
    function of the seed and the token's position in the sequence, not of the draws made before."""
    noise = (seed * 2654435761 + len(ids) * 40503) % 13
    return (next_token(ids) + noise) % 90 + 10


def seeded(body: dict[str, Any]) -> int | None:
    """The seed of a sampled request (None: greedy, or sampled without a seed, which the fake serves greedily)."""
    temperature = body.get("temperature")
    sampled = temperature is None or temperature > 0
    return body.get("seed") if sampled else None


def generate_seeded(prompt_ids: list[int], n: int, seed: int) -> list[int]:
    """What a single instance outputs for a seeded sampled request."""
    ids = list(prompt_ids)
    for _ in range(n):
        ids.append(sampled_token(ids, seed))
    return ids[len(prompt_ids):]


PROMPT = "The quick brown fox jumps over the lazy dog"
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]


def expected_text(prompt_ids: list[int], n: int) -> str:
    return "".join(token_text(t) for t in generate(prompt_ids, n))


# ---- serving helpers -----------------------------------------------------------------------------


class HttpServer:
    """A uvicorn server for an ASGI app on 127.0.0.1 and an ephemeral port, in this event loop.

    ``bind()`` takes the port without listening (connections are refused, like a vLLM still
    loading); ``start()`` serves; ``stop()`` then ``start()`` restarts on the same port.
    """

    def __init__(self, app: Any) -> None:
        self._app = app
        self._server: uvicorn.Server | None = None
        self._sock: socket.socket | None = None
        self._task: asyncio.Task[None] | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def bind(self) -> None:
        if self._sock is None:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # TCP_NODELAY (listener.bind_http)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", self.port))
            self.port = sock.getsockname()[1]
            self._sock = sock

    async def start(self) -> None:
        self.bind()
        assert self._sock is not None
        sock, self._sock = self._sock, None
        sock.listen(128)
        sock.setblocking(False)
        self._server = server = uvicorn.Server(uvicorn.Config(self._app, log_config=None, access_log=False,
                                                              lifespan="off", timeout_graceful_shutdown=1))
        self._task = task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
        deadline = time.monotonic() + START_TIMEOUT_S
        while not server.started:
            assert time.monotonic() < deadline and not task.done(), "fake server did not start"
            await asyncio.sleep(0.005)

    async def stop(self) -> None:
        if self._task is not None and self._server is not None:
            self._server.should_exit = True
            await asyncio.wait({self._task}, timeout=3)
            self._task = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class FakeVllm:
    """A vLLM-like instance. ``requests`` records (path, body) of every call."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self.errors: list[tuple[int, dict[str, Any]]] = []  # the next answers, instead of generating
        self.kv_sink: Callable[[dict[str, Any]], Awaitable[None]] | None = None
        self.omit_prompt_ids = False  # behave like a vLLM without return_token_ids
        self.hold_back_text = False  # non-streaming answers' text is "" (an incomplete UTF-8 character)
        self.text_of: Callable[[list[int]], str] = lambda tokens: "".join(map(token_text, tokens))  # their text
        self.held_tokens: set[int] = set()  # streamed with no text: it comes with the next token's (as vLLM holds
        # back an incomplete UTF-8 character); a token the prompt ends with is never emitted, as in vLLM
        self.eos_at: int | None = None  # output position that becomes EOS
        self.token_delay_s = 0.0
        self.prefill_delay_s = 0.0
        self.break_next = 0  # the next N generation calls break the connection after the request arrived
        self.encode: Callable[[str], list[int]] = tokenize  # the fake's tokenizer
        self.can_tokenize = True  # False: /tokenize refused, as by vLLM run with --skip-tokenizer-init
        self.model: Callable[[list[int]], int] = next_token  # the next token after these ids (greedy)
        self.max_model_len: int | None = None  # context length, enforced as vLLM does (None: unbounded)
        self.models_card: dict[str, Any] = {}  # extra fields of GET /v1/models' model card (root, max_model_len)
        self.die_after: int | None = None  # a stream breaks (connection dropped) after this many tokens
        self.cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens (None: not reported)
        self.reasoning_tokens: int | None = None  # a reasoning parser's: the chat output's first N are reasoning
        self.held_deltas = 0  # a parser's: the chat output's first N tokens make no delta (streamed: an empty one)
        self.cancelled_streams = 0
        self.finished_streams = 0
        # a decode carrying the early-decode marker waits on this before its first token, as a decoder's scheduler
        # holds it until its KV arrived (the cluster sets its agent's; None: it decodes at once, as a decoder
        # whose wait ran out and computed the rest)
        self.kv_park: Callable[[dict[str, Any]], Awaitable[None]] | None = None
        self.server = HttpServer(Starlette(routes=[
            Route("/v1/completions", self._completions, methods=["POST"]),
            Route("/v1/chat/completions", self._chat, methods=["POST"]),
            Route("/tokenize", self._tokenize, methods=["POST"]),
            Route("/v1/models", self._models, methods=["GET"]),
            Route("/health", lambda r: JSONResponse({}), methods=["GET"]),
        ]))

    @property
    def url(self) -> str:
        return self.server.url

    def calls(self, path: str) -> list[dict[str, Any]]:
        return [body for p, body in self.requests if p == path]

    # ---- endpoints ----

    async def _completions(self, request: Request) -> Any:
        body = await request.json()
        self.requests.append(("/v1/completions", body))
        if self.errors:
            status, error = self.errors.pop(0)
            return JSONResponse(error, status_code=status)
        prompt = body["prompt"]
        ids = self._truncate(list(prompt), body) if isinstance(prompt, list) else self._truncate_text(prompt, body)
        await self._maybe_send_kv(body)
        if self.break_next:
            return self._broken()
        refused = self._context_refusal(ids, body.get("max_tokens", 16))
        if refused is not None:
            return refused
        tokens, finish = self._generate(ids, body.get("max_tokens", 16), penalized(body), seeded(body))
        if body.get("stream"):
            return StreamingResponse(self._stream(body, ids, tokens, finish), media_type="text/event-stream")
        choice = {"index": 0, "text": self._text(tokens), "logprobs": self._logprobs(body, tokens, 0),
                  "finish_reason": finish, "stop_reason": None}
        if body.get("return_token_ids"):
            choice["token_ids"] = tokens
            if not self.omit_prompt_ids:
                choice["prompt_token_ids"] = ids
        return JSONResponse(self._answer("text_completion", [choice], ids, tokens, body))

    async def _chat(self, request: Request) -> Any:
        body = await request.json()
        self.requests.append(("/v1/chat/completions", body))
        if self.errors:
            status, error = self.errors.pop(0)
            return JSONResponse(error, status_code=status)
        forwarded = (body.get("kv_transfer_params") or {}).get("prompt_token_ids")  # vLLM 0.32: no rendering
        ids = forwarded or self._truncate(self.encode(chat_prompt(body["messages"])), body)  # no special tokens
        await self._maybe_send_kv(body)
        if self.break_next:
            return self._broken()
        tokens, finish = self._generate(ids, body.get("max_completion_tokens") or body.get("max_tokens") or 16,
                                        penalized(body), seeded(body))
        deltas = self._parsed(body, tokens)
        if any(d.get("tool_calls") for d in deltas):
            finish = "tool_calls"
        if body.get("stream"):
            return StreamingResponse(self._chat_stream(body, ids, tokens, deltas, finish),
                                     media_type="text/event-stream")
        message: dict[str, Any] = {"role": "assistant", "content": "".join(d.get("content", "") for d in deltas)}
        if any("reasoning" in d for d in deltas):
            message["reasoning"] = "".join(d.get("reasoning", "") for d in deltas)
        if any(d.get("tool_calls") for d in deltas):
            message.update(content=None, tool_calls=[{"id": "call_f", "type": "function", "function": {
                "name": "f", "arguments": "".join(d["tool_calls"][0]["function"].get("arguments", "")
                                                  for d in deltas if d.get("tool_calls"))}}])
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
        answer = self._answer("chat.completion", [choice], ids, tokens, body)
        if body.get("return_token_ids") and not self._hides_ids(body):
            choice["token_ids"] = tokens
            if not self.omit_prompt_ids:
                answer["prompt_token_ids"] = ids
        return JSONResponse(answer)

    def _parsed(self, body: dict[str, Any], tokens: list[int]) -> list[dict[str, Any]]:
        """Each output token's chat delta, as a parser makes them: the first ``reasoning_tokens`` are reasoning (a
        reasoning parser, None: none); with tools and tool_choice auto the output is one call of "f" whose
        arguments are the tokens' text (a tool parser)."""
        if body.get("tools") and body.get("tool_choice", "auto") in ("auto", None):
            return [{"tool_calls": [{"index": 0, "id": "call_f", "type": "function",
                                     "function": {"name": "f", "arguments": token_text(t)}}]} if i == 0 else
                    {"tool_calls": [{"index": 0, "function": {"arguments": token_text(t)}}]}
                    for i, t in enumerate(tokens)]
        thinking = self.reasoning_tokens or 0
        return [{} if i < self.held_deltas else {"reasoning": token_text(t)} if i < thinking else
                {"content": token_text(t)} for i, t in enumerate(tokens)]

    def _hides_ids(self, body: dict[str, Any]) -> bool:
        """vLLM 0.32 leaves a chat's token ids out under include_reasoning false when a parser runs."""
        return body.get("include_reasoning") is False and bool(self.reasoning_tokens or body.get("tools"))

    async def _chat_stream(self, body: dict[str, Any], ids: list[int], tokens: list[int],
                           deltas: list[dict[str, Any]], finish: str) -> Any:
        base = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk", "created": 1700000000,
                "model": MODEL}
        try:
            if self.kv_park is not None and MARKER_KEY in (body.get("kv_transfer_params") or {}):
                await self.kv_park(body["kv_transfer_params"][MARKER_KEY])
            role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            yield f"data: {json.dumps({**base, 'choices': [role]})}\n\n"
            for i, (token, delta) in enumerate(zip(tokens, deltas)):
                if self.token_delay_s:
                    await asyncio.sleep(self.token_delay_s)
                if self.die_after is not None and i == self.die_after:
                    raise ConnectionAbortedError("fake decoder died mid-stream")
                choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None,
                                          "finish_reason": finish if i == len(tokens) - 1 else None}
                if body.get("return_token_ids") and not self._hides_ids(body):
                    choice["token_ids"] = [token]
                yield f"data: {json.dumps({**base, 'choices': [choice]})}\n\n"
            details = {"completion_tokens_details": {"reasoning_tokens": self.reasoning_tokens}} \
                if self.reasoning_tokens else {}
            yield self._stream_end(base, body, ids, tokens, **details)
            self.finished_streams += 1
        except asyncio.CancelledError:
            self.cancelled_streams += 1
            raise

    @staticmethod
    def _stream_end(base: dict[str, Any], body: dict[str, Any], ids: list[int], tokens: list[int],
                    **details: Any) -> str:
        """A stream's last events: its usage when asked for (with ``details``), then [DONE]."""
        end = "data: [DONE]\n\n"
        if not (body.get("stream_options") or {}).get("include_usage"):
            return end
        usage = {"prompt_tokens": len(ids), "completion_tokens": len(tokens), "total_tokens": len(ids) + len(tokens),
                 **details}
        return f"data: {json.dumps({**base, 'choices': [], 'usage': usage})}\n\n" + end

    async def _tokenize(self, request: Request) -> Any:
        body = await request.json()
        self.requests.append(("/tokenize", body))
        if not self.can_tokenize:
            return JSONResponse({"error": {"message": "Unable to get tokenizer because skip_tokenizer_init is True",
                                           "type": "BadRequestError", "code": 400}}, status_code=400)
        text = chat_prompt(body["messages"]) if "messages" in body else body["prompt"]
        ids = self.encode(text)
        return JSONResponse({"count": len(ids), "max_model_len": 4096, "tokens": ids})

    async def _models(self, request: Request) -> Any:
        return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": self.name,
                                                         **self.models_card}]})

    # ---- helpers ----

    def _broken(self) -> StreamingResponse:
        """Headers, part of a body, then the connection drops (an engine killed mid-request)."""
        self.break_next -= 1

        async def body() -> Any:
            yield b'{"id": "cut'
            raise ConnectionResetError(f"fake {self.name} killed mid-request")

        return StreamingResponse(body(), media_type="application/json")

    def _truncate(self, ids: list[int], body: dict[str, Any], special: int = 0) -> list[int]:
        """vLLM's ``truncate_prompt_tokens``: the last N ids (the first with truncation_side right); -1 is the
        context less one. ``special``: the first ids are special tokens the tokenizer added to a text, which
        a Hugging Face tokenizer keeps when it truncates."""
        limit = body.get("truncate_prompt_tokens")
        if limit is not None and limit < 0:
            limit = self.max_model_len - 1 if self.max_model_len is not None else None
        if limit is None or limit >= len(ids):
            return ids
        kept, content, limit = ids[:special], ids[special:], limit - special
        return kept + (content[:limit] if body.get("truncation_side") == "right" else content[len(content) - limit:])

    def _truncate_text(self, text: str, body: dict[str, Any]) -> list[int]:
        return self._truncate(self.encode(text), body, special=1 if self.encode is tokenize else 0)  # its BOS

    def _text(self, tokens: list[int]) -> str:
        return "" if self.hold_back_text else self.text_of(tokens)

    async def _maybe_send_kv(self, body: dict[str, Any]) -> None:
        spec = (body.get("kv_transfer_params") or {}).get("disagg_spec")
        if spec is not None and self.kv_sink is not None:
            await self.kv_sink(spec)
        if self.prefill_delay_s:
            await asyncio.sleep(self.prefill_delay_s)

    def _context_refusal(self, ids: list[int], max_tokens: int | None) -> JSONResponse | None:
        """vLLM's ``get_max_tokens``: at most max_model_len - prompt; 0 is refused with 400."""
        if self.max_model_len is None or len(ids) < self.max_model_len:
            return None
        message = "max_tokens must be at least 1, got 0."
        return JSONResponse({"error": {"message": message, "type": "BadRequestError", "param": "max_tokens",
                                       "code": 400}}, status_code=400)

    def _generate(self, ids: list[int], max_tokens: int | None, penalize: bool = False,
                  seed: int | None = None) -> tuple[list[int], str]:
        n = 20 if max_tokens is None else max_tokens
        if self.max_model_len is not None:
            n = min(n, self.max_model_len - len(ids))
        tokens = list(ids)
        for _ in range(n):
            if seed is not None:
                tokens.append(sampled_token(tokens, seed))
            else:
                tokens.append(penalized_token(tokens, tokens[len(ids):]) if penalize else self.model(tokens))
        tokens = tokens[len(ids):]
        if self.eos_at is not None and self.eos_at < len(tokens):
            return tokens[: self.eos_at] + [EOS], "stop"
        return tokens, "length"

    def _answer(self, obj: str, choices: list[Any], ids: list[int], tokens: list[int],
                body: dict[str, Any]) -> dict[str, Any]:
        answer: dict[str, Any] = {
            "id": f"x-{uuid.uuid4().hex}", "object": obj, "created": 1700000000, "model": MODEL, "choices": choices,
            "usage": {"prompt_tokens": len(ids), "completion_tokens": len(tokens),
                      "total_tokens": len(ids) + len(tokens)},
        }
        if self.cached_tokens is not None:
            answer["usage"]["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        if (body.get("kv_transfer_params") or {}).get("ret_first_tok"):
            answer["kv_transfer_params"] = {"first_tok": tokens[0]}
        return answer

    @staticmethod
    def _logprobs(body: dict[str, Any], tokens: list[int], offset: int) -> dict[str, Any] | None:
        if body.get("logprobs") is None:
            return None
        texts = [token_text(t) for t in tokens]
        offsets = []
        for text in texts:
            offsets.append(offset)
            offset += len(text)
        return {"tokens": texts, "token_logprobs": [-0.5] * len(texts),
                "top_logprobs": [{text: -0.5} for text in texts], "text_offset": offsets}

    async def _stream(self, body: dict[str, Any], ids: list[int], tokens: list[int], finish: str) -> Any:
        base = {"id": f"x-{uuid.uuid4().hex}", "object": "text_completion", "created": 1700000000, "model": MODEL}
        offset = 0
        held = ""  # the text of held tokens, sent with the next one
        try:
            if self.kv_park is not None and MARKER_KEY in (body.get("kv_transfer_params") or {}):
                await self.kv_park(body["kv_transfer_params"][MARKER_KEY])
            for i, token in enumerate(tokens):
                if self.token_delay_s:
                    await asyncio.sleep(self.token_delay_s)
                if self.die_after is not None and i == self.die_after:
                    raise ConnectionAbortedError("fake decoder died mid-stream")
                last = i == len(tokens) - 1
                text, held = ("", held + token_text(token)) if token in self.held_tokens and not last else (
                    held + token_text(token), "")
                choice: dict[str, Any] = {"index": 0, "text": text,
                                          "logprobs": self._logprobs(body, [token], offset),
                                          "finish_reason": finish if i == len(tokens) - 1 else None,
                                          "stop_reason": None}
                offset += len(token_text(token))
                if body.get("return_token_ids"):
                    choice["token_ids"] = [token]
                    if i == 0:
                        choice["prompt_token_ids"] = ids
                yield f"data: {json.dumps({**base, 'choices': [choice]})}\n\n"
            yield self._stream_end(base, body, ids, tokens)
            self.finished_streams += 1
        except asyncio.CancelledError:
            self.cancelled_streams += 1
            raise


# ---- the control-plane side of an instance -------------------------------------------------------


class FakeAgent:
    """Announces one instance (every TP rank) to the proxy; on a decoder, reports KV per ``kv_mode``.

    kv_mode: "ready" (every rank), "fail" (KvFailed from rank 0), "silent" (nothing), "one_rank" (rank 0 only).
    """

    def __init__(self, control_address: str, role: str, http_url: str, *, tp_size: int = 1, base_port: int = 0,
                 capacity_slots: int = 64, chunk_tokens: int = 16, secret: str | None = None,
                 instance_id: str | None = None, fingerprint: Fingerprint | None = None) -> None:
        self.instance_id = instance_id or f"{role}-{uuid.uuid4().hex[:8]}"
        self.role = role
        self.http_url = http_url
        self.tp_size = tp_size
        self.base_port = base_port
        self.capacity_slots = capacity_slots
        self.free_slots = capacity_slots
        self.chunk_tokens = chunk_tokens
        self.fingerprint = fingerprint
        self.kv_mode = "ready"
        self.kv_fail_cause = KvFailCause.UNKNOWN  # what a KvFailed says ("fail" mode)
        self.kv_delay_s = 0.0
        self.kv_chunks_held: int | None = None  # report KvReady's chunks_held / bytes_received (None: old peer)
        self.kv_requests: list[str] = []
        self.reported: list[str] = []  # req_ids whose KvReady / KvFailed it sent, in order
        self.park_timeout_s = 5.0  # the decoder's p2p.router_kv_timeout_s: a parked decode then computes the rest
        self.load_s = 0.05  # a parked decode's engine step once its KV landed (the KvReady is out by then)
        self._landed: dict[str, asyncio.Event] = {}
        self._codec = Codec(secret)
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(control_address)
        self.proxy_name = dialled_name(control_address)  # as a real instance addresses the proxy
        self._tasks: set[asyncio.Task[None]] = set()

    def control_port(self, rank: int) -> int:
        return self.base_port + rank if self.base_port else 0

    def transport_port(self, rank: int) -> int:
        return self.base_port + 100 + rank if self.base_port else 0

    async def send(self, msg: Any) -> None:
        await self._sock.send_multipart(self._codec.pack(msg, self.proxy_name))

    async def announce(self) -> None:
        for rank in range(self.tp_size):
            await self.send(Announce(
                version=PROTOCOL_VERSION, instance_id=self.instance_id, role=self.role, http_url=self.http_url,
                tp_rank=rank, tp_size=self.tp_size, control_host="127.0.0.1" if self.base_port else "",
                control_port=self.control_port(rank), transport_port=self.transport_port(rank),
                capacity_slots=self.capacity_slots, free_slots=self.free_slots, slot_bytes=1 << 20,
                chunk_tokens=self.chunk_tokens,
                fingerprint=msgspec.structs.replace(self.fingerprint, tp_rank=rank) if self.fingerprint else None,
            ))

    async def goodbye(self) -> None:
        for rank in range(self.tp_size):
            await self.send(Goodbye(instance_id=self.instance_id, tp_rank=rank))

    def on_kv(self, spec: dict[str, Any]) -> None:
        """The fake sender wrote this request's KV here: report it (in the background)."""
        self.kv_requests.append(spec["req_id"])
        task = asyncio.get_running_loop().create_task(self._report(spec["req_id"]))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def parked(self, marker: dict[str, Any]) -> None:
        """A marked decode's wait for its KV on this decoder: until every rank's KV landed, at most
        ``park_timeout_s``."""
        landed = self._landed.setdefault(marker["req_id"], asyncio.Event())
        try:
            await asyncio.wait_for(landed.wait(), self.park_timeout_s)
        except TimeoutError:
            return
        await asyncio.sleep(self.load_s)

    async def _report(self, req_id: str) -> None:
        if self.kv_delay_s:
            await asyncio.sleep(self.kv_delay_s)
        self.reported.append(req_id)
        if self.kv_mode == "fail":
            await self.send(KvFailed(req_id=req_id, instance_id=self.instance_id, tp_rank=0, reason="buffer full",
                                     cause=self.kv_fail_cause))
        elif self.kv_mode in ("ready", "one_rank"):
            await self.report_ready(req_id, range(self.tp_size) if self.kv_mode == "ready" else range(1))

    async def report_ready(self, req_id: str, ranks: range | None = None) -> None:
        """KvReady for ``req_id`` from ``ranks`` (every rank: None); once every rank's is out, a decode parked
        for it goes on."""
        ranks = range(self.tp_size) if ranks is None else ranks
        for rank in ranks:
            held = self.kv_chunks_held
            extra = {} if held is None else {"chunks_held": held, "bytes_received": (3 - held) << 20}
            await self.send(KvReady(req_id=req_id, instance_id=self.instance_id, tp_rank=rank, chunks=3,
                                    nbytes=3 << 20, **extra))
        if len(ranks) == self.tp_size:
            self._landed.setdefault(req_id, asyncio.Event()).set()

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self._sock.close(linger=0)
        self._ctx.term()


class KvNetwork:
    """Routes a fake prefiller's "KV transfer" to the decoder agent the disagg_spec names."""

    def __init__(self) -> None:
        self._by_port: dict[int, FakeAgent] = {}
        self.specs: list[dict[str, Any]] = []

    def add(self, agent: FakeAgent) -> None:
        self._by_port[agent.control_port(0)] = agent

    def agent_for(self, spec: dict[str, Any]) -> FakeAgent | None:
        """The decoder agent ``spec`` sends the KV to (None: no decoder of this network listens there)."""
        return self._by_port.get(spec["receiver_alloc_port"][0])

    async def deliver(self, spec: dict[str, Any]) -> None:
        self.specs.append(spec)
        agent = self.agent_for(spec)
        if agent is not None:
            agent.on_kv(spec)


class FakeReceiverControl:
    """A decoder's receiver control sockets (one ROUTER per TP rank, on consecutive ports) for Cancel.

    Like ``ReceiveService``: a Cancel is answered with Ack, and the request is reported failed to
    the proxy (through ``agent``, once set) from that rank.
    """

    def __init__(self, tp_size: int = 1, secret: str | None = None) -> None:
        self.cancels: list[tuple[int, Cancel]] = []  # (rank, message)
        self.signers: list[str] = []  # who signed each Cancel ("" without a secret)
        self.agent: FakeAgent | None = None
        self._ctx = zmq.asyncio.Context()
        self._socks = self._bind_consecutive(tp_size)
        self.port = int(self._socks[0].getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
        # Like a receiver, it answers to its ranks' control addresses (a Cancel names the one it is for).
        self._codec = Codec(secret, names=[f"127.0.0.1:{self.port + rank}" for rank in range(tp_size)])
        self._tasks = [asyncio.get_running_loop().create_task(self._serve(rank, sock))
                       for rank, sock in enumerate(self._socks)]

    def req_ids(self, rank: int = 0) -> list[str]:
        return [msg.req_id for r, msg in self.cancels if r == rank]

    def _bind_consecutive(self, tp_size: int) -> list[zmq.asyncio.Socket]:
        for _ in range(20):
            socks = [self._ctx.socket(zmq.ROUTER) for _ in range(tp_size)]
            for sock in socks:
                sock.setsockopt(zmq.LINGER, 0)
            base = socks[0].bind_to_random_port("tcp://127.0.0.1", min_port=30000, max_port=60000)
            try:
                for rank, sock in enumerate(socks[1:], start=1):
                    sock.bind(f"tcp://127.0.0.1:{base + rank}")
                return socks
            except zmq.ZMQError:
                for sock in socks:
                    sock.close(linger=0)
        raise AssertionError("no consecutive free ports")

    async def _serve(self, rank: int, sock: zmq.asyncio.Socket) -> None:
        while True:
            identity, *frames = await sock.recv_multipart()
            env = self._codec.open(frames)
            msg = env.msg
            assert isinstance(msg, Cancel), msg
            self.cancels.append((rank, msg))
            self.signers.append(env.sender)
            await sock.send_multipart([identity, *self._codec.pack(Ack(msg.seq), env.sender)])
            if self.agent is not None:
                await self.agent.send(KvFailed(req_id=msg.req_id, instance_id=self.agent.instance_id, tp_rank=rank,
                                               reason=f"cancelled by sender: {msg.reason}"))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.wait(self._tasks, timeout=2)
        for sock in self._socks:
            sock.close(linger=0)
        self._ctx.term()
