"""Measure the HF baselines of `amk bench` on one GPU: HBM bandwidth, (a) eager, (b) compiled
decode step in a CUDA graph, each with its correctness verdict against HF generate.

Usage (on a GPU machine, repo root on PYTHONPATH):
    python bench/baselines.py --model config:llama-3.2-1b --model config:smollm2-135m \
        --tokens 64 --json out/baselines.json
Prints a table and writes one JSON object (device, bandwidth, per-model results).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import torch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="append", required=True)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--compile-mode", default="default",
                    help="comma list of torch.compile modes for baseline (b), e.g. "
                         "default,max-autotune-no-cudagraphs")
    ap.add_argument("--no-eager", action="store_true", help="skip baseline (a)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from amk.baselines import compile_modes, compiled_graph_name, hf_compiled_graph, hf_eager, judge, make_reference
    from ground.errors import AmkError
    from ground.timing import decode_weight_bytes, measure_hbm_bandwidth, roofline_ms
    from models.sources import resolve_model

    try:
        modes = compile_modes(args.compile_mode, "--compile-mode")
    except AmkError as err:
        print(err, file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench/baselines.py needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    bw = measure_hbm_bandwidth(dev)
    out = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
           "python": platform.python_version(), "hbm_bytes_per_s": bw,
           "command": " ".join(sys.argv), "models": []}
    print(f"device {out['device']}  measured HBM copy bandwidth {bw / 1e12:.2f} TB/s")
    for arg in args.model:
        t0 = time.time()
        rm = resolve_model(arg, dtype="bf16")
        model = rm.model.to(dev).eval()
        g = torch.Generator().manual_seed(1234)
        prompt = torch.randint(0, model.config.vocab_size, (1, args.prompt_len), generator=g).to(dev)
        ref = make_reference(model, prompt, args.tokens)  # verdicts with the bf16 near-tie rule
        nbytes = decode_weight_bytes(model)
        floor = roofline_ms(nbytes, bw)
        results = [] if args.no_eager else [judge(hf_eager(model, prompt, args.tokens), ref)]
        for mode in modes:
            t1 = time.time()
            try:
                r = judge(hf_compiled_graph(model, prompt, args.tokens, mode=mode), ref)
                r.note = f"{r.note}; compile + capture {time.time() - t1:.0f} s"
                results.append(r)
            except Exception as err:  # report, don't hide: the row says why it has no number
                print(f"  {compiled_graph_name(mode)} failed: {type(err).__name__}: {err}")
        rows = []
        for r in results:
            d = r.to_json()
            d["roofline_pct"] = 100 * floor / r.timing.median_ms if r.timing else None
            rows.append(d)
        out["models"].append({"model": arg, "weight_bytes": nbytes, "roofline_ms": floor,
                              "baselines": rows, "setup_s": time.time() - t0})
        print(f"{arg}: weight bytes {nbytes / 1e6:.1f} MB, roofline {floor:.3f} ms")
        for d in rows:
            med = d["latency_ms_median"]
            print(f"  {d['name']:<20} {med:8.3f} ms  ({d['roofline_pct']:.1f}% of roofline)"
                  f"  correct={d['correct']} {d['note']}")
        del model, rm
        torch.cuda.empty_cache()
    if args.json:
        from ground.files import atomic_write_text  # whole file or none

        atomic_write_text(args.json, json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    from ground.errors import run_main

    run_main(main, "bench/baselines.py")  # an AmkError: one line, its exit code
