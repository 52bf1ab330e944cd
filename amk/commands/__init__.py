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
