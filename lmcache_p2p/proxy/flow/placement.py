"""Where one request runs: its decoder lease, the pair it prefills on, and the instance it moves to
when one fails (another prefiller or decoder, a colocated instance, a migration target).

It owns the request's lease of the decoding instance (load and KV credit, ``registry.Lease``) and
the set of instances it tried, and asks the router (``router/routing.py``) to choose among routable
instances. It must not send requests, wait for the KV or shape bodies: the prefill attempts
(``flow/prefill.py``), the handover (``flow/handover.py``) and the flow (``flow/flow.py``) do, and tell it what
failed.
"""

from __future__ import annotations

import logging
from collections.abc import Collection

from lmcache_p2p.config import Role
from lmcache_p2p.proxy.router.admission import CannotAdmit
from lmcache_p2p.proxy.errors import NoInstanceAvailable, UpstreamConnectError, UpstreamError, UpstreamUnreachable
from lmcache_p2p.proxy.flow.context import RequestContext, Services
from lmcache_p2p.proxy.router.registry import Instance, Lease
from lmcache_p2p.proxy.router.routing import (
    ColocatedReason,
    RequestCost,
    chunks_needed,
    exceeds_every_buffer,
    no_capacity,
    pairable,
)

logger = logging.getLogger(__name__)


class Placement:
    def __init__(self, services: Services, ctx: RequestContext) -> None:
        self._s = services
        self._ctx = ctx
        self._lease: Lease | None = None  # the instance that decodes (colocated: serves the whole request)
        self._tried: set[str] = set()
        self.prefilled_on: Instance | None = None  # the prefiller whose prefill answered last: it holds the prompt

    @property
    def tried(self) -> frozenset[str]:
        return frozenset(self._tried)

    @property
    def leased(self) -> Lease | None:
        return self._lease

    def lease(self) -> Lease:
        if self._lease is None:
            raise RuntimeError("no decoder leased: prefill() first")
        return self._lease

    def release(self) -> None:
        if self._lease is not None:
            self._lease.release()

    # ---- pairs ---------------------------------------------------------------------------------

    def pairable(self) -> tuple[list[Instance], ColocatedReason | None]:
        """Routable decoders that may take KV from a routable prefiller; else none and why."""
        return pairable(self._s.registry)

    def grant_decoder(self, cost: RequestCost) -> Lease | None:
        """Admission's grant: a lease with credit for the KV on a pairable decoder, None while none has
        room; raises CannotAdmit when none ever will. Never awaits."""
        decoders, reason = self.pairable()
        if reason is not None:
            raise CannotAdmit(reason, f"no decoder to pair with a prefiller any more ({reason.value})")
        decoder = self._s.router.decoder_with_room(decoders, cost, prefix=self._ctx.prefix)
        if decoder is not None:
            chunks = chunks_needed(cost.prompt_tokens, decoder.chunk_tokens)
            return self._s.registry.lease(decoder, cost.decode_tokens, chunks)
        if exceeds_every_buffer(decoders, cost.prompt_tokens):
            raise CannotAdmit(ColocatedReason.TOO_LARGE, str(no_capacity(decoders, cost.prompt_tokens)))
        return None

    def lease_decoder(self, cost: RequestCost, avoid: Collection[str] = ()) -> Instance:
        """A pairable untried decoder with credit now, leased (no waiting: a retry), never one of ``avoid``;
        raises when none."""
        decoders, reason = self.pairable()
        if reason is not None:
            raise NoInstanceAvailable(f"no decoder to pair with a prefiller ({reason.value})")
        decoders = [d for d in decoders if d.instance_id not in avoid]
        if not decoders:
            raise NoInstanceAvailable(f"no decoder to pair with a prefiller but {', '.join(sorted(avoid))}")
        decoder = self._s.router.pick_decoder(decoders, cost, set(self._tried), prefix=self._ctx.prefix)
        self.hold(decoder, cost.decode_tokens, chunks_needed(cost.prompt_tokens, decoder.chunk_tokens))
        return decoder

    def hold(self, inst: Instance, tokens: int, chunks: int) -> None:
        self.take(self._s.registry.lease(inst, tokens, chunks))

    def take(self, lease: Lease) -> None:
        if self._lease is not None:
            self._lease.release()
        self._lease = lease
        self._tried.add(lease.instance.instance_id)

    def compatible_prefillers(self, decoder: Instance | None) -> list[Instance]:
        registry = self._s.registry
        prefillers = registry.routable(Role.SENDER)
        return prefillers if decoder is None else [p for p in prefillers if registry.compatible(p, decoder)]

    def pick_prefiller(self, decoder: Instance | None = None, exclude: Collection[str] = ()) -> Instance:
        prefiller = self._s.router.pick_prefiller(self.compatible_prefillers(decoder), exclude,
                                                  prefix=self._ctx.prefix)
        self._tried.add(prefiller.instance_id)
        return prefiller

    def prefiller_again(self, decoder: Instance) -> Instance | None:
        """The prefiller that holds the prompt (``prefilled_on``), when it is routable and may send to ``decoder``."""
        held = self.prefilled_on
        return held if held is not None and any(p is held for p in self.compatible_prefillers(decoder)) else None

    def untried_prefiller(self, decoder: Instance) -> Instance | None:
        untried = [p for p in self.compatible_prefillers(decoder) if p.instance_id not in self._tried]
        if not untried:
            return None
        prefiller = self._s.router.pick_prefiller(untried)
        self._tried.add(prefiller.instance_id)
        return prefiller

    def next_prefiller(self, failed: Collection[str], exc: UpstreamConnectError, decoder: Instance) -> Instance:
        """Another compatible routable prefiller (untried ones first); re-raises ``exc`` when there is none."""
        others = [p for p in self.compatible_prefillers(decoder) if p.instance_id not in failed]
        if not others:
            raise exc
        prefiller = self._s.router.pick_prefiller(others, exclude=self._tried)
        self._tried.add(prefiller.instance_id)
        self._s.metrics.failovers.labels("prefill").inc()
        logger.info("request %s: prefilling on %s instead", self._ctx.response_id, prefiller.instance_id)
        return prefiller

    def pick_any(self, cost: RequestCost, failed: Collection[str],
                 roles: tuple[Role, Role] = (Role.SENDER, Role.RECEIVER)) -> Instance | None:
        """The best routable instance not in ``failed``, of the first of ``roles`` that has one."""
        for role in roles:
            left = [i for i in self._s.registry.routable(role) if i.instance_id not in failed]
            if not left:
                continue
            if role is Role.SENDER:
                inst = self._s.router.pick_prefiller(left, exclude=self._tried)
            else:
                inst = self._s.router.pick_decoder(left, cost, exclude=self._tried, needs_kv=False)
            self._tried.add(inst.instance_id)
            return inst
        return None

    # ---- decoders that fail ----------------------------------------------------------------------

    def next_decoder(self, failed: Collection[str], exc: UpstreamConnectError) -> None:
        """Lease another routable decoder to recompute on; re-raises ``exc`` when there is none."""
        others = [d for d in self._s.registry.routable(Role.RECEIVER) if d.instance_id not in failed]
        if not others:
            raise exc
        others = same_backend_first(others, self.lease().instance)
        ctx = self._ctx
        cost = RequestCost(len(ctx.prompt_ids), ctx.req.output_tokens_estimate)
        decoder = self._s.router.pick_decoder(others, cost, exclude=self._tried, needs_kv=False)
        self.hold(decoder, cost.decode_tokens, chunks=0)
        self._s.metrics.failovers.labels("decode").inc()
        logger.info("request %s: decoding on %s instead (it recomputes the prompt)", ctx.response_id,
                    decoder.instance_id)

    def migrate(self, broken: Instance, failed: Collection[str], exc: UpstreamError, output_tokens: int) -> None:
        """Lease another instance to continue the output on: a decoder, else a prefiller (colocated);
        re-raises ``exc`` when there is none."""
        s, ctx = self._s, self._ctx
        logger.warning("request %s: the decode stream on %s broke after %d output token(s) (%s): continuing elsewhere",
                       ctx.response_id, broken.instance_id, output_tokens, exc)
        if not isinstance(exc, UpstreamConnectError):  # connect failures are counted where they happen
            s.metrics.connect_failures.labels(broken.role.value).inc()
            s.registry.note_connect_failure(broken)
        candidates = [d for d in s.registry.routable(Role.RECEIVER) if d.instance_id not in failed]
        if not candidates:
            candidates = [p for p in s.registry.routable(Role.SENDER) if p.instance_id not in failed]
        if not candidates:
            raise exc
        candidates = same_backend_first(candidates, broken)
        cost = RequestCost(len(ctx.prompt_ids) + output_tokens, ctx.req.output_tokens_estimate)
        target = (s.router.pick_decoder(candidates, cost, exclude=(), needs_kv=False) if candidates[0].role is
                  Role.RECEIVER else s.router.pick_prefiller(candidates))
        self.hold(target, cost.decode_tokens, chunks=0)
        s.metrics.failovers.labels("migrate").inc()
        logger.info("request %s: decoding continues on %s %s", ctx.response_id, target.role_name, target.instance_id)

    def continue_without(self, down: Instance, why: str) -> None:
        """The decode must not go to ``down``, the leased decoder (``why``: known down, or its prefiller cannot
        reach it): lease the prefiller that computed the prompt (its prefix cache holds it), else another
        routable decoder, else another prefiller (either computes the prompt). When none is routable the lease
        stays: the decode's own failover (``next_decoder``) then applies."""
        if self._lease is None or self._lease.instance is not down:
            return
        s, ctx = self._s, self._ctx
        cost = RequestCost(len(ctx.prompt_ids), ctx.req.output_tokens_estimate)
        prefillers = [p for p in s.registry.routable(Role.SENDER) if p is not down]
        target = next((p for p in prefillers if p is self.prefilled_on), None)
        if target is None:
            decoders = [d for d in s.registry.routable(Role.RECEIVER) if d is not down]
            if decoders:
                target = s.router.pick_decoder(decoders, cost, exclude=(), needs_kv=False)
            elif prefillers:
                target = s.router.pick_prefiller(prefillers)
        if target is None:
            logger.warning("request %s: %s, and no other instance is routable: the decode goes to it anyway",
                           ctx.response_id, why)
            return
        self.hold(target, cost.decode_tokens, chunks=0)
        s.metrics.failovers.labels("handover").inc()
        logger.info("request %s: %s; decoding on %s %s instead%s", ctx.response_id, why, target.role_name,
                    target.instance_id, " (its prefix cache holds the prompt)" if target is self.prefilled_on
                    else " (it computes the prompt)")

    def connect_failed(self, inst: Instance, exc: UpstreamUnreachable) -> None:
        """A connection to ``inst`` failed or broke: it counts towards taking ``inst`` out of rotation."""
        refused = isinstance(exc, UpstreamConnectError)
        logger.info("request %s: %s %s %s: %s", self._ctx.response_id, "cannot connect to" if refused else "lost",
                    inst.role_name, inst.instance_id, exc)
        if refused:
            self._s.metrics.connect_failures.labels(inst.role.value).inc()
        self._s.registry.note_connect_failure(inst)

    def note_colocated(self, inst: Instance, reason: ColocatedReason) -> None:
        self._s.metrics.colocated.labels(reason.value, inst.role.value).inc()
        logger.info("request %s: served colocated on %s %s, no KV transfer (%s)", self._ctx.response_id,
                    inst.role_name, inst.instance_id, reason.value)


def same_backend_first(candidates: list[Instance], like: Instance) -> list[Instance]:
    """Those of ``like``'s KV backend, else all: a decode that moves keeps taking KV the way it did (a decoder
    of another backend computes the prompt itself)."""
    same = [i for i in candidates if i.backend is like.backend]
    return same or candidates
