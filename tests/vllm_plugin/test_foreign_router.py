"""Behind vllm-router: the real LMCache adapter, patched, addresses the KV from the router's request id on
the prefiller and waits (bounded) for it on the decoder."""

from __future__ import annotations

import inspect
import logging
import types

import pytest

pytest.importorskip("lmcache")
pytest.importorskip("vllm")

from lmcache.integration.vllm import vllm_v1_adapter  # noqa: E402
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402

from lmcache_p2p.backend.sender import target_of  # noqa: E402
from lmcache_p2p.vllm_plugin import foreign_router, router_addressing  # noqa: E402
from lmcache_p2p.vllm_plugin.router_addressing import MARKER_KEY, Marker  # noqa: E402
from test_producer_lookup import CONFIGS  # noqa: E402

UUID = "0123456789abcdef0123456789abcdef"
ENGINE_ID = f"cmpl-___prefill_addr_127.0.0.1:7100___decode_addr_127.0.0.1:7200_{UUID}-0-a1b2c3d4"
PROMPT = list(range(600))  # 2 full chunks of 256 and a partial one


def config_of(name: str, **p2p) -> LMCacheEngineConfig:
    config = LMCacheEngineConfig.from_file(str(CONFIGS / name))
    config.extra_config = {**config.extra_config, "p2p": {**config.extra_config["p2p"], **p2p}}
    return config


class LookupClient:
    """LMCacheLookupClient's contract: a result cached per lookup id until cleared; hits = ``ready`` tokens."""

    def __init__(self) -> None:
        self.ready = 0
        self.lookups: list[int] = []  # tokens looked up, per lookup
        self.status: dict[str, int] = {}

    def supports_producer_reuse(self) -> bool:
        return True

    def lookup_cache(self, lookup_id: str) -> int:
        return self.status.get(lookup_id, -1)

    def lookup(self, token_ids, lookup_id, request_configs=None) -> int:
        self.lookups.append(len(token_ids))
        self.status[lookup_id] = min(self.ready, len(token_ids))
        return self.status[lookup_id]

    def clear_lookup_status(self, lookup_id: str) -> None:
        self.status.pop(lookup_id, None)


def impl_of(kv_role: str, config: LMCacheEngineConfig, client: LookupClient, skip_last_n_tokens: int = 0):
    """The real LMCacheConnectorV1Impl, patched, with what the three wrapped calls read."""
    assert foreign_router.patch_adapter(vllm_v1_adapter)
    assert foreign_router.patch_adapter(vllm_v1_adapter)  # idempotent
    impl = object.__new__(vllm_v1_adapter.LMCacheConnectorV1Impl)
    impl.__dict__.update(kv_role=kv_role, config=config, skip_last_n_tokens=skip_last_n_tokens, _requests_priority={},
                         load_specs={}, _max_tokens_per_load=0, _lmcache_chunk_size=256, worker_count=1,
                         _unfinished_requests={}, _request_trackers={}, use_layerwise=False, async_loading=False)
    impl._manager = type("Manager", (), {"lookup_client": client, "lmcache_engine": None})()
    return impl


def request_of(request_id: str = ENGINE_ID, params: dict | None = None, prompt: list[int] = PROMPT):
    return types.SimpleNamespace(request_id=request_id, kv_transfer_params=params, prompt_token_ids=prompt,
                                 all_token_ids=prompt, num_tokens=len(prompt), sampling_params=None, mm_features=None,
                                 priority=0, status=None, _output_token_ids=[7])


def prefiller() -> object:
    return impl_of("kv_producer", config_of("prefiller.yaml", router_control_port_offset=100), LookupClient())


def test_the_prefiller_sends_a_router_addressed_request_to_the_decoder_it_names():
    impl, request = prefiller(), request_of(params={"do_remote_decode": True})
    impl.update_state_after_alloc(request, 0)
    spec = vllm_v1_adapter.tmp_disagg_tracker.pop(ENGINE_ID)  # what LMCache hands our sender as transfer_spec
    assert spec.req_id == f"router-{UUID}-0" and spec.receiver_host == "127.0.0.1"
    assert target_of(spec, 0).endpoint == "tcp://127.0.0.1:7300"
    assert request.kv_transfer_params["do_remote_decode"] is True  # the router's own params stay
    _, params = impl.request_finished(request, [])
    assert params == {MARKER_KEY: {"req_id": f"router-{UUID}-0", "prompt_tokens": len(PROMPT)}}
    _, params = impl.request_finished(request, [])
    assert params is None  # told once


