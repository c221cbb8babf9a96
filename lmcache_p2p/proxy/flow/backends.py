"""What differs between the KV backends a request can run on, as one small strategy per backend.

A request runs on one path (admission, placement, prefill attempts, handover, decode, migration) whatever
its pair runs; the pair's backend (``Instance.backend``: a prefiller and a decoder pair only when they run
the same one) picks the strategy here, which answers three questions:

* how a prefill is asked and its KV handed over (:meth:`KvBackend.attempt`, a :class:`KvAttempt`):
  - ``lmcache_p2p`` (:class:`PushedAttempt`): ``kv_transfer_params.disagg_spec`` names the decoder's
    receive ports; the prefiller pushes the KV there during the prefill and the proxy waits for KvReady
    from every rank of the decoder; KV the decode does not load is cancelled on the decoder.
  - ``vllm-nixl`` (:class:`PulledAttempt`, vLLM's NixlConnector two-stage flow):
    ``{"do_remote_decode": true, ...}`` asks the prefiller to keep the prompt's KV blocks; its answer's
    ``kv_transfer_params`` (engine id, block ids, side-channel host and port, TP size) go in the decode
    request, and the decoder pulls the blocks before it decodes. Nothing to wait for at the proxy;
    blocks nobody pulls are the prefiller's to free (its ``kv_lease_duration``). The prefill and its decode
    carry one ``X-Request-Id`` (the attempt's ``req_id``), as vllm-router sends them: vLLM's
    NixlPushConnector (the prefiller writes into blocks the decoder registered) pairs the two by vLLM's
    request id, made of it; its prefiller answers ``transfer_mode: push``, which the proxy learns
    (``Instance.pushes_kv``). A chat prefill's id (``chatcmpl-...``) never pairs with the decode's (a
    completion, ``cmpl-...``), so on a prefiller known to push a chat prefill goes as a /v1/completions of
    the prompt's ids (:meth:`KvBackend.prefills_ids`) as the prefiller's /tokenize renders them, where that
    is how its chat endpoint renders them (no tools or tool calls: ``shaping.tokenizes_as_chat``). Any
    other chat KV on a push prefiller counts as failed at once and ``--on-kv-failure`` applies (``retry``:
    a /v1/completions prefill of the ids the chat prefill answered with).
* what the decode carries (:attr:`KvBackend.decode_prompt_is_prefill_prompt`): ours takes prompt + every
  token the client has (it computes the first token's KV itself); a NixlConnector decoder must be
  prompted with exactly the prompt the prefiller computed (its blocks cover that prompt and no more), so
  it generates the first token again, which the client already has (``Target.replays``). Under sampling
  the two draws may differ, so there the client's first token is the decoder's
  (:meth:`KvBackend.first_from_prefill`: greedy requests only get the prefiller's).
* where free capacity comes from and how long it is held (:attr:`KvBackend.decoder_keeps_kv`): ours
  announces its receive buffer's free slots, and the KV leaves that buffer when the decode loaded it (the
  first output); a NixlConnector decoder is polled for its paged KV cache's free blocks
  (``router/kv_metrics.py``) and holds the request's blocks until the decode ends.

With ``--early-decode`` (:attr:`KvBackend.decodes_early`: ours only) the decode goes out as soon as the prefill
answered, carrying :meth:`KvAttempt.early_params` (the marker a decoder behind vllm-router reads too,
``vllm_plugin/router_addressing.py``: the req_id and the prompt's token count), and the decoder's scheduler
holds it until that prompt's KV arrived (``vllm_plugin/foreign_router.py``) while the proxy's KV wait runs
beside it (``flow/handover.py``). A NixlConnector decode needs the prefill's answer itself, so it never goes
earlier than today.

A broken decode continues elsewhere (:attr:`KvBackend.continues_with_kv`): ours recomputes on the next
decoder; with NixlConnector the proxy prefills prompt + output so far on a prefiller and the next
decoder pulls that, so nothing is recomputed on the decoder and nothing reaches the client twice. A
decode that carries pull parameters must output within ``--kv-timeout-s`` (``Target.first_output_timeout_s``):
vLLM gives the pull itself no deadline.

Owns: the strategies and each attempt's state. Must not: choose instances, send requests (the prefill
attempts send, ``flow/prefill.py``) or wait without a deadline.
"""

from __future__ import annotations

import abc
import uuid
from typing import Any

