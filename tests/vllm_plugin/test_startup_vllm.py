"""Real vLLM-CPU servers whose LMCache plugin cannot start exit non-zero, with the reason in their log.

Before, LMCache logged "Failed to create backend p2p" and vLLM served with the plugin disabled.
"""

from __future__ import annotations

import json

import pytest

from lmcache_p2p.cli.launch import cache_flags
from test_startup import yaml_with
from vllm_server import VLLMServer, VLLMServerError, free_port

pytestmark = [pytest.mark.vllm, pytest.mark.vllm_start_fails]  # beside the serial group (tests/conftest.py)
pytest.importorskip("vllm")

CONSUMER = json.dumps({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_consumer",
                       "kv_connector_extra_config": {"skip_last_n_tokens": 1}})
BROKEN = {"unknown_key": {"bufer_size": "1GB"}, "engine_fails": {"buffer_size": "1KB"}}  # 1KB: below one chunk


@pytest.fixture(scope="module")
def failed_starts(tiny_model_dir, tmp_path_factory) -> dict[str, tuple[str, str]]:
    """Per BROKEN entry: a decoder with those ``p2p`` keys in its YAML, started beside the others (each on a core
    of its own); (what its start raised, the server's log)."""
    tmp = tmp_path_factory.mktemp("startup")
    servers = {name: decoder(tiny_model_dir, tmp / name, core, **p2p)
               for core, (name, p2p) in enumerate(BROKEN.items())}
    for server in servers.values():
        server.start()
    out = {}
    try:
        for name, server in servers.items():
            try:
                server.wait_healthy()
                out[name] = ("it started", server.log_text())
            except VLLMServerError as exc:
                out[name] = (str(exc), server.log_text())
    finally:
        for server in servers.values():
            server.stop()
    return out


def decoder(tiny_model_dir, tmp_path, cpu_core: int, **p2p) -> VLLMServer:
    tmp_path.mkdir(parents=True)
    config = yaml_with(tmp_path, "decoder.yaml", control_ports=[free_port()], transport_ports=[free_port()], **p2p)
    return VLLMServer(tiny_model_dir, port=free_port(), log_path=tmp_path / "decoder.log", cpu_core=cpu_core,
                      extra_args=[*cache_flags(), "--max-model-len", "2048", "--kv-transfer-config", CONSUMER],
                      extra_env={"LMCACHE_CONFIG_FILE": str(config)})


def test_an_unknown_p2p_key_makes_the_server_exit(failed_starts) -> None:
    error, log = failed_starts["unknown_key"]
    assert "exited with code 1 during start-up" in error
    assert "p2p.bufer_size: unknown key; known keys: " in log


def test_a_plugin_that_fails_in_the_engine_makes_the_server_exit(failed_starts) -> None:
    error, log = failed_starts["engine_fails"]
    assert "exited with code 1 during start-up" in error
    assert "lmcache_p2p plugin 'p2p' (lmcache_p2p.backend.ReceiverBackend) did not start" in log
    assert "p2p.buffer_size: 1024 bytes is smaller than one chunk of this model" in log