def test_the_prefiller_keeps_our_proxys_spec_and_sends_nothing_for_an_id_it_cannot_use(caplog):
    impl = prefiller()
    ours = {"req_id": "abc", "receiver_host": "10.0.0.9", "receiver_init_port": [1], "receiver_alloc_port": [2]}
    impl.update_state_after_alloc(request_of(params={"disagg_spec": ours}), 0)
    assert vllm_v1_adapter.tmp_disagg_tracker.pop(ENGINE_ID).receiver_host == "10.0.0.9"
    assert impl.request_finished(request_of(), [])[1] is None
    bad = ENGINE_ID.replace("127.0.0.1:7200", "decoder-zmq")
    router_addressing._warned.clear()
    with caplog.at_level(logging.WARNING):
        impl.update_state_after_alloc(request_of(bad), 0)
    assert bad not in vllm_v1_adapter.tmp_disagg_tracker  # no spec: LMCache stores nothing for our sender to push
    assert "does not parse" in caplog.text and impl.request_finished(request_of(bad), [])[1] is None


def test_without_the_offset_nothing_is_addressed():
    impl = impl_of("kv_producer", config_of("prefiller.yaml"), LookupClient())
    impl.update_state_after_alloc(request_of(), 0)
    assert ENGINE_ID not in vllm_v1_adapter.tmp_disagg_tracker


class Clock:
    def __init__(self) -> None:
        self.now = 100.0
        self.pauses: list[float] = []

    def __call__(self) -> float:
        return self.now

    def pause(self, s: float) -> None:
        self.pauses.append(s)


def decoder(client: LookupClient, clock: Clock, **p2p):
    config = config_of("decoder.yaml", router_control_port_offset=100, http_url="http://127.0.0.1:7200", **p2p)
    impl = impl_of("kv_consumer", config, client, skip_last_n_tokens=1)
    # the wrapper under test, with a fake clock, over the adapter's own lookup
    original = inspect.unwrap(vllm_v1_adapter.LMCacheConnectorV1Impl.get_num_new_matched_tokens)
    return impl, foreign_router.wrap_matched_tokens(original, clock, clock.pause)


MARKED = Marker(f"router-{UUID}-0", len(PROMPT)).as_params()


def test_the_decoder_waits_for_the_announced_kv_then_loads_the_whole_prompt():
    client, clock = LookupClient(), Clock()
    impl, matched = decoder(client, clock)
    request = request_of(params=MARKED)
    client.ready = 512  # two chunks landed, the third is on its way
    assert matched(impl, request, 0) is None  # vLLM skips the request this step
    assert impl.load_specs == {} and client.lookup_cache(ENGINE_ID) == -1
    clock.now += 0.5
    client.ready = len(PROMPT)
    assert matched(impl, request, 0) == len(PROMPT) - 1  # the whole prompt (vLLM recomputes the last token)
    assert client.lookups == [len(PROMPT), len(PROMPT)]  # over the whole prompt, not prompt[:-1]
    assert impl.skip_last_n_tokens == 1  # restored: a request of our proxy still looks up prompt[:-1]
    assert impl.load_specs[ENGINE_ID].lmcache_cached_tokens == len(PROMPT)
    assert foreign_router.state_of(impl).waiting == {}


def test_the_decoder_computes_what_did_not_arrive_by_the_deadline(caplog):
    client, clock = LookupClient(), Clock()
    impl, matched = decoder(client, clock, router_kv_timeout_s=2)
    request = request_of(params=MARKED)
    client.ready = 256
    assert matched(impl, request, 0) is None
    clock.now += 1.9
    assert matched(impl, request, 0) is None
    clock.now += 0.2
    with caplog.at_level(logging.WARNING):
        assert matched(impl, request, 0) == 256  # what arrived is loaded, the rest computed
    assert "256 of the 600 prompt tokens" in caplog.text and "p2p.router_kv_timeout_s (2s)" in caplog.text
    assert foreign_router.state_of(impl).waiting == {}


