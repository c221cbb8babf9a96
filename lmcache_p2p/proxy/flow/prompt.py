"""One request's prompt as the proxy learns it before routing: its ids (the client's, else as the proxy's
tokenizer makes them), cut as ``truncate_prompt_tokens`` says, their exact count, and their chunk hashes for
the prefix policy.

A text completion's ids go to the prefiller in place of its text (``prefill_body``): the prompt is then
tokenized once per request, here, not again in the prefiller's API server. A short prompt is tokenized on
the event loop (its encoding costs less than the hop to a thread and back), a long one in a thread, so
that the loop keeps serving other requests.

It owns that measurement only. It must not route or send anything: the flow (``flow/flow.py``) does, with
what it returns.
"""

from __future__ import annotations

import asyncio
import dataclasses

from lmcache_p2p.config import Role
from lmcache_p2p.proxy.flow.context import RequestContext, Services
from lmcache_p2p.proxy.http.shaping import ClientRequest, truncate_prompt
from lmcache_p2p.proxy.http.tokenizer import ProxyTokenizer

INLINE_TOKENIZE_MAX_TOKENS = 2048  # estimated prompt tokens (--chars-per-token) tokenized on the event loop


async def measure(s: Services, ctx: RequestContext, req: ClientRequest) -> tuple[ClientRequest, ProxyTokenizer | None]:
    """``req`` with its exact prompt token count when the proxy has the tokenizer (kept for the text), and that
    tokenizer (None: the proxy has none; it waits at most ``--tokenizer-wait-s`` for its first load)."""
    instances = [] if s.tokenizers.settled else s.registry.routable(Role.SENDER) + s.registry.routable(Role.RECEIVER)
    tokenizer = await s.tokenizers.get(instances, s.settings.tokenizer_wait_s)
    ids = await prompt_ids(req, tokenizer)
    if ids is not None and req.truncates:
        ids = truncate_prompt(req, ids, s.tokenizers.max_model_len)
    if ids and s.router.uses_prefix:
        ctx.prefix = s.router.prompt_prefix(ids)
    if ids is None:
        return req, tokenizer
    if req.prompt_ids is not None:
        return dataclasses.replace(req, prompt_ids=tuple(ids), exact_prompt_tokens=len(ids)), tokenizer
    # a truncated text goes to the prefiller as text: vLLM keeps the tokenizer's special tokens when it
    # truncates a text, which a cut of the ids would not
    return dataclasses.replace(req, exact_prompt_tokens=len(ids),
                               tokenized_ids=None if req.is_chat or req.truncates else tuple(ids)), tokenizer


async def prompt_ids(req: ClientRequest, tokenizer: ProxyTokenizer | None) -> list[int] | None:
    """The prompt's ids: the client's, else as ``tokenizer`` makes them (None: no tokenizer, or a prompt it
    cannot render)."""
    if req.prompt_ids is not None:
        return list(req.prompt_ids)
    if tokenizer is None:
        return None
    if req.prompt_tokens_estimate <= INLINE_TOKENIZE_MAX_TOKENS:
        return tokenizer.prompt_ids(req)
    return await asyncio.to_thread(tokenizer.prompt_ids, req)