from lmcache_p2p.proxy.flow.context import Services
from lmcache_p2p.proxy.handover.waiters import KvOutcome, KvStatus, KvWaiter
from lmcache_p2p.proxy.http.held_text import greedy
from lmcache_p2p.proxy.http.shaping import ClientRequest, kv_transfer_params, tokenizes_as_chat
from lmcache_p2p.proxy.router.instances import Backend, Instance
from lmcache_p2p.proxy.router.lease import Lease
from lmcache_p2p.vllm_plugin.router_addressing import Marker

# What vLLM's NixlConnector reads on a prefill (its toy proxy and vllm-router send exactly this).
NIXL_PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None, "remote_block_ids": None,
    "remote_host": None, "remote_port": None,
}
# What a NixlConnector decoder needs of the prefiller's answer to pull its blocks.
NIXL_DECODE_KEYS = ("remote_engine_id", "remote_block_ids", "remote_host", "remote_port")
PUSH_MODE = "push"  # the prefiller's transfer_mode when it runs NixlPushConnector


class KvAttempt(abc.ABC):
    """One attempt at getting a request's KV to its decoder, under a fresh ``req_id``."""

    def __init__(self, req_id: str, decoder: Lease, output_tokens: int) -> None:
        self.req_id = req_id
        self.decoder = decoder  # the lease whose credit this KV takes
        self.output_tokens = output_tokens  # output tokens at the end of the prefill's prompt (a continuation)
        self.prefill_sent = True  # False once every prefiller refused the connection: no KV can be on its way

    @property
    @abc.abstractmethod
    def prefill_params(self) -> dict[str, Any]:
        """The prefill's ``kv_transfer_params``."""

    @property
    def ready_at_s(self) -> float | None:
        """When the KV became ready, as the decoder's notices stamped it (None: with the prefill's answer)."""
        return None

    @property
    def request_id(self) -> str | None:
        """The ``X-Request-Id`` the prefill and the decode that takes its KV both carry (None: none)."""
        return None

    def answered(self, answer: dict[str, Any], endpoint: str, decode_endpoint: str) -> None:
        """The prefill's answer, to a prefill sent to ``endpoint`` (its decode goes to ``decode_endpoint``)."""

    @abc.abstractmethod
    async def wait(self, timeout_s: float) -> KvOutcome:
        """Until the decoder may take the KV, at most ``timeout_s``."""

    def drop(self) -> None:
        """Stop waiting (idempotent, never awaits)."""

    @property
    def can_be_overdue(self) -> bool:
        """Whether :meth:`wait` waits on the decoder (then a probe of it may end the wait early)."""
        return False

    def on_down(self, reason: str) -> None:
        """The decoder is known down: end the wait (DECODER_DOWN)."""

    def decode_params(self) -> dict[str, Any] | None:
        """The decode's ``kv_transfer_params`` (None: it carries none)."""
        return None

    def early_params(self, prompt_tokens: int) -> dict[str, Any] | None:
        """The ``kv_transfer_params`` of a decode sent before the KV is ready, whose prefill stored
        ``prompt_tokens`` tokens (None: this backend's decode cannot go before)."""
        return None

    def cancel(self, services: Services, reason: str) -> None:
        """Free the KV the decode will not (or did not) load, where the proxy can; never awaits."""


class PushedAttempt(KvAttempt):
    """lmcache_p2p: the prefiller pushes the KV into the decoder's buffer; KvReady from every rank."""

    def __init__(self, req_id: str, decoder: Lease, output_tokens: int, waiter: KvWaiter) -> None:
        super().__init__(req_id, decoder, output_tokens)
        self._waiter = waiter

    @property
    def prefill_params(self) -> dict[str, Any]:
        return kv_transfer_params(self.req_id, self.decoder.instance)

    @property
    def ready_at_s(self) -> float | None:
        return self._waiter.ready_at_s

    async def wait(self, timeout_s: float) -> KvOutcome:
        return await self._waiter.wait(timeout_s)

    def drop(self) -> None:
        self._waiter.drop()

    @property
    def can_be_overdue(self) -> bool:
        return True

    def on_down(self, reason: str) -> None:
        self._waiter.on_down(reason)

    def early_params(self, prompt_tokens: int) -> dict[str, Any] | None:
        return Marker(self.req_id, prompt_tokens).as_params()

    def cancel(self, services: Services, reason: str) -> None:
        if self.prefill_sent:
            services.canceller.cancel(self.decoder.instance, self.req_id, reason)


