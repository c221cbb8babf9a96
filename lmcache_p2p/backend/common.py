"""What both plugin roles share: reading our config section and building the transport."""

from __future__ import annotations

import logging
from typing import Any

from lmcache_p2p.config import P2PConfig, Role, check_lmcache_settings
from lmcache_p2p.protocol import Fingerprint
from lmcache_p2p.errors import ConfigError
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
    accepts passed the KV fingerprint check at Hello (same model, layers, heads, dtype, chunk size,
    TP layout and format), so one key means the same KV from any of them.
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
    """The transport of ``p2p.transport`` for this worker; ``gpu`` is its GPU (None on CPU).

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
                            device=device, timeout_s=cfg.transfer_timeout_s)


def dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def fingerprint_of(metadata: Any) -> Fingerprint | None:
    """What this worker's KV bytes mean, from LMCache's metadata (``LMCacheMetadata`` in 0.5.x).

    ``kv_shape`` is (layers, 2 or 1, chunk_tokens, kv_heads, head_size) for this TP rank; MLA
    models hold one latent instead of K and V (LMCache's KV_MLA_FMT). None without metadata.
    """
    if metadata is None:
        return None
    layers, _, chunk_tokens, kv_heads, head_size = (int(x) for x in metadata.kv_shape)
    rank, size = tp_rank_of(metadata)
    model = str(getattr(metadata, "model_name", "") or "")
    return Fingerprint(
        model=model, num_layers=layers, kv_heads=kv_heads,
        head_size=head_size, dtype=dtype_name(metadata.kv_dtype), chunk_tokens=chunk_tokens, tp_size=size,
        tp_rank=rank, kv_format="KV_MLA_FMT" if getattr(metadata, "use_mla", False) else "KV_2LTD",
        weights=weights_identity(model),
    )
