"""The measurement library behind `amk bench`: the lowering config and the Triton options a
bench run takes from its flags, the CUDA target, and the megakernel measurement itself
(lower, validate, build, check logits, time decode in a CUDA graph).

`amk bench` (amk/commands/bench.py), its tensor-parallel body (amk/bench_tp.py), the
benchmark scripts in bench/ and the tests import from here; command modules are imported by
the CLI alone (docs/layout.md).
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

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
                       backend_options: dict | None = None):
    """Lower, validate, build and time the megakernel for one config (R = 1).

    ``resolved``: the resolved HF model (its weights feed the kernel; the HF model itself is
    used on its current device for the logit check). ``prompt``: int64 [1, P] (CPU);
    ``ref``: the TokenReference. Returns (BaselineResult named ``amk_megakernel`` with
    timing, verdict and ``extra`` = logit_check, first_divergence, build_s), the Session and
    the executor. ``backend_options``: TritonExecutor options (``num_warps``, ``blocks``).
    Raises AmkError if the validator rejects the schedule.
    """
    from amk import pipeline
    from amk.baselines import BaselineResult, judge_tokens
    from lowering.triton.graph import DecodeGraph

    session = pipeline.Session.build(model_arg, 1, cfg, target, resolved=resolved)
    if not session.verdict.ok:
        raise AmkError("the schedule was rejected by the validator: "
                       + "; ".join(f.message for f in session.verdict.errors[:3]), exit_code=1)
    t0 = time.perf_counter()
    dec = session.decoder("triton", backend_options=backend_options)
    build_s = time.perf_counter() - t0
    report = session.check(dec)
    ex = dec.ex
    dec.step(int(prompt[0, 0]), 0)  # compiles; leaves the executor at a step boundary
    graph = DecodeGraph(ex, max_tokens=cfg.max_seq)
    toks, timing = graph.decode(prompt[0].tolist(), n_tokens)
    ok_tokens, first, note = judge_tokens(toks, ref)
    if not report.ok:
        note = f"logit check failed: {'; '.join(report.failures())}; {note}"
    res = BaselineResult("amk_megakernel", toks, timing, ok_tokens and report.ok, note,
                         {"first_divergence": first, "logit_check": report.to_json(),
                          "build_s": build_s, "tasks": len(session.program.tasks)})
    return res, session, ex


#: Blocks fields set by one flag each, with a value (0/1 for the booleans);
#: gemv_n / gemv_k come from --gemv-block NxK. Blocks checks its own fields, and its errors are
#: reworded with these flag names (one home for the rules); bench/sweep_best.py turns a sweep
#: row back into these flags.
BLOCKS_FLAGS = {"gemv_stages": "--gemv-stages", "gemv_unroll": "--gemv-unroll", "prefetch": "--prefetch",
                "attention_t": "--attention-block", "maxnreg": "--maxnreg", "x_chunk": "--x-chunk",
                "w_preload": "--w-preload", "prefetch_cap": "--prefetch-cap", "prefetch_rows": "--prefetch-rows",
                "roll": "--roll", "row_prefetch": "--row-prefetch", "x_stage": "--x-stage",
                "x_reuse": "--x-reuse", "lean_release": "--lean-release",
                "gemv_tma": "--gemv-tma", "ring": "--ring", "ring_rows": "--ring-rows", "ring_cols": "--ring-cols"}
_FLAG_OF = {**BLOCKS_FLAGS, "gemv_k": "--gemv-block K", "gemv_n": "--gemv-block N"}


def _flag_names(message: str) -> str:
    """A Blocks error message with its field names replaced by the bench flags that set them."""
    return re.sub(r"\b(" + "|".join(_FLAG_OF) + r")\b", lambda m: _FLAG_OF[m.group(1)], message)


def backend_options(args) -> dict:
    """TritonExecutor options from --num-warps, --gemv-block NxK, --gemv-stages,
    --prefetch, --gemv-unroll, --attention-block, --row-prefetch,
    --x-stage, --x-reuse, --x-chunk, --w-preload, --prefetch-cap, --prefetch-rows, --roll,
    --lean-release, --gemv-tma and --maxnreg. Raises AmkError naming the flag (the ranges are
    lowering.triton.runtime.Blocks' own checks)."""
    from lowering.triton.runtime import Blocks, TritonError

    try:
        n, k = (int(v) for v in args.gemv_block.lower().split("x"))
    except ValueError:
        raise AmkError(f"--gemv-block {args.gemv_block!r}: expected NxK, e.g. 32x512") from None
    att = getattr(args, "attention_block", 32)
    for v, what in ((n, "N"), (k, "K"), (args.num_warps, "--num-warps"), (att, "--attention-block")):
        if v < 1 or v & (v - 1):
            raise AmkError(f"{what} must be a power of two, got {v}")
    try:
        blocks = Blocks(gemv_n=n, gemv_k=k, gemv_stages=getattr(args, "gemv_stages", 1),
                        prefetch=getattr(args, "prefetch", 0), attention_t=att,
                        gemv_unroll=getattr(args, "gemv_unroll", 1),
                        row_prefetch=bool(getattr(args, "row_prefetch", 1)), maxnreg=getattr(args, "maxnreg", 0),
                        x_stage=bool(getattr(args, "x_stage", 1)), x_reuse=bool(getattr(args, "x_reuse", 1)),
                        x_chunk=getattr(args, "x_chunk", 8192), w_preload=getattr(args, "w_preload", 0),
                        prefetch_cap=getattr(args, "prefetch_cap", 0),
                        prefetch_rows=getattr(args, "prefetch_rows", 0), roll=getattr(args, "roll", 0),
                        lean_release=bool(getattr(args, "lean_release", 1)),
                        gemv_tma=bool(getattr(args, "gemv_tma", 0)), ring=getattr(args, "ring", 0),
                        ring_rows=getattr(args, "ring_rows", 4), ring_cols=getattr(args, "ring_cols", 2048))
    except TritonError as e:
        raise AmkError(_flag_names(str(e))) from None
    return {"num_warps": args.num_warps, "blocks": blocks}


def bench_config(args, sms: int):
    """The LoweringConfig of a bench run from its flags: ``--config FILE`` (lowering knobs as
    JSON) overridden by ``--workers``, ``--tile`` and ``--attn-split``; workers default to
    ``sms`` (one per SM), dtype to bf16 and max_seq to what ``--prompt-len`` + ``--tokens``
    need (at least 256). Raises AmkError naming FILE when it cannot be read, or the field
    LoweringConfig rejects."""
    from lowering.config import LoweringConfig

    base = {}
    if args.config:
        try:
            base = json.loads(Path(args.config).read_text())
        except (OSError, ValueError) as e:
            raise AmkError(f"{args.config}: cannot read the config: {e}") from None
    base.setdefault("workers", sms)
    base.setdefault("dtype", "bf16")
    if args.workers:
        base["workers"] = args.workers
    if args.tile:
        base["tile"] = args.tile
    if getattr(args, "attn_split", None):
        base["attn_split"] = args.attn_split
    base.setdefault("max_seq", max(256, args.prompt_len + args.tokens + 8))
    return LoweringConfig.from_json(base, source=args.config or "bench config")


def write_result(args: argparse.Namespace, result: dict, final: bool = True) -> None:
    """``--out FILE``: write ``result`` to FILE (indented JSON, NaN as null), whole or not at
    all (AmkError naming FILE, exit 2). ``--json`` (``final`` only): print it to stdout."""
    from amk.output import emit_json
    from ground.files import atomic_write_text, finite

    if args.out:
        atomic_write_text(args.out, json.dumps(finite(result), indent=1, default=str) + "\n")
    if final and args.json:
        emit_json(result)
