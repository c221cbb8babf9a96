"""A request flow's phase and its legal changes (flow_phase.py)."""

from __future__ import annotations

import pytest

from lmcache_p2p.proxy.flow.phase import FlowPhase, PhaseError, Phases


def test_a_flow_phase_moves_only_forward_along_its_legal_changes():
    phases = Phases("r1")
    with pytest.raises(PhaseError, match="r1: new -> decoding is not a legal phase change"):
        phases.advance(FlowPhase.DECODING)
    for to in (FlowPhase.PREFILLED, FlowPhase.PLANNED, FlowPhase.DECODING, FlowPhase.ENDED, FlowPhase.CLOSED):
        phases.advance(to)
    assert not phases.may(FlowPhase.PREFILLED) and phases.now is FlowPhase.CLOSED
