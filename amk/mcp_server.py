"""The amk MCP server (``amk mcp``): schedule tools for an agent, over stdio.

An agent proposes schedules, not knob values: it lowers a model into a schedule, reads a
summary or a slice of it, proposes typed edits (ir/edits.py), and gets the validator's
verdict with witnesses before anything runs. Tools (each returns one JSON object; a
failure is ``{"ok": false, "error": "...", "error_type": "..."}``, never an exception
through the protocol):

* ``lower``: a model (``config:NAME`` or a path under the work directory) into
  ``NAME.amk`` in the work directory (lowered and validated from shapes alone);
* ``validate``: text IR in, verdict (error classes, tasks, witnesses) out;
* ``edit``: a schedule file + an edit list in, verdict out; the edited schedule is written
  only when the validator accepts it;
* ``summary`` / ``slice``: lowering/views.py (per-stage counts and predicted times, the
  critical path, idle time per worker; one layer, worker, stage or rank in the text IR);
* ``run_sim``: a few decode steps of an accepted schedule on the CPU simulator, logits
  compared with the HF reference of the model it was lowered from;
* ``bench``: ``amk bench`` on a GPU; without one, ``{"ok": false, "error_type": "no_gpu"}``;
* ``search_results``: the files of a search directory (``amk search --out``), or one of them.

Every path is relative to the work directory (``--workdir``, default ``./amk-mcp``); one
that escapes it (``..``, an absolute path, a symlink out) is refused. No tool reports the
environment or any key. The ``mcp`` SDK is imported only here (and only by ``amk mcp``).
"""

from __future__ import annotations

import functools
import json
import os
import traceback
from pathlib import Path
from typing import Any, Callable

from ground.errors import AmkError

#: the largest file ``search_results`` returns (characters); more is cut with a note
MAX_READ_CHARS = 64_000
#: decode steps ``run_sim`` may run
MAX_SIM_STEPS = 8
META_SUFFIX = ".meta.json"


class ToolError(Exception):
    """A tool's input is unusable; answered as ``{"ok": false, "error": message}``."""


