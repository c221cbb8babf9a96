import json, sys, re
from pathlib import Path
def hist(txt, name):
    s = c = 0.0
    for line in txt.splitlines():
        if line.startswith(name + "_sum"): s += float(line.split()[-1])
        if line.startswith(name + "_count"): c += float(line.split()[-1])
    return s, c
for D in map(Path, sys.argv[1:]):
    print(D.name, (D/"diag.log").read_text().split("\n")[0] if (D/"diag.log").exists() else "")
    for k in range(3):
        f = D / f"c4_{k}.json"
        if not f.exists(): continue
        r = json.loads(f.read_text()); ok = [x for x in r["res"] if x.get("ok")]
        tt = sorted((x["t_first"] - x["t_send"]) * 1000 for x in ok)
        toks = sum(len(x.get("token_ids") or []) for x in ok)
        st = json.loads((D / f"stats_{k}.json").read_text())
        tl = st.get("timeline_ms", {})
        ho = st.get("handover_ms", {})
        out = []
        for side in ("pre", "dec"):
            a, b = (D / f"{side}_metrics_{k}_0.txt").read_text(), (D / f"{side}_metrics_{k}_1.txt").read_text()
            vals = []
            for n in ("vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds", "vllm:time_to_first_token_seconds"):
                s0, c0 = hist(a, n); s1, c1 = hist(b, n)
                vals.append(1000 * (s1 - s0) / max(1, c1 - c0))
            out.append(f"{side} queue/prefill/ttft mean {vals[0]:.1f}/{vals[1]:.1f}/{vals[2]:.1f}")
        print(f"  run{k}: ttft p50 {tt[24]:.1f} p99~max {tt[-1]:.1f} | tok/s {toks/(r['t1']-r['t0']):.0f} | handover p50 {ho.get('p50')} p99 {ho.get('p99')} | prefill p50 {tl.get('prefill',{}).get('p50')} p99 {tl.get('prefill',{}).get('p99')} decode_first p50 {tl.get('decode_first',{}).get('p50')} | " + "; ".join(out))
