"""The model's tokenizer in the proxy: exact prompt token counts, and the client's output text.

Where it comes from (``--tokenizer``):

* a path: that folder (or hub-style name already in the local cache) is loaded;
* ``auto`` (default): the model folder an instance serves (``root`` of its ``GET /v1/models``),
  when that path exists on the proxy's machine (``lmcache-p2p launch`` runs everything on one host);
* ``none``: no tokenizer.

It is loaded once, in a thread, as soon as an instance names its folder, and shared by every
request. The library it needs (``transformers``' AutoTokenizer, which imports torch) is imported before
the process serves anything (:func:`wait_imported`): its C extensions initialise holding the GIL for
seconds, many times that on a loaded machine, and would stall the event loop (every request, ``/health``,
``/instances``, the control socket) if imported beside it. Only fast tokenizers (``tokenizers``-backed, as
vLLM's own fast detokenizer) are used; a slow one is treated as no tokenizer, with a warning.

With a tokenizer the proxy counts prompt tokens exactly (text prompts as vLLM tokenizes them;
chat messages through the model's chat template, as vLLM renders them) and makes the output text
from token ids (``http/detokenize.py``), so the decoder always gets prompt ids + the first token.
Without one, counts are estimates (``--chars-per-token``) and the text comes from the instances.
A long text prompt is encoded in pieces on several cores where that gives the same ids (``http/pieces.py``).
"""

from __future__ import annotations

import asyncio
import gc
import importlib
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

from lmcache_p2p.proxy.http.detokenize import OutputText, TextParams
from lmcache_p2p.proxy.http.pieces import PieceEncoder
from lmcache_p2p.proxy.errors import ProxyError
from lmcache_p2p.proxy.router.registry import Instance
from lmcache_p2p.proxy.http.shaping import ClientRequest
from lmcache_p2p.proxy.upstream import Upstream

logger = logging.getLogger(__name__)

AUTO = "auto"
NONE = "none"
# What AutoTokenizer is imported from: ``import transformers`` alone is a lazy shell, this imports torch and the rest.
TOKENIZER_MODULE = "transformers.models.auto.tokenization_auto"
# mixed scripts, digits, whitespace runs, punctuation and markup: where two tokenizers of one vocabulary differ
_PROBE_TEXT = "Hello, world!  12 345.6 ünïcödé 中文 ½ <b>x</b>\n\tEnd"


class ProxyTokenizer:
    """A loaded Hugging Face fast tokenizer."""

    def __init__(self, hf_tokenizer: Any, source: str) -> None:
        self.hf = hf_tokenizer
        self.backend = hf_tokenizer._tokenizer  # tokenizers.Tokenizer: what DecodeStream steps with
        self.source = source
        self._fast_encode = self._backend_encodes_as_hf()
        self._pieces = PieceEncoder.of(self.backend) if self._fast_encode else None

    def prompt_tokens(self, req: ClientRequest) -> int | None:
        """The prompt's exact token count as vLLM would tokenize it (None: cannot tell here)."""
        ids = self.prompt_ids(req)
        return None if ids is None else len(ids)

    def prompt_ids(self, req: ClientRequest) -> list[int] | None:
        """The prompt's token ids as vLLM would make them (None: a prompt this proxy cannot render)."""
        if req.prompt_ids is not None:
            return list(req.prompt_ids)
        try:
            return self.chat_prompt_ids(req.body) if req.is_chat else self.text_prompt_ids(req.body)
        except Exception as exc:  # a template or content this proxy cannot render: the estimate stands
            logger.debug("cannot tokenize the prompt in the proxy (%s: %s): using the estimate",
                         type(exc).__name__, exc)
            return None

    def text_prompt_ids(self, body: dict[str, Any]) -> list[int]:
        prompt = body["prompt"]
        if isinstance(prompt, list):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise TypeError("the prompt is not a string")
        return self._encode(prompt, bool(body.get("add_special_tokens", True)))

    def chat_prompt_ids(self, body: dict[str, Any]) -> list[int]:
        """vLLM's chat path: render the template to text, then tokenize (add_special_tokens false by default)."""
        kwargs = dict(body.get("chat_template_kwargs") or {})
        kwargs.update(add_generation_prompt=body.get("add_generation_prompt", True),
                      continue_final_message=body.get("continue_final_message", False))
        if body.get("chat_template"):
            kwargs["chat_template"] = body["chat_template"]
        if body.get("tools"):
            kwargs["tools"] = body["tools"]
        text = self.hf.apply_chat_template([_string_content(m) for m in body["messages"]], tokenize=False, **kwargs)
        return self._encode(text, bool(body.get("add_special_tokens", False)))

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """``hf.encode``'s ids (vLLM's). From the backend without character offsets where it gives the same
        ids: a third less time on a long prompt (7.4 vs 10.3 ms at 16k tokens), which is on its TTFT; a long
        text in pieces on several cores where they give the same ids (``http/pieces.py``)."""
        if self._pieces is not None and (ids := self._pieces.encode(text, add_special_tokens)) is not None:
            return ids
        if self._fast_encode:
            return self.backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def _backend_encodes_as_hf(self) -> bool:
        """The backend alone tokenizes as ``hf.encode`` does: it has ``encode_batch_fast`` (tokenizers 0.20+),
        no truncation or padding of its own (``hf.encode`` turns them off), and agrees on the probe text."""
        backend = self.backend
        if not hasattr(backend, "encode_batch_fast") or backend.truncation or backend.padding:
            return False
        try:
            return all(backend.encode_batch_fast([_PROBE_TEXT], add_special_tokens=special)[0].ids
                       == list(self.hf.encode(_PROBE_TEXT, add_special_tokens=special)) for special in (True, False))
        except Exception as exc:  # a tokenizer the backend cannot run alone: hf.encode it is
            logger.debug("tokenizer backend cannot encode alone (%s: %s)", type(exc).__name__, exc)
            return False

    def output_text(self, prompt_ids: Sequence[int], params: TextParams, replay: Sequence[int] = ()) -> OutputText:
        return OutputText(self.backend, prompt_ids, params, replay)