def test_a_decode_without_the_marker_looks_up_as_before_and_never_waits():
    client, clock = LookupClient(), Clock()
    impl, matched = decoder(client, clock)
    assert matched(impl, request_of(), 0) == 0
    assert matched(impl, request_of("cmpl-x-0-a1b2c3d4", {MARKER_KEY: {"req_id": 5}}), 0) == 0
    assert client.lookups == [len(PROMPT) - 1, len(PROMPT) - 1] and clock.pauses == []


def test_an_aborted_waiting_decode_is_forgotten():
    client, clock = LookupClient(), Clock()
    impl, matched = decoder(client, clock)
    assert matched(impl, request_of(params=MARKED), 0) is None
    impl.request_finished(request_of(params=MARKED), [])
    assert foreign_router.state_of(impl).waiting == {}


class Engine:
    """LMCacheEngine's pin records: a pinned lookup overwrites ``lookup_pins[lookup_id]``."""

    def __init__(self) -> None:
        self.lookup_pins: dict[str, list[str]] = {}
        self.pinned: dict[str, int] = {}

    def lookup(self, hashes=None, offsets=None, lookup_id=None, pin=False, request_configs=None) -> int:
        keys = [f"k{i}" for i in range(len(hashes))]
        if pin:
            for k in keys:
                self.pinned[k] = self.pinned.get(k, 0) + 1
            self.lookup_pins[lookup_id] = keys
        return len(keys)

    def lookup_unpin(self, lookup_id: str) -> None:
        for k in self.lookup_pins.pop(lookup_id, []):
            self.pinned[k] -= 1


def test_a_second_lookup_of_a_request_drops_the_first_ones_pins():
    module = types.SimpleNamespace(__name__="fake", LMCacheEngine=type("LMCacheEngine", (Engine,), {}))
    assert foreign_router.patch_cache_engine(module) and foreign_router.patch_cache_engine(module)
    engine = module.LMCacheEngine()
    engine.lookup(hashes=[1, 2], offsets=[256, 256], lookup_id="r", pin=True)
    engine.lookup(hashes=[1, 2, 3], offsets=[256, 256, 88], lookup_id="r", pin=True)
    engine.lookup_unpin("r")  # what the worker does once the request loaded
    assert engine.pinned == {"k0": 0, "k1": 0, "k2": 0}


def test_the_real_lmcache_engine_is_patched():
    from lmcache.v1 import cache_engine

    assert foreign_router.patch_cache_engine(cache_engine)
    assert getattr(cache_engine.LMCacheEngine.lookup, "_lmcache_p2p_foreign_router_patched", False)


# ---- a decode our proxy sent before the KV was ready (proxy --early-decode) -----------------------------------


class ChunkLookupClient(LookupClient):
    """LMCache's lookup as its chunk keys make it: a chunk hits when the tokens it covers, from the prompt's start,
    are those the prefiller stored (``stored``, of which the first ``ready`` tokens' chunks arrived). A partial last
    chunk is keyed by its own tokens, so prompt + one more token does not hit the stored prompt's last chunk."""

    def __init__(self, stored: list[int], chunk_tokens: int = 256) -> None:
        super().__init__()
        self.stored = stored
        self.chunk_tokens = chunk_tokens

    def lookup(self, token_ids, lookup_id, request_configs=None) -> int:
        self.lookups.append(len(token_ids))
        hit = 0
        for start in range(0, len(token_ids), self.chunk_tokens):
            chunk = list(token_ids[start:start + self.chunk_tokens])
            end = start + len(chunk)
            if end > self.ready or chunk != self.stored[start:end] or (end < len(self.stored) and
                                                                       len(chunk) < self.chunk_tokens):
                break
            hit = end
        self.status[lookup_id] = hit
        return hit


OURS_ID = "cmpl-5f0c2a4e-0-a1b2c3d4"  # a request id of our proxy's decode: no router addressing in it


