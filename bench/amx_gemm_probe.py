"""Does a CPU's matrix product of one row depend on how many other rows it is computed with?

    python bench/amx_gemm_probe.py [--out FILE]

For bf16 and float32, the tiny model's shapes (hidden 128 -> 256 / 430): row 0 of ``x[:m] @ w`` for m
= 1..64, compared bit for bit with ``x[:1] @ w``. A decoder batches several streams (m > 1) where the
fault suite's plain reference runs one request at a time (m = 1): if the bits differ, greedy outputs
may leave the reference at a near tie with no fault involved. Prints and writes which m differ, with
the CPU's AMX / AVX-512 flags (needs torch only).
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch


def cpu_flags() -> list[str]:
    text = Path("/proc/cpuinfo").read_text()
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return sorted(f for f in set(flags) if f.startswith(("amx", "avx512_bf16")))


def probe(dtype: torch.dtype, k: int, n: int, rows: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, k, generator=g) * 1.0).to(dtype)
    w = (torch.randn(k, n, generator=g) * 0.2).to(dtype)
    alone = (x[:1] @ w)[0]
    differ, max_abs = [], 0.0
    for m in range(1, rows + 1):
        row = (x[:m] @ w)[0]
        if not torch.equal(row, alone):
            differ.append(m)
            max_abs = max(max_abs, (row.float() - alone.float()).abs().max().item())
    return {"dtype": str(dtype).removeprefix("torch."), "k": k, "n": n, "m_differing": differ,
            "max_abs_difference": max_abs, "alone_abs_mean": alone.float().abs().mean().item()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--rows", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(1)
    results = [probe(dt, k, n, args.rows) for dt in (torch.bfloat16, torch.float32)
               for k, n in ((128, 256), (256, 128), (128, 430), (128, 384))]
    out = {"cpu": platform.processor() or "", "cpu_flags": cpu_flags(), "torch": torch.__version__,
           "threads": torch.get_num_threads(), "results": results}
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
