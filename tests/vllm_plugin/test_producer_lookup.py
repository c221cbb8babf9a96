"""A prefiller whose only LMCache store is our SenderBackend makes no per-request lookup (issue 9).

LMCache's adapter means to skip producer lookups but tests ``hasattr(client,
"supports_producer_reuse")`` (always true), so each prefill paid a ZMQ round trip to the worker
for a lookup that cannot hit. These tests drive the real adapter class with the shipped YAMLs.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("lmcache")
pytest.importorskip("vllm")

from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402

from lmcache_p2p.vllm_plugin.producer_lookup import lookup_cannot_hit, patch_adapter  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def config_of(name: str, **overrides) -> LMCacheEngineConfig:
    config = LMCacheEngineConfig.from_file(str(CONFIGS / name))
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def test_only_a_sender_producer_skips_lookups():
    assert lookup_cannot_hit("kv_producer", config_of("prefiller.yaml"))
    assert not lookup_cannot_hit("kv_consumer", config_of("prefiller.yaml"))
    assert not lookup_cannot_hit("kv_both", config_of("prefiller.yaml"))
    assert not lookup_cannot_hit("kv_producer", config_of("decoder.yaml"))  # ReceiverBackend holds KV
    assert not lookup_cannot_hit("kv_producer", config_of("prefiller.yaml", local_cpu=True))
    assert not lookup_cannot_hit("kv_producer", config_of("prefiller.yaml", local_disk="file:///tmp/x"))
    assert not lookup_cannot_hit("kv_producer", config_of("prefiller.yaml", remote_url="lm://127.0.0.1:1"))
    other = config_of("prefiller.yaml", storage_plugins=["p2p", "other"])
    other.extra_config = {**other.extra_config, "storage_plugin.other.module_path": "x.y",
                          "storage_plugin.other.class_name": "Store"}
    assert not lookup_cannot_hit("kv_producer", other)
    assert not lookup_cannot_hit("kv_producer", None)


class RecordingLookupClient:
    def __init__(self) -> None:
        self.lookups: list[list[int]] = []

    def supports_producer_reuse(self) -> bool:  # like LMCacheLookupClient, the one vLLM gets
        return True

    def lookup_cache(self, lookup_id: str) -> int:
        return -1

    def lookup(self, token_ids, lookup_id, request_configs=None) -> int:
        self.lookups.append(list(token_ids))
        return 0


class FakeRequest:
    request_id = "req-1"
    all_token_ids = list(range(300))
    prompt_token_ids = all_token_ids
    num_tokens = 300
    sampling_params = None
    mm_features = None
    priority = 0


def adapter_impl(kv_role: str, config: LMCacheEngineConfig, client: RecordingLookupClient):
    """The real LMCacheConnectorV1Impl, patched, with only what get_num_new_matched_tokens reads."""
    from lmcache.integration.vllm import vllm_v1_adapter

    assert patch_adapter(vllm_v1_adapter)
    assert patch_adapter(vllm_v1_adapter)  # idempotent
    impl = object.__new__(vllm_v1_adapter.LMCacheConnectorV1Impl)
    impl.__dict__.update(kv_role=kv_role, config=config, skip_last_n_tokens=0, _requests_priority={},
                         load_specs={}, _max_tokens_per_load=0, _lmcache_chunk_size=256)
    impl._manager = type("Manager", (), {"lookup_client": client})()
    return impl


def test_sender_prefiller_answers_zero_without_a_lookup():
    client = RecordingLookupClient()
    impl = adapter_impl("kv_producer", config_of("prefiller.yaml"), client)
    assert impl.get_num_new_matched_tokens(FakeRequest(), 0) == 0
    assert impl.get_num_new_matched_tokens(FakeRequest(), 0) == 0
    assert client.lookups == []
    assert impl.load_specs == {}  # nothing to load: update_state_after_alloc returns early


def test_other_roles_and_stores_still_look_up():
    for kv_role, config in (("kv_consumer", config_of("decoder.yaml")),
                            ("kv_producer", config_of("prefiller.yaml", local_cpu=True))):
        client = RecordingLookupClient()
        impl = adapter_impl(kv_role, config, client)
        assert impl.get_num_new_matched_tokens(FakeRequest(), 0) == 0
        assert client.lookups == [list(range(300))], kv_role
