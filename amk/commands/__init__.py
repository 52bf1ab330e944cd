"""The CLI's command modules (one per ``amk`` subcommand) and the arguments they share."""

from __future__ import annotations

import argparse


def add_run_args(p: argparse.ArgumentParser, *, trials: str, minutes: str, out: str, resume: str) -> None:
    """The arguments of a resumable run over a model (``amk search``, ``amk tune``): MODEL
    (omitted with --resume), --tp, the budget (--trials N, --minutes M), its directory (--out
    DIR) and --resume DIR; the help texts name what differs between the commands."""
    p.add_argument("model", metavar="MODEL", nargs="?",
                   help="HF directory | file.gguf | smollm2-135m | config:NAME (omit with --resume)")
    p.add_argument("--tp", type=int, default=None, metavar="R", help="tensor-parallel ranks (1)")
    p.add_argument("--trials", type=int, default=None, metavar="N", help=trials)
    p.add_argument("--minutes", type=float, default=None, metavar="M", help=minutes)
    p.add_argument("--out", default=None, metavar="DIR", help=out)
    p.add_argument("--resume", default=None, metavar="DIR", help=resume)


def add_llm_args(p: argparse.ArgumentParser, *, instead: str) -> None:
    """The options of an LLM proposer (``amk search``, ``amk tune``): --llm-model,
    --llm-fallback and --llm-max-failures; ``instead`` names what --llm-fallback continues
    with."""
    p.add_argument("--llm-model", default=None, metavar="ID",
                   help="model id for --proposer llm (default: $AMK_LLM_MODEL or claude-sonnet-5-5)")
    p.add_argument("--llm-fallback", action="store_true", default=None,
                   help=f"--proposer llm: when LLM requests keep failing, continue with {instead} "
                        "instead of stopping")
    p.add_argument("--llm-max-failures", type=int, default=None, metavar="N",
                   help="--proposer llm: stop after N failed LLM requests in a row, unless "
                        "--llm-fallback (default 3)")
