"""Quantized weights on one GPU: amk's megakernel with bf16, int8, fp8 and q8_0 GEMV weights
against torchao's weight-only int8 / float8 HF models (torch.compile + CUDA graph), each with
its correctness verdict and its share of the quantized roofline.

Usage (on a GPU machine, repo root on PYTHONPATH; torchao installed for the torchao rows):
    python bench/quant.py config:llama-3.2-1b --weights int8,fp8 --out out/quant.json

Rows: ``amk bf16`` (the unquantized megakernel), ``amk int8`` / ``amk fp8`` / ``amk q8_0``
(``--weights``), ``hf bf16`` and ``torchao int8`` / ``torchao fp8`` / ``torchao q8_0``
(``quantize_`` with Int8WeightOnlyConfig per row / Float8WeightOnlyConfig /
Int8WeightOnlyConfig per group of 32 on a copy of the bf16 model, then
amk.baselines.hf_compiled_graph: a StaticCache decode step, torch.compile'd, replayed in a
CUDA graph). ``quantize_`` also switches on the inductor settings torchao recommends,
coordinate-descent tuning among them, which makes the compile of a torchao row long; each
run records those settings, its warm-up seconds (compile included) and Dynamo's graph
count; ``--torchao-inductor stock`` restores the stock settings after ``quantize_`` (row
``torchao FMT stock``), ``both`` measures a row each way. ``--amk-variant 'NAME: --knob V'``
adds a row ``amk FMT NAME`` per quantized format with those kernel knobs (an A/B in one
process). Each baseline is measured ``--repeats`` times (default 2; the table shows every run's
median). ``--rows`` picks the row kinds (amk, hf, torchao), so that one call may measure
what another call had no time for (the inductor cache of a warm machine then shortens the
compile). Verdicts: greedy tokens against HF generate of the model the row computes, by the
near-tie rule (amk.baselines.judge_tokens): the bf16 model for the bf16 rows, for a quantized
row the bf16 model with amk's quantized weights dequantized (lowering.quant.quantized_copy:
torchao's math for int8 and fp8, ggml's Q8_0 for q8_0); amk's rows also check logits at
several positions (Compilation.check). The roofline of a row is its weight bytes (quantized
weights at 1 byte plus their scales) over the HBM bandwidth measured in the same run
(ground/timing.py). Also reported per format: the quantized model's distance to the bf16
one (greedy agreement over 64 tokens, perplexity: lowering.quant.distance, on seeded token
ids).

Without a CUDA GPU it exits 2 with one line. ``--out FILE`` is written atomically, after
every row too (``partial: true`` until the run ends).
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if str(Path(__file__).resolve().parent) not in sys.path:  # bench/report.py, when imported by a path
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from ground.errors import AmkError, run_main  # noqa: E402

FORMATS = ("int8", "fp8", "q8_0")
ROWS = ("amk", "hf", "torchao")
INDUCTOR_MODES = ("recommended", "stock", "both")
NAME = "bench/quant.py"


def parser() -> argparse.ArgumentParser:
    from amk.bench import BENCH_DEFAULTS
    from lowering.config import KernelConfig, LoweringConfig
    from lowering.knobs import add_flags
    from search.defaults import add_args

    ap = argparse.ArgumentParser(prog=NAME, description=__doc__.splitlines()[0])
    ap.add_argument("model", metavar="MODEL", help="config:NAME, an alias or a checkpoint (as amk bench)")
    ap.add_argument("--weights", dest="formats", default="int8,fp8", metavar="int8,fp8",
                    help="comma list of the quantized formats to measure (default int8,fp8)")
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens per decode run (default 64)")
    ap.add_argument("--prompt-len", type=int, default=8, help="seeded prompt tokens (default 8)")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each baseline (default 2)")
    ap.add_argument("--rows", default=",".join(ROWS), metavar="amk,hf,torchao",
                    help="comma list of the row kinds to measure: amk (the megakernel), hf (bf16 "
                         "compiled + graph), torchao (quantized compiled + graph); default all. A "
                         "call too short for every compile can measure some kinds, the next the rest")
    ap.add_argument("--no-baselines", action="store_true", help="amk rows only (--rows amk)")
    ap.add_argument("--amk-variant", action="append", default=[], metavar="'NAME: --knob V ...'",
                    help="also measure each quantized format's amk row with these kernel knobs changed "
                         "(row 'amk FMT NAME'); repeatable")
    ap.add_argument("--torchao-inductor", choices=INDUCTOR_MODES, default="recommended",
                    help="the inductor settings of the torchao rows: recommended (what quantize_ switches "
                         "on, coordinate-descent tuning among them: long compiles), stock (restored after "
                         "quantize_), or both (a row each); default recommended")
    ap.add_argument("--json", action="store_true", help="print the result as one JSON line on stdout")
    ap.add_argument("--out", metavar="FILE", default=None, help="write the result (JSON) to FILE, atomically")
    # --weights is this script's list (q8_0: int8 with --weight-group 32); --quantize-lm-head applies to
    # each quantized row
    add_flags(ap.add_argument_group("lowering knobs (docs/lowering.md)"), LoweringConfig,
              skip=("weights", "weight_group"), defaults=BENCH_DEFAULTS)
    add_flags(ap.add_argument_group("kernel knobs (docs/triton.md)"), KernelConfig)
    add_args(ap.add_argument_group("default config (docs/tuning.md)"))
    return ap


def parse_formats(text: str) -> list[str]:
    """The ``--weights`` list: int8, fp8 and / or q8_0, in order, no repeats. AmkError
    otherwise."""
    out = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in out if t not in FORMATS]
    if bad or not out or len(set(out)) != len(out):
        raise AmkError(f"--weights: expected a comma list of {', '.join(FORMATS)}, got {text!r}")
    return out


def parse_variants(texts: list[str], base) -> list[tuple[str, object]]:
    """The ``--amk-variant`` list as (name, KernelConfig): each ``NAME: --knob V ...`` is the
    kernel knobs of ``base`` (a KernelConfig) with those flags applied, validated. Raises
    AmkError naming the variant for a missing name, a repeated name, an unknown flag or a
    value a knob does not allow."""
    import shlex

    from lowering.config import KernelConfig
    from lowering.knobs import add_flags, given

    out: list[tuple[str, object]] = []
    for text in texts:
        name, sep, flags = text.partition(":")
        name = name.strip()
        if not sep or not name or " " in name or name in {n for n, _ in out}:
            raise AmkError(f"--amk-variant {text!r}: expected 'NAME: --knob VALUE ...' with a new one-word NAME")
        ap = argparse.ArgumentParser(prog=f"--amk-variant {name}", add_help=False, exit_on_error=False)
        add_flags(ap, KernelConfig)
        try:
            ns, rest = ap.parse_known_args(shlex.split(flags))
        except (argparse.ArgumentError, ValueError) as err:
            raise AmkError(f"--amk-variant {name}: {err}") from None
        if rest:
            raise AmkError(f"--amk-variant {name}: not a kernel knob: {' '.join(rest)}")
        out.append((name, base.replace(**given(ns, KernelConfig)).validate(f"--amk-variant {name}")))
    return out


def kernel_key(fmt: str | None, kernel):
    """The kernel knobs ``kernel`` (a KernelConfig) with those that do nothing for weight
    format ``fmt`` at their defaults: two variants with one key build the same kernel for it
    (an fp8 program has no int8 to convert; q8_0's grouped scales never stream through TMA)."""
    if fmt == "fp8":
        return kernel.replace(int8_convert=type(kernel)().int8_convert)
    if fmt == "q8_0":
        return kernel.replace(q_tma=False)
    return kernel


def parse_rows(text: str, no_baselines: bool = False) -> set[str]:
    """The row kinds of ``--rows`` (``ROWS``); ``no_baselines`` keeps only ``amk``. Raises
    AmkError naming an unknown kind or an empty list."""
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    bad = [k for k in kinds if k not in ROWS]
    if bad or not kinds:
        raise AmkError(f"--rows {text!r}: expected a comma list of {', '.join(ROWS)}")
    return {"amk"} if no_baselines else set(kinds)


def quant_decode_bytes(model, fmt: str | None, quantize_lm_head: bool = False) -> int:
    """lowering.quant.decode_bytes: the quantized roofline's weight bytes."""
    from lowering.quant import decode_bytes

    return decode_bytes(model, fmt, quantize_lm_head)


def row(method: str, fmt: str, runs: list[dict], roofline_ms: float, correct: bool | None, note: str,
        extra: dict | None = None) -> dict:
    """One result row: ``runs`` are per-run ``{"latency_ms_median": ms, "timing": {...}}``
    (a failed run: ms None); the row's ms/token is the best run's median, its % of the
    roofline ``100 * roofline_ms / ms``."""
    meds = [r.get("latency_ms_median") for r in runs]
    good = [m for m in meds if m]
    best = min(good) if good else None
    return {"method": method, "weights": fmt, "runs_ms": meds, "latency_ms_median": best,
            "roofline_ms": roofline_ms, "roofline_pct": 100 * roofline_ms / best if best else None,
            "tokens_per_s": 1e3 / best if best else None, "correct": correct, "note": note,
            "runs": runs, **(extra or {})}


def result_table(result: dict):
    """The printed table of a result (rich)."""
    from rich.table import Table

    t = Table(title=f"{result['model']} on {result['device']}: HBM {result['hbm_bytes_per_s'] / 1e12:.2f} TB/s "
                    f"(measured in this run)")
    for c in ("method", "weight bytes", "ms/token", "runs (ms)", "% quantized roofline", "tokens/s",
              "correct", "note"):
        t.add_column(c)
    for r in result["rows"]:
        ms = r["latency_ms_median"]
        t.add_row(r["method"], f"{r['weight_bytes'] / 1e6:.1f} MB", f"{ms:.3f}" if ms else "-",
                  ", ".join(f"{m:.3f}" if m else "failed" for m in r["runs_ms"]),
                  f"{r['roofline_pct']:.1f}" if r["roofline_pct"] else "-",
                  f"{r['tokens_per_s']:.0f}" if r["tokens_per_s"] else "-",
                  {True: "yes", False: "NO", None: "-"}[r["correct"]], r["note"])
    return t


def build_result(meta: dict, bandwidth: float, rows: list[dict], distance: dict) -> dict:
    """The JSON object of a run: ``meta`` (device, model, versions, command, config), the
    measured bandwidth, the rows (``row``), the per-format distance to the bf16 model and the
    per-format speed-ups of amk's fastest correct row (bench/report.py quant_speedups)."""
    from report import quant_speedups

    res = {**meta, "hbm_bytes_per_s": bandwidth, "rows": rows, "distance": distance,
           "ok": all(r["correct"] is not False for r in rows)}
    res["speedups"] = quant_speedups(res)
    return res


def measure(args: argparse.Namespace, formats: list[str], progress: Callable[[str], None],
            checkpoint: Callable[[dict], None] = lambda result: None) -> dict:
    """Run every measurement on the GPU and return ``build_result``'s object: the row kinds
    of ``args.rows`` (parse_rows), the references and distances always; after each row,
    ``checkpoint`` receives the result so far (``partial: true``), so a run cut off by a time
    limit still leaves its finished rows."""
    import torch

    from amk.baselines import BaselineResult, hf_compiled_graph, judge, make_reference
    from amk.bench import cuda_target, measure_megakernel, run_config
    from amk.pipeline import check_tokens
    from ground.timing import measure_hbm_bandwidth, roofline_ms
    from lowering import quant
    from lowering.config import weight_knobs
    from lowering.triton.blocks import kernel_options
    from models.sources import resolve_model
    from search.tunedb import GpuKey

    kinds = parse_rows(getattr(args, "rows", ",".join(ROWS)), bool(getattr(args, "no_baselines", False)))
    qlm = bool(getattr(args, "quantize_lm_head", False))
    base_args = argparse.Namespace(**{k: v for k, v in vars(args).items() if k != "quantize_lm_head"})
    full, source = run_config(base_args, GpuKey.local())  # the bf16 config; formats set per row
    progress(source)
    variants = [(None, full.kernel), *parse_variants(getattr(args, "amk_variant", []), full.kernel)]
    imode = getattr(args, "torchao_inductor", "recommended")
    imodes = ["stock", "recommended"] if imode == "both" else [imode]
    import torch._inductor.config as inductor_config

    stock = inductor_config.save_config()  # before any quantize_ changes them, process-wide
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    progress("measuring HBM bandwidth")
    bw = measure_hbm_bandwidth(dev)
    progress(f"resolving {args.model} (bf16)")
    resolved = resolve_model(args.model, dtype="bf16")
    model = resolved.model.to(dev).eval()
    g = torch.Generator().manual_seed(1234)
    prompt = torch.randint(0, model.config.vocab_size, (1, args.prompt_len), generator=g)
    rows, distance = [], {}
    meta = {"device": props.name, "model": args.model, "command": " ".join(sys.argv),
            "python": platform.python_version(), "torch": torch.__version__,
            "torchao": _torchao_version(), "config": full.lowering.to_json(), "kernel": full.kernel.to_json(),
            "config_source": source, "tokens": args.tokens, "repeats": args.repeats,
            "amk_variants": {n: k.to_json() for n, k in variants if n}, "torchao_inductor": imodes,
            "rows": [k for k in ROWS if k in kinds]}

    def done(row_: dict) -> None:
        rows.append(row_)
        checkpoint({**build_result(meta, bw, rows, distance), "partial": True})

    for fmt in [None, *formats]:
        label = fmt or "bf16"
        ref_model = model if fmt is None else quant.quantized_copy(model, fmt, qlm)
        progress(f"HF greedy reference ({label})")
        ref = make_reference(ref_model, prompt.to(dev), args.tokens)
        if fmt is not None:
            vocab = model.config.vocab_size
            distance[label] = quant.distance(model, ref_model, check_tokens(vocab, 16, 1),
                                             check_tokens(vocab, 256, 2), 64)
        del ref_model  # the compilation builds its own copy for the logit check: one at a time
        _free()
        nbytes = quant_decode_bytes(model, fmt, qlm)
        floor = roofline_ms(nbytes, bw)
        cfg = full.lowering.replace(**weight_knobs(fmt or "none"), quantize_lm_head=qlm if fmt else False)
        compilation, seen = None, []
        for vname, kcfg in (variants if fmt else variants[:1]) if "amk" in kinds else ():
            name = f"amk {label}" + (f" {vname}" if vname else "")
            same = kernel_key(fmt, kcfg)
            if same in seen:
                progress(f"{name}: skipped, the same kernel as an earlier row for {label}")
                continue
            seen.append(same)
            progress(f"{name}: lower, validate, build, check logits, decode in a CUDA graph")
            extra = {"weight_bytes": nbytes, **({"kernel": kcfg.to_json()} if vname else {})}
            try:
                ours, compilation, ex = measure_megakernel(args.model, resolved, cfg, cuda_target(props), prompt,
                                                           ref, args.tokens, kernel_options(kcfg), compilation)
                del ex
                _free()
                done(row(name, label, [ours.to_json()], floor, ours.correct, ours.note,
                         {**extra, "logit_check": ours.extra.get("logit_check")}))
            except Exception as err:  # keep the row, with the reason, and go on to the next
                done(row(name, label, [{"latency_ms_median": None}], floor, False,
                         f"failed: {type(err).__name__}: {err}", extra))
        del compilation
        _free()
        if ("hf" if fmt is None else "torchao") not in kinds:
            continue
        for mode in [None] if fmt is None else imodes:
            name = "hf bf16" if fmt is None else f"torchao {label}" + (" stock" if mode == "stock" else "")
            runs, correct, note, base = [], True, "", None
            try:
                base = model if fmt is None else torchao_model(model, fmt, stock if mode == "stock" else None)
                for k in range(args.repeats):
                    progress(f"{name} + torch.compile + CUDA graph, run {k + 1} of {args.repeats}")
                    r = judge(hf_compiled_graph(base, prompt.to(dev), args.tokens), ref)
                    r.extra["inductor"] = inductor_settings()
                    runs.append(r.to_json())
                    correct, note = correct and bool(r.correct), r.note
                    ic = r.extra.get("inductor_counters", {})
                    progress(f"  {r.timing.median_ms:.3f} ms/token after {r.extra['compile_s']:.0f} s of warm-up "
                             f"({r.extra['dynamo_graphs']} Dynamo graphs; coordinate-descent benchmarks "
                             f"{ic.get('coordesc_tuning_bench', 0)}, FX graph cache hits "
                             f"{ic.get('fxgraph_cache_hit', 0)} / misses {ic.get('fxgraph_cache_miss', 0)})")
            except Exception as err:  # keep the row, with the reason, rather than lose the run
                r = BaselineResult(name, [], None, False, f"failed: {type(err).__name__}: {err}")
                runs.append(r.to_json())
                correct, note = False, r.note
            done(row(name, label, runs, floor, correct, note, {"weight_bytes": nbytes}))
            del base
            _free()
    return build_result(meta, bw, rows, distance)


def _free() -> None:
    """Return the memory of dropped models and executors to the device before the next."""
    import gc

    import torch

    gc.collect()
    torch.cuda.empty_cache()


def torchao_model(model, fmt: str, restore: bytes | None = None):
    """A copy of the bf16 HF ``model`` with torchao's weight-only quantization of every
    linear layer but the LM head (int8: Int8WeightOnlyConfig, fp8: Float8WeightOnlyConfig,
    q8_0: Int8WeightOnlyConfig with PerGroup(32) granularity), the layers amk quantizes.
    ``quantize_`` also applies torchao's recommended inductor settings, process-wide
    (torchao.quantization.utils.recommended_inductor_config_setter); ``restore`` (inductor
    settings from ``torch._inductor.config.save_config()``) is loaded back after it. Raises
    AmkError when torchao is not installed."""
    import copy

    import torch
    import torch._inductor.config as inductor_config

    try:
        from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig, quantize_
        from torchao.quantization.granularity import PerGroup
    except ImportError as err:
        raise AmkError(f"torchao is not installed ({err}); pip install 'amk[quant]'") from None
    m = copy.deepcopy(model)
    cfg = (Int8WeightOnlyConfig() if fmt == "int8" else Float8WeightOnlyConfig() if fmt == "fp8"
           else Int8WeightOnlyConfig(version=2, granularity=PerGroup(32)))
    head = m.get_output_embeddings()
    quantize_(m, cfg, filter_fn=lambda mod, fqn: isinstance(mod, torch.nn.Linear) and mod is not head
              and fqn.endswith("_proj"))
    if restore is not None:
        inductor_config.load_config(restore)
    return m


def inductor_settings() -> dict:
    """The inductor settings torchao's quantize_ changes, as they stand now."""
    import torch._inductor.config as c

    return {"coordinate_descent_tuning": bool(c.coordinate_descent_tuning),
            "coordinate_descent_check_all_directions": bool(c.coordinate_descent_check_all_directions),
            "force_fuse_int_mm_with_mul": bool(c.force_fuse_int_mm_with_mul)}


def _torchao_version() -> str | None:
    try:
        import torchao
    except ImportError:
        return None
    return torchao.__version__


def main(argv: list[str] | None = None, measure_fn: Callable | None = None) -> int:
    """The script: parse, check the arguments and the GPU, measure (``measure_fn(args,
    formats, progress)``, default ``measure``: the GPU run; another function skips the GPU
    check), print the table, write ``--out`` atomically, ``--json`` to stdout. Returns 0
    when every row is correct, 1 otherwise; AmkError (exit 2) for bad input or no GPU."""
    args = parser().parse_args(argv)
    formats = parse_formats(args.formats)
    parse_rows(args.rows, args.no_baselines)
    if args.tokens < 4 or args.repeats < 1 or args.prompt_len < 1:
        raise AmkError("--tokens must be >= 4, --repeats and --prompt-len >= 1")
    if measure_fn is None:
        import torch

        if not torch.cuda.is_available():
            raise AmkError("needs a CUDA GPU; none is visible here (see `amk doctor`)")
        measure_fn = measure
    from rich.console import Console

    from amk.bench import write_result
    from amk.output import check_writable_dir

    if args.out:
        check_writable_dir(Path(args.out).parent, "--out")
    con = Console(stderr=True)
    result = measure_fn(args, formats, lambda s: con.print(s, markup=False, highlight=False),
                        lambda partial: write_result(args, partial, final=False))
    out = Console(width=200, stderr=bool(args.json))
    out.print(result_table(result))
    from report import speedup_line

    for sp in result.get("speedups", []):
        out.print(speedup_line(sp), markup=False, highlight=False)
    write_result(args, result)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    run_main(main, NAME)
