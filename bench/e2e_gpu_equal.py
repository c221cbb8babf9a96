"""GPU correctness checks for the pass: greedy equality through 1P1D, and the NCCL killed-peer check.

``equal``: for each model (``--model LABEL=DIR``; ``LABEL:notok`` for a model served with
``--skip-tokenizer-init`` and token-id prompts, the proxy with ``--tokenizer none``), start a
single vLLM (GPU 0) and lmcache_p2p 1P1D over NIXL and over NCCL, one after the other with the
same vLLM flags, and send every case to each, one request at a time: prompts of 1 to 8 chunks
(256 tokens each, never chunk-aligned), streamed and not, ``/v1/completions`` and
``/v1/chat/completions`` (completions only without a tokenizer), greedy, ``ignore_eos``,
``return_token_ids``. Per 1P1D system: how many cases' token ids (and texts) equal the single
instance's, and, from the decoder's log, how many decode requests loaded the whole prompt from
the prefiller (LMCache hit = prompt + first token - 1, the one ``skip_last_n_tokens`` skips).

``kill``: 1P1D over NCCL with the launcher's supervision on: load through the proxy, ``kill -9``
of the prefiller (its API server and engine) the moment it logs a store after ``--kill-after-s``
(that request's writes are then on the wire), then: the decoder's
processes are the same and healthy, its log has no NCCL watchdog teardown, its receive slots all
return, and requests succeed (whole-prompt KV) once the launcher restarted the prefiller.

With ``--prefill-tp`` / ``--decode-tp`` (bench/e2e_gpu.py's flags) the single instance runs at the
decoder's TP size and each row also counts the decode requests that every decoder rank retrieved
whole (``decoder_requests_loaded_on_every_rank``).

Results: ``--results-dir``/equality.json and killed_peer.json (bench/e2e_gpu.py puts them into
``e2e_gpu.json``; a rerun skips the (model, system) pairs already there), ``--out`` for both.

    python3 bench/e2e_gpu_equal.py --mode equal --model tiny=/tmp/models/tiny -- --enforce-eager
    python3 bench/e2e_gpu_equal.py --mode kill --model 8b=/tmp/models/llama8b-shape \\
        -- --enforce-eager --load-format dummy
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import logging
import os
import random
import re
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import e2e_gpu  # noqa: E402  (bench/ is not a package)

from lmcache_p2p.cli.demo import lookups_in_log  # noqa: E402

logger = logging.getLogger("bench.e2e_gpu_equal")

CHUNK_TOKENS = 256
CHUNK_COUNTS = (1, 2, 3, 4, 5, 6, 7, 8)
OUTPUT_TOKENS = 24
REQUEST_TIMEOUT_S = 120.0
SYSTEMS = ("single", "lmcache_p2p-nixl", "lmcache_p2p-nccl")
WATCHDOG_MARKERS = ("watchdog", "ncclsystemerror", "ncclremoteerror", "terminate called", "process group watchdog",
                    "sigabrt", "core dumped")
WORDS = ("alpha bravo charlie delta echo river stone cloud maple ember frost lumen quartz vapor nimbus the quick "
         "brown fox").split()


@dataclasses.dataclass(frozen=True)
class Model:
    label: str
    path: Path
    tokenizer: bool  # False: --skip-tokenizer-init, token-id prompts, proxy --tokenizer none


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    endpoint: str  # "completions" | "chat"
    stream: bool
    chunks: int
    prompt: Any  # text, token ids, or chat messages


@dataclasses.dataclass
class Output:
    token_ids: list[int] | None
    text: str
    error: str = ""


# ---- prompts --------------------------------------------------------------------------------------


def target_tokens(chunks: int) -> int:
    """A prompt length inside chunk ``chunks`` (never on a chunk boundary)."""
    return (chunks - 1) * CHUNK_TOKENS + 37 + 23 * chunks


def text_of_tokens(tokenizer: Any, n: int, rng: random.Random) -> str:
    """Random words whose tokenization is about ``n`` tokens (special tokens included)."""
    words: list[str] = []
    while len(tokenizer(" ".join(words))["input_ids"]) < n:
        words += [rng.choice(WORDS) for _ in range(max(1, (n - len(words)) // 4))]
    while len(words) > 1 and len(tokenizer(" ".join(words[:-1]))["input_ids"]) >= n:
        words.pop()
    return " ".join(words)


def make_cases(model: Model, vocab_size: int) -> list[Case]:
    rng = random.Random(7)
    cases = []
    if model.tokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(model.path))
        for chunks in CHUNK_COUNTS:
            text = text_of_tokens(tok, target_tokens(chunks), rng)
            for stream in (False, True):
                cases.append(Case(f"completions-{chunks}c-{'stream' if stream else 'full'}", "completions", stream,
                                  chunks, text))
                cases.append(Case(f"chat-{chunks}c-{'stream' if stream else 'full'}", "chat", stream, chunks,
                                  [{"role": "user", "content": text}]))
        return cases
    for chunks in CHUNK_COUNTS:
        ids = [rng.randrange(10, vocab_size) for _ in range(target_tokens(chunks))]
        for stream in (False, True):
            cases.append(Case(f"ids-{chunks}c-{'stream' if stream else 'full'}", "completions", stream, chunks, ids))
    return cases


# ---- requests -------------------------------------------------------------------------------------


def served_model(url: str) -> str:
    return httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]


def body_of(case: Case, model_name: str) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model_name, "max_tokens": OUTPUT_TOKENS, "temperature": 0, "ignore_eos": True,
                            "return_token_ids": True, "stream": case.stream}
    if case.stream:
        body["stream_options"] = {"include_usage": True}
    if case.endpoint == "chat":
        body["messages"] = case.prompt
    else:
        body["prompt"] = case.prompt
    return body


def send(client: httpx.Client, url: str, case: Case, model_name: str) -> Output:
    path = "/v1/chat/completions" if case.endpoint == "chat" else "/v1/completions"
    body = body_of(case, model_name)
    try:
        if not case.stream:
            resp = client.post(url + path, json=body, timeout=REQUEST_TIMEOUT_S)
            if resp.status_code != 200:
                return Output(None, "", f"HTTP {resp.status_code}: {resp.text[:300]}")
            choice = resp.json()["choices"][0]
            message = choice.get("message") or {}
            text = choice.get("text") if case.endpoint == "completions" else message.get("content")
            ids = choice.get("token_ids")
            return Output(list(ids) if ids is not None else None, text or "")
        ids_seen: list[int] = []
        any_ids = False
        text = ""
        with client.stream("POST", url + path, json=body, timeout=REQUEST_TIMEOUT_S) as resp:
            if resp.status_code != 200:
                return Output(None, "", f"HTTP {resp.status_code}: {resp.read()[:300]!r}")
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return Output(None, text, f"stream error: {json.dumps(event)[:300]}")
                for choice in event.get("choices") or []:
                    if choice.get("token_ids") is not None:
                        any_ids = True
                        ids_seen += choice["token_ids"]
                    piece = choice.get("text") if case.endpoint == "completions" else \
                        (choice.get("delta") or {}).get("content")
                    text += piece or ""
        return Output(ids_seen if any_ids else None, text)
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
        return Output(None, "", f"{type(exc).__name__}: {exc}")


def run_cases(url: str, cases: Sequence[Case]) -> list[Output]:
    name = served_model(url)
    with httpx.Client() as client:
        return [send(client, url, case, name) for case in cases]


# ---- equality -------------------------------------------------------------------------------------


CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def model_args(model: Model, cfg: e2e_gpu.Config) -> e2e_gpu.Config:
    """The model's flags, the same for every system: ``--skip-tokenizer-init`` without a tokenizer,
    a plain chat template when the tokenizer has none (vLLM refuses chat requests without one)."""
    log_dir = cfg.log_dir / model.label
    log_dir.mkdir(parents=True, exist_ok=True)
    extra: tuple[str, ...] = ()
    if not model.tokenizer:
        extra = ("--skip-tokenizer-init",)
    elif not has_chat_template(model.path):
        template = log_dir / "chat_template.jinja"
        template.write_text(CHAT_TEMPLATE)
        extra = ("--chat-template", str(template))
    return dataclasses.replace(cfg, model=model.path, vllm_args=(*cfg.vllm_args, *extra), log_dir=log_dir)


def has_chat_template(path: Path) -> bool:
    config = path / "tokenizer_config.json"
    in_config = config.exists() and "chat_template" in json.loads(config.read_text())
    return in_config or (path / "chat_template.jinja").exists()


def start_system(system: str, cfg: e2e_gpu.Config, model: Model, on_exit: str = "stop") -> e2e_gpu.Deployment:
    if system == "single":
        return e2e_gpu.start_single(cfg)
    if not model.tokenizer:  # the proxy has no tokenizer either: the instances serve token ids only
        return start_p2p_notok(cfg, system.split("-", 1)[1], on_exit)
    return e2e_gpu.start_p2p(cfg, system.split("-", 1)[1], on_exit)


def start_p2p_notok(cfg: e2e_gpu.Config, transport: str, on_exit: str) -> e2e_gpu.Deployment:
    """``start_p2p`` with ``--proxy-arg=--tokenizer=none`` (the launcher's own flag for it)."""
    real_child = e2e_gpu.Child

    def child_with_proxy_arg(name: str, argv: list[str], *args: Any, **kwargs: Any) -> Any:
        if name.startswith("launch-") and "--" in argv:
            at = argv.index("--")
            argv = [*argv[:at], "--proxy-arg=--tokenizer=none", *argv[at:]]
        return real_child(name, argv, *args, **kwargs)

    e2e_gpu.Child = child_with_proxy_arg
    try:
        return e2e_gpu.start_p2p(cfg, transport, on_exit)
    finally:
        e2e_gpu.Child = real_child


def vocab_size(model: Model) -> int:
    return int(json.loads((model.path / "config.json").read_text())["vocab_size"])


def compare(cases: Sequence[Case], ref: Sequence[Output], got: Sequence[Output]) -> dict[str, Any]:
    ids_equal = text_equal = compared_ids = 0
    mismatches = []
    for case, a, b in zip(cases, ref, got):
        if a.error or b.error:
            mismatches.append({"case": case.name, "single_error": a.error[:200], "error": b.error[:200]})
            continue
        same_ids = a.token_ids is not None and a.token_ids == b.token_ids
        compared_ids += a.token_ids is not None
        ids_equal += same_ids
        text_equal += a.text == b.text
        if not same_ids or a.text != b.text:
            mismatches.append({"case": case.name, "single_ids": (a.token_ids or [])[:12],
                               "ids": (b.token_ids or [])[:12], "single_text": a.text[:80], "text": b.text[:80]})
    return {"cases": len(cases), "token_ids_compared": compared_ids, "token_ids_equal": ids_equal,
            "texts_equal": text_equal, "outputs_equal": ids_equal == len(cases) and compared_ids == len(cases),
            "mismatches": mismatches[:8]}


def decoder_hits(dep: e2e_gpu.Deployment, seen: int, decode_tp: int = 1) -> dict[str, Any]:
    lookups = lookups_in_log(dep.decoder_log)[seen:] if dep.decoder_log and dep.decoder_log.exists() else []
    full = sum(lk.hit_tokens == lk.total_tokens - 1 for lk in lookups)
    looked = sum(lk.total_tokens - 1 for lk in lookups)
    return {"decoder_lookups": len(lookups), "decoder_full_prompt_hits": full,
            "decoder_hit_ratio": round(sum(lk.hit_tokens for lk in lookups) / looked, 4) if looked else None,
            "decoder_lookups_detail": [[lk.total_tokens, lk.hit_tokens] for lk in lookups],
            **rank_retrieves(dep, decode_tp)}


RETRIEVED_RE = re.compile(r"\[req_id=(\S+)\] Retrieved (\d+) out of")
LOOKUP_RE = re.compile(r"Reqid: (\S+), Total tokens \d+, Inference Engine computed tokens: \d+, LMCache hit tokens: (\d+)")


def rank_retrieves(dep: e2e_gpu.Deployment, decode_tp: int) -> dict[str, Any]:
    """How many of the decoder's requests every one of its ``decode_tp`` ranks retrieved the scheduler's whole
    hit for: LMCache logs one retrieve line per rank (each worker holds one engine) and names no rank."""
    if not dep.decoder_log or not dep.decoder_log.exists():
        return {}
    text = dep.decoder_log.read_text(errors="replace")
    per_rank: dict[str, list[int]] = {}
    for req, got in RETRIEVED_RE.findall(text):
        per_rank.setdefault(req, []).append(int(got))
    hits = dict(LOOKUP_RE.findall(text))
    every = sum(ranks == [int(hits.get(req, -1))] * decode_tp for req, ranks in per_rank.items())
    return {"decoder_tp": decode_tp, "decoder_requests_loaded_on_every_rank": every,
            "decoder_requests_retrieved": len(per_rank)}


def run_equal(cfg: e2e_gpu.Config, models: Sequence[Model], systems: Sequence[str]) -> dict[str, Any]:
    path = cfg.results_dir / "equality.json"
    results: dict[str, Any] = json.loads(path.read_text()) if path.exists() and not cfg.force else {}
    for model in models:
        mcfg = model_args(model, cfg)
        cases = make_cases(model, vocab_size(model))
        entry = results.setdefault(model.label, {"model": str(model.path), "tokenizer": model.tokenizer,
                                                 "vllm_args": list(mcfg.vllm_args), "systems": {}})
        outputs_path = cfg.results_dir / "equality-outputs.json"  # {label: {system: [Output]}}: one file
        every: dict[str, Any] = json.loads(outputs_path.read_text()) if outputs_path.exists() and not cfg.force else {}
        outputs: dict[str, list[dict[str, Any]]] = every.setdefault(model.label, {})
        for system in systems:
            if system in entry["systems"] and system in outputs:
                logger.info("%s/%s: cached", model.label, system)
                continue
            if e2e_gpu.time_left_s(cfg) < cfg.estimate_start_s + 30:
                logger.warning("%s/%s: not started, %.0fs left (rerun to resume)", model.label, system,
                               e2e_gpu.time_left_s(cfg))
                return results
            started = time.monotonic()
            try:
                dep = start_system(system, mcfg, model)
            except (e2e_gpu.StartupError, RuntimeError, httpx.HTTPError) as exc:
                logger.error("%s/%s did not start: %s", model.label, system, exc)
                entry["systems"][system] = {"error": str(exc)[:1500]}
                continue
            up_s = time.monotonic() - started
            try:
                seen = len(lookups_in_log(dep.decoder_log)) if dep.decoder_log and dep.decoder_log.exists() else 0
                got = run_cases(dep.url, cases)
                time.sleep(1.0)  # the decoder's last log lines
                hits = decoder_hits(dep, seen, mcfg.decode_tp) if system != "single" else {}
            finally:
                dep.stop()
            outputs[system] = [dataclasses.asdict(o) for o in got]
            outputs_path.write_text(json.dumps(every))
            row: dict[str, Any] = {"up_s": round(up_s, 1), "failed": sum(bool(o.error) for o in got),
                                   "first_error": next((o.error[:300] for o in got if o.error), None), **hits}
            if system != "single" and "single" in outputs:
                ref = [Output(**o) for o in outputs["single"]]
                row.update(compare(cases, ref, got))
            entry["systems"][system] = row
            path.write_text(json.dumps(results, indent=1))
            logger.info("%s/%s: %s", model.label, system,
                        {k: v for k, v in row.items() if k not in ("decoder_lookups_detail", "mismatches")})
        entry["cases"] = [{"name": c.name, "chunks": c.chunks,
                           "prompt_tokens": target_tokens(c.chunks) if not model.tokenizer else None} for c in cases]
        path.write_text(json.dumps(results, indent=1))
    return results


# ---- the killed prefiller ---------------------------------------------------------------------------


def pids_listening(port: int) -> list[int]:
    """vLLM API servers started with ``--port PORT``, and every process below them (their engine)."""
    roots = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"vllm.entrypoints.openai.api_server" in b" ".join(argv) and b"--port" in argv:
            if argv[argv.index(b"--port") + 1] == str(port).encode():
                roots.append(int(entry.name))
    return sorted(set(roots) | {d for r in roots for d in descendants(r)})


def descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def alive(pids: Sequence[int]) -> bool:
    return all(Path(f"/proc/{p}").exists() for p in pids)


def decoder_slots(url: str) -> dict[str, Any]:
    try:
        listed = httpx.get(f"{url}/instances", params={"all": "1"}, timeout=5).json()
    except (httpx.HTTPError, ValueError) as exc:
        return {"error": str(exc)}
    decoders = [i for i in listed if i.get("role") == "receiver"]
    return {"free": [d.get("free_slots") for d in decoders], "capacity": [d.get("capacity_slots") for d in decoders]}


def load_requests(url: str, cases: Sequence[Case], name: str, until: float,
                  concurrency: int) -> list[tuple[float, str]]:
    """Closed-loop load until ``until``: (start time, error or "") per request."""
    def worker(seed: int) -> list[tuple[float, str]]:
        done = []
        with httpx.Client() as client:
            i = seed
            while time.monotonic() < until:
                t = time.monotonic()
                out = send(client, url, cases[i % len(cases)], name)
                done.append((t, out.error))
                i += concurrency
        return done

    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        return [r for f in [pool.submit(worker, s) for s in range(concurrency)] for r in f.result()]


STORE_MARKER = "Stored "  # LMCache's log line once a request's chunks went to the sender (their writes start)
LOG_POLL_S = 0.001


def wait_for_new_line(path: Path, marker: str, timeout_s: float) -> bool:
    """Poll ``path`` (from its current end) until a new line holds ``marker``; False after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    with path.open("rb") as f:
        f.seek(0, os.SEEK_END)
        pending = b""
        while time.monotonic() < deadline:
            chunk = f.read()
            if chunk:
                pending = (pending + chunk)[-65536:]
                if marker.encode() in pending:
                    return True
            else:
                time.sleep(LOG_POLL_S)
    return False


def kill_all(pids: Sequence[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def kill_under_load(dep: e2e_gpu.Deployment, cases: Sequence[Case], name: str, kill_after_s: float,
                    prefiller_log: Path) -> dict[str, Any]:
    """Closed-loop load; after ``kill_after_s``, ``kill -9`` the prefiller the moment it logs a store
    (that request's writes are then on the wire, for ~5 ms per 128 MiB)."""
    pids = pids_listening(e2e_gpu.P2P_PREFILL_PORT)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        load = pool.submit(load_requests, dep.url, cases, name, time.monotonic() + kill_after_s + 10.0, 16)
        time.sleep(kill_after_s)
        on_store = wait_for_new_line(prefiller_log, STORE_MARKER, 5.0)
        killed_at = time.monotonic()
        kill_all(pids)
        logger.info("killed the prefiller %s under load (%s)", pids,
                    "right after it logged a store" if on_store else "no store logged within 5 s")
        during = load.result()
    return {"prefiller_pids_killed": pids, "killed_right_after_a_store": on_store, "killed_at": killed_at,
            "load": {"requests": len(during), "failed": sum(bool(e) for _, e in during),
                     "failed_after_kill": sum(bool(e) for t, e in during if t >= killed_at - 1.0),
                     "errors": sorted({e[:160] for _, e in during if e})[:5]}}


def wait_slots_returned(url: str, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    slots = decoder_slots(url)
    while time.monotonic() < deadline and slots.get("free") != slots.get("capacity"):
        time.sleep(1)
        slots = decoder_slots(url)
    return {"decoder_slots_after_load": slots,
            "decoder_slots_returned": bool(slots.get("free")) and slots.get("free") == slots.get("capacity")}


def wait_prefiller_back(url: str, killed: Sequence[int], timeout_s: float) -> list[int]:
    """The restarted prefiller's processes once the proxy routes to it again ([] after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pids = pids_listening(e2e_gpu.P2P_PREFILL_PORT)
        try:
            health = httpx.get(f"{url}/health", timeout=5).json()
        except (httpx.HTTPError, ValueError):
            health = {}
        if pids and not set(pids) & set(killed) and health.get("prefillers", 0) >= 1:
            return pids
        time.sleep(1)
    return []


def decoder_state(dep: e2e_gpu.Deployment, pids: Sequence[int], log_from: int) -> dict[str, Any]:
    """Same processes, /health, and what its log says since ``log_from`` (a character offset)."""
    try:
        health: Any = httpx.get(f"http://127.0.0.1:{e2e_gpu.P2P_DECODE_PORT}/health", timeout=5).status_code
    except httpx.HTTPError as exc:
        health = str(exc)
    text = dep.decoder_log.read_text(errors="replace")[log_from:] if dep.decoder_log else ""
    lines = text.splitlines()
    return {"decoder_alive_at_end": alive(pids), "decoder_pids_at_end": pids_listening(e2e_gpu.P2P_DECODE_PORT),
            "decoder_health": health,
            "decoder_log_markers": {m: sum(m in line.lower() for line in lines) for m in WATCHDOG_MARKERS},
            "decoder_log_pair_lines": [line[-220:] for line in lines if "pair" in line
                                       and any(w in line for w in ("ended", "broke", "paired"))][:8]}


def passed(result: dict[str, Any]) -> bool:
    after = result["after_restart"]
    return (result["decoder_alive_at_end"] and result["decoder_slots_returned"] and result["decoder_health"] == 200
            and after["failed"] == 0 and after["decoder_lookups"] > 0
            and after["decoder_full_prompt_hits"] == after["decoder_lookups"])


def run_kill(cfg: e2e_gpu.Config, model: Model, kill_after_s: float, restart_wait_s: float) -> dict[str, Any]:
    mcfg = model_args(model, cfg)
    cases = [c for c in make_cases(model, vocab_size(model)) if c.endpoint == "completions" and not c.stream
             and c.chunks in (4, 8)]
    dep = start_system("lmcache_p2p-nccl", mcfg, model, on_exit="restart")
    result: dict[str, Any] = {"model": str(model.path), "vllm_args": list(mcfg.vllm_args), "transport": "nccl"}
    try:
        name = served_model(dep.url)
        with httpx.Client() as client:
            result["warm_failed"] = sum(bool(send(client, dep.url, c, name).error) for c in cases[:2])
        decoder_pids = pids_listening(e2e_gpu.P2P_DECODE_PORT)
        log_from = len(dep.decoder_log.read_text(errors="replace")) if dep.decoder_log else 0
        prefiller_log = mcfg.log_dir / "lmcache_p2p-nccl" / "prefiller-0.log"
        result["decoder_pids"] = decoder_pids
        result.update(kill_under_load(dep, cases, name, kill_after_s, prefiller_log))
        killed_at = result.pop("killed_at")
        result["decoder_alive_after_kill"] = alive(decoder_pids)
        result.update(wait_slots_returned(dep.url, 60.0))
        back = wait_prefiller_back(dep.url, result["prefiller_pids_killed"], restart_wait_s)
        result["prefiller_restarted_s"] = round(time.monotonic() - killed_at, 1) if back else None
        seen = len(lookups_in_log(dep.decoder_log))
        with httpx.Client() as client:
            after = [send(client, dep.url, c, name) for c in cases * 2]
        time.sleep(1.0)  # the decoder's last log lines
        hits = {k: v for k, v in decoder_hits(dep, seen).items() if k != "decoder_lookups_detail"}
        result["after_restart"] = {"requests": len(after), "failed": sum(bool(o.error) for o in after),
                                   "first_error": next((o.error[:300] for o in after if o.error), None), **hits}
        result.update(decoder_state(dep, decoder_pids, log_from))
        result["passed"] = passed(result)
    finally:
        dep.stop()
    (cfg.results_dir / "killed_peer.json").write_text(json.dumps(result, indent=1))
    logger.info("killed peer: %s", result)
    return result


# ---- command line ---------------------------------------------------------------------------------


def parse_models(values: Sequence[str]) -> list[Model]:
    models = []
    for value in values:
        label, _, path = value.partition("=")
        notok = label.endswith(":notok")
        models.append(Model(label.removesuffix(":notok"), Path(path).resolve(), not notok))
    return models


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, passthrough = argv[:at], argv[at + 1:]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["equal", "kill"], required=True)
    p.add_argument("--model", action="append", required=True, help="LABEL=DIR, or LABEL:notok=DIR (token ids only)")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--kill-after-s", type=float, default=4.0, help="load before the prefiller is killed")
    p.add_argument("--restart-wait-s", type=float, default=240.0, help="how long the prefiller may take to return")
    p.add_argument("--out", type=Path, default=None, help="also write the results here")
    known, rest = p.parse_known_args(argv)
    cfg, archive = e2e_gpu.parse_args(["--model", "/", *rest, "--", *passthrough])
    cfg.results_dir.mkdir(parents=True, exist_ok=True)
    cfg.log_dir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, e2e_gpu._interrupt)
    models = parse_models(known.model)
    try:
        if known.mode == "equal":
            result: Any = run_equal(cfg, models, [s for s in known.systems.split(",") if s])
        else:
            result = run_kill(cfg, models[0], known.kill_after_s, known.restart_wait_s)
        if known.out is not None:
            known.out.write_text(json.dumps(result, indent=1) + "\n")
    finally:
        if archive is not None:
            e2e_gpu.pack_logs(cfg, archive)
    return 0


if __name__ == "__main__":
    sys.exit(main())
