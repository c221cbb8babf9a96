"""GPU placement for ``lmcache-p2p launch --device cuda``: one GPU per instance, memory accounted.

A decoder with ``buffer_device: cuda`` allocates its receive buffer (``p2p.buffer_size`` bytes)
in VRAM next to vLLM, and so does a prefiller its send arena (LMCache stores its chunks there), which by itself sizes weights + activations + KV cache to
``--gpu-memory-utilization`` of the whole GPU. The launcher lowers each instance's utilization by
the buffer's share of the GPU (rounded up to 0.01) so both fit, and refuses with a clear error
when too little would be left for vLLM. Total GPU memory comes from ``nvidia-smi`` (the launcher
must not create a CUDA context of its own: that costs ~0.5 GiB on every GPU it touches).
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import subprocess
from collections.abc import Sequence

from lmcache_p2p.errors import GpuPlanError

MIN_VLLM_UTILIZATION = 0.05  # below this vLLM has no room for a KV cache worth serving from
NVIDIA_SMI_TIMEOUT_S = 20.0


@dataclasses.dataclass(frozen=True)
class GpuSlot:
    index: int  # CUDA device index on this host, as nvidia-smi numbers it
    total_bytes: int


def query_gpus(timeout_s: float = NVIDIA_SMI_TIMEOUT_S) -> list[GpuSlot]:
    """Every GPU of this host with its total memory, from nvidia-smi."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        raise GpuPlanError("--device cuda: nvidia-smi not found on PATH, so no GPU can be seen; "
                           "install the NVIDIA driver tools or use --device cpu")
    try:
        out = subprocess.run([exe, "--query-gpu=index,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=timeout_s, check=True).stdout
    except (subprocess.SubprocessError, OSError) as exc:
        raise GpuPlanError(f"--device cuda: nvidia-smi could not list the GPUs within {timeout_s:.0f}s: {exc}") from exc
    return parse_nvidia_smi(out)


def parse_nvidia_smi(text: str) -> list[GpuSlot]:
    """``index, memory.total`` rows (MiB, as ``--format=csv,noheader,nounits`` prints them)."""
    slots = []
    for line in text.strip().splitlines():
        index, mib = (field.strip() for field in line.split(","))
        slots.append(GpuSlot(int(index), int(mib) * 2**20))
    return slots


def pick_gpus(count: int, available: Sequence[GpuSlot], wanted: Sequence[int] | None,
              need: str | None = None, lower: str = "lower --prefill/--decode") -> list[GpuSlot]:
    """``count`` GPUs, one per instance (or per TP rank): ``wanted`` (``--gpus``) or the first ``count`` of the host.

    ``need`` says what asks for them (default "N instances need N GPUs (one each)"), ``lower`` which flags to
    change. ``--gpus`` may name a GPU more than once only with ``--share-gpus``: the caller splits its memory."""
    need = need or f"{count} instances need {count} GPUs (one each)"
    by_index = {slot.index: slot for slot in available}
    if wanted:
        missing = [i for i in wanted if i not in by_index]
        if missing:
            raise GpuPlanError(f"--gpus names GPU(s) {missing} but this host has {sorted(by_index)}")
        if len(wanted) < count:
            raise GpuPlanError(f"{need} but --gpus lists {len(wanted)}: name more GPUs in --gpus or {lower[0].lower()}"
                               f"{lower[1:]}")
        return [by_index[i] for i in wanted[:count]]
    if len(available) < count:
        raise GpuPlanError(f"{need} but this host has {len(available)}: {lower}")
    return list(available[:count])


def utilization_with_buffer(base: float, buffer_bytes: int, total_bytes: int, flag: str = "--buffer-size",
                            buffer: str = "the decoder's receive buffer") -> float:
    """vLLM's ``--gpu-memory-utilization`` for an instance with a buffer of ours on the same GPU (a
    decoder's receive buffer; a prefiller's send arena, ``flag`` --send-buffer-size)."""
    share = math.ceil(buffer_bytes / total_bytes * 100) / 100
    util = round(base - share, 2)
    if util < MIN_VLLM_UTILIZATION:
        raise GpuPlanError(
            f"{buffer} ({flag}, {buffer_bytes / 2**30:.1f} GiB) takes {share:.2f} of its "
            f"GPU ({total_bytes / 2**30:.0f} GiB), leaving vLLM {util:.2f} of --gpu-memory-utilization {base:.2f} "
            f"(at least {MIN_VLLM_UTILIZATION} needed): lower {flag} or raise --gpu-memory-utilization")
    return util


def shared_gpus(slots: Sequence[GpuSlot], names: Sequence[str], share: bool, transport: str) -> dict[int, int]:
    """How many instances each GPU holds; a GPU named twice needs ``--share-gpus`` and NIXL (NCCL cannot put
    two ranks of one pair on one GPU)."""
    counts: dict[int, int] = {}
    for slot in slots:
        counts[slot.index] = counts.get(slot.index, 0) + 1
    crowded = sorted(i for i, n in counts.items() if n > 1)
    if crowded and not share:
        raise GpuPlanError(f"--gpus {','.join(str(s.index) for s in slots)} repeats GPU(s) {crowded}: one GPU per "
                           f"instance, or --share-gpus to split a GPU's memory between its instances")
    if crowded and transport == "nccl":
        on = [n for n, s in zip(names, slots) if s.index == crowded[0]]
        raise GpuPlanError(f"--share-gpus puts {' and '.join(on)} on GPU {crowded[0]}, but NCCL cannot join two ranks "
                           f"on one GPU: use --transport nixl or one GPU per instance")
    return counts


def split_utilization_arg(vllm_args: Sequence[str]) -> tuple[float | None, list[str]]:
    """Take ``--gpu-memory-utilization`` out of pass-through vLLM args (the launcher sets it per role)."""
    rest: list[str] = []
    value: float | None = None
    it = iter(vllm_args)
    for arg in it:
        if arg == "--gpu-memory-utilization":
            value = float(next(it))
        elif arg.startswith("--gpu-memory-utilization="):
            value = float(arg.split("=", 1)[1])
        else:
            rest.append(arg)
    return value, rest
