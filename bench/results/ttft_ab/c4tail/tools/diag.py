"""Diagnostic: 1P1D as bench/anchor.py starts it; c4 runs of the anchor client; perf sched trace of one."""
import json, os, signal, subprocess, sys, time, urllib.request
from pathlib import Path
TREE = Path(os.environ.get("TREE", "/work/wt/tail"))
WORK = Path("/work/wt/tail/runs/anchor")
OUT = Path(sys.argv[1]); OUT.mkdir(parents=True, exist_ok=True)
RUNS = int(sys.argv[2]) if len(sys.argv) > 2 else 3
PERF_RUN = int(os.environ.get("PERF_RUN", "1"))
PY = "/work/main/.venv/bin/python"
EXTRA = os.environ.get("LAUNCH_EXTRA", "").split()
argv = [PY, "-m", "lmcache_p2p.cli.main", "launch", "--prefill", "1", "--decode", "1", "--model", str(WORK / "tiny-llama"),
        "--proxy-port", "9100", "--max-model-len", "2048", "--log-dir", str(OUT / "logs"), "--no-prefix-caching",
        *[f"--vllm-arg={a}" for a in ["--max-num-seqs", "256", "--max-num-batched-tokens", "16384", "--dtype", "bfloat16"]], *EXTRA]
env = {**os.environ, "PYTHONPATH": str(TREE), "NO_PROXY": "127.0.0.1"}
def get(url):
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()
def post(url):
    urllib.request.urlopen(urllib.request.Request(url, data=b"", method="POST"), timeout=10).read()
def children(pid):
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(x) for x in out]
def tree(pid):
    res = [pid]
    for c in children(pid): res += tree(c)
    return res
def client(load, out, n=None):
    a = [PY, "/work/shared/anchor/bench.py", "--mode", "single", "--url", "http://127.0.0.1:9100", "--load", load,
         "--workload", str(WORK / "workload.json"), "--model", str(WORK / "tiny-llama"), "--max-tokens", "32",
         "--timeout", "60", "--warmup", "0", "--out", str(out)] + (["--n", str(n)] if n else [])
    subprocess.run(a, check=True, timeout=300, env=env, cwd=TREE)
print("load before", open("/proc/loadavg").read().strip(), flush=True)
proc = subprocess.Popen(argv, cwd=TREE, env=env, stdout=open(OUT / "launch.out", "wb"), stderr=subprocess.STDOUT, start_new_session=True)
try:
    deadline = time.time() + 300
    while True:
        try:
            h = json.loads(get("http://127.0.0.1:9100/health"))
            if (h.get("prefillers"), h.get("decoders")) == (1, 1): break
        except Exception: pass
        if time.time() > deadline or proc.poll() is not None: raise SystemExit("not up")
        time.sleep(1)
    client("c1", OUT / "warm.json", n=1)
    # roles
    roles = {}
    for c in children(proc.pid):
        cmd = open(f"/proc/{c}/cmdline").read().replace("\0", " ")
        role = "proxy" if " proxy " in cmd else ("pre" if "--port 7100" in cmd else ("dec" if "--port 7200" in cmd else "other"))
        for p in tree(c):
            try:
                name = open(f"/proc/{p}/comm").read().strip()
            except OSError: continue
            roles[p] = f"{role}:{name}"
    pin = os.environ.get("PIN", "")  # e.g. "dec:python=1,dec:VLLM::EngineCore=1,proxy:python=1"
    for item in filter(None, pin.split(",")):
        key, core = item.split("=")
        for p, r in roles.items():
            if r == key:
                subprocess.run(["taskset", "-a", "-p", "-c", core, str(p)], check=True, capture_output=True)
                print("pinned", r, p, "to", core, flush=True)
    threads = {}
    for p, r in roles.items():
        for t in os.listdir(f"/proc/{p}/task"):
            try:
                tn = open(f"/proc/{p}/task/{t}/comm").read().strip()
                aff = [l for l in open(f"/proc/{p}/task/{t}/status") if l.startswith("Cpus_allowed_list")][0].split()[1]
            except OSError: continue
            threads[int(t)] = {"pid": p, "role": r, "name": tn, "aff": aff}
    (OUT / "threads.json").write_text(json.dumps({"roles": roles, "threads": threads}, indent=0))
    offset = time.time() - time.monotonic()
    for k in range(RUNS):
        time.sleep(3)
        post("http://127.0.0.1:9100/stats/reset")
        m0 = get("http://127.0.0.1:7100/metrics"); d0 = get("http://127.0.0.1:7200/metrics")
        perf = None
        if k == PERF_RUN:
            perf = subprocess.Popen(["perf", "record", "-k", "CLOCK_MONOTONIC", "-e", "sched:sched_switch", "-e", "sched:sched_wakeup", "-a", "-o", str(OUT / "perf.data")],
                                    stdout=subprocess.DEVNULL, stderr=open(OUT / "perf.err", "wb"))
            time.sleep(1)
        load = open("/proc/loadavg").read().split()[0]
        client("c4", OUT / f"c4_{k}.json")
        if perf: time.sleep(0.3); perf.send_signal(signal.SIGINT); perf.wait(30)
        (OUT / f"pre_metrics_{k}_0.txt").write_text(m0); (OUT / f"pre_metrics_{k}_1.txt").write_text(get("http://127.0.0.1:7100/metrics"))
        (OUT / f"dec_metrics_{k}_0.txt").write_text(d0); (OUT / f"dec_metrics_{k}_1.txt").write_text(get("http://127.0.0.1:7200/metrics"))
        (OUT / f"stats_{k}.json").write_text(get("http://127.0.0.1:9100/stats"))
        r = json.loads((OUT / f"c4_{k}.json").read_text())
        tt = sorted((x["t_first"] - x["t_send"]) * 1000 for x in r["res"] if x.get("ok"))
        print(k, "load", load, "ttft p50 %.1f max %.1f" % (tt[len(tt)//2], tt[-1]), "wall %.2f" % (r["t1"] - r["t0"]), flush=True)
    (OUT / "offset.json").write_text(json.dumps({"wall_minus_mono": offset}))
finally:
    proc.send_signal(signal.SIGTERM)
    try: proc.wait(60)
    except subprocess.TimeoutExpired: os.killpg(proc.pid, signal.SIGKILL)
