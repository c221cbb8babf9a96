"""The test-only wrong proxy breaks continuations only, as it says (no processes)."""

from __future__ import annotations

import pytest

from broken_proxy import broken
from fault_scenarios import first_difference

from lmcache_p2p.proxy.http.shaping import Endpoint, decode_body, parse_client_request

REQ = parse_client_request(Endpoint.COMPLETIONS, {"model": "m", "prompt": [1, 2], "max_tokens": 10}, 4.0)


@pytest.mark.parametrize("mode, prompt", [("drop", [1, 2, 7, 8]), ("duplicate", [1, 2, 7, 8, 9, 9])])
def test_a_continuation_is_wrong_by_one_token_at_the_cut_and_keeps_its_length(mode, prompt):
    body = broken(decode_body, mode)(REQ, [1, 2], [7, 8, 9], proxy_text=False)
    assert body["prompt"] == prompt and body["max_tokens"] == 7


@pytest.mark.parametrize("mode", ["drop", "duplicate"])
def test_the_first_decode_is_left_right(mode):
    assert broken(decode_body, mode)(REQ, [1, 2], [7], proxy_text=False) == decode_body(REQ, [1, 2], [7],
                                                                                          proxy_text=False)


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 5, 3], [1, 2, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2