class Workdir:
    """The one directory the server reads and writes; ``path(name)`` resolves a name in it."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, name: str, what: str = "path") -> Path:
        """``root / name`` resolved; ToolError if ``name`` is empty, absolute or resolves
        outside the work directory (``..``, a symlink out)."""
        if not isinstance(name, str) or not name.strip():
            raise ToolError(f"{what}: expected a non-empty file name relative to the work directory")
        if os.path.isabs(name):
            raise ToolError(f"{what}: {name!r} is absolute; give a path relative to the work directory")
        p = (self.root / name).resolve()
        if p != self.root and self.root not in p.parents:
            raise ToolError(f"{what}: {name!r} escapes the work directory; refused")
        return p

    def rel(self, p: Path) -> str:
        return str(p.relative_to(self.root))


def _safe(fn: Callable[..., dict]) -> Callable[..., dict]:
    """Answer a tool's failure as a structured result: ToolError and AmkError (bad input)
    with their message, anything else with its type and message (no traceback, no
    environment)."""

    @functools.wraps(fn)
    def wrapper(*a: Any, **kw: Any) -> dict:
        try:
            return fn(*a, **kw)
        except ToolError as e:
            return {"ok": False, "error": str(e), "error_type": "bad_input"}
        except AmkError as e:
            return {"ok": False, "error": str(e), "error_type": type(e).__name__}
        except Exception as e:  # noqa: BLE001 - a tool answers, never raises through
            tb = traceback.extract_tb(e.__traceback__)
            where = f" at {Path(tb[-1].filename).name}:{tb[-1].lineno}" if tb else ""
            return {"ok": False, "error": f"{type(e).__name__}: {e}{where}",
                    "error_type": "internal"}

    return wrapper


class Tools:
    """The tools' logic, independent of the MCP SDK (the server registers these methods)."""

    def __init__(self, workdir: str | os.PathLike):
        self.wd = Workdir(workdir)

    # -- helpers ---------------------------------------------------------------------------
    def _load(self, name: str):
        from ir.io import load_program

        p = self.wd.path(name, "schedule")
        if not p.is_file():
            raise ToolError(f"schedule: no file {name!r} in the work directory")
        return load_program(p)

    def _meta(self, name: str) -> dict | None:
        p = self.wd.path(name + META_SUFFIX, "schedule")
        if not p.is_file():
            return None
        return json.loads(p.read_text())

    def _model_arg(self, model: str) -> str:
        if not isinstance(model, str) or not model:
            raise ToolError("model: expected config:NAME or a path in the work directory")
        if model.startswith("config:"):
            return model
        return str(self.wd.path(model, "model"))

    # -- tools -----------------------------------------------------------------------------
    def lower(self, model: str, tp: int = 1, name: str = "schedule",
              config: dict | None = None) -> dict:
        """Lower ``model`` for ``tp`` ranks into NAME.amk (validated)."""
        from amk.editing import verdict_report, write_program
        from amk.pipeline import Compilation
        from ground.files import atomic_write_json
        from lowering.config import LoweringConfig

        if not isinstance(tp, int) or isinstance(tp, bool) or not 1 <= tp <= 8:
            raise ToolError(f"tp: expected an integer 1..8, got {tp!r}")
        if config is not None and not isinstance(config, dict):
            raise ToolError("config: expected an object of lowering knobs")
        if not isinstance(name, str) or "/" in name or not name:
            raise ToolError("name: expected a plain file name")
        out = self.wd.path(name if name.endswith((".amk", ".json")) else name + ".amk", "name")
        cfg = LoweringConfig.from_json(config or {}, "config", ranks=tp)
        arg = self._model_arg(model)
        s = Compilation.build(arg, tp, cfg, weights=False)
        write_program(s.program, str(out))
        atomic_write_json(Path(str(out) + META_SUFFIX), {"model": model, "tp": tp,
                                                         "config": cfg.to_json()})
        rep = verdict_report(s.verdict)
        return {"ok": rep["ok"], "schedule": self.wd.rel(out), "tasks": len(s.program.tasks),
                "ranks": s.program.ranks, "workers": s.program.workers, "verdict": rep}

    def validate(self, ir: str) -> dict:
        """Validate a program given as text IR."""
        from amk.editing import verdict_report
        from ir.text import parse_program
        from validator import validate

        if not isinstance(ir, str) or not ir.strip():
            raise ToolError("ir: expected the program in the text IR")
        prog = parse_program(ir, "ir")
        return verdict_report(validate(prog))

    def edit(self, schedule: str, edits: list, out: str | None = None) -> dict:
        """Apply edits to a schedule file; write OUT (default: SCHEDULE with .edited) when
        accepted."""
        from amk.editing import edit_program, verdict_report, write_program
        from ir.edits import parse_edits

        prog = self._load(schedule)
        checked = parse_edits(edits, "edits")
        new, verdict = edit_program(prog, checked)
        rep = verdict_report(verdict)
        target = out or (Path(schedule).stem + ".edited.amk")
        dest = self.wd.path(target, "out")
        rep["written"] = None
        if verdict.ok:
            write_program(new, str(dest))
            meta = self._meta(schedule)
            if meta is not None:
                from ground.files import atomic_write_json

                atomic_write_json(Path(str(dest) + META_SUFFIX), meta)
            rep["written"] = self.wd.rel(dest)
        rep["edits"] = len(checked)
        return rep

    def summary(self, schedule: str) -> dict:
        from lowering.views import summary

        return {"ok": True, **summary(self._load(schedule))}

    def slice(self, schedule: str, layer: int | None = None, worker: int | None = None,
              stage: str | None = None, rank: int | None = None) -> dict:
        from lowering.views import slice_program

        for k, v in (("layer", layer), ("worker", worker), ("rank", rank)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise ToolError(f"{k}: expected an integer >= 0, got {v!r}")
        return {"ok": True, "ir": slice_program(self._load(schedule), layer, worker, stage, rank)}

    def run_sim(self, schedule: str, steps: int = 2) -> dict:
        """Validate, then run ``steps`` decode steps on the sim and compare the logits with HF."""
        from amk.pipeline import Decoder, compare, hf_tokenwise_logits, import_graph, make_executor, \
            resolve, check_tokens
        from validator import validate

        if not isinstance(steps, int) or isinstance(steps, bool) or not 1 <= steps <= MAX_SIM_STEPS:
            raise ToolError(f"steps: expected an integer 1..{MAX_SIM_STEPS}, got {steps!r}")
        prog = self._load(schedule)
        meta = self._meta(schedule)
        if meta is None:
            raise ToolError(f"schedule: {schedule!r} has no recorded model ({schedule}{META_SUFFIX}); "
                            "make it with the lower tool (or edit one that was)")
        verdict = validate(prog)
        if not verdict.ok:
            from amk.editing import verdict_report

            return {"ok": False, "error": "the validator rejects the schedule; it is not run",
                    "error_type": "rejected", "verdict": verdict_report(verdict)}
        res = resolve(self._model_arg(meta["model"]))
        graph = import_graph(res)
        ex = make_executor(prog, graph, res.model.state_dict(), "sim", check=False)
        dec = Decoder(prog, ex)
        toks = check_tokens(graph.spec.vocab, steps)
        keep = list(range(steps))
        got = dec.teacher_forced(toks, keep)
        ref = hf_tokenwise_logits(res.model, toks, keep)
        rep = compare(ref, got, str(prog.config.get("dtype", "f32")), toks)
        return {"ok": bool(rep.ok), "steps": steps, "tokens": toks,
                "checks": [c.to_json() for c in rep.positions], "failures": rep.failures(),
                "reference": "HF eager, one token per step"}

    def bench(self, model: str, tp: int = 1) -> dict:
        """``amk bench MODEL --tp TP`` on the GPU; a structured no_gpu error without one."""
        import subprocess
        import sys

        try:
            import torch

            gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        except Exception:  # noqa: BLE001
            gpus = 0
        if gpus < 1:
            return {"ok": False, "error": "no GPU on this machine: bench and profile need one",
                    "error_type": "no_gpu"}
        if not isinstance(tp, int) or isinstance(tp, bool) or not 1 <= tp <= gpus:
            raise ToolError(f"tp: expected an integer 1..{gpus} (the GPUs here), got {tp!r}")
        arg = self._model_arg(model)
        out = self.wd.path("bench.json", "out")
        proc = subprocess.run([sys.executable, "-m", "amk", "bench", arg, "--tp", str(tp),
                               "--out", str(out)], capture_output=True, text=True, timeout=1800)
        res: dict = {"ok": proc.returncode == 0, "exit_code": proc.returncode,
                     "result": self.wd.rel(out) if out.is_file() else None}
        if proc.returncode != 0:
            res["error"] = (proc.stderr.strip().splitlines() or ["amk bench failed"])[-1]
        elif out.is_file():
            res["bench"] = json.loads(out.read_text())
        return res

    def search_results(self, search_dir: str, file: str | None = None) -> dict:
        """The files under ``search_dir`` (sizes), or the text of one of them."""
        d = self.wd.path(search_dir, "search_dir")
        if not d.is_dir():
            raise ToolError(f"search_dir: no directory {search_dir!r} in the work directory")
        if file is None:
            files = sorted(p for p in d.rglob("*") if p.is_file())
            return {"ok": True, "dir": self.wd.rel(d),
                    "files": [{"path": str(p.relative_to(d)), "bytes": p.stat().st_size}
                              for p in files[:500]],
                    "left_out": max(0, len(files) - 500)}
        p = self.wd.path(os.path.join(search_dir, file), "file")
        if d not in p.parents:
            raise ToolError(f"file: {file!r} is not under {search_dir!r}")
        if not p.is_file():
            raise ToolError(f"file: no file {file!r} in {search_dir!r}")
        text = p.read_text(errors="replace")
        cut = len(text) > MAX_READ_CHARS
        return {"ok": True, "path": self.wd.rel(p), "text": text[:MAX_READ_CHARS], "truncated": cut}


def build_server(workdir: str | os.PathLike):
    """An MCP server (the SDK's MCPServer, or FastMCP on mcp 1.x) with the tools of ``Tools``
    registered, every one wrapped so that it answers failures as structured results."""
    try:
        from mcp.server.mcpserver import MCPServer as Server
    except ImportError:  # mcp 1.x
        from mcp.server.fastmcp import FastMCP as Server
    from ir.edits import OP_HELP

    tools = Tools(workdir)
    server = Server("amk", instructions=(
        "amk schedule tools: lower a model to a schedule, read its summary and slices, propose "
        "typed edits; every edit is validated (deadlocks, races) before anything runs."))
    edit_ops = "; ".join(f"{k}: {v}" for k, v in OP_HELP.items())

    @server.tool(description="Lower a model (config:NAME, e.g. config:tiny-llama, or a path in "
                             "the work dir) for tp ranks into NAME.amk in the work dir; validated. "
                             "config: lowering knobs (docs/lowering.md).")
    @_safe
    def lower(model: str, tp: int = 1, name: str = "schedule", config: dict | None = None) -> dict:
        return tools.lower(model, tp, name, config)

    @server.tool(description="Validate a schedule given as text IR: verdict, error classes, "
                             "tasks and witnesses (deadlock cycle, racing pair and regions).")
    @_safe
    def validate(ir: str) -> dict:
        return tools.validate(ir)

    @server.tool(description="Apply typed edits (a list of {op, ...}) to a schedule file in the "
                             "work dir, validate, and write OUT only if accepted. Ops: " + edit_ops)
    @_safe
    def edit(schedule: str, edits: list, out: str | None = None) -> dict:
        return tools.edit(schedule, edits, out)

    @server.tool(description="Summary of a schedule: per stage and rank the tasks per worker and "
                             "predicted us, the predicted critical path, idle time per worker.")
    @_safe
    def summary(schedule: str) -> dict:
        return tools.summary(schedule)

    @server.tool(name="slice", description="One layer, worker, stage and/or rank of a schedule "
                                           "in the text IR (at most 400 tasks).")
    @_safe
    def slice_(schedule: str, layer: int | None = None, worker: int | None = None,
               stage: str | None = None, rank: int | None = None) -> dict:
        return tools.slice(schedule, layer, worker, stage, rank)

    @server.tool(description="Run a few decode steps (1..8) of an accepted schedule on the CPU "
                             "simulator; logits compared with the HF reference of its model.")
    @_safe
    def run_sim(schedule: str, steps: int = 2) -> dict:
        return tools.run_sim(schedule, steps)

    @server.tool(description="Benchmark a model with amk bench on the GPU (error_type no_gpu "
                             "when this machine has none).")
    @_safe
    def bench(model: str, tp: int = 1) -> dict:
        return tools.bench(model, tp)

    @server.tool(description="List the files of a search directory in the work dir, or read "
                             "one of them (file).")
    @_safe
    def search_results(search_dir: str, file: str | None = None) -> dict:
        return tools.search_results(search_dir, file)

    return server


def serve(workdir: str | os.PathLike) -> None:
    """Run the server on stdio until the client closes it."""
    build_server(workdir).run("stdio")
