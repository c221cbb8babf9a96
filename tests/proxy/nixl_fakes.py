"""Fake vLLM instances running vLLM's NixlConnector (pull mode) or NixlPushConnector, as far as the proxy sees
them.

The contract they keep (vLLM 0.32, ``nixl/pull_scheduler.py``):

* prefiller: a request with ``kv_transfer_params.do_remote_decode`` keeps its prompt's KV blocks and answers
  ``kv_transfer_params`` naming them (``remote_engine_id``, ``remote_request_id``, ``remote_block_ids``,
  ``remote_host``, ``remote_port``, ``tp_size``, ``do_remote_prefill: true``); it returns no first token of
  its own (only ``token_ids`` when asked).
* decoder: a request with ``do_remote_prefill`` pulls those blocks: they must exist (not pulled already,
  not lost) and cover exactly its prompt, else the request fails with an error event in its stream (vLLM's
  ``kv_load_failure_policy: fail``); a pull frees the blocks on the prefiller.
* ``/metrics``: ``vllm:kv_cache_usage_perc`` and ``vllm:cache_config_info`` (blocks, block size).
* request ids as vLLM makes them of the ``X-Request-Id`` header (a random one without it):
  ``cmpl-{id}-{prompt index}-{8 random}`` for a completion, ``chatcmpl-{id}-{8 random}`` for a chat.
* push mode (``NixlNetwork.push``, ``nixl/push_scheduler.py`` and ``push_worker.py``): the prefiller answers
  ``transfer_mode: push``, and the decoder's blocks are written by the prefiller whose finished request has
  the decoder's request id once the random suffix is cut off both (``get_base_request_id``); a decode that
  no prefill matches waits for a push that never comes (its stream stays silent).
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import json
import re
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from .fakes import FakeVllm, tokenize

_request_id: contextvars.ContextVar[str] = contextvars.ContextVar("fake_vllm_request_id")
_RANDOM_SUFFIX = re.compile(r"-[0-9a-f]{8}$")


def vllm_request_id(kind: str, request: Request) -> str:
    """vLLM 0.32's engine request id of an HTTP request (``kind``: cmpl or chatcmpl)."""
    base = request.headers.get("x-request-id") or uuid.uuid4().hex
    index = "-0" if kind == "cmpl" else ""
    return f"{kind}-{base}{index}-{uuid.uuid4().hex[:8]}"


def base_request_id(request_id: str) -> str:
    return _RANDOM_SUFFIX.sub("", request_id)


@dataclasses.dataclass
class Held:
    engine: str
    prompt_ids: list[int]


class NixlNetwork:
    """The blocks prefillers hold for decoders, and what decoders pulled."""

    def __init__(self) -> None:
        self.held: dict[str, Held] = {}  # remote_request_id -> what the prefiller keeps
        self.pulls: list[tuple[str, str, list[int]]] = []  # (decoder, remote_request_id, prompt)
        self.failed_pulls: list[tuple[str, str]] = []  # (decoder, why)
        self.die_first_stream_after: int | None = None  # the first decode stream of the cluster dies after n tokens
        self.break_first_prefill = False  # the first prefiller asked to keep KV dies with the request in hand
        self.hang_first_pull = False  # the first decoder's pull never completes (its stream stays silent)
        self.hang_first_pull_headers = False  # ... and its decoder never even answers the decode's headers
        self.push = False  # the instances run NixlPushConnector
        self.unmatched_pushes: list[str] = []  # decoders' request ids that no finished prefill matched

    def keep(self, engine: str, prompt_ids: list[int], request_id: str) -> str:
        self.held[request_id] = Held(engine, list(prompt_ids))
        return request_id

    def pushed_to(self, decoder_request_id: str) -> str | None:
        """Push mode: the prefill whose blocks the decoder's request gets (None: none matches, nothing comes)."""
        base = base_request_id(decoder_request_id)
        match = next((rid for rid in self.held if base_request_id(rid) == base), None)
        if match is None:
            self.unmatched_pushes.append(decoder_request_id)
        return match

    def pull(self, decoder: str, params: dict[str, Any], prompt_ids: list[int]) -> str | None:
        """None when the pull worked, else why not."""
        held = self.held.pop(str(params.get("remote_request_id")), None)
        problem = None
        if held is None:
            problem = "no such blocks on the prefiller (lost, expired or pulled already)"
        elif held.engine != params.get("remote_engine_id"):
            problem = f"blocks belong to {held.engine}"
        elif held.prompt_ids != prompt_ids:
            problem = f"blocks cover {len(held.prompt_ids)} tokens, the decode's prompt is {len(prompt_ids)}"
        if problem is None:
            self.pulls.append((decoder, str(params["remote_request_id"]), list(prompt_ids)))
        else:
            self.failed_pulls.append((decoder, problem))
        return problem


