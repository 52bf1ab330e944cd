"""``amk ui [DIR]``: a local web app over search, tune and compile directories.

    amk ui [DIR] [--port P] [--host H] [--db DIR]

Serves http://127.0.0.1:P/ (default port 8765; 0 picks a free one): the runs under DIR (default
the current directory), each run's trials and latency, the tuning database, a schedule's queues,
stages, critical path and simulated trace, a rejected schedule's witness in its text IR, the
proposals an ``amk search --approve`` holds for review, and an edit editor that validates on
save (docs/ui.md). Only files under DIR are served. It binds the loopback address unless
``--host`` is given (then a warning: anyone who reaches that address can approve proposals and
write edited schedules under DIR). Exit code 2 when DIR is not a directory or fastapi/uvicorn
are missing.
"""

from __future__ import annotations

import argparse
import sys

from ground.errors import AmkError

HELP = "local web app over search/tune runs and schedules (trials, traces, witnesses, review)"


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("ui", help=HELP, description=__doc__.split("\n\n")[0])
    p.add_argument("dir", metavar="DIR", nargs="?", default=".",
                   help="the directory served: search / tune runs, compiled schedules (default .)")
    p.add_argument("--port", type=int, default=8765, help="TCP port (default 8765; 0: a free one)")
    p.add_argument("--host", default=None,
                   help="address to bind (default 127.0.0.1; another one is reachable by others: a warning)")
    p.add_argument("--db", metavar="DIR", default=None,
                   help="the tuning database listed beside tune runs (default as amk tune's)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    if not Path(args.dir).is_dir():
        raise AmkError(f"{args.dir}: not a directory")
    if not 0 <= args.port <= 65535:
        raise AmkError(f"--port must be in 0..65535, got {args.port}")
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise AmkError(f"amk ui needs fastapi and uvicorn (pip install fastapi uvicorn): {e}") from None
    host = args.host or "127.0.0.1"
    if args.host is not None and args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: amk ui binds {args.host}: anyone who can reach it can read the runs under "
              f"{args.dir}, approve proposals and write edited schedules there", file=sys.stderr)
    from amk.webui import serve

    def ready(url: str) -> None:
        print(f"amk ui: serving {Path(args.dir).resolve()} at {url} (Ctrl-C stops)", file=sys.stderr,
              flush=True)

    try:
        serve(args.dir, host, args.port, args.db, ready=ready)
    except OSError as e:
        raise AmkError(f"amk ui: cannot listen on {host}:{args.port}: {e.strerror or e}") from None
    return 0
