"""Engine level on the GPU machine: the plugin path with chunks of Llama-3.1-8B's shape.

Prefiller engine on GPU 0 (its KV on the GPU, LMCache's chunks in pinned host memory, as in
vLLM) -> decoder engine with the receive buffer on GPU 1; both load the plugin from YAML.
Chunks are [2, 32, 256, 1024] bf16 = 32 MiB. Assertions: every token hits, the KV loaded on
GPU 1 is bit-exact, every slot is FREE afterwards, nothing failed on the sender.
Runs with NIXL (host chunks staged through GPU 0, then cuda_ipc) and with NCCL (the pinned ->
device staging ring), and for each with the prefiller's chunks in a VRAM arena on GPU 0
(``p2p.buffer_device: cuda`` on the sender: no host round trip). With one CUDA device both engines
share it (NIXL only); skipped without one.
"""

from __future__ import annotations

import time

import pytest
from engines import EngineProc, free_port, write_config
from test_engine_p2p import all_free, assert_received, store, wait_for

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
# Two GPUs: prefiller on cuda:0, decoder on cuda:1 (peer writes over NVLink). One GPU: both on cuda:0, NIXL
# only (cuda_ipc between two processes on one device; NCCL cannot pair two ranks on one GPU).
DECODER_GPU = "cuda:1" if torch.cuda.is_available() and torch.cuda.device_count() >= 2 else "cuda:0"

CHUNK_BYTES = 2 * 32 * 256 * 1024 * 2  # [2, 32, 256, 1024] bf16
GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
           "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "UCX_TLS": "cuda_ipc,cuda_copy,tcp,self",
           "P2P_ENGINE_SHAPE": "llama8b"}


@pytest.fixture(scope="module", params=["nixl", "nccl", "nixl-vram", "nccl-vram"])
def gpu_pair(request, tmp_path_factory):
    transport, _, vram = request.param.partition("-")
    if transport == "nccl" and DECODER_GPU == "cuda:0":
        pytest.skip("NCCL needs two CUDA devices")
    tmp = tmp_path_factory.mktemp(f"gpu-{request.param}")
    port = free_port()
    rcfg = write_config(tmp / "decoder.yaml", "decoder.yaml", transport=transport, buffer_size="512MB",
                        buffer_device=DECODER_GPU, control_ports=[port], transport_ports=[free_port()])
    # 2 GiB of LMCache host memory on the prefiller: 64 chunks of 32 MiB in flight at most.
    sender_buffer = {"buffer_device": "cuda", "buffer_size": "1GB"} if vram else {}
    scfg = write_config(tmp / "prefiller.yaml", "prefiller.yaml", {"max_local_cpu_size": 2}, transport=transport,
                        alloc_timeout_s=10, **sender_buffer)
    made = []
    try:
        made.append(EngineProc("decoder", rcfg, tmp / "decoder.log", {**GPU_ENV, "P2P_ENGINE_DEVICE": DECODER_GPU}))
        made.append(EngineProc("prefiller", scfg, tmp / "prefiller.log", {**GPU_ENV, "P2P_ENGINE_DEVICE": "cuda:0"}))
        yield transport, port, made[0], made[1]
    finally:
        for proc in reversed(made):
            proc.close()


def test_llama8b_chunks_from_gpu0_land_bit_exact_in_a_gpu1_buffer(gpu_pair):
    transport, port, receiver, sender = gpu_pair
    assert receiver.call(op="buffer") == {"slot_bytes": CHUNK_BYTES, "device": DECODER_GPU}
    n = 6 * 256 + 100  # six full 32 MiB chunks and a partial one
    started = time.monotonic()
    store(sender, port, seed=11, n=n, req_id=f"gpu-{transport}-1")
    assert_received(receiver, seed=11, n=n)
    elapsed_s = time.monotonic() - started
    assert all_free(receiver)
    stats = wait_for(lambda: sender.call(op="slots"), lambda s: s["pending"] == 0, 10)
    assert stats["failed"] == 0 and stats["sent"] >= 1
    if "arena_pages" in stats:  # chunks were stored on GPU 0 and every page came back once written
        assert stats["arena_device"] == "cuda:0" and stats["arena_spilled"] == 0
        final = wait_for(lambda: sender.call(op="slots"), lambda s: s["arena_free"] == s["arena_pages"], 10)
        assert final["arena_free"] == final["arena_pages"], final
    print(f"\n{transport}: lmcache {receiver.lmcache_version}, {n} tokens ({n * CHUNK_BYTES // 256 >> 20} MiB) "
          f"stored on cuda:0 -> loaded on {DECODER_GPU} bit-exact in {elapsed_s * 1e3:.0f} ms")


def test_two_requests_back_to_back_then_every_slot_is_free(gpu_pair):
    transport, port, receiver, sender = gpu_pair
    store(sender, port, seed=21, n=1024, req_id=f"gpu-{transport}-a")
    store(sender, port, seed=22, n=2048, req_id=f"gpu-{transport}-b")
    assert_received(receiver, seed=22, n=2048)
    assert_received(receiver, seed=21, n=1024)
    assert all_free(receiver)
