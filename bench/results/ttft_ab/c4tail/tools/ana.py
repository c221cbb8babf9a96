"""perf sched_switch trace -> per-CPU time by role/thread during the c4 run; and per slow request."""
import json, re, subprocess, sys
from collections import defaultdict
from pathlib import Path
D = Path(sys.argv[1]); K = int(sys.argv[2]) if len(sys.argv) > 2 else 1
th = json.loads((D / "threads.json").read_text())
threads = {int(k): v for k, v in th["threads"].items()}
roles = {int(k): v for k, v in th["roles"].items()}
off = json.loads((D / "offset.json").read_text())["wall_minus_mono"]
res = json.loads((D / f"c4_{K}.json").read_text())
t0, t1 = res["t0"] - off, res["t1"] - off
txt = subprocess.run(["perf", "script", "-i", str(D / "perf.data"), "-F", "cpu,time,event,trace"], capture_output=True, text=True).stdout
# lines: [000] 12345.678901: sched:sched_switch: prev_comm=X prev_pid=N prev_prio=.. prev_state=S ==> next_comm=Y next_pid=M next_prio=..
pat = re.compile(r"\[(\d+)\]\s+([\d.]+):\s+sched:sched_switch:.*prev_pid=(\d+).*prev_state=(\S+).*next_comm=(.*?) next_pid=(\d+)")
cur = {}; last = {}
spans = []  # cpu, tid, start, end
for line in txt.splitlines():
    m = pat.search(line)
    if not m: continue
    cpu, t, prev, state, ncomm, nxt = int(m[1]), float(m[2]), int(m[3]), m[4], m[5], int(m[6])
    if cpu in cur:
        spans.append((cpu, cur[cpu], last[cpu], t))
    cur[cpu] = nxt; last[cpu] = t
def label(tid):
    if tid == 0: return "idle"
    t = threads.get(tid)
    if t: return f"{t['role']}/{t['name']}"
    try: return "?" + open(f"/proc/{tid}/comm").read().strip()
    except OSError: return "other"
def tally(a, b, cpu_filter=None):
    acc = defaultdict(float)
    for cpu, tid, s, e in spans:
        if cpu_filter is not None and cpu != cpu_filter: continue
        s2, e2 = max(s, a), min(e, b)
        if e2 > s2: acc[(cpu, label(tid))] += e2 - s2
    return acc
W = t1 - t0
print(f"run wall {W*1000:.0f} ms")
for cpu in (0, 1):
    acc = tally(t0, t1, cpu)
    tot = sum(acc.values())
    print(f"cpu{cpu}: " + ", ".join(f"{k[1]} {v*1000:.0f}ms({100*v/W:.0f}%)" for k, v in sorted(acc.items(), key=lambda kv: -kv[1])[:14]))
# group by role process
for cpu in (0, 1):
    acc = tally(t0, t1, cpu); g = defaultdict(float)
    for (c, l), v in acc.items(): g[l.split('/')[0]] += v
    print(f"cpu{cpu} by process: " + ", ".join(f"{k} {v*1000:.0f}" for k, v in sorted(g.items(), key=lambda kv: -kv[1])))
# slowest requests: what ran on cpu0 during [t_send, t_first]
rs = sorted([r for r in res["res"] if r.get("ok")], key=lambda r: -(r["t_first"] - r["t_send"]))
for r in rs[:int(sys.argv[3]) if len(sys.argv) > 3 else 5]:
    a, b = r["t_send"] - off, r["t_first"] - off
    g = defaultdict(float)
    for (c, l), v in tally(a, b, 0).items(): g[l.split('/')[0] if 'Worker' not in l else l] += v
    print(f"req {r['i']} ttft {(b-a)*1000:.0f}ms tok {r.get('prompt_tokens')} cpu0: " + ", ".join(f"{k} {v*1000:.1f}" for k, v in sorted(g.items(), key=lambda kv: -kv[1])[:8]))
