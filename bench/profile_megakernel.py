"""Where does a megakernel step spend its time? In-kernel %globaltimer stamps per task.

Usage: python bench/profile_megakernel.py MODEL [--config FILE] [--workers 132] [--tile 32]
           [--num-warps 8] [--gemv-block 32x512] ... [--steps 12] [--tp R [--spawn]] [--json FILE]
           [--trace FILE]
The config is the one ``amk bench`` runs (profile_config): without ``--config FILE`` or
``--no-tuned`` the tuned entry for the model on this GPU at ``--tp``, else the cost-model
heuristic (search/defaults.py; ``--db DIR`` as amk bench's), with the same knob flags over it
(lowering.knobs), one worker per SM (per co-located rank) and bf16 unless set; the source line
is printed first. Co-located ranks (``--tp R`` without ``--spawn``) take no tuned entry.
Runs ``--steps`` decode steps with the profiling kernel (one extra global store per stamp)
and reports, per op: task count, mean / p90 op time (op start -> signals released) and
mean wait time (queue head -> waits satisfied), plus the step's span and the sum of op
times on the busiest worker. The profiled kernel is slightly slower than the plain one;
use it to rank costs, not as the latency.
"""

from __future__ import annotations

import argparse
import sys
import json
from collections import defaultdict

import numpy as np
import torch


def profile_config(args: argparse.Namespace, gpu, sms: int, colocated: bool = False):
    """(AmkConfig, config source line) of a profile: what ``amk bench`` runs (amk.bench.run_config):
    ``--config FILE`` or ``--no-tuned`` with the flags, else the tuned entry for the model on
    ``gpu`` (search.tunedb.GpuKey) at ``--tp``, else the cost-model heuristic, the flags over it.
    ``sms``: workers per rank by default (one per SM of a rank's share of the GPU);
    ``colocated``: ranks share one GPU, for which no entry is tuned (the knobs' defaults).
    AmkError (exit code 2) for a bad flag, file or entry."""
    from amk.checks import model_spec
    from search.defaults import command_config

    tuned = not (args.config or args.no_tuned or colocated)
    spec = model_spec(args.model)[1] if tuned else None
    cfg, line = command_config(args, "bench/profile_megakernel.py", spec, args.tp, gpu,
                               defaults={"workers": sms, "dtype": "bf16", "max_seq": max(256, args.steps)})
    if colocated and not (args.config or args.no_tuned):
        line = "config: the knobs' defaults (co-located ranks have no tuned entry)"
    return cfg, line


