"""The measurement library behind `amk bench`: the config (lowering and kernel knobs) a bench
run takes from its file and flags, the CUDA target, and the megakernel measurement itself
(lower, validate, build, check logits, time decode in a CUDA graph).

`amk bench` (amk/commands/bench.py), its tensor-parallel body (amk/bench_tp.py), the
benchmark scripts in bench/ and the tests import from here; command modules are imported by
the CLI alone (docs/layout.md).
"""

from __future__ import annotations

import argparse
import json
import time

from ground.errors import AmkError


#: Worker CTAs per SM a schedule may ask for on a CUDA target (the validator's static
#: limit); the runtime then checks the compiled kernel's real occupancy before launching.
MAX_WORKERS_PER_SM = 4


def cuda_target(props):
    """The Target of a schedule for the Triton backend on a CUDA device described by
    ``props`` (torch.cuda.get_device_properties): at most MAX_WORKERS_PER_SM workers per SM
    (two 4-warp workers per SM fit when the kernel needs <= 255 registers per thread)."""
    from ir.program import Target

    sms = props.multi_processor_count
    return Target(name=props.name, sms=sms, max_workers=MAX_WORKERS_PER_SM * sms, backend="triton")


def measure_megakernel(model_arg, resolved, cfg, target, prompt, ref, n_tokens: int,
                       backend_options: dict | None = None, compilation=None):
    """Lower, validate, build and time the megakernel for one config (R = 1).

    ``resolved``: the resolved HF model (its weights feed the kernel; the HF model itself is
    used on its current device for the logit check). ``prompt``: int64 [1, P] (CPU);
    ``ref``: the TokenReference; ``cfg``: the LoweringConfig. Returns (BaselineResult named
    ``amk_megakernel`` with timing, verdict and ``extra`` = logit_check, first_divergence,
    build_s), the Compilation and the executor. ``backend_options``: TritonExecutor options
    (``num_warps``, ``blocks``: lowering.triton.blocks.kernel_options). ``compilation``: an
    earlier result's Compilation of the same ``cfg``, reused (kernel knobs differ, the
    validated program does not).
    Raises AmkError if the validator rejects the schedule.
    """
    from amk import pipeline
    from amk.baselines import BaselineResult, judge_tokens
    from lowering.triton.graph import DecodeGraph

    if compilation is None:
        compilation = pipeline.Compilation.build(model_arg, 1, cfg, target, resolved=resolved)
    if not compilation.verdict.ok:
        raise AmkError("the schedule was rejected by the validator: "
                       + "; ".join(f.message for f in compilation.verdict.errors[:3]), exit_code=1)
    t0 = time.perf_counter()
    dec = compilation.decoder("triton", backend_options=backend_options)
    build_s = time.perf_counter() - t0
    report = compilation.check(dec)
    ex = dec.ex
    dec.step(int(prompt[0, 0]), 0)  # compiles; leaves the executor at a step boundary
    graph = DecodeGraph(ex, max_tokens=cfg.max_seq)
    toks, timing = graph.decode(prompt[0].tolist(), n_tokens)
    ok_tokens, first, note = judge_tokens(toks, ref)
    if not report.ok:
        note = f"logit check failed: {'; '.join(report.failures())}; {note}"
    res = BaselineResult("amk_megakernel", toks, timing, ok_tokens and report.ok, note,
                         {"first_divergence": first, "logit_check": report.to_json(),
                          "build_s": build_s, "tasks": len(compilation.program.tasks)})
    return res, compilation, ex


def bench_config(args, sms: int):
    """The AmkConfig of a bench run (``amk bench``, bench/megakernel_sweep.py points,
    bench/profile_megakernel.py): ``--config FILE`` overridden by the knob flags in ``args``
    (lowering.config.config_from_args), checked at ``args.tp`` ranks; lowering fields that
    neither sets take the bench's own defaults: one worker per SM (``sms``), dtype bf16 and the
    max_seq that ``--prompt-len`` + ``--tokens`` need (at least 256). Raises AmkError naming
    the file or flag and the field."""
    from lowering.config import config_from_args

    return config_from_args(args, "amk bench", ranks=getattr(args, "tp", None), defaults=bench_defaults(args, sms))


def bench_defaults(args, sms: int) -> dict:
    """``amk bench``'s own lowering defaults: one worker per SM (``sms``), bf16, the max_seq
    that --prompt-len + --tokens need (at least 256)."""
    return {"workers": sms, "dtype": "bf16", "max_seq": max(256, args.prompt_len + args.tokens + 8)}


def run_config(args, gpu):
    """(AmkConfig, config source line) of ``amk bench``: with --config FILE or --no-tuned as
    ``bench_config``; otherwise the tuned entry of the model on ``gpu`` (a GpuKey, None: no
    GPU here) at --tp, else the cost-model heuristic (search/defaults.py), flags over it and
    the bench defaults (``bench_defaults``) for what it leaves out."""
    from amk.checks import model_spec
    from search.defaults import command_config
    from search.heuristic import DEFAULT_SMS

    tuned = not (getattr(args, "config", None) or getattr(args, "no_tuned", False))
    spec = model_spec(args.model)[1] if tuned else None
    sms = gpu.sms if gpu is not None else DEFAULT_SMS
    return command_config(args, "amk bench", spec, getattr(args, "tp", 1), gpu, defaults=bench_defaults(args, sms))


#: ``amk bench``'s own defaults of lowering knobs, in words (its --help)
BENCH_DEFAULTS = {"workers": "one per SM", "dtype": "bf16", "max_seq": "--prompt-len + --tokens + 8, at least 256"}


def write_result(args: argparse.Namespace, result: dict, final: bool = True) -> None:
    """``--out FILE``: write ``result`` to FILE (indented JSON, NaN as null), whole or not at
    all (AmkError naming FILE, exit 2). ``--json`` (``final`` only): print it to stdout."""
    from amk.output import emit_json
    from ground.files import atomic_write_text, finite

    if args.out:
        atomic_write_text(args.out, json.dumps(finite(result), indent=1, default=str) + "\n")
    if final and args.json:
        emit_json(result)
