"""``amk validate FILE [--json]``: statically check a schedule program.

FILE is the text form (``.amk``) or the JSON form (``.json``) of a ScheduleProgram
(ir/io.py). The validator (validator/, docs/validator.md) checks structure, deadlock and
races and prints each error with its witness, prefixed with the place of the first task it
names: ``file:line:column`` in the text form, ``file: tasks[i]`` in JSON.

Exit codes: 0 accepted, 1 rejected, 2 unreadable or unparsable input (the message carries
file:line:column). ``--json`` prints one JSON object: ``ok``, ``errors`` (each with
``class``, ``message``, ``tasks``, ``buffers``, ``witness`` and, when it names a task,
``location``), ``stats`` and ``file``; on
unparsable input it prints ``{"ok": false, "input_error": ...}`` and exits 2.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from typing import Any, Callable

from ground.errors import AmkError

LARGE = 10_000  # tasks: show stage progress for programs at least this big


HELP = "statically check a schedule for deadlocks and races"
DESCRIPTION = """\
Check a schedule program (text .amk or .json): structure, deadlock (cycle witness, exact
simulation), races (coverage, unordered writes, remote delivery, cross-step reuse). Exit 0
accepted, 1 rejected, 2 unreadable input."""


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `validate` subcommand to the root parser."""
    p = subparsers.add_parser("validate", help=HELP, description=DESCRIPTION)
    p.add_argument("file", metavar="FILE", help="schedule program (.amk text or .json)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (ok, errors, stats) instead of text")
    p.add_argument("--backend", choices=("sim", "triton"), default=None,
                   help="check op support against this backend (default: the target's)")
    p.add_argument("--quiet", action="store_true",
                   help="print nothing on success (no stage progress either)")
    p.set_defaults(func=run)


def _jsonable(x: Any) -> Any:
    """Witnesses are plain data; numpy scalars (if any) become Python numbers."""
    if hasattr(x, "item") and callable(x.item):
        return x.item()
    return str(x)


def _locator(prog: Any, where: Callable[[int], str]) -> Callable[[Any], str | None]:
    """``locate(finding)``: the file position of the first task the finding names (for a
    DuplicateTask, its second occurrence), or None."""
    index: dict[Any, list[int]] = {}
    for i, t in enumerate(prog.tasks):
        try:
            index.setdefault(t.id, []).append(i)
        except TypeError:  # an unhashable id: the structure pass reports it
            continue

    def locate(f: Any) -> str | None:
        if not f.tasks:
            return None
        idx = index.get(f.tasks[0])
        if not idx:
            return None
        return where(idx[1] if f.cls == "DuplicateTask" and len(idx) > 1 else idx[0])

    return locate


