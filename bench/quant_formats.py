"""Weight-only formats on the CPU: how far int8 / fp8 (E4M3) with per-row or per-group scales,
and GGUF's Q8_0, move a model from its unquantized self, measured with torch.

Usage (CPU, repo root on PYTHONPATH; the real SmolLM2-135M-Instruct by default):
    python bench/quant_formats.py smollm2-135m --groups 0,32,64,128 --spread 8 --breakdown \\
        --out out/quant_formats.json

Each row is one variant of the model: the decoder layers' linear weights (q/k/v, o, gate/up,
down; with ``head`` 1 the LM head too, a tied head untied first) replaced by their quantized
weights dequantized, as lowering.quant.quantized_copy does. Its columns are
lowering.quant.distance against the unquantized fp32 model (teacher-forced greedy agreement
over ``--tokens`` tokens after quant.EVAL_PROMPT, the first free-running difference, the
perplexity change on quant.EVAL_TEXT), the relative RMS error of the quantized weights, and
for each teacher-forced token the variant predicts differently, the unquantized model's
top-1 minus top-2 logit margin there. Formats:

* ``int8`` / ``fp8``, ``group`` 0: one f32 scale per output row, lowering.quant.quantize_rows
  (torchao's Int8WeightOnlyConfig / Float8WeightOnlyConfig math);
* ``int8`` / ``fp8``, ``group`` G > 0: the same math with one scale per G consecutive K
  elements of a row (torchao's group-wise granularity; a last group shorter than G when G
  does not divide K);
* ``fp8-mse``: fp8 whose scale, per row or group, is the one of ``absmax / 448 * 2 ** (j /
  16)``, j = 0 .. 15, with the least squared error of the group's dequantized weights (the
  same stored format as fp8, a scale chosen by search);
* ``q8_0``: GGUF's Q8_0 blocks (32 K elements, one f16 scale ``absmax / 127`` each, int8
  values), through ``gguf.quants``.

``--spread N`` adds, per format and group, N realisations of the same rounding error: the
scale multiplied by ``2 ** (j / N)`` for fp8 (E4M3's relative rounding error does not depend
on the scale, so each j is an equally good fp8 quantization that rounds differently) and by
``1 + 0.05 j / N`` for int8, and for fp8-mse every candidate scale by ``2 ** (j / (16 N))``
(a shifted grid of candidates), j = 0 .. N-1. ``--breakdown`` adds, for int8 and fp8 at per-row
scales, the perplexity change of quantizing one decoder layer alone, one projection kind
alone, and the LM head alone. A reference row gives the unquantized model cast to bf16.

``--out FILE`` is written atomically; ``--json`` prints the result as one JSON line.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import platform
import sys
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ground.errors import AmkError, run_main  # noqa: E402

NAME = "bench/quant_formats.py"
FORMATS = ("int8", "fp8", "fp8-mse", "q8_0")
Q8_0_BLOCK = 32
MSE_CANDIDATES = 16  # fp8-mse: scales absmax / 448 * 2 ** (j / 16), j = 0 .. 15
KINDS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=NAME, description=__doc__.splitlines()[0])
    ap.add_argument("model", metavar="MODEL", nargs="?", default="smollm2-135m",
                    help="config:NAME, an alias or a checkpoint (default smollm2-135m)")
    ap.add_argument("--formats", default=",".join(FORMATS), help=f"comma list of {', '.join(FORMATS)} (default all)")
    ap.add_argument("--groups", default="0,32,64,128",
                    help="comma list of scale group sizes along K for int8 / fp8, 0 = per row (default 0,32,64,128)")
    ap.add_argument("--heads", default="0,1", help="comma list: LM head unquantized (0) / quantized (1) (default 0,1)")
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens compared (default 64)")
    ap.add_argument("--spread", type=int, default=0, metavar="N",
                    help="N >= 2 realisations of each int8 / fp8 rounding (module doc); 0 = none (default)")
    ap.add_argument("--breakdown", action="store_true",
                    help="per-layer, per-projection and LM-head-only perplexity changes at per-row scales")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--json", action="store_true", help="print the result as one JSON line on stdout")
    ap.add_argument("--out", metavar="FILE", default=None, help="write the result (JSON) to FILE, atomically")
    return ap


def int_list(text: str, flag: str, lo: int, hi: int | None = None) -> list[int]:
    """A comma list of distinct integers in [lo, hi] (hi None: no upper bound). AmkError
    naming ``flag`` otherwise."""
    try:
        out = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        out = []
    if not out or len(set(out)) != len(out) or any(v < lo or (hi is not None and v > hi) for v in out):
        bound = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise AmkError(f"{flag}: expected a comma list of distinct integers {bound}, got {text!r}")
    return out


def parse_formats(text: str) -> list[str]:
    """The ``--formats`` list, in order, no repeats. AmkError otherwise."""
    out = [t.strip() for t in text.split(",") if t.strip()]
    if not out or len(set(out)) != len(out) or any(t not in FORMATS for t in out):
        raise AmkError(f"--formats: expected a comma list of {', '.join(FORMATS)}, got {text!r}")
    return out


def fake_quant(w, fmt: str, group: int = 0, factor: float = 1.0):
    """``w`` [N, K] (float) quantized to ``fmt`` and dequantized, in w's dtype: [N, K].

    ``group`` 0: per-row scales; G > 0: one scale per G consecutive K elements (the last
    group of a row shorter when G does not divide K); ``q8_0`` ignores ``group`` (32-element
    blocks). ``factor`` multiplies the int8 / fp8 scale, or each candidate scale of fp8-mse
    (1: lowering.quant's math exactly; fp8 needs factor >= 1 so that no element clamps). Raises AmkError for a q8_0 weight
    whose K is not a multiple of 32.
    """
    import torch

    from lowering.quant import FP8_MAX, IR_DTYPE, dequantize, quantize_rows

    n, k = w.shape
    if fmt == "q8_0":
        from gguf import GGMLQuantizationType, quants

        if k % Q8_0_BLOCK:
            raise AmkError(f"q8_0: K = {k} is not a multiple of the {Q8_0_BLOCK}-element block")
        arr = w.detach().float().numpy()
        back = quants.dequantize(quants.quantize(arr, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0)
        return torch.from_numpy(back.copy()).reshape(n, k).to(w.dtype)
    g = group or k
    pad = (-k) % g
    rows = torch.nn.functional.pad(w.detach(), (0, pad)).reshape(-1, g)  # zeros leave absmax as is
    if fmt == "fp8-mse":
        x = rows.float()
        amax = x.abs().amax(1, keepdim=True)
        best = err = None
        for j in range(MSE_CANDIDATES):
            s = amax / FP8_MAX * factor * 2 ** (j / MSE_CANDIDATES)
            s = torch.where(s > 0, s, torch.ones_like(s))
            dq = (x / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * s
            e = ((dq - x) ** 2).sum(1, keepdim=True)
            if best is None:
                best, err = dq, e
            else:
                best, err = torch.where(e < err, dq, best), torch.minimum(e, err)
        out = best
    elif factor == 1.0:
        q, s = quantize_rows(rows, IR_DTYPE[fmt])
        out = dequantize(q, s)
    else:
        x = rows.float()
        amax = x.abs().amax(1, keepdim=True)
        if fmt == "fp8":
            s = amax / FP8_MAX * factor
            s = torch.where(s > 0, s, torch.ones_like(s))
            out = (x / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * s
        else:
            s = (amax / 127.5 * factor).clamp(min=torch.finfo(torch.float32).eps)
            out = torch.clamp(torch.round(x * (1.0 / s)), -128, 127) * s
    return out.reshape(n, k + pad)[:, :k].to(w.dtype)


def _gemv_modules(model):
    """``[(layer index, projection name, nn.Linear)]`` of the decoder layers' GEMV weights."""
    import torch

    out = []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and ".layers." in f".{name}" and name.endswith("_proj"):
            out.append((int(name.split("layers.")[1].split(".")[0]), name.rsplit(".", 1)[-1], mod))
    return out


def variant(base, fmt: str, group: int = 0, head: bool = False, factor: float = 1.0,
            layers: set[int] | None = None, kinds: tuple[str, ...] | None = None):
    """A copy of HF ``base`` with the selected decoder GEMV weights (all, or those of
    ``layers`` / projection ``kinds``) and, with ``head``, the LM head replaced by
    ``fake_quant(w, fmt, group, factor)``; a tied head is untied so the embedding stays
    unquantized (lowering.quant.quantized_copy's rule)."""
    import torch

    m = copy.deepcopy(base)
    with torch.no_grad():
        for li, kind, mod in _gemv_modules(m):
            if (layers is None or li in layers) and (kinds is None or kind in kinds):
                mod.weight.copy_(fake_quant(mod.weight, fmt, group, factor))
        if head:
            h = m.get_output_embeddings()
            h.weight = torch.nn.Parameter(fake_quant(h.weight, fmt, group, factor), requires_grad=False)
            if getattr(m.config, "tie_word_embeddings", False):
                m.config.tie_word_embeddings = False
    return m


def rel_rms_error(base, fmt: str, group: int, head: bool, factor: float = 1.0) -> float:
    """sqrt(sum (q - w)^2 / sum w^2) over the weights ``variant`` quantizes."""
    ws = [mod.weight.detach() for _, _, mod in _gemv_modules(base)]
    if head:
        ws.append(base.get_output_embeddings().weight.detach())
    num = sum(float(((fake_quant(w, fmt, group, factor).float() - w.float()) ** 2).sum()) for w in ws)
    return math.sqrt(num / sum(float((w.float() ** 2).sum()) for w in ws))


class Probe:
    """The unquantized model, the token ids of the comparison, its greedy reference tokens
    and their top-1 minus top-2 logit margins; ``row`` measures one variant."""

    def __init__(self, base, prompt: list[int], text: list[int], n: int):
        import torch

        from lowering import quant

        self.base, self.prompt, self.text, self.n = base, prompt, text, n
        self.ref = quant.greedy_tokens(base, prompt, n)
        with torch.no_grad():
            lg = base(input_ids=torch.tensor([prompt + self.ref])).logits[0, len(prompt) - 1:-1].float()
        top = lg.topk(2, -1).values
        self.margin = [float(v) for v in top[:, 0] - top[:, 1]]
        self.ppl_base = quant.perplexity(base, text)

    def row(self, model, **labels) -> dict:
        """lowering.quant.distance of ``model`` plus the teacher-forced flips with the base's
        margins: ``{**labels, greedy_match, greedy_prefix, ppl, ppl_pct, flips}``."""
        from lowering import quant

        d = quant.distance(self.base, model, self.prompt, self.text, self.n)
        pred = quant.forced_argmax(model, self.prompt + self.ref)[len(self.prompt) - 1:-1]
        flips = [{"token": i, "base_margin": round(self.margin[i], 4)}
                 for i, (a, b) in enumerate(zip(pred, self.ref)) if a != b]
        return {**labels, "greedy_match": d["greedy_match"], "greedy_prefix": d["greedy_prefix"],
                "ppl": d["ppl_quant"], "ppl_pct": 100 * (d["ppl_ratio"] - 1), "flips": flips}

    def ppl_pct(self, model) -> float:
        """Perplexity change of ``model`` on the text, in percent."""
        from lowering import quant

        return 100 * (quant.perplexity(model, self.text) / self.ppl_base - 1)


def spread_factor(fmt: str, j: int, n: int) -> float:
    """The scale factor of realisation ``j`` of ``n`` (module doc)."""
    if fmt == "fp8-mse":
        return 2 ** (j / (n * MSE_CANDIDATES))
    return 2 ** (j / n) if fmt == "fp8" else 1 + 0.05 * j / n


def measure(args: argparse.Namespace, formats: list[str], groups: list[int], heads: list[int],
            progress: Callable[[str], None]) -> dict:
    """Every row of the run (module doc) as one JSON-able dict."""
    import torch

    from amk import pipeline
    from lowering import quant

    if args.threads:
        torch.set_num_threads(args.threads)
    progress(f"resolving {args.model}")
    r = pipeline.resolve(args.model)
    if r.tokenizer is None:
        raise AmkError(f"{args.model}: no tokenizer, so no text to measure perplexity on")
    base = r.model.eval()
    root = Path(__file__).resolve().parents[1]
    prompt = list(r.tokenizer(quant.EVAL_PROMPT)["input_ids"])
    text = list(r.tokenizer((root / quant.EVAL_TEXT).read_text())["input_ids"])
    probe = Probe(base, prompt, text, args.tokens)
    rows = [probe.row(copy.deepcopy(base).to(torch.bfloat16), format="bf16 (unquantized)", group=None, head=None)]
    rows[0]["rel_rms_error"] = None
    variants = [(f, g, h) for f in formats for g in ([0] if f == "q8_0" else groups) for h in heads]
    for fmt, g, h in variants:
        progress(f"{fmt} group {g} head {h}")
        row = probe.row(variant(base, fmt, g, bool(h)), format=fmt, group=Q8_0_BLOCK if fmt == "q8_0" else g, head=h)
        row["rel_rms_error"] = rel_rms_error(base, fmt, g, bool(h))
        rows.append(row)
    spread = []
    if args.spread:
        for fmt in [f for f in formats if f != "q8_0"]:
            for g in groups:
                runs = []
                for j in range(args.spread):
                    c = spread_factor(fmt, j, args.spread)
                    progress(f"{fmt} group {g}: realisation {j + 1} of {args.spread} (scale x {c:.4f})")
                    runs.append(probe.row(variant(base, fmt, g, False, c), factor=c))
                pcts = [x["ppl_pct"] for x in runs]
                spread.append({"format": fmt, "group": g, "head": 0, "runs": runs,
                               "ppl_pct_mean": sum(pcts) / len(pcts), "ppl_pct_min": min(pcts),
                               "ppl_pct_max": max(pcts),
                               "all_tokens_agree": sum(x["greedy_match"] == 1.0 for x in runs)})
    breakdown = {}
    if args.breakdown:
        nl = 1 + max(li for li, _, _ in _gemv_modules(base))
        for fmt in [f for f in formats if f in ("int8", "fp8")]:
            g = 0
            progress(f"{fmt}: one layer, one projection kind, the LM head alone")
            breakdown[fmt] = {
                "layer": [probe.ppl_pct(variant(base, fmt, g, layers={i})) for i in range(nl)],
                "kind": {"+".join(k): probe.ppl_pct(variant(base, fmt, g, kinds=k)) for k in KINDS},
                "lm_head_only": probe.ppl_pct(variant(base, fmt, g, head=True, layers=set())),
            }
    return {"model": args.model, "command": "python " + " ".join([NAME, *sys.argv[1:]]),
            "python": platform.python_version(), "torch": torch.__version__, "tokens": args.tokens,
            "text_tokens": len(text), "ppl_base": probe.ppl_base, "reference_tokens": probe.ref,
            "base_margins": probe.margin, "rows": rows, "spread": spread, "breakdown": breakdown}


def tables(result: dict) -> list:
    """The printed tables of a result (rich)."""
    from rich.table import Table

    n = result["tokens"]
    t = Table(title=f"{result['model']}: distance to the unquantized fp32 model "
                    f"(ppl {result['ppl_base']:.3f} on {result['text_tokens']} tokens, {n} greedy tokens)")
    for c in ("format", "scales", "LM head", "weight rel. RMS err", "tokens agree", "first free diff",
              "ppl change", "flipped tokens (base margin)"):
        t.add_column(c)

    def flips(r):
        return ", ".join(f"{f['token']} ({f['base_margin']:.3f})" for f in r["flips"]) or "-"

    for r in result["rows"]:
        g = r["group"]
        t.add_row(r["format"], "-" if g is None else ("per row" if g == 0 else f"per {g}"),
                  {None: "-", 0: "bf16", 1: "quantized"}[r["head"]],
                  "-" if r["rel_rms_error"] is None else f"{100 * r['rel_rms_error']:.2f}%",
                  f"{round(r['greedy_match'] * n)}/{n}", str(r["greedy_prefix"]) if r["greedy_prefix"] < n else "none",
                  f"{r['ppl_pct']:+.2f}%", flips(r))
    out = [t]
    if result["spread"]:
        s = Table(title="realisations of the same rounding error (scale x factor, LM head bf16)")
        for c in ("format", "scales", "ppl change per realisation", "mean", "all tokens agree"):
            s.add_column(c)
        for sp in result["spread"]:
            s.add_row(sp["format"], "per row" if sp["group"] == 0 else f"per {sp['group']}",
                      ", ".join(f"{r['ppl_pct']:+.2f}" for r in sp["runs"]), f"{sp['ppl_pct_mean']:+.2f}%",
                      f"{sp['all_tokens_agree']} of {len(sp['runs'])}")
        out.append(s)
    for fmt, b in result["breakdown"].items():
        s = Table(title=f"{fmt} per row: perplexity change with one part quantized alone")
        s.add_column("part")
        s.add_column("ppl change")
        for i, v in enumerate(b["layer"]):
            s.add_row(f"layer {i}", f"{v:+.3f}%")
        for k, v in b["kind"].items():
            s.add_row(f"{k}, all layers", f"{v:+.3f}%")
        s.add_row("LM head", f"{b['lm_head_only']:+.3f}%")
        out.append(s)
    return out


def main(argv: list[str] | None = None) -> int:
    """The script: parse and check the arguments, measure, print the tables, write ``--out``
    atomically, ``--json`` to stdout. Returns 0; AmkError (exit 2) for bad input."""
    args = parser().parse_args(argv)
    formats = parse_formats(args.formats)
    groups = int_list(args.groups, "--groups", 0)
    heads = int_list(args.heads, "--heads", 0, 1)
    if args.tokens < 4:
        raise AmkError(f"--tokens must be >= 4, got {args.tokens}")
    if args.spread == 1 or args.spread < 0:
        raise AmkError(f"--spread must be 0 or >= 2, got {args.spread}")
    from rich.console import Console

    from amk.output import check_writable_dir, emit_json
    from ground.files import atomic_write_text, finite

    if args.out:
        check_writable_dir(Path(args.out).parent, "--out")
    con = Console(stderr=True)
    result = measure(args, formats, groups, heads, lambda s: con.print(s, markup=False, highlight=False))
    show = Console(width=200, stderr=bool(args.json))
    for t in tables(result):
        show.print(t)
    if args.out:
        atomic_write_text(args.out, json.dumps(finite(result), indent=1) + "\n")
    if args.json:
        emit_json(result)
    return 0


if __name__ == "__main__":
    run_main(main, NAME)
