"""Run a named benchmark suite from bench/suites/NAME.json: one device call, results under one folder.

Usage:
    python bench/suite.py NAME [--out DIR] [--dry-run]
    python bench/suite.py --list

On a lent GPU machine: ``source scripts/device_env.sh && python3 bench/suite.py NAME`` (the
carried wheels installed, multicast off). Results go to ``--out``; by default
``$OUT/<gpu>/`` when ``$OUT`` is set (the device call's output folder, copied back into
``bench/results/<gpu>/``), else ``bench/results/<gpu>/``. ``<gpu>`` names the visible GPUs:
``h100``, ``h200``, ``h200x2``, ``h200x4``, ...

A suite file is a JSON object::

    {"description": "what it measures and on which machine",
     "gpus": 1,                                  # GPUs the suite needs (at least)
     "steps": [{"name": "llama-3.2-1b", "timeout_s": 560,
                "run": "amk bench config:llama-3.2-1b ... --out {out}/llama-3.2-1b-tp1.json",
                "env": {"CUDA_VISIBLE_DEVICES": "0,1"}}]}   # env optional

``run`` is one command line: ``amk ...`` (``python -m amk``), ``bench/NAME.py ...`` or
``pytest ...`` (``python -m pytest``); ``{out}`` is the result folder. The steps run in order,
each killed (with its process group) at ``timeout_s``; the timeouts add up to at most
``BUDGET_S`` so that a suite fits one device call. After each step, every `amk bench` result
it wrote gets the ``date`` (UTC) and, where git knows it, the ``commit`` it was measured at,
which bench/report.py prints. ``{out}/suite-NAME.json`` records each step's command, exit
code and seconds. Exit code: 0 when every step exited 0, 1 otherwise, 2 for a bad suite or
argument.

``--dry-run`` runs nothing: it parses every step's command with the parser of the program it
calls (``amk bench`` also checks its config file, its block flags and the model's split over
``--tp`` ranks, all from configs, no GPU) and prints the commands.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python bench/suite.py` from a source checkout
    sys.path.insert(0, str(ROOT))

from ground.errors import AmkError  # noqa: E402
from ground.files import atomic_write_json  # noqa: E402

SUITES = ROOT / "bench" / "suites"
BUDGET_S = 580  # one device call runs at most 600 s; leave room for start-up
# NVLink multicast stays off on the shared machines (docs/gpu-testing.md)
DEVICE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
              "NVSHMEM_DISABLE_NVLS": "1", "PYTHONUNBUFFERED": "1"}


@dataclass
class Step:
    """One command of a suite: ``argv`` as written in the suite (``{out}`` not yet filled)."""

    name: str
    argv: list[str]
    timeout_s: float
    env: dict[str, str] = field(default_factory=dict)

    def shown(self, out: str) -> str:
        """The step's command line as written, ``{out}`` filled in."""
        return shlex.join(a.replace("{out}", out) for a in self.argv)

    def command(self, out: str) -> list[str]:
        """The argv to execute, ``{out}`` replaced by ``out`` and the program resolved."""
        args = [a.replace("{out}", out) for a in self.argv]
        prog, rest = args[0], args[1:]
        if prog == "amk":
            return [sys.executable, "-m", "amk", *rest]
        if prog == "pytest":
            return [sys.executable, "-m", "pytest", *rest]
        return [sys.executable, str(ROOT / prog), *rest]


@dataclass
class Suite:
    name: str
    description: str
    gpus: int
    steps: list[Step]


def suite_names(suites: Path = SUITES) -> list[str]:
    return sorted(p.stem for p in suites.glob("*.json"))


