"""bench/faults_gpu.py without a GPU or vLLM: where each transport's deployment runs (and why NCCL does not on one
GPU), the GPU deployment's commands and LMCache YAML, the store-path evidence in a prefiller's log, the reference
and its batch check against a fake OpenAI server, the rows and the result file, the pass's flow (budget, a failed
reference, the start fallback, SIGTERM), and the process bookkeeping that keeps a killed pass from leaving servers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from lmcache_p2p.cli.gpu import GpuSlot
from lmcache_p2p.cli.processes import Child
from lmcache_p2p.errors import StartupError

H200 = GpuSlot(0, 143771 << 20)
# The GPU kit's tiny model (head_dim 64: 1 KiB of KV per token) and the CPU suite's (head_dim 32).
GPU_TINY = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "hidden_size": 256,
            "num_hidden_layers": 2, "vocab_size": 350}
CPU_TINY = {**GPU_TINY, "head_dim": 32, "hidden_size": 128}


@pytest.fixture(scope="module")
def fg():
    repo = Path(__file__).resolve().parents[2]
    for p in (str(repo / "tests" / "faults"), str(repo / "tests"), str(repo)):
        if p not in sys.path:
            sys.path.insert(0, p)
    import importlib

    return importlib.import_module("bench.faults_gpu")


def model_dir(tmp_path: Path, config: dict) -> Path:
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(config))
    return d


# ---- placement ----------------------------------------------------------------------------------


def test_nixl_shares_gpu_0_and_nccl_on_one_gpu_is_not_run_with_the_reason(fg):
    nixl = fg.placement("nixl", 1, 3)
    assert nixl == fg.Placement("nixl", "0,0,0", True)
    assert nixl.flags() == ["--device", "cuda", "--transport", "nixl", "--gpus", "0,0,0", "--share-gpus"]
    reason = fg.placement("nccl", 1, 3)
    assert isinstance(reason, str) and reason.startswith("not run: NCCL needs a GPU per instance (3 for 1P2D)")
    assert "NVIDIA/nccl#418" in reason
    # the launcher's own refusal, quoted as it says it
    assert "--share-gpus puts prefiller-0 and decoder-0 on GPU 0, but NCCL cannot join two ranks on one GPU" in reason


def test_nccl_runs_with_a_gpu_per_instance(fg):
    assert fg.placement("nccl", 3, 3) == fg.Placement("nccl", "0,1,2", False)
    assert fg.placement("nccl", 8, 3).flags() == ["--device", "cuda", "--transport", "nccl", "--gpus", "0,1,2"]


# ---- the deployment ---------------------------------------------------------------------------------


@pytest.mark.parametrize("config, slot_bytes", [(GPU_TINY, 256 << 10), (CPU_TINY, 128 << 10)])
def test_each_decoder_buffer_holds_8_chunks_of_the_models_kv(fg, tmp_path, config, slot_bytes):
    model = model_dir(tmp_path, config)
    assert fg.receive_buffer_bytes(model) == 8 * slot_bytes
    spec = fg.gpu_spec(model, ["--enforce-eager"])
    assert spec.buffer_size == str(8 * slot_bytes)
    args = list(spec.vllm_args)
    assert args[-1] == "--enforce-eager" and args[args.index("--kv-cache-memory-bytes") + 1] == str(2 << 30)
    assert spec.sender_p2p["async_store"] is True and spec.sender_p2p["batched_gather"] is True
    assert spec.sender_p2p["transfer_timeout_s"] == 10  # the CPU suite's settings stay


def test_the_gpu_deployment_puts_every_instance_on_gpu_0_with_vram_buffers_and_the_async_store(fg, tmp_path,
                                                                                             monkeypatch):
    monkeypatch.delenv("UCX_TLS", raising=False)
    import fault_cluster

    parser_before = fault_cluster.build_parser
    model = model_dir(tmp_path, GPU_TINY)
    where = fg.placement("nixl", 1, 3)
    cluster = fg.GpuFaultCluster(model, tmp_path / "logs", fg.gpu_spec(model, ["--enforce-eager"]), where, [H200])
    assert fault_cluster.build_parser is parser_before  # restored once the deployment is built
    assert sorted(cluster.instances) == ["decoder-0", "decoder-1", "prefiller-0"]
    assert cluster.args.device == "cuda" and cluster.args.transport == "nixl"
    for name in cluster.instances:
        child = cluster.children[name]
        argv = list(child.argv)
        assert child.env["CUDA_VISIBLE_DEVICES"] == "0" and child.gpus == (0,)
        assert "cuda_ipc" in child.env["UCX_TLS"]
        # the deployment's 0.3 of the GPU split three ways, less each one's buffer (2 GB arena: 0.02; 2 MiB: 0.01)
        want = "0.08" if name.startswith("prefiller") else "0.09"
        assert argv[argv.index("--gpu-memory-utilization") + 1] == want, argv
        assert argv.count("--gpu-memory-utilization") == 1
        assert "--kv-cache-memory-bytes" in argv and "--enforce-eager" in argv
    sender = cluster.p2p_config("prefiller-0")
    assert sender["buffer_device"] == "cuda" and sender["buffer_size"] == "2GB"
    assert sender["async_store"] is True and sender["batched_gather"] is True and sender["transport"] == "nixl"
    for name in ("decoder-0", "decoder-1"):
        receiver = cluster.p2p_config(name)
        assert receiver["buffer_device"] == "cuda" and receiver["buffer_size"] == str(8 * (256 << 10))
        assert receiver["ready_lease_s"] == 30


def test_a_deployment_built_without_the_gpu_placement_is_refused(fg, tmp_path, monkeypatch):
    monkeypatch.delenv("UCX_TLS", raising=False)
    import fault_cluster

    model = model_dir(tmp_path, GPU_TINY)
    monkeypatch.setattr(fg.GpuFaultCluster, "_child", fault_cluster.FaultCluster._child)  # as if it were renamed
    with pytest.raises(StartupError, match="were not placed on a GPU"):
        fg.GpuFaultCluster(model, tmp_path / "logs", fg.gpu_spec(model, []), fg.placement("nixl", 1, 3), [H200])


def test_a_dry_run_writes_the_plan_and_not_run_rows(fg, tmp_path, monkeypatch):
    monkeypatch.delenv("UCX_TLS", raising=False)
    model = model_dir(tmp_path, GPU_TINY)
    out = tmp_path / "faults_gpu.json"
    assert fg.main(["--dry-run", "--model", str(model), "--out", str(out), "--log-dir", str(tmp_path / "logs")]) == 0
    result = json.loads(out.read_text())
    assert {(r["transport"], r["status"]) for r in result["rows"]} == {("nixl", "not run"), ("nccl", "not run")}
    assert len(result["rows"]) == 6 and result["failed_scenarios"] == []
    plan = result["deployments"]["nixl"]["plan"]
    assert set(plan) == {"proxy", "prefiller-0", "decoder-0", "decoder-1"}
    assert plan["prefiller-0"]["p2p"]["async_store"] is True
    assert "nccl" not in result["deployments"]  # one GPU: planned nowhere, its rows say why


# ---- evidence -------------------------------------------------------------------------------------


PREFILLER_LOG = """\
INFO 12-06 10:00:01 [send_buffer.py:68] lmcache_p2p sender: 8192 chunk pages (2.00 GiB) on cuda:0 for stored chunks
INFO 12-06 10:00:01 [send_gather.py:150] lmcache_p2p sender: VLLMPagedMemGPUConnectorV2.batched_from_gpu gathers each \
store's VRAM chunks in one pass
INFO 12-06 10:00:01 [store_ready.py:243] lmcache_p2p sender: LMCacheConnectorV1Impl.wait_for_save stores without the \
engine waiting for the store's GPU work
[2026-12-06 10:00:05,001] LMCache INFO: [req_id=cmpl-1] Stored 512 out of total 512 tokens
ERROR 12-06 10:00:09 [sender.py:1] something failed
\x1b[31;20m[2026-12-06 10:00:10,002] LMCache ERROR:\x1b[0m a store failed
Traceback (most recent call last):
INFO 12-06 10:00:11 [proxy.py:1] no ERROR here
"""


def test_the_store_path_evidence_of_a_prefillers_log(fg):
    got = fg.store_path_evidence(PREFILLER_LOG + PREFILLER_LOG.splitlines()[0] + "\n")
    assert got["vram_arena"] == [{"gib": 2.0, "device": "cuda:0"}, {"gib": 2.0, "device": "cuda:0"}]
    assert got["one_pass_gather"] == 1 and got["async_store"] == 1
    assert got["gather_not_installed"] == 0 and got["stores_wait_for_forward"] == 0 and got["arena_full"] == 0
    assert fg.log_counts(PREFILLER_LOG) == {"kv_stores": 1, "kv_hits": 0, "kv_loads": 0, "full_graph_loads": 0,
                                            "error_lines": 3}


# A compiled decoder's log (vLLM's V2 model runner, FULL CUDA graphs) before backend/full_graph_load.py: LMCache
# promised both prompts' KV at lookup and never retrieved it; the third lookup is a miss.
COMPILED_DECODER_LOG = """\
[2026-12-06 05:55:50,496] LMCache INFO: Reqid: cmpl-a, Total tokens 161, Inference Engine computed tokens: 0, \
LMCache hit tokens: 160, need to load: 160 (vllm_v1_adapter.py:1473:lmcache.integration.vllm.vllm_v1_adapter)
[2026-12-06 05:55:50,502] LMCache INFO: Reqid: cmpl-b, Total tokens 244, Inference Engine computed tokens: 0, \
LMCache hit tokens: 243, need to load: 243 (vllm_v1_adapter.py:1473:lmcache.integration.vllm.vllm_v1_adapter)
[2026-12-06 05:57:40,913] LMCache INFO: Reqid: cmpl-c, Total tokens 1572, Inference Engine computed tokens: 0, \
LMCache hit tokens: 0, need to load: 0 (vllm_v1_adapter.py:1473:lmcache.integration.vllm.vllm_v1_adapter)
"""
LOADED = """\
INFO 12-06 06:00:00 [full_graph_load.py:90] lmcache_p2p: a step with no attention metadata (vLLM's V2 model runner \
before a FULL CUDA graph) loads the KV of 1 request(s) that LMCache alone would skip
[2026-12-06 06:00:00,010] LMCache INFO: [req_id=cmpl-d] Retrieved 160 out of 160 required tokens (from 161 total \
tokens). size: 0.0003 gb, cost 0.4 ms (cache_engine.py:958:lmcache.v1.cache_engine)
"""


def test_a_decoders_log_tells_promised_kv_from_loaded_kv(fg):
    assert fg.log_counts(COMPILED_DECODER_LOG) == {"kv_stores": 0, "kv_hits": 2, "kv_loads": 0,
                                                   "full_graph_loads": 0, "error_lines": 0}
    fixed = COMPILED_DECODER_LOG + COMPILED_DECODER_LOG.splitlines()[0] + "\n" + LOADED
    counts = fg.log_counts(fixed)
    assert (counts["kv_hits"], counts["kv_loads"], counts["full_graph_loads"]) == (3, 1, 1)


def test_the_fault_suite_counts_retrievals_not_hits_as_loaded_kv(fg, tmp_path):
    """A scenario's "loaded KV" is what the decoder retrieved after the scenario's first lookup."""
    import fault_cluster
    from types import SimpleNamespace

    log = tmp_path / "decoder-1.log"
    log.write_text(LOADED + COMPILED_DECODER_LOG)  # a load before the scenario, then its two unloaded hits
    cluster = SimpleNamespace(children={"decoder-1": SimpleNamespace(log_path=log)})
    assert fault_cluster.FaultCluster.kv_loads_after_lookup(cluster, "decoder-1", 0) == 0
    log.write_text(COMPILED_DECODER_LOG + LOADED)
    assert fault_cluster.FaultCluster.kv_loads_after_lookup(cluster, "decoder-1", 0) == 1
    assert fault_cluster.FaultCluster.kv_loads_after_lookup(cluster, "decoder-1", 3) == 0  # past the last lookup


# ---- the reference, against a fake OpenAI server ------------------------------------------------------

FAKE_SERVER = textwrap.dedent('''
    """A fake vLLM: greedy output = (sum of the prompt + position) % 97; with CHANGE_WHEN_BATCHED set, a request
    that finds another in flight gets token 0 at its position 5 (a batch-dependent kernel)."""
    import json, os, sys, threading, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    active, batched = set(), set()  # requests in flight; those that ever shared the server with another
    lock = threading.Lock()

    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        def log_message(self, *a): pass
        def do_GET(self):
            body = b"ok"
            self.send_response(200); self.send_header("content-length", str(len(body))); self.end_headers()
            self.wfile.write(body)
        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers["content-length"])))
            me = object()
            with lock:
                active.add(me)
                if len(active) > 1:
                    batched.update(active)
            time.sleep(0.3)
            with lock:
                active.discard(me)
                was_batched = me in batched
            ids = [(sum(req["prompt"]) + i) % 97 for i in range(req["max_tokens"])]
            if was_batched and os.environ.get("CHANGE_WHEN_BATCHED"):
                ids[5] = 0 if ids[5] else 1
            if not req.get("stream"):
                body = json.dumps({"choices": [{"text": "", "token_ids": ids}]}).encode()
                self.send_response(200); self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body))); self.end_headers(); self.wfile.write(body)
                return
            events = [{"choices": [{"text": "x", "token_ids": [t]}]} for t in ids]
            body = b"".join(b"data: " + json.dumps(e).encode() + b"\\n\\n" for e in events) + b"data: [DONE]\\n\\n"
            self.send_response(200); self.send_header("content-type", "text/event-stream")
            self.send_header("content-length", str(len(body))); self.end_headers(); self.wfile.write(body)

    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
''')


def fake_server(tmp_path: Path, port: int, **env: str) -> Child:
    script = tmp_path / "fake_vllm.py"
    script.write_text(FAKE_SERVER)
    return Child("reference", [sys.executable, str(script), str(port)], {**os.environ, **env},
                 tmp_path / "reference.log", f"http://127.0.0.1:{port}/health")


def prompts(fg, n: int, max_tokens: int = 12) -> list:
    return [fg.Prompt(tuple(range(i, i + 5)), max_tokens) for i in range(n)]


@pytest.mark.parametrize("batch_changes, differ", [(False, 0), (True, 3)])
def test_reference_outputs_one_at_a_time_then_the_batch_check(fg, tmp_path, batch_changes, differ):
    from vllm_server import free_port

    child = fake_server(tmp_path, free_port(), **({"CHANGE_WHEN_BATCHED": "1"} if batch_changes else {}))
    every = prompts(fg, 5)
    child.start()
    try:
        got = fg.reference_outputs(child, every, every[:3], deadline_s=30)
    finally:
        child.stop()
    assert "error" not in got, got
    assert got["prompts"] == 5
    for p in every:  # what the suite's judging reads: the one-at-a-time output
        assert p.reference["a"] == tuple((sum(p.ids) + i) % 97 for i in range(12))
    check = got["batch_check"]
    assert check["prompts"] == 3 and check["failed"] == 0 and check["differ"] == differ
    assert check["first_differences"] == ([5] * differ)
    assert child.exited() is not None  # the reference stops once it has given its outputs


def test_a_reference_that_never_comes_up_is_an_error_not_an_exception(fg, tmp_path, monkeypatch):
    monkeypatch.setattr(fg, "STARTUP_TIMEOUT_S", 1.0)
    child = Child("reference", [sys.executable, "-c", "import time; time.sleep(30)"], dict(os.environ),
                  tmp_path / "reference.log", "http://127.0.0.1:9/health")
    child.start()
    got = fg.reference_outputs(child, prompts(fg, 1), [], deadline_s=5)
    assert got["error"].startswith("StartupError: not healthy after 1s")
    assert child.exited() is not None


# ---- rows and the result file ---------------------------------------------------------------------------


def test_rows_passed_and_failed_and_the_result_file(fg, tmp_path):
    ok = fg.Row("decoder_killed_mid_stream", requests=4, succeeded=4, recovered=True)
    wrong = fg.Row("sender_killed_mid_transfer", requests=8, succeeded=8, wrong_outputs=1, recovered=True)
    rows = [fg.row_entry("nixl", ok), fg.row_entry("nixl", wrong),
            fg.not_run_entry("nccl", "decoder_killed_mid_stream", "not run: one GPU")]
    assert rows[0]["passed"] is True and rows[0]["status"] == "run" and rows[0]["requests"] == 4
    assert rows[1]["passed"] is False
    assert fg.failed_of(rows) == ["nixl/sender_killed_mid_transfer"]  # a row not run has not failed
    result = fg.Result(tmp_path / "out" / "faults_gpu.json", {"commit": None}, {"gpus": []}, rows)
    result.write()
    written = json.loads(result.path.read_text())
    assert written["failed_scenarios"] == ["nixl/sender_killed_mid_transfer"] and written["rows"] == rows
    assert not result.path.with_name("faults_gpu.json.tmp").exists()


# ---- the pass's flow, with fakes for the deployment, the reference and the suite --------------------------


class FakeCluster:
    fail_first_start = False

    def __init__(self, model, log_dir, spec, where, slots):
        self.instances = {"prefiller-0": None, "decoder-0": None, "decoder-1": None}
        log_dir.mkdir(parents=True, exist_ok=True)
        self.children = {n: Child(n, ["true"], {}, log_dir / f"{n}.log", "http://127.0.0.1:9/health")
                         for n in ["proxy", *self.instances]}
        self.kills, self.calls = [], []

    def p2p_config(self, name):
        return {"role": name}

    def start(self, timeout_s):
        self.calls.append("start")
        if FakeCluster.fail_first_start and self.calls.count("start") == 1:
            raise StartupError("decoder-1 exited with code 1 during start-up")

    def start_in_waves(self, timeout_s):
        self.calls.append("waves")

    def stop(self):
        self.calls.append("stop")


class FakeSuite:
    seconds = 0.0

    def __init__(self, cluster, workload, cfg):
        pass

    def run(self, scenario):
        time.sleep(FakeSuite.seconds)
        return __import__("fault_scenarios").Row(scenario.name, requests=4, succeeded=4, recovered=True)


@pytest.fixture
def fakes(fg, monkeypatch, tmp_path):
    made = []

    def cluster(*args):
        made.append(FakeCluster(*args))
        return made[-1]

    reference = {"prompts": 28, "batch_check": {"differ": 0}}
    monkeypatch.setattr(fg, "GpuFaultCluster", cluster)
    monkeypatch.setattr(fg, "plain_vllm", lambda *a, **k: Child("reference", ["true"], {}, tmp_path / "r.log",
                                                                  "http://127.0.0.1:9/health"))
    monkeypatch.setattr(fg, "reference_outputs", lambda *a: dict(reference))
    monkeypatch.setattr(fg, "Suite", FakeSuite)
    monkeypatch.setattr(fg, "short_workload", lambda model: fg.Workload([], [], [], []))
    monkeypatch.setattr(fg, "gpu_spec", lambda model, args: fg.dataclasses.replace(fg.SPEC, buffer_size="2097152"))
    FakeCluster.fail_first_start = False
    return made, reference


def pass_config(fg, tmp_path, budget_s: float):
    return fg.PassConfig(tmp_path / "model", tmp_path / "logs", fg.SCENARIOS, fg.TRANSPORTS, ("--enforce-eager",),
                         time.monotonic() + budget_s, tmp_path / "pids")


def test_the_pass_runs_every_scenario_then_records_nccl_as_not_run_on_one_gpu(fg, tmp_path, fakes):
    made, _ = fakes
    result = fg.Result(tmp_path / "faults_gpu.json", {}, {})
    fg.run_pass(pass_config(fg, tmp_path, 1000), result, [H200])
    rows = json.loads(result.path.read_text())["rows"]
    assert [(r["transport"], r["scenario"], r["status"]) for r in rows] == [
        *[("nixl", s, "run") for s in fg.SCENARIOS], *[("nccl", s, "not run") for s in fg.SCENARIOS]]
    assert all(r["passed"] for r in rows[:3])
    assert made[0].calls == ["start", "stop"]  # one deployment, stopped at the end
    deployment = json.loads(result.path.read_text())["deployments"]["nixl"]
    assert deployment["reference"]["prompts"] == 28 and "deployment_up_s" in deployment


def test_an_earlier_passs_logs_are_not_this_passs_evidence(fg, tmp_path, fakes):
    stale = tmp_path / "logs" / "nixl" / "cluster" / "decoder-0.log"
    stale.parent.mkdir(parents=True)
    stale.write_text("[req_id=cmpl-old] Retrieved 160 out of 160 required tokens\n" * 19)
    result = fg.Result(tmp_path / "faults_gpu.json", {}, {})
    fg.run_pass(fg.dataclasses.replace(pass_config(fg, tmp_path, 1000), transports=("nixl",)), result, [H200])
    logs = json.loads(result.path.read_text())["deployments"]["nixl"]["logs"]
    assert logs["decoder-0"]["kv_loads"] == 0 and not stale.exists()


def test_a_scenario_that_would_outlast_the_budget_is_not_run(fg, tmp_path, fakes, monkeypatch):
    monkeypatch.setattr(fg, "STARTUP_ESTIMATE_S", 0.0)
    result = fg.Result(tmp_path / "faults_gpu.json", {}, {})
    # the fakes take no time: enough for the first two scenarios' estimates, not the third's
    budget = fg.ESTIMATE_S["decoder_restart_then_new_requests"] + 10
    assert fg.ESTIMATE_S["sender_killed_mid_transfer"] > budget
    fg.run_pass(fg.dataclasses.replace(pass_config(fg, tmp_path, budget), transports=("nixl",)), result, [H200])
    status = [(r["scenario"], r["status"]) for r in result.rows]
    assert status == [("decoder_killed_mid_stream", "run"), ("decoder_restart_then_new_requests", "run"),
                      ("sender_killed_mid_transfer", "not run")]
    assert "left of the pass's budget" in result.rows[2]["reason"]


def test_no_deployment_starts_without_time_for_it(fg, tmp_path, fakes):
    made, _ = fakes
    result = fg.Result(tmp_path / "faults_gpu.json", {}, {})
    fg.run_pass(fg.dataclasses.replace(pass_config(fg, tmp_path, 10), transports=("nixl",)), result, [H200])
    assert made == [] and [r["status"] for r in result.rows] == ["not run"] * 3


def test_a_failed_reference_stops_everything_and_every_row_says_why(fg, tmp_path, fakes):
    made, reference = fakes
    reference.clear()
    reference["error"] = "StartupError: reference exited with code 1"
    result = fg.Result(tmp_path / "faults_gpu.json", {}, {})
    fg.run_pass(fg.dataclasses.replace(pass_config(fg, tmp_path, 1000), transports=("nixl",)), result, [H200])
    assert [r["status"] for r in result.rows] == ["not run"] * 3
    assert all("the plain reference instance: StartupError" in r["reason"] for r in result.rows)
    assert made[0].calls[-1] == "stop"


def test_a_failed_start_at_once_falls_back_to_one_instance_after_another(fg, tmp_path, fakes):
    made, _ = fakes
    FakeCluster.fail_first_start = True
    result = fg.Result(tmp_path / "faults_gpu.json", {}, {})
    fg.run_pass(fg.dataclasses.replace(pass_config(fg, tmp_path, 1000), transports=("nixl",)), result, [H200])
    assert made[0].calls == ["start", "waves", "stop"]
    assert [r["status"] for r in result.rows] == ["run"] * 3
    assert "decoder-1 exited" in result.deployments["nixl"]["start_at_once_error"]


def test_sigterm_stops_the_pass_and_the_rows_not_made_say_so(fg, tmp_path, fakes, monkeypatch):
    FakeSuite.seconds = 5.0
    monkeypatch.setattr(fg, "collect", lambda command: {"command": command})
    monkeypatch.setattr(fg.gpu_plan, "query_gpus", lambda: [H200])
    out = tmp_path / "faults_gpu.json"
    def term_once_handled() -> None:  # SIGTERM only once main() handles it (else it would end pytest itself)
        deadline = time.monotonic() + 30
        while signal.getsignal(signal.SIGTERM) is not fg._interrupt and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)  # inside the first scenario
        os.kill(os.getpid(), signal.SIGTERM)

    timer = __import__("threading").Thread(target=term_once_handled, daemon=True)
    previous = signal.getsignal(signal.SIGTERM)
    timer.start()
    try:
        rc = fg.main(["--model", str(tmp_path), "--out", str(out), "--log-dir", str(tmp_path / "logs")])
    finally:
        signal.signal(signal.SIGTERM, previous)
        FakeSuite.seconds = 0.0
    assert rc == 3
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 6 and all(r["status"] == "not run" for r in rows)
    assert any("stopped (SIGTERM)" in r["reason"] for r in rows)


# ---- processes --------------------------------------------------------------------------------------------


def test_a_killed_groups_processes_are_waited_for_and_their_pids_were_recorded(fg, tmp_path):
    child = Child("sleeper", [sys.executable, "-c", "import subprocess, time; subprocess.Popen(['sleep', '30']); "
                              "time.sleep(30)"], dict(os.environ), tmp_path / "s.log", "http://127.0.0.1:9/health")
    fg.record_starts([child], tmp_path / "pids")
    child.start()
    try:
        deadline = time.monotonic() + 10
        while len(fg.group_members(child.proc.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        members = fg.group_members(child.proc.pid)
        assert child.proc.pid in members and len(members) == 2  # the leader and the process it spawned
        assert (tmp_path / "pids").read_text().split() == [str(child.proc.pid)]
        os.killpg(child.proc.pid, signal.SIGKILL)
        child.proc.wait(10)
        assert fg.wait_gone(members, 10) == []
        assert not any(fg.running(p) for p in members)
    finally:
        child.stop()


def test_a_process_still_running_is_reported(fg):
    proc = subprocess.Popen(["sleep", "30"])
    try:
        assert fg.running(proc.pid)
        assert fg.wait_gone([proc.pid], 0.2) == [proc.pid]
    finally:
        proc.kill()
        proc.wait()
