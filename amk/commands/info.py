"""``amk info MODEL``: what a user needs to know about a model before compiling it.

Resolves the MODEL argument (``models.sources``) WITHOUT loading weights: the architecture is
built on torch's ``meta`` device, so ``amk info config:llama-3.1-8b`` allocates nothing, and a
directory holding only ``config.json`` is described as well (``has_weights`` false).
Prints family, shapes (layers, hidden, intermediate, query/KV heads, head_dim, vocabulary),
RoPE, parameter count and weight bytes per dtype, KV-cache bytes per token, the features amk
must support (each unsupported one listed with its config field), and the tensor-parallel
degrees that split the heads evenly.

Exit code 0 when the model was described (supported or not), 2 on a bad MODEL argument.
"""

from __future__ import annotations

import argparse
from typing import Any

from models import features

DTYPE_BYTES = {"bf16": 2, "f32": 4}
TP_MAX = 8


HELP = "describe a model: shapes, parameters, support, TP degrees"
DESCRIPTION = """\
Describe a model before compiling: family, shapes, parameter count and weight bytes, unsupported
features, and even tensor-parallel degrees. MODEL is a local HF directory, a .gguf file, the
alias smollm2-135m, or config:NAME (a built-in random-weight recipe)."""


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `info` subcommand to the root parser."""
    p = subparsers.add_parser("info", help=HELP, description=DESCRIPTION)
    p.add_argument("model", metavar="MODEL", help="HF directory | file.gguf | smollm2-135m | "
                                                  "config:NAME")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object to stdout instead of a table")
    p.add_argument("--max-tp", type=int, default=TP_MAX, metavar="R",
                   help=f"largest tensor-parallel degree to consider (default {TP_MAX})")
    p.set_defaults(func=run)


def _param_counts(model: Any) -> dict[str, int]:
    """Unique parameter counts: total, embedding, lm_head (0 when tied to the embedding)."""
    total = sum(p.numel() for p in model.parameters())  # parameters() skips tied duplicates
    emb = model.get_input_embeddings().weight
    out_emb = model.get_output_embeddings()
    head = out_emb.weight if out_emb is not None else None
    tied = head is None or head is emb
    return {"total": int(total), "embedding": int(emb.numel()),
            "lm_head": 0 if tied else int(head.numel())}


def _checkpoint_bytes(source: Any) -> int | None:
    if source.kind in ("gguf", "alias"):
        return (source.path / source.gguf_file).stat().st_size
    if source.kind == "hf-dir" and source.weights:
        return sum(p.stat().st_size for p in source.path.glob("*.safetensors"))
    return None


def _gguf_storage(source: Any) -> dict[str, Any] | None:
    """A GGUF checkpoint's linear weights (2-D ``blk.*.weight`` tensors) by ggml type, and the
    flags that run them as stored when they are all Q8_0 (int8 with 32-column groups, the
    same values as the dequantized model); None for another source."""
    from collections import Counter

    from models import sources

    if source.kind not in ("gguf", "alias"):
        return None
    types = sources.gguf_tensor_types(source.path / source.gguf_file)
    linear = Counter(t for name, (t, dims) in types.items() if name.startswith("blk.") and dims == 2)
    return {"linear_weights": dict(linear),
            "run_as_stored": "--weights int8 --weight-group 32" if set(linear) == {"Q8_0"} else None}


def describe(arg: str, max_tp: int = TP_MAX) -> dict[str, Any]:
    """Everything ``amk info`` prints, as one JSON-serialisable dict. Raises AmkError."""
    from ground.errors import AmkError
    from models import sources

    source = sources.parse_model_arg(arg)
    config = sources.load_config(source)
    report = features.check_support(config)
    n_heads = int(config.num_attention_heads)
    n_kv = int(getattr(config, "num_key_value_heads", None) or n_heads)
    try:
        head_dim = features.head_dim(config)
    except (TypeError, ZeroDivisionError):
        head_dim = None
    layers = int(config.num_hidden_layers)

    params: dict[str, int] | None = None
    params_error = None
    try:
        params = _param_counts(sources.load_model(source, weights=False))
    except AmkError as err:  # e.g. a model type transformers cannot build
        params_error = str(err)

    info: dict[str, Any] = {
        "model": arg,
        "source": source.describe(),
        "source_kind": source.kind,
        "family": report.family,
        "model_type": report.model_type,
        "architectures": list(getattr(config, "architectures", None) or []),
        "layers": layers,
        "hidden_size": int(config.hidden_size),
        "intermediate_size": getattr(config, "intermediate_size", None),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "vocab_size": int(config.vocab_size),
        "max_position_embeddings": getattr(config, "max_position_embeddings", None),
        "rms_norm_eps": getattr(config, "rms_norm_eps", None),
        "rope": features.rope_parameters(config),
        "tie_word_embeddings": bool(getattr(config, "tie_word_embeddings", False)),
        "qkv_bias": report.model_type == "qwen2" or bool(getattr(config, "attention_bias", False)),
        "qk_norm": report.model_type == "qwen3",
        "parameters": params,
        "parameters_error": params_error,
        "weight_bytes": {k: params["total"] * b for k, b in DTYPE_BYTES.items()} if params else None,
        "kv_cache_bytes_per_token": (
            {k: 2 * layers * n_kv * head_dim * b for k, b in DTYPE_BYTES.items()}
            if head_dim else None),
        "checkpoint_bytes": _checkpoint_bytes(source),
        "gguf_storage": _gguf_storage(source),
        "has_weights": source.weights,
        "supported": report.ok,
        "unsupported": [{"feature": u.feature, "field": u.field, "value": u.value, "why": u.why}
                        for u in report.unsupported],
        "tp_degrees": features.tp_degrees(n_heads, n_kv, max_tp) if n_heads > 0 and n_kv > 0 else [],
        "tp_note": "degrees that split query and KV heads evenly; amk also lowers uneven "
                   "splits (e.g. 5 heads on one rank, 4 on another) at some load imbalance",
    }
    return info


def _fmt_count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit} ({n:,})"
    return f"{n:,}"


def _fmt_bytes(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _print_human(info: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(highlight=False)
    t = Table(title=f"amk info {escape(info['model'])}", title_justify="left", show_header=False)
    t.add_column("field", style="bold")
    t.add_column("value", overflow="fold")

    def row(k: str, v: Any) -> None:
        t.add_row(k, escape(str(v)))

    row("source", info["source"])
    row("family", f"{info['family'] or 'unsupported'} (model_type {info['model_type'] or '?'})")
    row("layers", info["layers"])
    row("hidden size", info["hidden_size"])
    row("intermediate size", info["intermediate_size"])
    group = info["num_attention_heads"] // max(info["num_key_value_heads"], 1)
    row("query heads", info["num_attention_heads"])
    row("KV heads", f"{info['num_key_value_heads']} (GQA group {group})")
    row("head dim", info["head_dim"])
    row("vocabulary", info["vocab_size"])
    row("max positions", info["max_position_embeddings"])
    rope = info["rope"]
    extra = {k: v for k, v in rope.items() if k not in ("rope_type", "rope_theta")}
    row("RoPE", f"{rope['rope_type']}, theta {rope['rope_theta']:g}"
        + (f", {extra}" if extra else ""))
    eps = info["rms_norm_eps"]
    row("RMSNorm eps", f"{eps:.3g}" if isinstance(eps, float) else eps)
    row("LM head", "tied to the embedding" if info["tie_word_embeddings"] else "untied")
    row("qkv bias / q,k norm", f"{'yes' if info['qkv_bias'] else 'no'} / "
                               f"{'yes' if info['qk_norm'] else 'no'}")
    p = info["parameters"]
    if p:
        row("parameters", _fmt_count(p["total"]))
        row("  embedding / lm_head", f"{_fmt_count(p['embedding'])} / "
                                     f"{_fmt_count(p['lm_head']) if p['lm_head'] else 'tied'}")
        row("weight bytes", ", ".join(f"{k} {_fmt_bytes(v)}" for k, v in info["weight_bytes"].items()))
    else:
        row("parameters", f"unknown: {info['parameters_error']}")
    if info["kv_cache_bytes_per_token"]:
        row("KV cache per token", ", ".join(
            f"{k} {_fmt_bytes(v)}" for k, v in info["kv_cache_bytes_per_token"].items()))
    if info["checkpoint_bytes"] is not None:
        row("checkpoint on disk", _fmt_bytes(info["checkpoint_bytes"]))
    elif not info["has_weights"]:
        row("checkpoint on disk", "none: config.json only (info and compile work from it; "
                                  "generate needs the weights)")
    g = info.get("gguf_storage")
    if g:
        row("linear weights stored", ", ".join(f"{k} x {v}" for k, v in sorted(g["linear_weights"].items())))
        if g["run_as_stored"]:
            row("run as stored", f"{g['run_as_stored']} (the file's int8 values and scales)")
    if info["supported"]:
        t.add_row("supported", "[green]yes[/]")
    else:
        t.add_row("supported", "[red]no[/]")
        for u in info["unsupported"]:
            t.add_row("  unsupported", escape(f"{u['feature']} ({u['field']}={u['value']!r}): "
                                              f"{u['why']}"))
    row("even TP degrees", ", ".join(map(str, info["tp_degrees"])) or "none")
    console.print(t)
    console.print(f"TP: {info['tp_note']}.")


def run(args: argparse.Namespace) -> int:
    """Run `amk info`; returns the exit code (see the module docstring)."""
    from ground.errors import AmkError

    if args.max_tp < 1:
        raise AmkError(f"--max-tp must be >= 1, got {args.max_tp}")
    info = describe(args.model, args.max_tp)
    if args.json:
        from amk.output import emit_json

        emit_json(info)
    else:
        _print_human(info)
    return 0