def load_suite(name: str, suites: Path = SUITES) -> Suite:
    """Read and check ``suites/NAME.json``.

    Raises:
        AmkError: unknown suite, unreadable JSON, a missing or mistyped field, a program other
            than amk / bench/*.py / pytest, or timeouts over BUDGET_S in total.
    """
    path = suites / f"{name}.json"
    if not path.is_file():
        raise AmkError(f"no suite {name!r} in {suites} (suites: {', '.join(suite_names(suites)) or 'none'})")
    try:
        obj = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise AmkError(f"{path}: not readable JSON ({err})") from None

    def need(cond: bool, what: str):
        if not cond:
            raise AmkError(f"{path}: {what}")

    need(isinstance(obj, dict) and set(obj) <= {"description", "gpus", "steps"},
         'expected an object with "description", "gpus" and "steps"')
    need(isinstance(obj.get("description"), str) and obj["description"], '"description": a non-empty string')
    need(isinstance(obj.get("gpus"), int) and obj["gpus"] >= 1, '"gpus": a positive integer')
    need(isinstance(obj.get("steps"), list) and obj["steps"], '"steps": a non-empty list')
    steps, names = [], set()
    for i, s in enumerate(obj["steps"]):
        where = f"steps[{i}]"
        need(isinstance(s, dict) and {"name", "run", "timeout_s"} <= set(s) <= {"name", "run", "timeout_s", "env"},
             f'{where}: expected "name", "run", "timeout_s" and optionally "env"')
        need(isinstance(s["name"], str) and re.fullmatch(r"[a-z0-9][a-z0-9._-]*", s["name"]) is not None
             and s["name"] not in names, f"{where}: \"name\" must be a unique lower-case word")
        names.add(s["name"])
        need(isinstance(s["timeout_s"], (int, float)) and s["timeout_s"] > 0, f'{where}: "timeout_s" > 0')
        env = s.get("env", {})
        need(isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()),
             f'{where}: "env" maps names to strings')
        try:
            argv = shlex.split(s["run"]) if isinstance(s["run"], str) else []
        except ValueError as err:
            raise AmkError(f"{path}: {where}: \"run\" does not parse as a command line ({err})") from None
        need(bool(argv), f'{where}: "run" must be a command line')
        prog = argv[0]
        need(prog in ("amk", "pytest") or re.fullmatch(r"bench/[a-z0-9_]+\.py", prog) is not None,
             f"{where}: runs {prog!r}; a step runs amk, pytest or a bench/*.py script")
        need(prog in ("amk", "pytest") or (ROOT / prog).is_file(), f"{where}: {prog} does not exist")
        steps.append(Step(s["name"], argv, float(s["timeout_s"]), dict(env)))
    total = sum(s.timeout_s for s in steps)
    need(total <= BUDGET_S, f"step timeouts add up to {total:.0f} s, over one device call's {BUDGET_S} s")
    return Suite(name, obj["description"], obj["gpus"], steps)


def gpu_tag() -> str:
    """``h100``, ``h200x2``, ...: the visible GPUs' chip (lower case) and count; raises AmkError
    without a CUDA GPU."""
    try:
        import torch
    except ImportError:
        torch = None
    if torch is None or not torch.cuda.is_available():
        raise AmkError("no CUDA GPU is visible: pass --out DIR (or --dry-run)")
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    chip = re.search(r"\b([A-Z]\d{2,4}[A-Z]?)\b", names[0])
    tag = chip.group(1).lower() if chip else re.sub(r"[^a-z0-9]+", "-", names[0].lower()).strip("-")
    return tag if len(names) == 1 else f"{tag}x{len(names)}"


class _Parsed(Exception):
    def __init__(self, namespace):
        self.namespace = namespace


def parse_step(step: Step, out: str = "OUT") -> argparse.Namespace | None:
    """Parse ``step``'s command with its program's own argparse parser, running nothing.

    ``amk bench`` steps are also checked the way `amk bench` checks them before touching a
    GPU: the --config file and the knob flags make a valid AmkConfig (lowering.config) at
    ``--tp`` ranks and the model's shapes split over them. Returns the parsed namespace (None for
    pytest steps, whose test files must exist). Raises AmkError naming the step.
    """
    argv = [a.replace("{out}", out) for a in step.argv]
    prog, rest = argv[0], argv[1:]
    try:
        if prog == "pytest":
            files = [a.split("::")[0] for a in rest if a.endswith(".py") or ".py::" in a]
            missing = [f for f in files if not (ROOT / f).is_file()]
            if missing:
                raise AmkError(f"no test file {', '.join(missing)}")
            return None
        if prog == "amk":
            from amk.cli import build_parser

            ns = _parse_quietly(lambda: build_parser().parse_args(rest))
            if ns.command == "bench":
                _check_bench(ns)
            return ns
        return _parse_script(ROOT / prog, rest)
    except AmkError as err:
        raise AmkError(f"step {step.name!r} of the suite: {err}") from None


def _parse_quietly(fn):
    """Run an argparse call; its usage error (SystemExit 2, message on stderr) becomes AmkError."""
    import contextlib
    import io

    buf = io.StringIO()
    try:
        with contextlib.redirect_stderr(buf):
            return fn()
    except SystemExit as err:
        msg = buf.getvalue().strip().splitlines()
        raise AmkError(msg[-1] if msg else f"argument parsing exited with {err.code}") from None


