"""How long the prefiller's worker thread waited while runnable (preempted), and who ran on its cpu then."""
import json, re, subprocess, sys
from collections import defaultdict
from pathlib import Path
D = Path(sys.argv[1]); K = int(sys.argv[2]) if len(sys.argv) > 2 else 1
th = json.loads((D / "threads.json").read_text()); threads = {int(k): v for k, v in th["threads"].items()}
off = json.loads((D / "offset.json").read_text())["wall_minus_mono"]
res = json.loads((D / f"c4_{K}.json").read_text()); t0, t1 = res["t0"] - off, res["t1"] - off
ROLE = __import__("os").environ.get("ROLE", "pre")
CPU = 0 if ROLE == "pre" else 1
worker = [t for t, v in threads.items() if v["role"] == f"{ROLE}:VLLM::Worker" and v["name"] == "VLLM::Worker"][0]
txt = subprocess.run(["perf", "script", "-i", str(D / "perf.data"), "-F", "cpu,time,event,trace"], capture_output=True, text=True).stdout
sw = re.compile(r"\[(\d+)\]\s+([\d.]+):\s+sched:sched_switch:.*prev_pid=(\d+).*prev_state=(\S+).*next_pid=(\d+)")
wk = re.compile(r"\[(\d+)\]\s+([\d.]+):\s+sched:sched_wakeup:.*pid=(\d+)")
def label(tid):
    if tid == 0: return "idle"
    t = threads.get(tid)
    return f"{t['role']}" + ("" if t['name'] in ('python', 'VLLM::Worker', 'VLLM::EngineCor') else "/" + t['name']) if t else "other"
runnable_since = None; running = False; waited = 0.0; ran_while = defaultdict(float); cur = {}; last = {}
run_total = 0.0; run_start = None
for line in txt.splitlines():
    m = sw.search(line)
    if m:
        cpu, t, prev, state, nxt = int(m[1]), float(m[2]), int(m[3]), m[4], int(m[5])
        if not (t0 <= t <= t1):
            cur[cpu] = nxt; last[cpu] = t; continue
        if runnable_since is not None and cpu in cur and cur[cpu] != worker and cpu == CPU:
            ran_while[label(cur[cpu])] += t - max(last[cpu], runnable_since)
        if prev == worker:
            run_total += t - (run_start or t)
            runnable_since = t if state.startswith("R") else None
        if nxt == worker:
            if runnable_since is not None: waited += t - runnable_since
            runnable_since = None; run_start = t
        cur[cpu] = nxt; last[cpu] = t
        continue
    m = wk.search(line)
    if m and int(m[3]) == worker and t0 <= float(m[2]) <= t1:
        runnable_since = float(m[2])  # woken: runnable from now until switched in
print(f"run wall {(t1-t0)*1000:.0f} ms; {ROLE} worker ran {run_total*1000:.0f} ms, runnable but waiting {waited*1000:.0f} ms")
print(f"on cpu{CPU} while it waited runnable:", ", ".join(f"{k} {v*1000:.0f}" for k, v in sorted(ran_while.items(), key=lambda kv: -kv[1])[:10]))