def parser() -> argparse.ArgumentParser:
    """The script's command line (module doc)."""
    from lowering.config import KernelConfig, LoweringConfig
    from lowering.knobs import add_flags
    from search.defaults import add_args as add_tuned_args

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--config", metavar="FILE", default=None,
                    help="config file (docs/lowering.md), as amk bench --config reads it; the knob flags "
                         "override it")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--tp", type=int, default=1,
                    help="ranks, co-located on this one GPU (workers is then per rank: R x W must be co-resident)")
    ap.add_argument("--spawn", action="store_true",
                    help="with --tp R: one process per GPU over NVSHMEM (R GPUs needed), as `amk generate --tp R`; "
                         "each rank profiles its own kernel, rank 0 prints, --json FILE gets one file per rank "
                         "(FILE with .r<rank> before the suffix)")
    ap.add_argument("--layer", type=int, default=None,
                    help="also print the stage timeline of this layer (default: the middle one)")
    ap.add_argument("--all-layers", action="store_true",
                    help="also print every stage's timeline averaged over the layers, each layer's span and "
                         "the LM head's timeline")
    ap.add_argument("--json", default=None)
    ap.add_argument("--trace", default=None, metavar="FILE",
                    help="also write the last step as a Chrome/Perfetto trace (amk profile's format, "
                         "clock gpu; docs/ui.md); not with --spawn")
    add_tuned_args(ap)
    add_flags(ap.add_argument_group("lowering knobs (docs/lowering.md)"), LoweringConfig,
              defaults={"workers": "the SMs / the co-located ranks", "dtype": "bf16", "max_seq": "256"})
    add_flags(ap.add_argument_group("kernel knobs (docs/triton.md)"), KernelConfig)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    ctx = None
    if args.spawn and args.tp > 1:
        from amk import launch
        code, ctx = launch.script_entry(__file__, argv, args.tp)
        if code is not None:
            return code

    from amk import pipeline
    from amk.bench import cuda_target
    from lowering.triton import vm as MK
    from lowering.triton.blocks import kernel_options
    from models.sources import resolve_model

    dev = ctx.device if ctx is not None else torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    sms = props.multi_processor_count // (1 if ctx is not None else args.tp)
    from search.tunedb import GpuKey

    full, source = profile_config(args, GpuKey(str(props.name), int(props.multi_processor_count)), sms,
                                  colocated=ctx is None and args.tp > 1)
    if ctx is None or ctx.rank == 0:
        print(source, flush=True)
    cfg = full.lowering
    resolved = resolve_model(args.model, dtype="fp32" if cfg.dtype == "f32" else "bf16",
                             device=dev if ctx is not None else None)
    target = cuda_target(props)
    built = pipeline.Compilation.build(args.model, args.tp, cfg, target, resolved=resolved)
    dec = built.decoder("triton", backend_options={
        **kernel_options(full.kernel), "profile": True, **({"dist": ctx} if ctx is not None else {})})
    ex = dec.ex
    tok = 1
    for pos in range(args.steps):
        tok = dec.step(tok, pos)
    torch.cuda.synchronize(dev)
    prof = ex._prof.view(-1, MK.PROF_W).cpu().numpy().astype(np.int64)
    tab = ex.table
    ops = tab.task_ops
    t0 = prof[:, 0].min()
    span_us = (prof[:, 2].max() - t0) / 1e3
    per_op = defaultdict(lambda: {"n": 0, "op_us": [], "wait_us": []})
    for row, op in enumerate(ops):
        d = per_op[op]
        d["n"] += 1
        d["op_us"].append((prof[row, 2] - prof[row, 1]) / 1e3)
        d["wait_us"].append((prof[row, 1] - prof[row, 0]) / 1e3)
    busy = []
    for w in range(tab.workers):
        lo, hi = int(tab.qstart[w]), int(tab.qstart[w + 1])
        busy.append(float(((prof[lo:hi, 2] - prof[lo:hi, 1]) / 1e3).sum()))
    gaps = np.concatenate([(prof[int(tab.qstart[w]) + 1:int(tab.qstart[w + 1]), 0]
                            - prof[int(tab.qstart[w]):int(tab.qstart[w + 1]) - 1, 2]) / 1e3
                           for w in range(tab.workers)])
    print(f"{args.model}: {len(ops)} tasks on {tab.workers} workers; last step span "
          f"{span_us:.1f} us; busiest worker's op time {max(busy):.1f} us; gap between a "
          f"worker's tasks (signals done -> next stamp) mean {gaps.mean():.2f} us")
    print(f"{'op':<16}{'tasks':>7}{'op us mean':>12}{'op us p90':>11}{'op us sum':>11}"
          f"{'wait us mean':>14}")
    out = {"model": args.model, "device": props.name, "span_us": span_us,
           "rank": 0 if ctx is None else ctx.rank, "ranks": args.tp, "spawned": ctx is not None,
           "busiest_worker_op_us": max(busy), "gap_us_mean": float(gaps.mean()), "ops": {}}
    for op, d in sorted(per_op.items(), key=lambda kv: -sum(kv[1]["op_us"])):
        a, wt = np.array(d["op_us"]), np.array(d["wait_us"])
        print(f"{op:<16}{d['n']:>7}{a.mean():>12.2f}{np.percentile(a, 90):>11.2f}{a.sum():>11.1f}"
              f"{wt.mean():>14.2f}")
        out["ops"][op] = {"tasks": d["n"], "op_us_mean": float(a.mean()),
                          "op_us_p90": float(np.percentile(a, 90)), "op_us_sum": float(a.sum()),
                          "wait_us_mean": float(wt.mean())}
    out["stream"] = stream_share(tab, prof)
    print(f"weight stream idle: {out['stream']['idle_share_mean']:.1%} of the step on the mean worker "
          f"({out['stream']['idle_share_min']:.1%} .. {out['stream']['idle_share_max']:.1%}); "
          f"waiting {out['stream']['wait_share_mean']:.1%}, other ops and GEMV prologues/ends "
          f"{out['stream']['other_share_mean']:.1%}")
    # GEMV tasks: where the op time goes (stamps 3-6, vm.PROF_W). A GEMV decodes its operands
    # before its waits (ops/gemv.py t_gemv), so "decode" (waits done -> operands decoded) is ~0
    # and the decode shows in the wait time instead.
    gem = [r for r, op in enumerate(ops) if prof[r, 3] > 0]
    if gem:
        g = prof[gem].astype(np.float64)
        parts = {"decode": g[:, 3] - g[:, 1], "prologue": g[:, 4] - g[:, 3], "stream+store": g[:, 5] - g[:, 4],
                 "to op end": g[:, 6] - g[:, 5], "barrier+signals": g[:, 2] - g[:, 6]}
        print("GEMV op time by part (us, mean over " + str(len(gem)) + " tasks): "
              + ", ".join(f"{k} {v.mean() / 1e3:.2f}" for k, v in parts.items()))
        out["gemv_parts_us"] = {k: float(v.mean() / 1e3) for k, v in parts.items()}
        ring = g[:, 9] > 0
        if ring.any():
            r = g[ring]
            pages = r[:, 9].sum()
            out["ring"] = {"tasks": int(ring.sum()), "pages": int(pages),
                           "page_wait_us_per_page": float(r[:, 7].sum() / pages / 1e3),
                           "issue_us_per_page": float(r[:, 8].sum() / pages / 1e3),
                           "stream_us_per_page": float((r[:, 5] - r[:, 4]).sum() / pages / 1e3)}
            print("weight ring: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                              for k, v in out["ring"].items()))
    att = attention_parts(ops, prof)
    if att:
        print(f"attention op time by part (us, mean over {att['tasks']} tasks): "
              + ", ".join(f"{k} {v:.2f}" for k, v in att.items() if k != "tasks"))
        out["attention_parts_us"] = att
    n_layers = built.graph.spec.layers
    out["stages"] = stage_timeline(tab, prof, args.layer if args.layer is not None else n_layers // 2)
    if args.all_layers:
        out["stages_mean"], out["layer_span_us"] = layers_mean(tab, prof, n_layers)
        out["lm_stages"] = stage_timeline(tab, prof, "lm")
    if args.json:
        path = args.json
        if ctx is not None:
            stem, dot, suf = path.rpartition(".")
            path = f"{stem}.r{ctx.rank}.{suf}" if dot else f"{path}.r{ctx.rank}"
        from ground.files import atomic_write_text  # whole file or none

        atomic_write_text(path, json.dumps(out, indent=1))
    if args.trace:
        from ground.errors import AmkError

        if ctx is not None:
            raise AmkError("--trace writes the trace of one process; drop --spawn (co-located ranks trace together)")
        from amk.profile import prof_times
        from ground.files import atomic_write_text
        from lowering.trace import build_trace, check_trace

        times = prof_times(built.program, prof, list(tab.task_ids), list(tab.task_ranks) or [0] * tab.n_tasks)
        trace = build_trace(built.program, times, clock="gpu", seq_len=args.steps,
                            meta={"model": args.model, "device": props.name, "steps_run": args.steps,
                                  "kernel": full.kernel.to_json(), "source": "bench/profile_megakernel.py"})
        problems = check_trace(trace)
        if problems:
            raise AmkError("the trace breaks the trace-event format: " + "; ".join(problems[:3]))
        atomic_write_text(args.trace, json.dumps(trace, separators=(",", ":")) + "\n")
        print(f"trace: {args.trace} ({trace['otherData']['step_us']:.1f} us step, "
              f"{trace['otherData']['flows']} signal->wait flows)")
    if ctx is not None and ctx.rank != 0:
        spans = out.get("layer_span_us")
        print(f"rank {ctx.rank}: last step span {span_us:.1f} us"
              + (f"; layer spans mean {np.mean(spans):.1f} us" if spans else ""), file=sys.stderr)
    return 0


#: The ops whose tasks stamp 7 -> 9 (ops/attention.py t_attention; vm.PROF_W).
ATTENTION_OPS = ("attention", "rope_attention", "rope_attention_kv")


def attention_parts(ops, prof) -> dict:
    """Where the attention tasks' op time goes, from their stamps (vm.PROF_W): ``decode``
    (waits done -> position read and checked, stamps 1 -> 7), ``prologue`` (-> the position
    loop starts, 8: RoPE of q and k, the q / k / v loads, the first K / V block's loads
    issued), ``positions`` (the loop, -> 9), ``store`` (-> op done, 6) and
    ``barrier+signals`` (-> 2), each the mean over the tasks in us, with ``tasks`` their
    count. Empty when no task of ``ops`` (one op name per task row) is an attention op with
    stamps (a kernel built before these stamps, or no attention)."""
    rows = [r for r, op in enumerate(ops) if op in ATTENTION_OPS and prof[r, 8] > 0]
    if not rows:
        return {}
    a = prof[rows].astype(np.float64)
    parts = {"decode": a[:, 7] - a[:, 1], "prologue": a[:, 8] - a[:, 7], "positions": a[:, 9] - a[:, 8],
             "store": a[:, 6] - a[:, 9], "barrier+signals": a[:, 2] - a[:, 6]}
    return {"tasks": len(rows), **{k: float(v.mean() / 1e3) for k, v in parts.items()}}


def stream_share(tab, prof) -> dict:
    """How much of the step each worker's weight stream stands still.

    A worker streams weights between a GEMV task's stamps 4 and 5 (prologue done -> stores
    done, vm.PROF_W); everything else in the step (waiting for counters, other ops, GEMV
    decode, prologue, barrier and signals, gaps between tasks) is time in which that worker
    reads no weights. The step is the kernel's span (first stamp -> last signals done, all
    workers). Returns the shares (fractions of the span) as mean / min / max over workers.
    """
    t0 = prof[:, 0].min()
    span = float(prof[:, 2].max() - t0)
    idle, wait, other = [], [], []
    for w in range(tab.workers):
        lo, hi = int(tab.qstart[w]), int(tab.qstart[w + 1])
        p = prof[lo:hi].astype(np.float64)
        g = p[:, 3] > 0
        stream = float((p[g, 5] - p[g, 4]).sum())
        waited = float((p[:, 1] - p[:, 0]).sum())
        idle.append(1.0 - stream / span)
        wait.append(waited / span)
        other.append(1.0 - stream / span - waited / span)
    a, b, c = np.array(idle), np.array(wait), np.array(other)
    return {"span_us": span / 1e3, "idle_share_mean": float(a.mean()), "idle_share_min": float(a.min()),
            "idle_share_max": float(a.max()), "wait_share_mean": float(b.mean()),
            "other_share_mean": float(c.mean())}


def stage_timeline(tab, prof, layer: int | str, quiet: bool = False) -> list[dict]:
    """Per stage of one layer (tasks grouped by id prefix ``l{layer}.<stage>``; ``layer`` "lm":
    the LM head's ``lm.<stage>`` tasks): tasks, the
    first op start and last op end relative to the layer's first stage start, the slowest
    task's op time, the spread of op starts, and the hand-off: this stage's first op start
    minus the previous stage's last op end (signal -> poll -> header -> operand loads).
    The lowest rank's tasks when several ranks are co-located."""
    groups: dict[str, list[int]] = {}
    first = min(tab.task_ranks)  # co-located: rank 0; one rank per process: that rank
    for row, tid in enumerate(tab.task_ids):
        parts = tid.split(".")
        if parts[0] == (layer if isinstance(layer, str) else f"l{layer}") and tab.task_ranks[row] == first:
            key = parts[1]
            if layer == "lm" and key[:1] == "k" and key[1:].isdigit():
                key = "head"  # the LM-head GEMV tiles of every argmax chunk
            if len(parts) > 3 and parts[2] in ("w", "put", "red", "ag", "rs", "add"):
                key += "." + parts[2]  # the GEMV, put, reduce, gather parts of a row-parallel stage
            elif key == "attn" and parts[-1] == "combine":
                key = "attn.combine"  # split-KV: the combines apart from the part tasks
            groups.setdefault(key, []).append(row)
    if not groups:
        return []
    t0 = min(prof[rows, 1].min() for rows in groups.values())
    order = sorted(groups, key=lambda g: prof[groups[g], 1].min())
    if not quiet:
        print(f"layer {layer} stages (us from the layer's first op start):")
        print(f"{'stage':<14}{'tasks':>6}{'first op':>10}{'last op':>10}{'last end':>10}{'max op':>9}{'handoff':>9}")
    out, prev_end = [], None
    for g in order:
        rows = groups[g]
        s, e = prof[rows, 1], prof[rows, 2]
        d = {"stage": g, "tasks": len(rows), "first_op_us": (s.min() - t0) / 1e3,
             "last_op_us": (s.max() - t0) / 1e3, "last_end_us": (e.max() - t0) / 1e3,
             "max_op_us": float((e - s).max()) / 1e3,
             "handoff_us": None if prev_end is None else (s.min() - prev_end) / 1e3}
        prev_end = e.max()
        out.append(d)
        if not quiet:
            print(f"{g:<14}{d['tasks']:>6}{d['first_op_us']:>10.2f}{d['last_op_us']:>10.2f}"
              f"{d['last_end_us']:>10.2f}{d['max_op_us']:>9.2f}"
                  f"{'' if d['handoff_us'] is None else format(d['handoff_us'], '9.2f')}")
    return out


def layers_mean(tab, prof, n_layers: int) -> tuple[list[dict], list[float]]:
    """Each stage's timeline averaged over layers 1 .. n_layers - 1 (layer 0 starts after the
    embedding and is skipped), and every layer's span (its first op start to its last op end, us)."""
    per = [stage_timeline(tab, prof, i, quiet=True) for i in range(n_layers)]
    spans = [max(d["last_end_us"] for d in p) for p in per if p]
    stages: dict[str, list[dict]] = {}
    for p in per[1:]:
        for d in p:
            stages.setdefault(d["stage"], []).append(d)
    out = []
    print(f"stages averaged over layers 1..{n_layers - 1} (us from each layer's first op start):")
    print(f"{'stage':<14}{'first op':>10}{'last op':>10}{'last end':>10}{'max op':>9}")
    for g, ds in sorted(stages.items(), key=lambda kv: np.mean([d["first_op_us"] for d in kv[1]])):
        m = {k: float(np.mean([d[k] for d in ds])) for k in ("first_op_us", "last_op_us", "last_end_us", "max_op_us")}
        m["stage"] = g
        out.append(m)
        print(f"{g:<14}{m['first_op_us']:>10.2f}{m['last_op_us']:>10.2f}{m['last_end_us']:>10.2f}{m['max_op_us']:>9.2f}")
    print("layer spans (us): " + " ".join(f"{v:.1f}" for v in spans))
    return out, spans


if __name__ == "__main__":
    from ground.errors import run_main

    run_main(main, "bench/profile_megakernel.py")  # an AmkError: one line, its exit code