def test_our_proxys_early_decode_loads_the_whole_stored_prompt_and_computes_only_the_first_token():
    """The proxy's decode is prompt + first token; the prefiller stored the prompt: the lookup covers exactly the
    stored prompt (its partial last chunk included), so the decoder waits for all of it, not for a hit that the
    prompt + first token can never make."""
    client, clock = ChunkLookupClient(PROMPT), Clock()
    impl, matched = decoder(client, clock)
    decode = PROMPT + [7]
    request = request_of(OURS_ID, Marker("5f0c2a4e", len(PROMPT)).as_params(), prompt=decode)
    client.ready = 512  # two chunks landed, the partial third is on its way
    assert matched(impl, request, 0) is None
    clock.now += 0.5
    client.ready = len(PROMPT)
    assert matched(impl, request, 0) == len(PROMPT)  # every stored token loaded; vLLM computes the first token
    assert client.lookups == [len(PROMPT), len(PROMPT)]  # the stored prompt, not prompt + first token
    assert impl.load_specs[OURS_ID].lmcache_cached_tokens == len(PROMPT)
    assert impl.skip_last_n_tokens == 1 and foreign_router.state_of(impl).waiting == {}


def test_a_decode_that_regenerates_the_first_token_loads_the_whole_prompt_too():
    """The proxy sends the prompt alone when it cannot make the first token's text: every stored token hits and
    vLLM computes the last prompt token again (its output is the first token)."""
    client, clock = ChunkLookupClient(PROMPT), Clock()
    impl, matched = decoder(client, clock)
    client.ready = len(PROMPT)
    request = request_of(OURS_ID, Marker("5f0c2a4e", len(PROMPT)).as_params())
    assert matched(impl, request, 0) == len(PROMPT) - 1
    assert client.lookups == [len(PROMPT)]


def test_a_parked_decode_pauses_only_when_the_engine_asks_again_within_the_pause():
    """An idle engine asks again at once: the wrapper sleeps out the rest of the pause (no spin on the GIL the
    receive thread needs). A busy engine's steps are longer than the pause: no sleep is added to them."""
    client, clock = LookupClient(), Clock()
    impl, matched = decoder(client, clock)
    request = request_of(params=MARKED)
    client.ready = 256
    assert matched(impl, request, 0) is None
    assert clock.pauses == []  # the first ask: nothing to pause for
    clock.now += 0.0002  # asked again 0.2 ms later: an engine with nothing else to run
    assert matched(impl, request, 0) is None
    assert clock.pauses == [pytest.approx(foreign_router.RETRY_PAUSE_S - 0.0002)]
    clock.now += 0.02  # a busy engine's next step, 20 ms later
    assert matched(impl, request, 0) is None
    other = request_of(ENGINE_ID.replace(UUID, "f" * 32), params=MARKED)
    assert matched(impl, other, 0) is None  # another parked request, asked in the same step
    assert len(clock.pauses) == 1


def test_a_decoder_our_launcher_starts_behind_our_proxy_waits_for_the_marked_kv(tmp_path):
    """The decoder's YAML as ``lmcache-p2p launch`` writes it behind our proxy has no router offset (only a
    prefiller behind vllm-router needs one): its role alone turns the marker's wait on."""
    from lmcache_p2p.cli import launch
    from lmcache_p2p.cli.main import build_parser

    args = build_parser().parse_args(["launch", "--prefill", "1", "--decode", "1"])
    decoder_inst = next(i for i in launch.plan(args) if i.role == "decoder")
    config = LMCacheEngineConfig.from_file(str(launch.write_lmcache_config(decoder_inst, args, tmp_path)))
    assert "router_control_port_offset" not in config.extra_config["p2p"]
    client, clock = ChunkLookupClient(PROMPT), Clock()
    impl = impl_of("kv_consumer", config, client, skip_last_n_tokens=1)
    original = inspect.unwrap(vllm_v1_adapter.LMCacheConnectorV1Impl.get_num_new_matched_tokens)
    matched = foreign_router.wrap_matched_tokens(original, clock, clock.pause)
    request = request_of(OURS_ID, Marker("5f0c2a4e", len(PROMPT)).as_params(), prompt=PROMPT + [7])
    client.ready = 256
    assert matched(impl, request, 0) is None  # parked: the marker is read
    client.ready = len(PROMPT)
    clock.now += 0.01
    assert matched(impl, request, 0) == len(PROMPT)
