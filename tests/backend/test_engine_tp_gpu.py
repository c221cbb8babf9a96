"""Engine level on a GPU, different TP splits over NIXL cuda_ipc: several rank processes on one device.

Every engine (each TP rank of a prefiller and of a decoder) runs as a GPU worker on the same
device (``cuda:0``; on a machine of several GPUs, the decoder's buffer on the last one); the
decoders' receive buffers are in VRAM and the KV moves over UCX cuda_ipc. The prefillers keep
their chunks in a VRAM arena (``p2p.buffer_device: cuda``), so a split packs on the GPU and a
merge runs on the decoder's GPU. Assertions as in test_engine_tp.py: every decoder rank loads its
own heads bit-exact for every chunk, the bytes moved are the decoder's KV once, every slot is
free afterwards. Skipped without a CUDA device.
"""

from __future__ import annotations

import pytest
from test_engine_tp import check_moved
from tp_engines import start_instances

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DECODER_GPU = f"cuda:{torch.cuda.device_count() - 1}" if torch.cuda.is_available() else "cuda:0"
GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
           "UCX_TLS": "cuda_ipc,cuda_copy,tcp,self"}


@pytest.fixture(scope="module")
def gpu_engines(tmp_path_factory):
    sender = dict(env={**GPU_ENV, "P2P_ENGINE_DEVICE": "cuda:0"}, p2p={"buffer_device": "cuda", "buffer_size": "256MB"})
    receiver = dict(env={**GPU_ENV, "P2P_ENGINE_DEVICE": DECODER_GPU}, p2p={"buffer_device": DECODER_GPU})
    specs = [dict(name="p2", role="sender", tp=2, **sender), dict(name="p1", role="sender", tp=1, **sender),
             dict(name="d2", role="receiver", tp=2, **receiver), dict(name="d1", role="receiver", tp=1, **receiver),
             dict(name="mla-p2", role="sender", tp=2, mla=True, **sender),
             dict(name="mla-d1", role="receiver", tp=1, mla=True, **receiver)]
    engines = start_instances(tmp_path_factory.mktemp("tp-gpu"), specs)
    yield engines
    for inst in engines.values():
        inst.close()


@pytest.mark.parametrize("p, d, n", [("p2", "d2", 650), ("p2", "d1", 1024), ("p1", "d2", 1024)])
def test_each_decoder_rank_loads_exactly_its_heads_over_cuda_ipc(gpu_engines, p, d, n):
    check_moved(gpu_engines, p, d, n, heads_per_decoder_rank=2 // gpu_engines[d].tp)


def test_an_mla_latent_is_sent_by_one_sender_rank_over_cuda_ipc(gpu_engines):
    check_moved(gpu_engines, "mla-p2", "mla-d1", 650, heads_per_decoder_rank=1, mla=True, idle_ranks=(1,))
