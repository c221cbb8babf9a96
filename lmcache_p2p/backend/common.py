"""What both plugin roles share: reading our config section and building the transport."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from lmcache_p2p.config import P2PConfig, Role, check_lmcache_settings
from lmcache_p2p.protocol import Fingerprint
from lmcache_p2p.errors import ConfigError
from lmcache_p2p.kv_layout import MLA_FORMAT, KvLayout
from lmcache_p2p.transport import Transport, create_transport
from lmcache_p2p.weights_id import weights_identity

logger = logging.getLogger(__name__)


def load_config(lmcache_config: Any, role: Role) -> P2PConfig:
    """Validate our settings for ``role``; LMCache only logs plugin errors, so log loudly too."""
    try:
        check_lmcache_settings(lmcache_config, role)
        cfg = P2PConfig.from_lmcache(lmcache_config)
        if cfg.role is not role:
            raise ConfigError("p2p.role", f"is {cfg.role.value} but the plugin class is the {role.value} "
                                          f"(storage_plugin.<name>.class_name); make them agree")
        return cfg
    except ConfigError as exc:
        logger.error("lmcache_p2p disabled: invalid configuration in LMCACHE_CONFIG_FILE: %s", exc)
        raise


def chunk_key(key: Any) -> str:
    """The wire identity of a chunk (an LMCache ``CacheEngineKey``): its content hash.

    The hash names tokens, not the model: it is enough only because every sender a receiver
    accepts passed the KV fingerprint check at Hello (same model, layers, heads, dtype, chunk size
    and format, a reconcilable TP split), so one key means the same KV from any of them. The key's
    ``world_size`` / ``worker_id`` are left out on purpose: LMCache hashes tokens only, so a decoder
    rank's own key for a chunk has this same hash whatever the prefiller's TP rank and size were.
    """
    return f"{key.chunk_hash:x}"


def tp_rank_of(metadata: Any) -> tuple[int, int]:
    """(rank, size) of this worker in its tensor-parallel group."""
    if metadata is None:
        return 0, 1
    return int(getattr(metadata, "worker_id", 0) or 0), int(getattr(metadata, "world_size", 1) or 1)


def worker_gpu(dst_device: Any) -> str | None:
    """The GPU LMCache runs this worker on ("cuda:N" as LMCache passes ``dst_device``), or None."""
    device = str(dst_device or "")
    return device if device.startswith("cuda") else None


def build_transport(cfg: P2PConfig, name: str, tp_rank: int, gpu: str | None = None) -> Transport:
    """The transport of ``p2p.transport`` for this worker, built, not started (the caller starts
    it, and closes it on any later failure); ``gpu`` is its GPU (None on CPU).

    NIXL: a sender on a GPU stages host chunks bound for a peer's GPU memory through a small
    ring on its own GPU (nixl/staging.py; UCX alone moves host -> remote GPU at ~0.6 GB/s).
    NCCL: runs on the receive buffer's GPU, else on the worker's GPU, else on Gloo (CPU);
    both ends must agree (NCCL needs a GPU on each side). Only a receiver's store listens on
    ``p2p.transport_ports``; a sender's (never dialled: it joins its receivers' stores) takes a
    free port, so several prefillers share a host without configuring ports.
    """
    if cfg.transport.value == "nixl":
        stage = gpu if cfg.role is Role.SENDER else None
        return create_transport("nixl", name, backend_params=dict(cfg.nixl_backend_params) or None,
                                stage_device=stage)
    receiver = cfg.role is Role.RECEIVER
    device = cfg.buffer_device if receiver and cfg.buffer_device != "cpu" else gpu or "cpu"
    return create_transport("nccl", name, host=cfg.host, port=cfg.transport_port(tp_rank) if receiver else 0,
                            advertise_host=cfg.advertised_host() if receiver else None,
                            device=device, timeout_s=cfg.transfer_timeout_s,
                            max_queued_writes=cfg.nccl_max_queued_writes)


def dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def fingerprint_of(metadata: Any, kv_heads_total: int = 0) -> Fingerprint | None:
    """What this worker's KV bytes mean and how they are split, from LMCache's metadata
    (``LMCacheMetadata`` in 0.5.x): its TP rank and size (``worker_id`` / ``world_size``).

    ``kv_shape`` is (layers, 2 or 1, chunk_tokens, kv_heads, head_size) for this TP rank; MLA
    models hold one latent instead of K and V (LMCache's KV_MLA_FMT). The model's total KV heads:
    ``kv_heads_total`` (``p2p.kv_heads_total``) if set, else the model folder's config.json, else
    this rank's heads x TP size. None without metadata. ConfigError for a split that cannot be.
    """
    if metadata is None:
        return None
    layers, _, chunk_tokens, kv_heads, head_size = (int(x) for x in metadata.kv_shape)
    rank, size = tp_rank_of(metadata)
    model = str(getattr(metadata, "model_name", "") or "")
    mla = bool(getattr(metadata, "use_mla", False))
    total = 1 if mla else kv_heads_total or model_kv_heads(model, kv_heads, size) or kv_heads * size
    layout = KvLayout(total, size, rank, mla)
    if layout.problem() or layout.heads_per_rank != kv_heads:
        raise ConfigError("p2p.kv_heads_total", f"{total} KV heads on TP {size} cannot give rank {rank} the "
                                                f"{kv_heads} heads LMCache reports ({layout.problem() or 'mismatch'})")
    return Fingerprint(
        model=model, num_layers=layers, kv_heads=kv_heads,
        head_size=head_size, dtype=dtype_name(metadata.kv_dtype), chunk_tokens=chunk_tokens, tp_size=size,
        tp_rank=rank, kv_format=MLA_FORMAT if mla else "KV_2LTD",
        weights=weights_identity(model), kv_heads_total=total,
    )


def model_kv_heads(model: str, rank_heads: int, tp_size: int) -> int:
    """The total KV heads a local model folder's config.json declares, when it agrees with this rank's
    share (vLLM gives each rank max(1, total // tp) heads); 0 when unknown or it does not agree."""
    try:
        config = json.loads((Path(model).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return 0
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    total = text.get("num_key_value_heads") or text.get("num_attention_heads")
    if isinstance(total, int) and total > 0 and max(1, total // tp_size) == rank_heads:
        return total
    return 0


def check_rank_stores(lmcache_config: Any, metadata: Any) -> None:
    """Every TP rank must run the plugin: LMCache's ``save_only_first_rank`` (on by default for MLA)
    stores and loads on rank 0 only, and the other ranks would never announce or load."""
    rank, size = tp_rank_of(metadata)
    if size <= 1 or not getattr(metadata, "use_mla", False):
        return
    get = getattr(lmcache_config, "get_extra_config_value", None)
    if get is None or get("save_only_first_rank", True):
        raise ConfigError("extra_config.save_only_first_rank",
                          f"must be false for an MLA model on TP {size}: every rank loads its own copy of the "
                          "latent (lmcache_p2p sends it once per decoder rank)")
