"""The held-back text of a broken stream, without the proxy's tokenizer (held_text.py)."""

from __future__ import annotations

import pytest

from lmcache_p2p.proxy.errors import ContinuationMismatch
from lmcache_p2p.proxy.http.held_text import HeldText, Replay
from lmcache_p2p.proxy.http.responses import Delta


def delta(text: str, *ids: int, finish: str | None = None) -> Delta:
    return Delta(text, list(ids), None, finish, None)


def test_the_last_delta_with_text_and_those_without_after_it_are_generated_again():
    held = HeldText(enabled=True)
    for d in (delta(" a", 1), delta(" b c", 2, 3), delta("", 4)):
        held.observe(d)
    replay = held.replay()
    assert replay.rewound == 3
    # the next instance generates 2, 3, 4 (4's text held back again, then completed by 5's)
    out = [replay.filter(d) for d in (delta(" b", 2), delta(" c", 3), delta("", 4), delta(" d e", 5))]
    assert out == [None, None, None, delta(" d e", 5)]


def test_a_continuation_that_generates_other_tokens_ends_the_output_rather_than_repeat_positions():
    """The client has 7 and 8: another token in their place would be a second token at a position it holds
    (and one more than max_tokens allows)."""
    replay = Replay([7, 8], " x")
    with pytest.raises(ContinuationMismatch, match=r"generated token ids \[9\] where the client already has \[7\]"):
        replay.filter(delta(" y", 9))
    replay = Replay([7, 8], " x")
    assert replay.filter(delta("", 7)) is None
    with pytest.raises(ContinuationMismatch, match="--tokenizer"):
        replay.filter(delta(" x z", 10, 11))  # 8 regenerated as 10


def test_a_continuation_whose_text_differs_from_what_the_client_has_ends_the_output():
    replay = Replay([7], " x")
    with pytest.raises(ContinuationMismatch, match="sent the text ' y' where the client already has ' x'"):
        replay.filter(delta(" y", 7))


def test_nothing_is_generated_again_under_sampling_or_for_instances_without_text():
    sampled = HeldText(enabled=False)
    sampled.observe(delta("", 1))
    assert sampled.replay().rewound == 0
    textless = HeldText(enabled=True)
    for i in range(40):
        textless.observe(delta("", i))
    assert textless.replay().rewound == 0
