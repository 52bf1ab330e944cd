"""The CLI's command modules (one per ``amk`` subcommand) and the arguments they share."""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
import traceback
from pathlib import Path
from typing import Any

from ground.errors import AmkError

_SHAPE = re.compile(r"^([A-Za-z_]\w*)=(\d+(?:[,x]\d+)*)$")


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


# ----------------------------------------------------------------------------- a torch.distributed function
# (amk dist FILE.py:FUNC and amk search FILE.py:FUNC)
def is_function_arg(text: str | None) -> bool:
    """Whether a command's first argument names a function, ``FILE.py:FUNC`` (a ``.py`` path,
    a colon, a name), rather than a model."""
    if not text:
        return False
    path, sep, func = text.rpartition(":")
    return bool(sep) and path.endswith(".py") and bool(func)


def parse_target(text: str) -> tuple[Path, str]:
    """``FILE.py:FUNC`` -> (path, function name); AmkError (exit 2) for another form or a
    missing file."""
    path, sep, func = text.rpartition(":")
    if not sep or not path or not func:
        raise AmkError(f"{text}: expected FILE.py:FUNC, e.g. examples/distributed/allgather_matmul.py:allgather_matmul")
    if not func.isidentifier():
        raise AmkError(f"{text}: {func!r} is not a Python function name")
    p = Path(path)
    if p.suffix != ".py":
        raise AmkError(f"{text}: {path} is not a .py file")
    if not p.is_file():
        raise AmkError(f"{path}: no such file")
    return p, func


def parse_shapes(items: list[str]) -> dict[str, tuple[int, ...]]:
    """``["x=64,128", "w=128x32"]`` -> ``{"x": (64, 128), "w": (128, 32)}``; AmkError (exit 2)
    naming the bad item."""
    out: dict[str, tuple[int, ...]] = {}
    for item in items:
        m = _SHAPE.match(item.strip())
        if not m:
            raise AmkError(f"--shape {item}: expected NAME=DIMS with positive integers, e.g. x=64,128")
        name, dims = m.group(1), tuple(int(d) for d in re.split(r"[,x]", m.group(2)))
        if name in out:
            raise AmkError(f"--shape {item}: {name} is given twice")
        if any(d < 1 for d in dims):
            raise AmkError(f"--shape {item}: dimensions must be >= 1")
        out[name] = dims
    return out


def parse_world(text: str) -> int:
    try:
        world = int(text)
    except ValueError:
        raise AmkError(f"--world {text}: expected an integer >= 1") from None
    if world < 1:
        raise AmkError(f"--world {text}: expected an integer >= 1")
    return world


def load_function(path: Path, func: str) -> Any:
    """Import ``path`` as a module (its directory first on sys.path, as ``python FILE`` would
    have it) and return its ``func``. AmkError (exit 2) when the import fails (with the file's
    line) or ``func`` is not a function of it."""
    name = "amk_dist_" + re.sub(r"\W", "_", path.stem)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise AmkError(f"{path}: cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    directory = str(path.resolve().parent)
    added = directory not in sys.path
    if added:
        sys.path.insert(0, directory)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:
        raise AmkError(f"{path}:{e.lineno}:{e.offset or 0}: syntax error: {e.msg}") from None
    except Exception as e:
        frames = [f for f in traceback.extract_tb(e.__traceback__) if Path(f.filename).resolve() == path.resolve()]
        line = f":{frames[-1].lineno}" if frames else ""
        raise AmkError(f"{path}{line}: importing it failed: {type(e).__name__}: {e}".splitlines()[0]) from None
    finally:
        if added:
            sys.path.remove(directory)
    fn = getattr(module, func, None)
    if fn is None:
        funcs = sorted(k for k, v in vars(module).items() if callable(v) and getattr(v, "__module__", None) == name)
        raise AmkError(f"{path}: no function {func!r} (its functions: {', '.join(funcs) or 'none'})")
    if not callable(fn):
        raise AmkError(f"{path}: {func} is a {type(fn).__name__}, not a function")
    return fn


def capture_function(path: Path, func: str, world: str | int, shape_items: list[str], dtype: str) -> Any:
    """Function ``func`` of ``path`` (``parse_target``'s pair) captured at world size ``world``
    with the ``--shape`` items (rank-local ``NAME=DIMS``) and ``dtype``: the
    models.capture.Captured (the pattern, its operands, where each step is). AmkError (exit
    code 2) for a bad argument, a missing shape or a function amk dist does not lower (the op
    and its file:line)."""
    from models.capture import capture

    world = parse_world(str(world))
    shapes = parse_shapes(shape_items)
    if not shapes:
        raise AmkError(f"{path}:{func}: give the rank-local shape of each tensor parameter with --shape NAME=DIMS, "
                       "e.g. --shape x=64,128")
    return capture(load_function(path, func), world, shapes, dtype)

