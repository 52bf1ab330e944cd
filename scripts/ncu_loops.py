"""Per-loop view of an Nsight Compute source-page CSV (``ncu -i R --page source --csv
--print-source sass``, gzip or plain): every SASS loop (a backward branch) holding at least 1%
of the warp-stall samples, with its size, global loads, executions and top stall reasons.

Usage: python scripts/ncu_loops.py FILE.csv[.gz]
"""
import csv, gzip, sys, re
rows = list(csv.reader((gzip.open if sys.argv[1].endswith(".gz") else open)(sys.argv[1], "rt")))
hdr = rows[1]; data = rows[2:]
I = {h: i for i, h in enumerate(hdr)}
def n(v):
    try: return float(v.replace(",", ""))
    except: return 0.0
ins = [(int(r[0], 16), r[1].strip(), n(r[I["Warp Stall Sampling (All Samples)"]]), n(r[I["Instructions Executed"]]), r) for r in data if r and r[0].startswith("0x")]
base = ins[0][0]
tot = sum(s for _, _, s, _, _ in ins)
# find loops (backward branches)
addr = {a: k for k, (a, *_ ) in enumerate(ins)}
loops = []
for k, (a, t, s, e, r) in enumerate(ins):
    m = re.search(r"BRA\s+(0x[0-9a-f]+)", t)
    if m and int(m.group(1), 16) <= a and int(m.group(1), 16) in addr:
        loops.append((addr[int(m.group(1), 16)], k))
reasons = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
print(f"total samples {tot:.0f}")
for s0, e0 in loops:
    seg = ins[s0:e0 + 1]
    ss = sum(x[2] for x in seg)
    if ss < 0.01 * tot: continue
    execs = max(x[3] for x in seg)
    ldg = sum(1 for x in seg if "LDG" in x[1])
    rs = {h: sum(n(x[4][I[h]]) for x in seg) for h in reasons}
    top = sorted(rs.items(), key=lambda kv: -kv[1])[:5]
    print(f"loop {seg[0][0]-base:#x}-{seg[-1][0]-base:#x} n={len(seg)} ldg={ldg} samples {100*ss/tot:.1f}% exec(max)={execs:.0f} ", ", ".join(f"{h}={v:.0f}" for h, v in top))
