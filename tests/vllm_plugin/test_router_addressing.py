"""The one reader of a foreign router's addressing: vllm-router's request ids as vLLM's engine sees them."""

from __future__ import annotations

import logging

import pytest

from lmcache_p2p.vllm_plugin import router_addressing as ra

UUID = "0123456789abcdef0123456789abcdef"
ROUTER_ID = f"___prefill_addr_127.0.0.1:7100___decode_addr_127.0.0.1:7200_{UUID}"


@pytest.mark.parametrize("engine_id, key", [
    (f"cmpl-{ROUTER_ID}-0-a1b2c3d4", f"router-{UUID}-0"),  # a completion: prompt index, 8 random characters
    (f"cmpl-{ROUTER_ID}-2-a1b2c3d4", f"router-{UUID}-2"),  # the third prompt of a batched completion
    (f"chatcmpl-{ROUTER_ID}-a1b2c3d4", f"router-{UUID}"),
    (f"chatcmpl-{ROUTER_ID}-12345678", f"router-{UUID}"),  # random characters that happen to be digits
    (f"1_cmpl-{ROUTER_ID}-0-a1b2c3d4", f"router-{UUID}-0~1"),  # sample 1 of n
    (f"cmpl-{ROUTER_ID}-0", f"router-{UUID}-0"),  # VLLM_DISABLE_REQUEST_ID_RANDOMIZATION
])
def test_the_key_is_what_the_prefiller_and_the_decoder_share(engine_id, key):
    req = ra.parse_request_id(engine_id)
    assert req == ra.RouterRequest(key, "127.0.0.1", 7200)
    # the decoder's engine id differs only in vLLM's random characters: the same key
    assert ra.parse_request_id(engine_id.replace("a1b2c3d4", "ffff0000")) == req


def test_an_id_without_router_addressing_is_an_ordinary_request():
    for engine_id in ("cmpl-3f2a-0-a1b2c3d4", "chatcmpl-abc", "cmpl-___prefill_addr_x", "mock_req_1"):
        assert ra.parse_request_id(engine_id) is None
        assert ra.spec_for(engine_id, 100, 1) is None


@pytest.mark.parametrize("engine_id, says", [
    (f"cmpl-___prefill_addr_a:1___decode_addr_host:http_{UUID}-0-a1b2c3d4", "is not HOST:PORT"),
    (f"cmpl-___prefill_addr_a:1___decode_addr_tcp://10.0.0.2:5555_{UUID}-0-a1b2c3d4", "is not HOST:PORT"),
    (f"cmpl-___prefill_addr_a:1___decode_addr_h:99999_{UUID}-0-a1b2c3d4", "is not HOST:PORT"),
    (f"cmpl-___prefill_addr_a:1___decode_addr_h:1_notauuid-0-a1b2c3d4", "names a decoder but"),
    (f"cmpl-{ROUTER_ID}-x-a1b2c3d4", "unexpected suffix"),
    (f"chatcmpl-{ROUTER_ID}-0-a1b2c3d4", "unexpected suffix"),
])
def test_an_id_that_names_a_decoder_badly_says_what(engine_id, says):
    with pytest.raises(ValueError, match=says):
        ra.parse_request_id(engine_id)


def test_a_bad_id_is_logged_once_and_served_colocated(caplog):
    ra._warned.clear()
    bad = f"cmpl-___prefill_addr_a:1___decode_addr_nohost_{UUID}-0-a1b2c3d4"
    with caplog.at_level(logging.DEBUG, logger=ra.__name__):
        assert ra.spec_for(bad, 100, 1) is None
        assert ra.spec_for(bad, 100, 1) is None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "does not parse" in warnings[0].getMessage()
    assert "computes the prompt itself" in warnings[0].getMessage()


def test_the_spec_names_the_decoders_control_port_of_every_rank():
    spec = ra.spec_for(f"cmpl-{ROUTER_ID}-0-a1b2c3d4", 100, 2)
    assert spec == {"req_id": f"router-{UUID}-0", "receiver_host": "127.0.0.1", "receiver_alloc_port": [7300, 7301],
                    "receiver_init_port": [7300, 7301]}
    assert ra.spec_for(f"cmpl-{ROUTER_ID}-0-a1b2c3d4", -7200, 1) is None  # port 0: logged, nothing sent


def test_the_marker_round_trips_and_a_bad_one_is_refused(caplog):
    marker = ra.Marker(f"router-{UUID}-0", 443)
    assert ra.marker_of(marker.as_params(), "r") == marker
    assert ra.marker_of({"do_remote_prefill": True}, "r") is None
    assert ra.marker_of(None, "r") is None
    ra._warned.clear()
    with caplog.at_level(logging.WARNING, logger=ra.__name__):
        for bad in ({"req_id": 3, "prompt_tokens": 1}, {"req_id": "k"}, {"req_id": "k", "prompt_tokens": True}, "k"):
            assert ra.marker_of({ra.MARKER_KEY: bad}, "r") is None
    assert "does not wait for KV" in caplog.text
