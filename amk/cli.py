"""The ``amk`` command line: a root parser and one module per subcommand.

Each module in ``COMMANDS`` lives in ``amk/commands/`` and defines
``register(subparsers)``, which adds its parser and sets ``func`` to a callable
``run(args) -> int`` (the exit code). User mistakes raise ``AmkError``; they are printed
on one line and turned into the error's exit code, never a traceback.

Output convention (amk/output.py): ``--json`` is a flag; with it stdout carries
only the command's one JSON object (also on failure: ``{"ok": false, "error": ...}``) and
everything else goes to stderr. Result files are written through ``ground.files``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from amk import __version__
from ground.errors import AmkError

# Subcommand modules, in the order `amk --help` lists them.
COMMANDS = ["doctor", "info", "compile", "generate", "validate", "validate_corpus", "edit", "run", "bench",
            "search", "tune", "profile", "dist", "mcp", "ui"]


def _module_of(command: str) -> str | None:
    """The module in ``COMMANDS`` that registers subcommand ``command`` (``validate-corpus``
    lives in ``validate_corpus``), or None."""
    name = command.replace("-", "_")
    return name if name in COMMANDS and "_" not in command else None


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The root parser with every subcommand, or with only the module ``only`` registered
    (``main`` does that when the first argument names a subcommand: importing every command
    module costs ~50 ms, a large share of a quick command such as ``amk validate``)."""
    parser = argparse.ArgumentParser(
        prog="amk",
        description="Compile HF decoder models into validated persistent multi-GPU megakernels.",
    )
    parser.add_argument("--version", action="version", version=f"amk {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS if only is None else [only]:
        importlib.import_module(f"amk.commands.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``), run the subcommand, return its exit code:
    0 success, 1 ran and the result is a failure, 2 bad input (argparse errors exit 2 too)."""
    if argv is None:
        argv = sys.argv[1:]
    parser = build_parser(_module_of(argv[0]) if argv else None)
    args, extra = parser.parse_known_args(argv)
    if extra:
        hint = ""
        if getattr(args, "json", None) is True:  # e.g. the old `amk bench ... --json FILE`
            hint = ("; --json takes no value: it prints the JSON object to stdout "
                    "(amk bench writes a result file with --out FILE)")
        parser.error(f"unrecognized arguments: {' '.join(extra)}{hint}")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from amk import output

    if not output.json_mode(args):
        return _run(args)[0]
    with output.json_stdout():
        code, error = _run(args)
        # One object on stdout whatever happened; ranks other than 0 of a multi-GPU run
        # stay silent (rank 0 speaks for them).
        if not output.emitted() and code != 0 and os.environ.get("RANK", "0") == "0":
            output.emit_json({"ok": False, "error": error or f"exit code {code}",
                              "exit_code": code})
        return code


def _run(args: argparse.Namespace) -> tuple[int, str | None]:
    """``args.func(args)`` with AmkError and Ctrl-C turned into one line on stderr; returns
    (exit code, the error message or None)."""
    try:
        return int(args.func(args) or 0), None
    except AmkError as err:
        from rich.console import Console
        from rich.markup import escape

        Console(stderr=True, highlight=False, soft_wrap=True).print(
            f"[bold red]error:[/] {escape(str(err))}"
        )
        return err.exit_code, str(err)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130, "interrupted"
