"""Time the megakernel for several lowering configs of one model in one GPU call.

Usage: python bench/megakernel_sweep.py MODEL [--workers 32,66,132] [--tile 64,128]
           [--policy balanced] [--warps 4,8] [--gemv-block 16x256,32x512] [--gemv-stages 1,3]
           [--fuse 0,1] [--wave 0,1] [--prefetch 0,1] [--tokens 64] [--json FILE]
Each row: config, tasks, median ms/token, % of roofline, and the correctness verdict
(greedy tokens vs HF generate with the bf16 near-tie rule, plus the logit check).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch


def ints(s: str) -> list[int]:
    """A comma-list flag's integers."""
    return [int(x) for x in s.split(",")]


def flags(s: str) -> list[bool]:
    """A comma-list flag of 0/1 values."""
    return [bool(x) for x in ints(s)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--workers", default="32,66,132")
    ap.add_argument("--tile", default="64,128")
    ap.add_argument("--policy", default="balanced,round_robin")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--gemv-block", default="16x256,32x512")
    ap.add_argument("--gemv-stages", default="1",
                    help="comma list of GEMV pipeline depths (Blocks.gemv_stages), e.g. 1,2,3")
    ap.add_argument("--fuse", default="0", help="comma list of 0/1 for the fuse knob")
    ap.add_argument("--wave", default="0", help="comma list of 0/1 for the wave knob")
    ap.add_argument("--prefetch", default="0", help="comma list of L2 prefetch look-aheads (Blocks.prefetch)")
    ap.add_argument("--att-t", default="32", help="comma list of attention blocks (Blocks.attention_t)")
    ap.add_argument("--att-dot", default="0", help="comma list of 0/1 (Blocks.attention_dot)")
    ap.add_argument("--unroll", default="1", help="comma list of GEMV unroll factors (Blocks.gemv_unroll)")
    ap.add_argument("--attn-split", default="1", help="comma list of the attn_split lowering knob")
    ap.add_argument("--row-prefetch", default="1", help="comma list of 0/1 (Blocks.row_prefetch)")
    ap.add_argument("--x-stage", default="1", help="comma list of 0/1 (Blocks.x_stage)")
    ap.add_argument("--x-reuse", default="1", help="comma list of 0/1 (Blocks.x_reuse)")
    ap.add_argument("--x-chunk", default="8192", help="comma list of powers of two (Blocks.x_chunk)")
    ap.add_argument("--w-preload", default="0", help="comma list of Blocks.w_preload (0 = off)")
    ap.add_argument("--prefetch-cap", default="0", help="comma list of Blocks.prefetch_cap (bytes; 0 = whole tile)")
    ap.add_argument("--prefetch-rows", default="0", help="comma list of Blocks.prefetch_rows (0 = no limit)")
    ap.add_argument("--roll", default="0", help="comma list of Blocks.roll (row blocks; 0 = off)")
    ap.add_argument("--tile-gate-up", default="0", help="comma list of the tile_gate_up lowering knob (0 = tile)")
    ap.add_argument("--tile-qkv", default="0", help="comma list of the tile_qkv lowering knob (0 = tile)")
    ap.add_argument("--kroll", default="0", help="comma list of Blocks.kroll (unrolled K groups; 0 = off)")
    ap.add_argument("--tile-lm-head", default="0", help="comma list of the tile_lm_head lowering knob (0 = tile)")
    ap.add_argument("--relaxed-poll", default="0", help="comma list of 0/1 (Blocks.relaxed_poll)")
    ap.add_argument("--maxnreg", default="0", help="comma list of register caps (Blocks.maxnreg; 0 = automatic)")
    ap.add_argument("--sync-opt", default="1", help="comma list of 0/1: Blocks.elide_waits and "
                                                    "Blocks.coalesce_signals together")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from amk.baselines import make_reference
    from amk.commands.bench import cuda_target, measure_megakernel
    from amk.timing import decode_weight_bytes, measure_hbm_bandwidth, roofline_ms
    from lowering.config import LoweringConfig
    from lowering.triton.runtime import Blocks
    from models.sources import resolve_model

    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    bw = measure_hbm_bandwidth(dev)
    resolved = resolve_model(args.model, dtype="bf16")
    model = resolved.model.to(dev)
    g = torch.Generator().manual_seed(1234)
    prompt = torch.randint(0, model.config.vocab_size, (1, args.prompt_len), generator=g)
    ref = make_reference(model, prompt.to(dev), args.tokens)
    floor = roofline_ms(decode_weight_bytes(model), bw)
    target = cuda_target(props)
    rows = []

    def dump() -> None:  # after every row: a sweep cut off by a time limit keeps what it measured
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": props.name, "model": args.model, "hbm_bytes_per_s": bw,
                           "roofline_ms": floor, "command": " ".join(sys.argv), "rows": rows}, f,
                          indent=1)

    print(f"{args.model} on {props.name}: HBM {bw / 1e12:.2f} TB/s, roofline {floor:.4f} ms")
    grid = itertools.product(ints(args.workers), ints(args.tile), args.policy.split(","), ints(args.warps),
                             args.gemv_block.split(","), ints(args.gemv_stages), flags(args.fuse),
                             ints(args.prefetch), flags(args.wave), ints(args.att_t), flags(args.sync_opt),
                             ints(args.unroll), flags(args.att_dot), ints(args.attn_split),
                             flags(args.row_prefetch), ints(args.maxnreg), flags(args.x_stage),
                             flags(args.relaxed_poll), flags(args.x_reuse), ints(args.x_chunk), ints(args.w_preload),
                             ints(args.prefetch_cap), ints(args.roll), ints(args.tile_gate_up),
                             ints(args.tile_lm_head), ints(args.prefetch_rows), ints(args.tile_qkv),
                             ints(args.kroll))
    for (w, t, pol, nw, gb, gs, fuse, pf, wave, att, so, un, ad, asp, rp, mr, xst, rpl, xru, xch, wpl, pfc, rl,
         tgu, tlm, pfr, tqkv, kr) in grid:
        bn, bk = (int(v) for v in gb.split("x"))
        opts = {"num_warps": nw, "blocks": Blocks(gemv_n=bn, gemv_k=bk, gemv_stages=gs, prefetch=pf,
                                                  attention_t=att, elide_waits=so, coalesce_signals=so,
                                                  gemv_unroll=un, attention_dot=ad, row_prefetch=rp,
                                                  maxnreg=mr, x_stage=xst, relaxed_poll=rpl, x_reuse=xru, x_chunk=xch,
                                                  w_preload=wpl, prefetch_cap=pfc, roll=rl,
                                                  prefetch_rows=pfr, kroll=kr)}
        tag = (f"workers={w:<4} tile={t:<4} tile_qkv={tqkv} tile_gate_up={tgu} tile_lm_head={tlm} {pol:<12} warps={nw} gemv={gb:<7} stages={gs} "
               f"fuse={int(fuse)} prefetch={pf} wave={int(wave)} att_t={att} sync_opt={int(so)} unroll={un} att_dot={int(ad)} "
               f"attn_split={asp} row_prefetch={int(rp)} maxnreg={mr} x_stage={int(xst)} x_reuse={int(xru)} x_chunk={xch} w_preload={wpl} prefetch_cap={pfc} prefetch_rows={pfr} roll={rl} kroll={kr} relaxed_poll={int(rpl)}")
        cfg = LoweringConfig(tile=t, workers=w, policy=pol, dtype="bf16", fuse=fuse, wave=wave, attn_split=asp,
                             tile_qkv=tqkv, tile_gate_up=tgu, tile_lm_head=tlm, max_seq=max(256, args.prompt_len + args.tokens + 8)).validate()
        knobs = {"config": cfg.to_json(), "num_warps": nw, "gemv_block": gb, "gemv_stages": gs,
                 "prefetch": pf, "attention_t": att, "sync_opt": so, "gemv_unroll": un, "attention_dot": ad,
                 "row_prefetch": rp, "maxnreg": mr, "x_stage": xst, "x_reuse": xru, "x_chunk": xch, "w_preload": wpl, "prefetch_cap": pfc, "prefetch_rows": pfr, "roll": rl, "kroll": kr,
                 "relaxed_poll": rpl}
        try:
            res, session, ex = measure_megakernel(args.model, resolved, cfg, target, prompt, ref,
                                                  args.tokens, opts)
        except Exception as err:
            print(f"  {tag}: FAILED {type(err).__name__}: {err}", flush=True)
            rows.append({**knobs, "error": f"{type(err).__name__}: {err}"})
            dump()
            continue
        med = res.timing.median_ms
        row = {**knobs, "tasks": res.extra["tasks"], "latency_ms_median": med,
               "timing": res.timing.to_json(), "roofline_pct": 100 * floor / med,
               "correct": res.correct, "note": res.note, "build_s": res.extra["build_s"],
               "occupancy": ex.occupancy,
               "max_abs_err": res.extra["logit_check"].get("max_abs_err")}
        rows.append(row)
        dump()
        print(f"  {tag} tasks={row['tasks']:<6} {med:8.4f} ms "
              f"({row['roofline_pct']:5.1f}% roofline) correct={res.correct} {res.note}",
              flush=True)
        del ex, session
        torch.cuda.empty_cache()
    dump()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
