"""The ``amk`` command line: a root parser and one module per subcommand.

Each module in ``COMMANDS`` lives in ``amk/commands/`` and defines
``register(subparsers)``, which adds its parser and sets ``func`` to a callable
``run(args) -> int`` (the exit code). User mistakes raise ``AmkError``; they are printed
on one line and turned into the error's exit code, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from amk import __version__
from ground.errors import AmkError

# Subcommand modules, in the order `amk --help` lists them.
COMMANDS = ["doctor", "info", "compile", "generate", "validate", "validate_corpus", "run", "bench", "search"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="amk",
        description="Compile HF decoder models into validated persistent multi-GPU megakernels.",
    )
    parser.add_argument("--version", action="version", version=f"amk {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"amk.commands.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except AmkError as err:
        from rich.console import Console
        from rich.markup import escape

        Console(stderr=True, highlight=False, soft_wrap=True).print(
            f"[bold red]error:[/] {escape(str(err))}"
        )
        return err.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