class FakeNixlVllm(FakeVllm):
    """A ``FakeVllm`` with ``--kv-transfer-config {"kv_connector": "NixlConnector", "kv_role": "kv_both"}``."""

    def __init__(self, name: str, network: NixlNetwork, side_channel_port: int) -> None:
        super().__init__(name)
        self.network = network
        self.engine_id = f"engine-{name}"
        self.side_channel_port = side_channel_port
        self.blocks = 64
        self.block_size = 16
        self.usage = 0.0  # vllm:kv_cache_usage_perc
        self.metrics_status = 200
        self.metrics_delay_s = 0.0
        self.metrics_asked = 0  # GET /metrics requests received
        self.server._app.router.routes.append(Route("/metrics", self._metrics, methods=["GET"]))

    async def _chat(self, request: Request) -> Any:
        _request_id.set(vllm_request_id("chatcmpl", request))
        body = await request.json()
        # vLLM 0.32 prompts a chat with the ids forwarded for decode-side reuse (kv_transfer_params.prompt_token_ids)
        forwarded = (body.get("kv_transfer_params") or {}).get("prompt_token_ids")
        refused = await self._kv_load(body, "/v1/chat/completions", forwarded or [])
        return refused if refused is not None else await super()._chat(request)

    async def _completions(self, request: Request) -> Any:
        _request_id.set(vllm_request_id("cmpl", request))
        body = await request.json()
        refused = await self._kv_load(body, "/v1/completions", self._prompt_of(body))
        return refused if refused is not None else await super()._completions(request)

    async def _kv_load(self, body: dict[str, Any], path: str, prompt_ids: list[int]) -> Any:
        """A decode's pull (or wait for a push) of the KV its params name: None when it got it (or needs none),
        else what the decoder answers instead."""
        params = body.get("kv_transfer_params") or {}
        if params.get("do_remote_prefill") and self.network.push:
            matched = self.network.pushed_to(_request_id.get())
            if matched is None:
                self.requests.append((path, body))
                return StreamingResponse(_silent(), media_type="text/event-stream")
            params = body["kv_transfer_params"] = {**params, "remote_request_id": matched}  # what it was written
        if params.get("do_remote_prefill") and self.network.hang_first_pull_headers:
            self.network.hang_first_pull_headers = False
            self.requests.append((path, body))
            await asyncio.sleep(3600)  # cancelled when the proxy closes the connection
        if params.get("do_remote_prefill") and self.network.hang_first_pull:
            self.network.hang_first_pull = False
            self.requests.append((path, body))
            return StreamingResponse(_silent(), media_type="text/event-stream")
        if params.get("do_remote_prefill"):
            problem = self.network.pull(self.name, params, prompt_ids)
            if problem is not None:
                self.requests.append((path, body))
                return _stream_error(f"KV load failed: {problem}")
            if self.network.die_first_stream_after is not None and body.get("stream"):
                # this decoder's streams die from now on (a killed engine); the proxy moves this one elsewhere
                self.die_after, self.network.die_first_stream_after = self.network.die_first_stream_after, None
        if params.get("do_remote_decode") and self.network.break_first_prefill:
            self.network.break_first_prefill, self.break_next = False, 1
        return None

    def _answer(self, obj: str, choices: list[Any], ids: list[int], tokens: list[int],
                body: dict[str, Any]) -> dict[str, Any]:
        answer = super()._answer(obj, choices, ids, tokens, body)
        params = body.get("kv_transfer_params") or {}
        if params.get("do_remote_decode"):
            request_id = self.network.keep(self.engine_id, ids, _request_id.get())
            answer["kv_transfer_params"] = {
                "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2, 3]],
                "remote_engine_id": self.engine_id, "remote_request_id": request_id, "remote_host": "127.0.0.1",
                "remote_port": self.side_channel_port, "tp_size": 1, "remote_num_tokens": len(ids),
                "transfer_mode": "push" if self.network.push else "pull",
            }
        return answer

    def _prompt_of(self, body: dict[str, Any]) -> list[int]:
        prompt = body["prompt"]
        return list(prompt) if isinstance(prompt, list) else tokenize(prompt)

    async def _metrics(self, request: Request) -> Any:
        self.metrics_asked += 1
        if self.metrics_delay_s:
            await asyncio.sleep(self.metrics_delay_s)
        if self.metrics_status != 200:
            return JSONResponse({"error": "down"}, status_code=self.metrics_status)
        text = (
            "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n"
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f'vllm:kv_cache_usage_perc{{engine="0",model_name="tiny"}} {self.usage}\n'
            "# TYPE vllm:cache_config_info gauge\n"
            f'vllm:cache_config_info{{block_size="{self.block_size}",cache_dtype="auto",engine="0",'
            f'num_cpu_blocks="None",num_gpu_blocks="{self.blocks}",prefix_caching_hash_algo="sha256"}} 1.0\n'
        )
        return PlainTextResponse(text)


async def _silent() -> Any:
    """A decode waiting for a pull that never completes (vLLM sets no deadline on it)."""
    await asyncio.sleep(3600)
    yield "data: [DONE]\n\n"


def _stream_error(message: str) -> StreamingResponse:
    """vLLM's answer to a decode whose KV load failed (``FinishReason.ERROR``): an error event, then [DONE]."""
    async def events() -> Any:
        yield f"data: {json.dumps({'error': {'message': message, 'type': 'InternalServerError', 'code': 500}})}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")