class PulledAttempt(KvAttempt):
    """vllm-nixl: the prefiller keeps the KV blocks; its answer tells the decoder where to pull them."""

    def __init__(self, req_id: str, decoder: Lease, output_tokens: int) -> None:
        super().__init__(req_id, decoder, output_tokens)
        self._params: dict[str, Any] | None = None
        self._problem = "the prefill has not answered"

    @property
    def prefill_params(self) -> dict[str, Any]:
        return dict(NIXL_PREFILL_PARAMS)

    @property
    def request_id(self) -> str | None:
        return self.req_id

    def answered(self, answer: dict[str, Any], endpoint: str, decode_endpoint: str) -> None:
        params = answer.get("kv_transfer_params")
        missing = [k for k in NIXL_DECODE_KEYS if not isinstance(params, dict) or params.get(k) is None]
        if missing:
            self._problem = (f"the prefiller's answer has no kv_transfer_params {', '.join(missing)} for the decoder "
                             "to pull its KV from: is it running vLLM's NixlConnector (kv_role kv_both or "
                             "kv_producer)?")
            return
        if params.get("transfer_mode") == PUSH_MODE and endpoint != decode_endpoint:  # type: ignore[union-attr]
            self._problem = (f"the prefiller runs NixlPushConnector, which pairs a prefill with its decode by vLLM's "
                             f"request id, and a prefill on {endpoint} is named unlike its decode (on "
                             f"{decode_endpoint}): its KV can never be pushed")
            return
        self._params = dict(params)  # type: ignore[arg-type]

    async def wait(self, timeout_s: float) -> KvOutcome:
        if self._params is None:
            return KvOutcome(KvStatus.FAILED, 0.0, reason=self._problem)
        return KvOutcome(KvStatus.READY, 0.0)

    def decode_params(self) -> dict[str, Any] | None:
        return self._params


class KvBackend(abc.ABC):
    """One backend's answers (see the module docstring)."""

    backend: Backend
    decode_prompt_is_prefill_prompt: bool  # the decode is prompted with the prefill's prompt alone
    decoder_keeps_kv: bool  # the decoder holds the KV from the decode's start to its end (else: until loaded)
    continues_with_kv: bool  # a broken decode continues after a prefill of prompt + output (else: recomputed)
    decodes_early: bool  # the decode may go before the KV is ready (--early-decode), with ``early_params``

    @abc.abstractmethod
    def attempt(self, services: Services, decoder: Lease, output_tokens: int) -> KvAttempt:
        """A new attempt at getting the KV of the prompt (+ ``output_tokens`` output tokens) onto ``decoder``."""

    def first_from_prefill(self, req: ClientRequest) -> bool:
        """The client's first token is the prefiller's (else the decoder generates the whole output)."""
        return True

    def prefills_ids(self, req: ClientRequest, prefiller: Instance) -> bool:
        """The prefill goes to /v1/completions with the prompt's ids (else to the client's endpoint as sent)."""
        return False

    def learn(self, prefiller: Instance, answer: dict[str, Any]) -> None:
        """What a prefill's answer tells of its prefiller."""


class LmcacheP2PBackend(KvBackend):
    backend = Backend.LMCACHE_P2P
    decode_prompt_is_prefill_prompt = False
    decoder_keeps_kv = False
    continues_with_kv = False
    decodes_early = True

    def attempt(self, services: Services, decoder: Lease, output_tokens: int) -> KvAttempt:
        req_id = uuid.uuid4().hex
        waiter = services.waiters.register(req_id, decoder.instance.tp_size, decoder.instance.instance_id)
        return PushedAttempt(req_id, decoder, output_tokens, waiter)


class VllmNixlBackend(KvBackend):
    backend = Backend.VLLM_NIXL
    decode_prompt_is_prefill_prompt = True
    decoder_keeps_kv = True
    continues_with_kv = True
    decodes_early = False

    def attempt(self, services: Services, decoder: Lease, output_tokens: int) -> KvAttempt:
        return PulledAttempt(uuid.uuid4().hex, decoder, output_tokens)

    def first_from_prefill(self, req: ClientRequest) -> bool:
        """Greedy only: the decoder generates the first token again, and only a greedy draw is the same."""
        return greedy(req)

    def prefills_ids(self, req: ClientRequest, prefiller: Instance) -> bool:
        """A chat prefill on a push prefiller: its vLLM request id must pair with the decode's, a completion's.
        Only where /tokenize renders the chat as the chat endpoint would (else: retried, as before learning)."""
        return prefiller.pushes_kv and tokenizes_as_chat(req)

    def learn(self, prefiller: Instance, answer: dict[str, Any]) -> None:
        params = answer.get("kv_transfer_params")
        if isinstance(params, dict):
            prefiller.pushes_kv = params.get("transfer_mode") == PUSH_MODE


_BACKENDS: dict[Backend, KvBackend] = {b.backend: b for b in (LmcacheP2PBackend(), VllmNixlBackend())}


def backend_of(inst: Instance) -> KvBackend:
    return _BACKENDS[inst.backend]
