"""A rate-limited log of rejected control frames: one WARNING per kind, then a count at most every few seconds."""

from __future__ import annotations

import enum
import logging
import time


class RejectionLog:
    """Logs rejected frames without flooding: WARNING for the first of a kind, then at most every
    ``warn_every_s`` with the count since (DEBUG in between)."""

    def __init__(self, logger: logging.Logger, where: str, warn_every_s: float = 10.0) -> None:
        self._logger = logger
        self._where = where
        self._warn_every_s = warn_every_s
        self._last_s: dict[str, float] = {}
        self._since: dict[str, int] = {}

    def log(self, reason: enum.Enum | str, detail: object) -> None:
        reason = getattr(reason, "value", reason)
        now = time.monotonic()
        self._since[reason] = self._since.get(reason, 0) + 1
        if now - self._last_s.get(reason, -self._warn_every_s) >= self._warn_every_s:
            self._logger.warning("%s dropped a control message (%s; %d dropped since the last report): %s",
                                 self._where, reason, self._since[reason], detail)
            self._last_s[reason] = now
            self._since[reason] = 0
        else:
            self._logger.debug("%s dropped a control message (%s): %s", self._where, reason, detail)
