"""The phase of one request's flow and its legal changes (in place of run-once flags).

    NEW --prefill--> PREFILLED --plan--> PLANNED --first output--> DECODING
                         |                  |                          |
                         +------------------+----------output complete-+--> ENDED
    any phase --close--> CLOSED

It owns the phase only: what each change does (remember the output, record the timeline, return
the decoder's credit) is the flow's. It must not be skipped: a step that runs once per request
asks the phase, not a flag of its own.
"""

from __future__ import annotations

import enum


class FlowPhase(enum.Enum):
    NEW = "new"  # received; prefill (routing, admission, the prefill itself) not answered yet
    PREFILLED = "prefilled"  # the first token is known (colocated: the prompt ids)
    PLANNED = "planned"  # the KV wait is over and a decode request is named (it may move on a failure)
    DECODING = "decoding"  # the decoding instance sent its first output: it has loaded the KV
    ENDED = "ended"  # the output is complete; the decoding instance's cache holds prompt + output
    CLOSED = "closed"  # everything the request held is released


_LEGAL: dict[FlowPhase, frozenset[FlowPhase]] = {
    FlowPhase.NEW: frozenset({FlowPhase.PREFILLED, FlowPhase.CLOSED}),
    FlowPhase.PREFILLED: frozenset({FlowPhase.PLANNED, FlowPhase.ENDED, FlowPhase.CLOSED}),
    FlowPhase.PLANNED: frozenset({FlowPhase.DECODING, FlowPhase.ENDED, FlowPhase.CLOSED}),
    FlowPhase.DECODING: frozenset({FlowPhase.ENDED, FlowPhase.CLOSED}),
    FlowPhase.ENDED: frozenset({FlowPhase.CLOSED}),
    FlowPhase.CLOSED: frozenset(),
}


class PhaseError(RuntimeError):
    """A step asked for a phase change the flow does not allow (a bug in the caller)."""


class Phases:
    """The current phase; ``advance`` refuses a change ``_LEGAL`` does not list."""

    def __init__(self, request_id: str) -> None:
        self._request_id = request_id
        self.now = FlowPhase.NEW

    def advance(self, to: FlowPhase) -> None:
        if to not in _LEGAL[self.now]:
            raise PhaseError(f"request {self._request_id}: {self.now.value} -> {to.value} is not a legal phase change")
        self.now = to

    def may(self, to: FlowPhase) -> bool:
        return to in _LEGAL[self.now]