def _string_content(message: Any) -> dict[str, Any]:
    """vLLM's "string" content format: text parts joined by newlines; anything else is refused."""
    if not isinstance(message, dict):
        raise TypeError("a message is not an object")
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise TypeError("non-text content")
            texts.append(part.get("text") or "")
        return {**message, "content": "\n".join(texts)}
    return message


def load_tokenizer(path: str) -> ProxyTokenizer | None:
    """Load the tokenizer in ``path`` (blocking: call it in a thread). None when it is not a fast one."""
    auto_tokenizer = import_library().AutoTokenizer  # lazy: seconds to import

    hf = auto_tokenizer.from_pretrained(path)
    if not hasattr(hf, "_tokenizer"):
        logger.warning("the tokenizer in %s is not a fast (tokenizers-backed) one: the proxy cannot detokenize "
                       "as vLLM's fast detokenizer does; text comes from the instances (--tokenizer)", path)
        return None
    return ProxyTokenizer(hf, path)


class TokenizerProvider:
    """Loads the tokenizer once, at first use, off the event loop; ``get`` is cheap afterwards.

    It also learns the served context length (``max_model_len`` of ``GET /v1/models``), which
    tells when a prompt + the output so far fill the context (no decode can follow).
    """

    def __init__(self, source: str, upstream: Upstream | None, timeout_s: float, *, load_timeout_s: float) -> None:
        self._source = source or AUTO
        self._upstream = upstream
        self._timeout_s = timeout_s
        self._load_timeout_s = load_timeout_s  # --tokenizer-load-timeout-s
        self._loading: asyncio.Task[ProxyTokenizer | None] | None = None
        self._done = upstream is None and self._source in (AUTO, NONE)
        self._tokenizer: ProxyTokenizer | None = None
        self._prefetch: asyncio.Task[Any] | None = None
        self._checks: set[asyncio.Task[None]] = set()
        self.max_model_len: int | None = None

    @classmethod
    def fixed(cls, tokenizer: ProxyTokenizer | None, max_model_len: int | None = None) -> TokenizerProvider:
        """A provider that already holds ``tokenizer`` (tests, embedding)."""
        provider = cls(NONE, None, 0.0, load_timeout_s=0.0)
        provider._tokenizer, provider.max_model_len, provider._done = tokenizer, max_model_len, True
        return provider

    @property
    def settled(self) -> bool:
        """Loaded, or known to be absent: ``get`` answers at once."""
        return self._done

    @property
    def loaded_source(self) -> str | None:
        """Where the loaded tokenizer came from (None: not loaded, or none)."""
        return self._tokenizer.source if self._tokenizer is not None else None

    def prefetch(self) -> None:
        """Import the tokenizer library in a thread now (seconds), so the first request waits for the load alone."""
        if not self._done and self._prefetch is None and self._source != NONE:
            self._prefetch = asyncio.get_running_loop().create_task(
                asyncio.to_thread(import_library), name="proxy-tokenizer-import")
            self._prefetch.add_done_callback(_log_prefetch_failure)

    async def import_before_serving(self) -> None:
        """Import the tokenizer library before the proxy serves (:func:`wait_imported`); nothing without one."""
        self.prefetch()
        if self._prefetch is not None:
            await wait_imported(self._prefetch, self._load_timeout_s)

    async def get(self, instances: Sequence[Instance], wait_s: float | None = None) -> ProxyTokenizer | None:
        """The tokenizer, loading it if needed; waits at most ``wait_s`` (None: until loaded) and answers
        None meanwhile: a request never stalls behind a slow first load (seen: 36 s of TTFT on the
        first GPU requests), it just goes without exact counts and proxy-made text."""
        if self._done:
            return self._tokenizer
        if self._loading is None:
            self._loading = asyncio.get_running_loop().create_task(self._load(instances), name="proxy-tokenizer")
        loading = self._loading
        try:
            tokenizer = await asyncio.wait_for(asyncio.shield(loading), wait_s)
        except TimeoutError:
            return None  # still loading: this request goes without; the load carries on
        except Exception as exc:  # no instance answered /v1/models yet: try again with the next request
            logger.debug("tokenizer not loaded yet: %s", exc)
            if self._loading is loading:
                self._loading = None
            return None
        self._tokenizer, self._done = tokenizer, True
        _freeze_heap()
        return tokenizer

    async def load_in_background(self, instances: Callable[[], Sequence[Instance]],
                                 retry_s: float = 0.5) -> None:
        """Load as soon as an instance can tell what it serves, before any request needs it (a task
        of the proxy; ends once settled)."""
        self.prefetch()
        while not self._done:
            found = instances()
            if found or self._source not in (AUTO,):
                await self.get(found)
            if not self._done:
                await asyncio.sleep(retry_s)

    async def _load(self, instances: Sequence[Instance]) -> ProxyTokenizer | None:
        root = await self._served_model(instances) if self._upstream is not None else None
        path = self._source
        if path == NONE:
            return None
        if path == AUTO:
            if root is None or not os.path.isdir(root):
                logger.warning("the served model %r is not a folder on the proxy's machine: no tokenizer in the "
                               "proxy (pass --tokenizer DIR for exact prompt counts and every prompt's KV used)", root)
                return None
            path = root
        if self._prefetch is not None:  # a second thread importing transformers meanwhile sees it half-initialized
            done, _ = await asyncio.wait({self._prefetch}, timeout=self._load_timeout_s)  # (AutoTokenizer missing)
            if not done:  # raised to ``get``, which lets a later request try again
                logger.warning("importing transformers for the tokenizer took more than %g s: no tokenizer for now "
                               "(raise --tokenizer-load-timeout-s)", self._load_timeout_s)
                raise ProxyError(f"importing transformers took more than {self._load_timeout_s:g} s "
                                 "(--tokenizer-load-timeout-s)")
        try:
            tokenizer = await asyncio.to_thread(load_tokenizer, path)
        except Exception as exc:
            logger.warning("cannot load the tokenizer from %s (%s: %s): prompt counts are estimates and text comes "
                           "from the instances; pass --tokenizer DIR", path, type(exc).__name__, exc)
            return None
        if tokenizer is None or not await self._agrees_with_instances(tokenizer, instances):
            return None
        logger.info("tokenizer loaded from %s: exact prompt counts, prompt ids to the prefillers, output text made "
                    "in the proxy", path)
        task = asyncio.get_running_loop().create_task(self._check_all(tokenizer, instances), name="proxy-text-check")
        self._checks.add(task)
        task.add_done_callback(self._checks.discard)
        return tokenizer

    async def check_instance(self, inst: Instance) -> None:
        """``inst`` came up: once the tokenizer is loaded, learn whether ``inst`` tokenizes as it does
        (``Instance.makes_text``: its empty first text is then the token's own, see ``flow/output.py``)."""
        if self._done and self._tokenizer is not None:
            await self._learn(self._tokenizer, inst)

    async def _check_all(self, tokenizer: ProxyTokenizer, instances: Sequence[Instance]) -> None:
        for inst in instances:
            await self._learn(tokenizer, inst)

    async def _learn(self, tokenizer: ProxyTokenizer, inst: Instance) -> None:
        if not inst.makes_text:
            inst.makes_text = await self._tokenizes_as(tokenizer, inst) is True

    async def _agrees_with_instances(self, tokenizer: ProxyTokenizer, instances: Sequence[Instance]) -> bool:
        """The instances tokenize a probe text as ``tokenizer`` does (one ``/tokenize``).

        The proxy sends the prefillers the prompt ids it made and makes the client's text from ids, so a
        tokenizer other than the instances' (vLLM started with its own ``--tokenizer`` or
        ``--tokenizer-mode``) would give wrong answers, not only wrong text: such a tokenizer is not
        used. An instance that cannot tokenize (``--skip-tokenizer-init``) or does not answer leaves it
        unchecked.
        """
        if self._upstream is None:
            return True
        for inst in instances:
            agrees = await self._tokenizes_as(tokenizer, inst)
            if agrees is None:
                continue
            inst.makes_text = agrees  # not asked again by the check of every instance after the load
            if not agrees:
                logger.warning("the tokenizer in %s makes other ids of a probe text than %s's vLLM: not used (prompt "
                               "counts are estimates, prompts go to the instances as text and text comes from them); "
                               "pass --tokenizer DIR naming the tokenizer the instances use", tokenizer.source,
                               inst.instance_id)
            return agrees
        logger.info("no instance could tokenize a probe text: the tokenizer in %s is used unchecked", tokenizer.source)
        return True

    async def _tokenizes_as(self, tokenizer: ProxyTokenizer, inst: Instance) -> bool | None:
        """Whether ``inst``'s ``/tokenize`` makes ``tokenizer``'s ids of a probe text; None: it did not answer
        (``--skip-tokenizer-init``: it has no tokenizer)."""
        assert self._upstream is not None
        try:
            answer = await self._upstream.post_json(inst.http_url, "/tokenize",
                                                    {"prompt": _PROBE_TEXT, "add_special_tokens": True},
                                                    timeout_s=self._timeout_s)
        except ProxyError as exc:
            logger.debug("%s cannot check the tokenizer (%s)", inst.instance_id, exc)
            return None
        except Exception as exc:  # e.g. the proxy closing its session meanwhile: unknown, not fatal
            logger.warning("checking %s's tokenizer failed: %r", inst.instance_id, exc)
            return None
        return answer.get("tokens") == tokenizer.hf.encode(_PROBE_TEXT, add_special_tokens=True)

    async def _served_model(self, instances: Sequence[Instance]) -> str | None:
        """``root`` of an instance's /v1/models (and its ``max_model_len``). Raises when no instance answers."""
        assert self._upstream is not None
        error: Exception = ProxyError("no instance to ask for its model")
        for inst in instances:
            try:
                answer = await self._upstream.get_json(inst.http_url, "/v1/models", timeout_s=self._timeout_s)
            except ProxyError as exc:
                error = exc
                continue
            data = answer.get("data")
            card = data[0] if isinstance(data, list) and data and isinstance(data[0], dict) else {}
            if isinstance(card.get("max_model_len"), int):
                self.max_model_len = card["max_model_len"]
            root = card.get("root")
            return root if isinstance(root, str) else None
        raise error


