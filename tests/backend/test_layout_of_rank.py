"""A rank's KV layout as the plugin reads it from LMCache's metadata, and the chunk keys' TP fields."""

from __future__ import annotations

import json
import types

import pytest
import torch

from lmcache_p2p.backend.common import check_rank_stores, chunk_key, fingerprint_of
from lmcache_p2p.errors import ConfigError
from lmcache_p2p.kv_layout import layout_of


def _metadata(model: str, heads: int, world: int, rank: int, mla: bool = False):
    return types.SimpleNamespace(model_name=model, kv_shape=(2, 1 if mla else 2, 256, heads, 32),
                                 kv_dtype=torch.bfloat16, worker_id=rank, world_size=world, use_mla=mla)


def test_the_split_comes_from_the_metadata_and_the_total_from_the_model_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_key_value_heads": 2, "num_attention_heads": 8}))
    fp = fingerprint_of(_metadata(str(tmp_path), 1, 4, 3))  # 2 heads replicated over TP 4
    assert (fp.kv_heads_total, fp.tp_size, fp.tp_rank, fp.kv_heads) == (2, 4, 3, 1)
    assert (layout_of(fp).head_start, layout_of(fp).head_end) == (1, 2)
    unreadable = fingerprint_of(_metadata("no-such-model", 2, 2, 1))  # heads x TP size
    assert unreadable.kv_heads_total == 4 and layout_of(unreadable).head_start == 2
    assert fingerprint_of(_metadata("m", 1, 2, 1), kv_heads_total=1).kv_heads_total == 1  # p2p.kv_heads_total
    mla = fingerprint_of(_metadata("m", 1, 2, 1, mla=True))
    assert (mla.kv_format, mla.kv_heads_total) == ("KV_MLA_FMT", 1)


def test_a_total_that_cannot_give_this_rank_its_heads_names_the_key():
    with pytest.raises(ConfigError, match="p2p.kv_heads_total"):
        fingerprint_of(_metadata("m", 2, 2, 0), kv_heads_total=8)


def test_mla_on_several_ranks_needs_every_rank_to_store():
    config = types.SimpleNamespace(get_extra_config_value=lambda key, default: {}.get(key, default))
    with pytest.raises(ConfigError, match="save_only_first_rank"):
        check_rank_stores(config, _metadata("m", 1, 2, 0, mla=True))
    off = types.SimpleNamespace(get_extra_config_value=lambda key, default: {"save_only_first_rank": False}.get(key))
    check_rank_stores(off, _metadata("m", 1, 2, 0, mla=True))
    check_rank_stores(config, _metadata("m", 2, 2, 0))  # not MLA: every rank stores anyway


def test_a_decoder_ranks_own_key_has_the_wire_key_of_any_prefiller_split():
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.token_database import ChunkedTokenDatabase

    tokens = torch.arange(768)
    keys = []
    for world, rank in ((1, 0), (2, 0), (2, 1), (4, 3)):
        meta = LMCacheMetadata(model_name="m", world_size=world, local_world_size=world, worker_id=rank,
                               local_worker_id=rank, kv_dtype=torch.bfloat16, kv_shape=(2, 2, 256, 2 // min(world, 2), 32))
        db = ChunkedTokenDatabase(LMCacheEngineConfig.from_defaults(chunk_size=256), meta)
        ranks_keys = [k for _, _, k in db.process_tokens(tokens)]
        assert {(k.world_size, k.worker_id) for k in ranks_keys} == {(world, rank)}
        keys.append([chunk_key(k) for k in ranks_keys])
    assert len(keys[0]) == 3 and all(k == keys[0] for k in keys)
