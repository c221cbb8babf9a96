"""Greedy streams of the fault suite's tiny model, alone and batched, in plain PyTorch (transformers).

    python bench/amx_batch_probe.py OUT.json [TOKENS]

Results: ``bench/results/faults_decide/amx_batch_probe_*.json`` (the AMX host's was run as the same text
from a copy of the tree, with ``PYTHONPATH`` at its root).

No vLLM: a check of the one question a CPU kind decides, whether batching alone moves a greedy
stream. The 8 stream prompts of ``fault_suite.build_workload`` (seed 4: 100-300 tokens), the tiny
model built by ``lmcache_p2p.cli.tiny_model`` (the weights' sha256 is printed), one thread; per dtype
(bfloat16, float32): each prompt alone, then all 8 in one left-padded batch; where each batched
stream first leaves its alone stream. Also, per dtype, the rows m (1..16) at which row 0 of a
(m x 128) @ (128 x 256) product differs from its one-row product; at each first difference, the
alone run's top 3 log-probabilities and the gap between the two tokens in each run (a near tie: tiny).
"""

import hashlib
import json
import platform
import random
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from lmcache_p2p.cli.tiny_model import build_tiny_model

out, tokens = Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 1200
torch.set_num_threads(1)
model_dir = build_tiny_model(Path("/tmp/tiny-llama"))
tok = json.loads((model_dir / "tokenizer.json").read_text())
special = {t["id"] for t in tok.get("added_tokens", []) if t.get("special")}
vocab = [i for i in range(json.loads((model_dir / "config.json").read_text())["vocab_size"]) if i not in special]
rng = random.Random(4)
prompts = [[rng.choice(vocab) for _ in range(rng.randint(100, 300))] for _ in range(8)]


def first_diff(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def greedy(m, batch):
    width = max(map(len, batch))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    g = m.generate(input_ids=ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens,
                   do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    logp = [torch.log_softmax(step.float(), -1) for step in g.logits]
    return [(row[width:].tolist(), [lp[i] for lp in logp]) for i, row in enumerate(g.sequences)]


def at(alone, batched, d):
    """At the first difference: the alone run's top 3 and the gap between its token and the batched one's."""
    (a, la), (b, lb) = alone, batched
    top = torch.topk(la[d], 3)
    return {"position": d, "alone_top3": [[int(t), round(float(v), 5)] for t, v in zip(top.indices, top.values)],
            "alone_gap": round(float(la[d][a[d]] - la[d][b[d]]), 6),
            "batched_gap": round(float(lb[d][b[d]] - lb[d][a[d]]), 6)}


flags = sorted({f for line in open("/proc/cpuinfo") if line.startswith("flags") for f in line.split()
                if f.startswith(("amx", "avx512_bf16"))})
res = {"cpu": platform.processor(), "cpu_flags": flags, "torch": torch.__version__,
       "weights_sha256": hashlib.sha256((model_dir / "model.safetensors").read_bytes()).hexdigest(), "tokens": tokens}
for dt in (torch.bfloat16, torch.float32):
    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dt).eval()
    with torch.no_grad():
        alone = [greedy(m, [p])[0] for p in prompts]
        batched = greedy(m, prompts)
    x, w = torch.randn(16, 128).to(dt), (torch.randn(128, 256) * 0.2).to(dt)
    gemm = [k for k in range(1, 17) if not torch.equal((x[:k] @ w)[0], (x[:1] @ w)[0])]
    name = str(dt).removeprefix("torch.")
    diffs = [first_diff(a[0], b[0]) for a, b in zip(alone, batched)]
    res[name] = {"batched_first_difference": diffs, "gemm_rows_differing": gemm,
                 "at_difference": [None if d is None else at(a, b, d) for a, b, d in zip(alone, batched, diffs)],
                 "alone_first_tokens": [a[0][:8] for a in alone]}
    print(name, res[name]["batched_first_difference"], gemm, flush=True)
out.write_text(json.dumps(res, indent=1) + "\n")