def import_library() -> Any:
    """The module AutoTokenizer comes from, imported (blocking: seconds)."""
    return importlib.import_module(TOKENIZER_MODULE)


async def wait_imported(importing: asyncio.Task[Any], timeout_s: float) -> None:
    """Wait at most ``timeout_s`` (``--tokenizer-load-timeout-s``) for ``importing``, the tokenizer library's import
    in a thread, before the process serves anything: the import holds the GIL while C extensions initialise
    (torch's), so beside a serving event loop it would stall every request and control message on it. Past the
    timeout the process serves anyway and the import goes on (a warning names the key)."""
    done, _ = await asyncio.wait({importing}, timeout=timeout_s)
    if not done:
        logger.warning("importing %s took more than %g s: serving meanwhile, which the import may stall until it ends "
                       "(--tokenizer-load-timeout-s; --tokenizer none goes without)", TOKENIZER_MODULE, timeout_s)


def _log_prefetch_failure(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.warning("importing transformers failed (%s): the proxy will have no tokenizer", task.exception())


def _freeze_heap() -> None:
    """Put every object alive now out of the garbage collector's reach (``gc.freeze``, as vLLM's
    API server does after start-up). ``transformers`` and its imports leave hundreds of thousands of
    long-lived objects; each full collection would walk them all while the event loop, and every
    request in it, stands still."""
    gc.freeze()
