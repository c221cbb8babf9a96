"""What a receiver refused or ignored, shared by its parts (for tests, logs and metrics)."""

from __future__ import annotations

import dataclasses
import logging


@dataclasses.dataclass
class Counters:
    """What the receiver refused or ignored, for tests, logs and (later) metrics."""

    hello_refused_fingerprint: int = 0
    written_ignored: int = 0  # Writtens ignored whole: their peer or sender does not own the request
    written_slots_ignored: int = 0  # slots of any Written left unchanged: not granted to that request or peer
    writes_refused: int = 0  # transport writes (NCCL doorbells) refused before receiving
    slots_quarantined: int = 0  # RESERVED slots given up while a write could still land
    slots_confirmed: int = 0  # quarantined slots freed by their writer's Written
    senders_torn_down: int = 0
    chunks_held: int = 0  # Alloc chunks granted -1 because the buffer cache held them
    bytes_held: int = 0
    chunks_loaded_from_cache: int = 0  # retrieves served by a CACHED slot
    bytes_received: int = 0  # bytes landed for requests (moved over the transport)


class WarnOnce:
    """Logs a WARNING the first time for each (what, peer), DEBUG after: one bad peer, one line."""

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger
        self._warned: set[tuple[str, str]] = set()

    def __call__(self, what: str, peer: str, fmt: str, *args: object) -> None:
        if (what, peer) in self._warned:
            self._logger.debug(fmt, *args)
            return
        self._warned.add((what, peer))
        self._logger.warning(fmt + " (logged once per peer)", *args)
