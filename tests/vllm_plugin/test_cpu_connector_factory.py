"""The vLLM general plugin hooks LMCache's connector factory lazily, and only for vLLM on CPU.

Each check runs in a fresh interpreter: the point is what happens to a process's imports.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("vllm")
pytest.importorskip("lmcache")

SUBPROCESS_TIMEOUT_S = 180
CHILD_ENV = {"LMCACHE_TRACK_USAGE": "false", "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}


def run_python(*snippets: str) -> str:
    """Run the snippets (each dedented on its own) as one script in a fresh interpreter."""
    code = "\n".join(textwrap.dedent(snippet) for snippet in snippets)
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
        env=CHILD_ENV,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


FACTORY_CALL = """
    import torch
    from lmcache.utils import EngineType
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata
    metadata = LMCacheMetadata(
        model_name="tiny", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
        kv_dtype=torch.bfloat16, kv_shape=(2, 2, 256, 2, 32),
    )
    config = LMCacheEngineConfig.from_defaults(chunk_size=256, local_cpu=True)
"""


def test_vllm_plugin_loader_installs_hook_without_importing_lmcache():
    out = run_python(
        """
        import sys
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        print("lmcache imported at plugin load:", any(m.split(".")[0] == "lmcache" for m in sys.modules))
        # What LMCache's vLLM service factory does when it builds the engine:
        from lmcache.v1.gpu_connector import CreateGPUConnector
        """,
        FACTORY_CALL,
        """
        connector = CreateGPUConnector(config, metadata, EngineType.VLLM, layout_hints={})
        print("connector:", type(connector).__name__, connector.get_shape(7))
        """
    )
    assert "lmcache imported at plugin load: False" in out
    assert "connector: CPUPagedKVConnector torch.Size([2, 2, 7, 64])" in out


def test_install_patches_an_already_imported_lmcache():
    out = run_python(
        """
        import lmcache.v1.gpu_connector as gc
        from lmcache_p2p.vllm_plugin import cpu_connector_factory as plugin
        plugin.install()
        plugin.install()  # idempotent
        """,
        FACTORY_CALL,
        """
        connector = gc.CreateGPUConnector(config, metadata, EngineType.VLLM)
        print("connector:", type(connector).__name__)
        print("mock:", type(gc.CreateGPUConnector(config, metadata, EngineType.MOCK)).__name__)
        """
    )
    assert "connector: CPUPagedKVConnector" in out
    assert "mock: MockGPUConnector" in out  # other engines still go to LMCache's factory


def test_unsupported_lmcache_options_fail_loudly():
    out = run_python(
        """
        from lmcache_p2p.vllm_plugin import cpu_connector_factory as plugin
        plugin.install()
        from lmcache.v1.gpu_connector import CreateGPUConnector
        """,
        FACTORY_CALL,
        """
        config.use_layerwise = True
        try:
            CreateGPUConnector(config, metadata, EngineType.VLLM)
        except ValueError as exc:
            print("error:", exc)
        """
    )
    assert "error: LMCache config use_layerwise: true is not supported" in out


def test_vllm_plugin_loader_hooks_the_prefiller_lookup_skip():
    out = run_python(
        """
        import sys
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        print("lmcache imported at plugin load:", any(m.split(".")[0] == "lmcache" for m in sys.modules))
        from lmcache.integration.vllm.vllm_v1_adapter import LMCacheConnectorV1Impl
        method = LMCacheConnectorV1Impl.get_num_new_matched_tokens
        print("patched:", getattr(method, "_lmcache_p2p_producer_lookup_patched", False))
        """
    )
    assert "lmcache imported at plugin load: False" in out
    assert "patched: True" in out
