"""``amk mcp [--workdir DIR]``: the MCP server of amk's schedule tools, on stdio.

The tools (amk/mcp_server.py): lower, validate, edit, summary, slice, run_sim, bench,
search_results. Every path a tool takes is relative to DIR (default ``./amk-mcp``, created
if missing); one escaping it is refused. The ``mcp`` SDK is imported only when this command
runs. Exit code 2 when DIR cannot be created or the SDK is missing.
"""

from __future__ import annotations

import argparse

from ground.errors import AmkError

HELP = "serve amk's schedule tools over MCP (stdio)"
DESCRIPTION = """\
An MCP server (stdio transport) for agents that propose schedules: lower a model, validate
text IR, apply typed edits (validated before anything runs), summary and slices, a few sim
decode steps against the HF reference, bench on a GPU, search results. Files are read and
written only under --workdir."""


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `mcp` subcommand to the root parser."""
    p = subparsers.add_parser("mcp", help=HELP, description=DESCRIPTION)
    p.add_argument("--workdir", metavar="DIR", default="amk-mcp",
                   help="the only directory the tools read and write (default ./amk-mcp)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from amk.output import check_writable_dir

    check_writable_dir(args.workdir, "amk mcp --workdir")
    try:
        import mcp  # noqa: F401
    except ImportError as e:
        raise AmkError(f"amk mcp needs the mcp package (pip install mcp): {e}") from None
    from amk.mcp_server import serve

    serve(args.workdir)
    return 0
