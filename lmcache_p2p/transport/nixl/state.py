"""The state every part of a NixlTransport shares, declared once, and the agent's memory calls.

:class:`~lmcache_p2p.transport.nixl.transport.NixlTransport` builds the :class:`NixlState`,
opens it in ``start()`` (the agent, the staging ring) and closes it; its parts (``peers.py``,
``submit.py``, ``settle.py``) each hold the same object and change it under its lock. The agent
is created without NIXL's own locking, so every call into it holds ``lock``.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from lmcache_p2p.errors import TransportError
from lmcache_p2p.transport.lifecycle import Lifecycle
from lmcache_p2p.transport.nixl.records import BACKEND, Peer, Registration, Xfer, mem_type

if TYPE_CHECKING:
    from lmcache_p2p.protocol import Region
    from lmcache_p2p.transport.nixl.staging import StagingRing

logger = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class NixlState:
    """What a NixlTransport's parts share; every field changes under ``lock``."""

    name: str
    lifecycle: Lifecycle
    lock: threading.RLock = dataclasses.field(default_factory=threading.RLock)
    agent: Any = None  # the nixl_agent, from start() to close()
    errors: tuple[type[BaseException], ...] = (RuntimeError,)  # what NIXL's bindings raise
    disconnected: tuple[type[BaseException], ...] = ()  # NIXL's "the remote agent went away"
    regs: list[Registration] = dataclasses.field(default_factory=list)
    peers: dict[str, Peer] = dataclasses.field(default_factory=dict)
    inflight: dict[int, Xfer] = dataclasses.field(default_factory=dict)  # posted, not settled (aborted included)
    retiring: set[str] = dataclasses.field(default_factory=set)  # disconnected; unloaded once their writes settle
    leaked: list[Registration] = dataclasses.field(default_factory=list)  # temp sources NIXL may still read
    ring: StagingRing | None = None  # host -> peer GPU staging (stage_device), from start() to close()
    given_up: int = 0  # writes NIXL failed while their puts may still read: never settled

    def check_open(self) -> Any:
        """The agent of a started transport; ClosedError before start() and after close()."""
        self.lifecycle.check_open()
        return self.agent

    def register_regions(self, agent: Any, regions: Sequence[Region]) -> list[Registration]:
        """One NIXL registration per region, so that each can be deregistered on its own."""
        done: list[Registration] = []
        try:
            for region in regions:
                descs = agent.get_reg_descs([(region.addr, region.length, region.device_id, "")], mem_type(region))
                agent.register_memory(descs, backends=[BACKEND])
                done.append(Registration(region, descs, None))
        except self.errors as exc:
            for reg in done:
                self.deregister(agent, reg)
            raise TransportError(
                f"NIXL could not register {mem_type(region)} memory 0x{region.addr:x} (+{region.length} bytes): {exc}"
            ) from exc
        return done

    def deregister(self, agent: Any, reg: Registration) -> None:
        try:
            agent.deregister_memory(reg.descs, backends=[BACKEND])
        except self.errors:
            logger.warning("%s: NIXL failed to deregister 0x%x (+%d bytes)", self.name, reg.region.addr,
                           reg.region.length, exc_info=True)

    def remove_remote(self, agent: Any, name: str) -> None:
        try:
            agent.remove_remote_agent(name)
        except self.errors:
            logger.warning("%s: NIXL failed to remove remote agent %s", self.name, name, exc_info=True)