def _parse_script(path: Path, argv: list[str]) -> argparse.Namespace:
    """Import a bench script and run its ``main(argv)`` until its parser returns: the parse
    raises _Parsed with the namespace, so nothing after it runs."""
    spec = importlib.util.spec_from_file_location(f"_suite_{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the script loads
    spec.loader.exec_module(mod)
    if not hasattr(mod, "main"):
        raise AmkError(f"{path.name} has no main(argv)")
    orig = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise _Parsed(orig(self, args, namespace))

    argparse.ArgumentParser.parse_args = parse_then_stop
    try:
        _parse_quietly(lambda: mod.main(argv))
    except _Parsed as parsed:
        return parsed.namespace
    finally:
        argparse.ArgumentParser.parse_args = orig
    raise AmkError(f"{path.name}'s main returned without parsing its arguments")


def _check_bench(ns: argparse.Namespace):
    """`amk bench`'s own checks that need no GPU: the config file and knob flags (as `amk
    bench` reads them, --config relative to the repository), the workers and the split."""
    from amk.bench import bench_config
    from amk.checks import check_counts, check_model_split

    if ns.config:
        ns.config = str(ROOT / ns.config)
    cfg = bench_config(ns, 1)
    check_counts(ns.tp, getattr(ns, "workers", None))
    check_model_split(ns.model, ns.tp, cfg.lowering)
    if not ns.out:
        raise AmkError("amk bench writes no result file: add --out {out}/NAME.json")


def git_commit() -> str | None:
    """HEAD's hash, with ``-dirty`` when tracked files differ from it; None without git."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("-dirty" if dirty else "")


def stamp_results(argv: list[str], date: str, commit: str | None):
    """Add ``date`` / ``commit`` to each `amk bench` result a step wrote with ``--out FILE``."""
    for i, a in enumerate(argv[:-1]):
        if a != "--out":
            continue
        path = Path(argv[i + 1])
        try:
            obj = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(obj, dict) and str(obj.get("command", "")).startswith("amk bench"):
            obj.setdefault("date", date)
            if commit:
                obj.setdefault("commit", commit)
            atomic_write_json(path, obj)


def run_step(step: Step, out: str) -> tuple[int, float, bool]:
    """Run one step in its own process group; returns (exit code, seconds, timed out)."""
    argv = step.command(out)
    env = {**os.environ, **DEVICE_ENV, **step.env}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    print(f"=== {step.name}: {step.shown(out)}", flush=True)
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, start_new_session=True)
    try:
        rc, timed_out = proc.wait(timeout=step.timeout_s), False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        rc, timed_out = proc.wait(), True
    secs = time.monotonic() - t0
    print(f"=== {step.name}: exit {rc}{' (timed out)' if timed_out else ''} after {secs:.0f} s", flush=True)
    return rc, secs, timed_out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("name", nargs="?", help="suite name (a file bench/suites/NAME.json)")
    ap.add_argument("--out", help="result folder (default: $OUT/<gpu> or bench/results/<gpu>)")
    ap.add_argument("--dry-run", action="store_true", help="parse every step's command, run nothing")
    ap.add_argument("--list", action="store_true", help="list the suites and what they measure")
    ap.add_argument("--suites", type=Path, default=SUITES, help="suite folder (default: bench/suites)")
    args = ap.parse_args(argv)
    try:
        if args.list:
            for n in suite_names(args.suites):
                s = load_suite(n, args.suites)
                print(f"{n}: {s.description} ({len(s.steps)} steps, {sum(t.timeout_s for t in s.steps):.0f} s at most)")
            return 0
        if not args.name:
            raise AmkError(f"name a suite: {', '.join(suite_names(args.suites))}")
        suite = load_suite(args.name, args.suites)
        if args.dry_run:
            out = args.out or "bench/results/<gpu>"
            for step in suite.steps:
                parse_step(step, out)
                print(f"{step.name} ({step.timeout_s:.0f} s): {step.shown(out)}")
            return 0
        out = Path(args.out) if args.out else (
            Path(os.environ["OUT"]) / gpu_tag() if os.environ.get("OUT") else ROOT / "bench" / "results" / gpu_tag())
        out.mkdir(parents=True, exist_ok=True)
    except AmkError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    date = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    commit = git_commit()
    record = {"suite": suite.name, "description": suite.description, "date": date, "commit": commit,
              "out": str(out), "steps": []}
    failed = 0
    for step in suite.steps:
        rc, secs, timed_out = run_step(step, str(out))
        stamp_results(step.command(str(out)), date, commit)
        record["steps"].append({"name": step.name, "run": step.shown(str(out)),
                                "exit_code": rc, "seconds": round(secs, 1), "timed_out": timed_out})
        failed += rc != 0
        atomic_write_json(out / f"suite-{suite.name}.json", record)
    print(f"suite {suite.name}: {len(suite.steps) - failed} of {len(suite.steps)} steps exited 0; "
          f"results in {out}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
