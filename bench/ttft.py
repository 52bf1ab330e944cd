"""Time to first token: prefill vs feeding the prompt one decode step per token.

Usage (on a GPU machine, from the repository root):
    python bench/ttft.py --backend triton --out bench/results/ttft-smollm2-135m.json
    python bench/ttft.py --backend sim --prompt-len 32 --new-tokens 4      # CPU, end to end

One process, one compiled model (``amk.api.compile``: the schedule and kernel config that
``amk generate`` picks for the model, or ``--config FILE``), one executor. The prompt is
``--prompt-len`` token ids of a fixed English text (repeated as needed) in the model's
tokenizer. After a warm-up (a short prompt both ways: the kernel compile, the prefill model's
first forward), the two ways of feeding the prompt alternate, ``--runs`` times each
(prefill, step by step, prefill, ...); each run is ``generate(prompt, max_new_tokens=1)``
and its time to first token is the wall time from the call to the first new token (prefill
or decode steps, the first decode step and the host's read of the token). The table shows
every run and the fastest of each way; the speedup is fastest(step by step) /
fastest(prefill).

Then the greedy continuation of ``--new-tokens`` tokens, with the prefill and step by step,
is compared with HF's greedy ``generate`` (fp32, on the CPU) on the same prompt ids.

``--out FILE`` writes the JSON (atomically): device, command, model, backend, tp, config,
prompt length, every run's TTFT, the fastest of each way, the speedup, the continuations
and their match with HF. Exit code 0 when both continuations equal HF's greedy tokens, 1
otherwise, 2 for bad input.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python bench/ttft.py` from a source checkout
    sys.path.insert(0, str(ROOT))

from ground.errors import AmkError, run_main  # noqa: E402

TEXT = ("The history of computing is a story of machines that learned to do arithmetic faster "
        "than the people who built them. Early mechanical calculators added and multiplied with "
        "gears; the first electronic computers filled rooms with vacuum tubes and read their "
        "programs from punched cards. Transistors made them smaller, integrated circuits made "
        "them cheaper, and today a single graphics processor holds tens of billions of "
        "transistors that multiply matrices for neural networks. ")


def prompt_ids(tokenizer, n: int) -> list[int]:
    """The first ``n`` token ids of TEXT repeated (deterministic for a tokenizer)."""
    ids: list[int] = []
    text = TEXT
    while len(ids) < n:
        ids = [int(t) for t in tokenizer(text)["input_ids"]]
        text += TEXT
    return ids[:n]


def device_info(backend: str) -> dict:
    """The machine the numbers come from."""
    import torch

    info = {"backend": backend, "host_cpu": platform.processor() or platform.machine(),
            "torch": torch.__version__}
    if backend == "triton" and torch.cuda.is_available():
        info.update(gpu=torch.cuda.get_device_name(0),
                    sms=torch.cuda.get_device_properties(0).multi_processor_count)
    return info


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/ttft.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="MODEL argument (default smollm2-135m)")
    p.add_argument("--backend", choices=("sim", "triton"), default="triton")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--config", default=None, metavar="FILE",
                   help="config file (default: what amk generate picks: tuned entry or heuristic)")
    p.add_argument("--prompt-len", type=int, default=512, metavar="N")
    p.add_argument("--new-tokens", type=int, default=32, metavar="N",
                   help="greedy continuation compared with HF (default 32)")
    p.add_argument("--runs", type=int, default=2, help="TTFT runs of each way (>= 2; default 2)")
    p.add_argument("--out", default=None, metavar="FILE", help="write the JSON result here")
    a = p.parse_args(argv)
    for flag, v, lo in (("--prompt-len", a.prompt_len, 2), ("--new-tokens", a.new_tokens, 1),
                        ("--runs", a.runs, 2), ("--tp", a.tp, 1)):
        if v < lo:
            raise AmkError(f"{flag} must be >= {lo}, got {v}")
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from rich.console import Console
    from rich.table import Table

    from amk import api, pipeline
    from ground.files import atomic_write_json

    err = Console(stderr=True, highlight=False)
    if args.out:
        from amk.output import check_writable_dir

        check_writable_dir(Path(args.out).resolve().parent, "--out")
    with err.status(f"compiling {args.model} for {args.backend}, tp {args.tp}"):
        m = api.compile(args.model, args.tp, args.backend, args.config,
                        max_seq=args.prompt_len + args.new_tokens)
    err.print(m.config_source, soft_wrap=True)
    prompt = prompt_ids(m.tokenizer, args.prompt_len)
    if len(prompt) < args.prompt_len:
        raise AmkError(f"the text gives {len(prompt)} tokens, fewer than --prompt-len {args.prompt_len}")
    with err.status("building the executor and warming up (kernel compile, prefill forward)"):
        m.prepare(prefill=True, warm=True)
        for pf in (True, False):
            m.generate(prompt[:8], 2, prefill=pf, eos_token_id=[])
    runs: dict[str, list[float]] = {"prefill": [], "step by step": []}
    for i in range(args.runs):
        for way, pf in (("prefill", True), ("step by step", False)):
            with err.status(f"run {i + 1}/{args.runs}: {way}"):
                o = m.generate(prompt, 1, prefill=pf, eos_token_id=[], return_dict_in_generate=True)
            runs[way].append(o.ttft_s * 1e3)
    best = {k: min(v) for k, v in runs.items()}
    speedup = best["step by step"] / best["prefill"]
    with err.status(f"greedy continuation ({args.new_tokens} tokens) both ways, and HF greedy"):
        cont = {way: m.generate(prompt, args.new_tokens, prefill=pf, return_dict_in_generate=True).tokens
                for way, pf in (("prefill", True), ("step by step", False))}
        t0 = time.perf_counter()
        ref = pipeline.hf_generate(m.compilation.resolved.model, prompt, args.new_tokens)
        hf_s = time.perf_counter() - t0
    match = {way: pipeline.first_divergence(toks, ref) for way, toks in cont.items()}

    t = Table(title=f"time to first token: {args.model}, {args.prompt_len}-token prompt, "
                    f"{args.backend}, tp {args.tp}")
    t.add_column("way")
    for i in range(args.runs):
        t.add_column(f"run {i + 1} ms", justify="right")
    t.add_column("fastest ms", justify="right")
    t.add_column(f"greedy {args.new_tokens} vs HF")
    for way, v in runs.items():
        div = match[way]
        t.add_row(way, *[f"{x:.2f}" for x in v], f"[bold]{best[way]:.2f}[/]",
                  "[green]identical[/]" if div is None else f"[red]differs at token {div}[/]")
    Console(highlight=False).print(t)
    Console(highlight=False).print(f"prefill TTFT speedup: [bold]{speedup:.1f}x[/] "
                                   f"(fastest step by step / fastest prefill)")
    ok = all(d is None for d in match.values())
    result = {
        "ok": ok, "device": device_info(args.backend), "command": " ".join(["python", *sys.argv]),
        "model": args.model, "backend": args.backend, "tp": args.tp,
        "config": m.config.to_json(), "config_source": m.config_source,
        "prompt_len": args.prompt_len, "prompt_tokens": prompt, "runs_per_way": args.runs,
        "ttft_ms": {k: [round(x, 4) for x in v] for k, v in runs.items()},
        "ttft_ms_fastest": {k: round(v, 4) for k, v in best.items()},
        "speedup": round(speedup, 3),
        "continuation": {"new_tokens": args.new_tokens, "prefill": cont["prefill"],
                         "step_by_step": cont["step by step"], "hf_greedy": ref,
                         "first_divergence": {k.replace(" ", "_"): v for k, v in match.items()},
                         "hf_seconds": round(hf_s, 3)},
    }
    if args.out:
        atomic_write_json(args.out, result)
        err.print(f"wrote {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    run_main(main, "bench/ttft.py")