def _keep_freed_memory() -> None:
    """Let glibc keep freed memory for reuse in this process.

    By default glibc hands every freed block over 128 KiB back to the kernel and maps fresh
    pages for the next one. The checks allocate and free numpy arrays of megabytes, so a
    fresh process spent ~0.1 s of the 61k-task Llama schedule in page faults (its first
    validation was that much slower than later ones in the same process). Raising the mmap
    and trim thresholds stops that; the process is short-lived, so holding the memory costs
    nothing. A no-op where there is no glibc ``mallopt``.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        libc.mallopt(-3, 64 << 20)  # M_MMAP_THRESHOLD: blocks up to 64 MiB from the heap
        libc.mallopt(-1, 256 << 20)  # M_TRIM_THRESHOLD: keep up to 256 MiB free at the top
    except (OSError, AttributeError):
        pass


def _single_blas_thread() -> None:
    """The checks do no linear algebra: in a fresh process (numpy not loaded yet) OpenBLAS
    starts one thread, not a pool that spins on the cores the validation needs (~80 ms of
    CPU at import on 2 cores). A setting the user made is kept."""
    if "numpy" not in sys.modules:
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


def run(args: argparse.Namespace) -> int:
    _keep_freed_memory()
    _single_blas_thread()
    # numpy and the checks load before the program: imports allocate many objects, and
    # with a big program in memory every collection they trigger would scan it
    from validator import validate

    t0 = time.perf_counter()
    # The program holds no garbage cycles. The cyclic collector stays off while it is built
    # (the first collection after the parse would walk its million new objects: 0.2 s for
    # 61k tasks) and the program stays out of its sight while it is checked and reported.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        try:
            from ir.io import load_program_located

            status = None
            if not args.json and not args.quiet:
                err = _console(stderr=True)
                if err.is_terminal:
                    from rich.markup import escape

                    status = err.status(f"loading {escape(args.file)}")
                    status.start()
            try:
                prog, where = load_program_located(args.file)
            finally:
                if status is not None:
                    status.stop()
        except AmkError as e:
            if args.json:
                from amk.output import emit_json

                emit_json({"ok": False, "file": args.file, "input_error": str(e),
                           "error": str(e), "exit_code": 2})
            raise AmkError(str(e), exit_code=2) from None
        load_s = time.perf_counter() - t0
        gc.freeze()
        try:
            return _check(args, prog, where, load_s, validate)
        finally:
            gc.unfreeze()
    finally:
        if gc_was_enabled:
            gc.enable()


def _console(stderr: bool = False) -> Any:
    """A rich Console for stdout or stderr (rich loads only when something is printed)."""
    from rich.console import Console

    return Console(stderr=stderr, highlight=False, soft_wrap=True)


def _check(args: argparse.Namespace, prog: Any, where: Callable[[int], str], load_s: float,
           validate: Callable) -> int:
    """Validate the loaded program and print the verdict; the exit code."""
    n_tasks = len(prog.tasks)
    show_progress = not args.json and not args.quiet and n_tasks >= LARGE
    if show_progress:
        from rich.markup import escape

        err = _console(stderr=True)
        err.print(f"validating {escape(args.file)}: {n_tasks} tasks, {prog.ranks} rank(s) x "
                  f"{prog.workers} worker(s) (loaded in {load_s:.2f} s)")
        t_val = time.perf_counter()

        def progress(stage: str) -> None:  # elapsed validation time as each stage starts
            err.print(f"  [dim]{time.perf_counter() - t_val:7.2f}s[/] {escape(stage)}")
    else:
        progress = None
    verdict = validate(prog, backend=args.backend, progress=progress)
    verdict.stats["load_s"] = round(load_s, 4)
    locate = _locator(prog, where) if not verdict.ok else None
    if args.json:
        from amk.output import emit_json

        obj = verdict.to_json()
        obj["file"] = args.file
        for f, e in zip(verdict.errors, obj["errors"]):
            loc = locate(f)
            if loc is not None:
                e["location"] = loc
        emit_json(obj, default=_jsonable)
        return 0 if verdict.ok else 1
    total = verdict.stats.get("total_s", 0.0)
    if verdict.ok and args.quiet:
        return 0
    from rich.markup import escape

    out = _console()
    if verdict.ok:
        out.print(f"[bold green]accepted[/] {escape(args.file)}: {n_tasks} tasks, "
                  f"{prog.ranks} rank(s) x {prog.workers} worker(s), validated in "
                  f"{total:.3f} s")
        return 0
    out.print(f"[bold red]rejected[/] {escape(args.file)}: {len(verdict.errors)} error(s)")
    for f in verdict.errors:
        loc = locate(f)
        head = f"{escape(loc)}: " if loc is not None else ""
        out.print(f"{head}[bold]{escape(f.cls)}[/]: {escape(f.message)}")
        if f.witness:
            text = json.dumps(f.witness, default=_jsonable, indent=1)
            if len(text) > 4000:
                text = text[:4000] + "\n ... (witness truncated; --json prints all of it)"
            out.print("  witness: " + escape(text).replace("\n", "\n  "))
    supp = verdict.stats.get("suppressed_findings")
    if supp:
        out.print(f"(more errors of these classes were not listed: {supp})")
    return 1
