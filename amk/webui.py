"""``amk ui``: a local web app over search, tune and compile directories (FastAPI; the only
module that imports fastapi).

``create_app(root)`` serves the static front-end of ``amk/ui/`` (plain HTML, JS and CSS; no
build step, nothing fetched from elsewhere) and a JSON API over the directory tree ``root``:

* ``GET /api/runs``: the runs under ``root`` (a search: ``results.jsonl``; a tune:
  ``trials.jsonl``; a compiled schedule: ``schedule.json`` or ``schedule.amk``);
* ``GET /api/run?path=``: one run's trials (status, proposer, ratio, verdict, timing source,
  latency), its summary and, for a tune, the tuning database's entries;
* ``GET /api/schedule?path=``: a schedule's per-rank per-worker queues, stages, critical path
  (lowering/views.py) and its text IR; ``GET /api/trace?path=``: its simulated trace
  (lowering/trace.py), or a trace file as it is;
* ``GET /api/verdict?path=&trial=``: a rejected trial's verdict and witness, with the text IR
  of the schedule it judged (an edit search's base with the trial's edits) and the tasks and
  counters of the witness;
* ``GET /api/review?path=``, ``POST /api/review/decide``: the proposals an ``amk search
  --approve`` holds, and the reviewer's decision (search/review.py);
* ``POST /api/edit/validate``: an edit list against a schedule, or a whole text-IR schedule,
  validated; ``save`` writes the result into the run directory only when it is accepted.

Safety: every ``path`` is resolved inside ``root`` (a path that leaves it, through ``..`` or a
link, is refused with 403); the Host header must name the address served (DNS rebinding);
nothing of the environment (API keys included) is ever put in a response.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from ground.errors import AmkError

STATIC = Path(__file__).resolve().parent / "ui"
STATIC_RE = re.compile(r"[a-z][a-z0-9_-]*\.(html|js|css)")
TYPES = {"html": "text/html; charset=utf-8", "js": "text/javascript; charset=utf-8",
         "css": "text/css; charset=utf-8"}
MAX_DEPTH = 4
TRACE_RE = re.compile(r"trace.*\.json")
MAX_TRACE_TASKS = 20000


class Forbidden(Exception):
    """A path outside the served directory."""


def inside(root: Path, rel: str) -> Path:
    """``root / rel`` resolved (links followed); Forbidden when it is not inside ``root``
    (``..``, an absolute path, a link that leads out) or names a hidden entry."""
    if not isinstance(rel, str) or "\x00" in rel:
        raise Forbidden(rel)
    root = root.resolve()
    p = (root / rel).resolve()
    if p != root and root not in p.parents:
        raise Forbidden(rel)
    if any(part.startswith(".") for part in p.relative_to(root).parts):
        raise Forbidden(rel)
    return p


def find_runs(root: Path) -> list[dict[str, Any]]:
    """The runs under ``root`` (depth at most MAX_DEPTH), each ``{"path", "kind", ...}``:
    ``search`` (results.jsonl), ``tune`` (trials.jsonl), ``schedule`` (schedule.json /
    schedule.amk of ``amk compile --out`` and the schedules a search keeps) or ``trace``
    (``trace*.json`` files of ``amk profile``)."""
    root = root.resolve()
    out = []

    def walk(d: Path, depth: int) -> None:
        try:
            entries = sorted(d.iterdir()) if d.is_dir() else []
        except OSError:  # unreadable: not listed
            return
        names = {p.name for p in entries}
        rel = d.relative_to(root).as_posix() if d != root else "."
        if "results.jsonl" in names:
            out.append({"path": rel, "kind": "search", **_brief(d, "state.json")})
        elif "trials.jsonl" in names:
            out.append({"path": rel, "kind": "tune", **_brief(d, "settings.json")})
        for n in ("schedule.json", "schedule.amk"):
            if n in names:
                out.append({"path": (d / n).relative_to(root).as_posix(), "kind": "schedule"})
                break
        for n in sorted(names):
            if TRACE_RE.fullmatch(n) and (d / n).is_file():
                out.append({"path": (d / n).relative_to(root).as_posix(), "kind": "trace"})
        if depth >= MAX_DEPTH:
            return
        for p in entries:
            if p.is_dir() and not p.is_symlink() and not p.name.startswith(".") \
                    and p.name not in ("work", "review", "__pycache__"):
                walk(p, depth + 1)

    walk(root, 0)
    return out


def _brief(d: Path, name: str) -> dict[str, Any]:
    try:
        obj = json.loads((d / name).read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    s = obj.get("settings", obj)
    return {k: s.get(k) for k in ("model", "tp", "backend", "proposer") if k in s}


def _jsonl(p: Path) -> list[dict[str, Any]]:
    rows = []
    if p.is_file():
        for line in p.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a torn last line (the run is writing it)
    return rows


def trial_rows(d: Path) -> tuple[str, list[dict[str, Any]]]:
    """(kind, rows) of run directory ``d``: one row per trial with ``trial``, ``status``,
    ``proposer``, ``ratio`` (search: speedup over the start; tune: incumbent ms / ms),
    ``latency_ms``, ``timing_source``, ``verdict`` (the validator's classes, ``ok``, or the
    stage that failed) and ``reason``."""
    if (d / "results.jsonl").is_file():
        rows = []
        for r in _jsonl(d / "results.jsonl"):
            x = r.get("extra") or {}
            v = x.get("verdict") or {}
            verdict = ("ok" if v.get("ok") else ",".join(v.get("classes") or []) or "rejected") if v \
                else (x.get("stage") or "-")
            rows.append({"trial": r.get("trial"), "status": r.get("status"), "proposer": r.get("proposer"),
                         "ratio": r.get("speedup_vs_start"), "latency_ms": r.get("latency_ms"),
                         "timing_source": r.get("timing_source"), "verdict": verdict,
                         "reason": r.get("reason", ""), "edits": x.get("edits"),
                         "has_witness": bool(v.get("errors")), "candidate_id": r.get("candidate_id")})
        return "search", rows
    if (d / "trials.jsonl").is_file():
        rows = []
        for r in _jsonl(d / "trials.jsonl"):
            ms, inc = r.get("ms"), r.get("incumbent_ms")
            rows.append({"trial": r.get("trial"), "status": r.get("status"),
                         "proposer": r.get("kind") + (f" ({r['note']})" if r.get("note") else "")
                         if r.get("kind") else r.get("note"),
                         "ratio": inc / ms if ms and inc else None, "latency_ms": ms,
                         "timing_source": r.get("timing_source"),
                         "verdict": "ok" if (r.get("correctness") or {}).get("passed") else r.get("status"),
                         "reason": r.get("reason", ""), "edits": None, "has_witness": False,
                         "candidate_id": r.get("id")})
        return "tune", rows
    raise FileNotFoundError(str(d))


def load_schedule(p: Path):
    """The ScheduleProgram of a .json or .amk file (AmkError when it cannot be read)."""
    from ir.io import load_program

    return load_program(str(p))


def schedule_view(prog) -> dict[str, Any]:
    """Queues (per rank and worker: task id, op, predicted start/end us), the summary
    (stages, critical path, idle time) and the text IR of ``prog``."""
    from ir.text import format_program
    from lowering.views import summary, timeline

    tl = timeline(prog, 1)
    queues: dict[str, list[dict[str, Any]]] = {}
    for k, t in enumerate(prog.tasks):
        queues.setdefault(f"r{t.rank}.w{t.worker}", []).append(
            {"id": t.id, "op": t.op, "start_us": round(tl.start.get(k, -1) * 1e6, 3),
             "end_us": round(tl.end.get(k, -1) * 1e6, 3)})
    crit = {prog.tasks[k].id for k in tl.critical}
    return {"summary": summary(prog, 1, max_stages=400, max_path=400), "queues": queues,
            "critical": sorted(crit), "text": format_program(prog)}


def _witness_names(report: dict[str, Any]) -> dict[str, list[str]]:
    """Task ids and counter names a verdict's errors and witnesses name (for highlighting):
    the errors' ``tasks``; a witness's ``task`` / ``signalled_by`` / ``pending_signallers``
    values and ``counter`` values; deadlock cycle nodes ``task ID`` / ``counter NAME``."""
    tasks, counters = set(), set()
    task_keys = {"task", "tasks", "signalled_by", "pending_signallers"}

    def visit(x: Any, key: str = "") -> None:
        if isinstance(x, dict):
            for k, v in x.items():
                visit(v, k)
        elif isinstance(x, (list, tuple)):
            for v in x:
                visit(v, key)
        elif isinstance(x, str):
            if x.startswith("task "):
                tasks.add(x[5:])
            elif x.startswith("counter "):
                counters.add(x[8:])
            elif key in task_keys:
                tasks.add(x)
            elif key in ("counter", "counters"):
                counters.add(x)

    for e in report.get("errors") or []:
        visit(e.get("tasks"), "tasks")
        visit(e.get("witness"))
    return {"tasks": sorted(tasks), "counters": sorted(counters)}


def verdict_view(d: Path, trial: int) -> dict[str, Any]:
    """A trial's verdict with the text IR it judged (an edit search: base + the trial's edits;
    otherwise the run's incumbent/best schedule is not that program, so only the verdict) and
    the witness's tasks and counters."""
    recs = [r for r in _jsonl(d / "results.jsonl") if r.get("trial") == trial]
    if not recs:
        raise FileNotFoundError(f"trial {trial}")
    r = recs[0]
    x = r.get("extra") or {}
    v = x.get("verdict") or {}
    out: dict[str, Any] = {"trial": trial, "status": r.get("status"), "reason": r.get("reason"),
                           "verdict": v, "edits": x.get("edits"), "text": None,
                           "highlight": _witness_names(v)}
    if x.get("edits") is not None and (d / "base" / "schedule.json").is_file():
        from amk.editing import edit_program
        from ir.text import format_program

        try:
            prog, verdict = edit_program(load_schedule(d / "base" / "schedule.json"), x["edits"])
            out["text"] = format_program(prog)
        except AmkError as err:
            out["text_error"] = str(err)
    return out


def validate_edit(root: Path, body: dict[str, Any]) -> dict[str, Any]:
    """The editor's save: ``{"schedule": REL, "edits": [...]}`` (an edit list against that
    schedule) or ``{"text": "..."}`` (a whole text-IR program, edited from ``schedule`` if
    given), validated. With ``"save":
    NAME`` and an accepted result, the program is written as ``edited/NAME.amk`` (and the edit
    list as ``edited/NAME.edits.json``) inside the run directory of ``schedule`` (or ``root``).
    Returns ``{"ok", "verdict", "highlight", "text", "saved"}``; bad input is ``{"error"}``."""
    from amk.editing import edit_program, verdict_report
    from ground.files import atomic_write_json, atomic_write_text
    from ir.text import format_program, parse_program
    from validator import validate

    save = body.get("save")
    if save is not None and (not isinstance(save, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", save)):
        return {"error": "save: a name of letters, digits, - and _ (at most 64)"}
    try:
        if body.get("text") is not None:
            prog = parse_program(str(body["text"]))
            verdict = validate(prog)
            where = root.resolve()
            if body.get("schedule"):  # saved beside the schedule it was edited from
                where = inside(root, str(body["schedule"])).parent
        else:
            src = inside(root, str(body.get("schedule", "")))
            if not src.is_file():
                return {"error": f"no schedule file {body.get('schedule')!r}"}
            edits = body.get("edits")
            if isinstance(edits, str):
                try:
                    edits = json.loads(edits)
                except json.JSONDecodeError as e:
                    return {"error": f"edits: invalid JSON at {e.lineno}:{e.colno}: {e.msg}"}
            prog, verdict = edit_program(load_schedule(src), edits if edits is not None else [])
            where = src.parent
    except AmkError as err:
        return {"error": str(err)}
    report = verdict_report(verdict)
    out = {"ok": report["ok"], "verdict": report, "highlight": _witness_names(report),
           "text": format_program(prog), "saved": None}
    if save and report["ok"]:
        dest = where / "edited"
        dest.mkdir(exist_ok=True)
        atomic_write_text(dest / f"{save}.amk", out["text"])
        if body.get("text") is None:
            atomic_write_json(dest / f"{save}.edits.json", body.get("edits") if not isinstance(
                body.get("edits"), str) else json.loads(body["edits"]))
        out["saved"] = (dest / f"{save}.amk").relative_to(root.resolve()).as_posix()
    return out


def create_app(root: str | Path, db: str | None = None, hosts: list[str] | None = None):
    """The FastAPI app over directory ``root`` (module docstring). ``db``: the tuning database
    directory whose entries the tune view lists (``search.tunedb.open_db``); ``hosts``: the
    Host header values accepted besides the loopback names (``"*"``: any, for a wildcard
    bind address). AmkError when ``root`` is not a directory."""
    from fastapi import Body, FastAPI, HTTPException, Query, Request
    from fastapi.responses import JSONResponse, RedirectResponse, Response

    base = Path(root).resolve()
    if not base.is_dir():
        raise AmkError(f"{root}: not a directory")
    allowed = set(hosts or []) | {"127.0.0.1", "localhost", "[::1]"}
    app = FastAPI(title="amk ui", docs_url=None, redoc_url=None, openapi_url=None)

    @app.middleware("http")
    async def guard(request: Request, call_next):
        raw = request.headers.get("host") or ""
        host = raw.split("]")[0] + "]" if raw.startswith("[") else raw.rsplit(":", 1)[0]
        if "*" not in allowed and host not in allowed:
            return JSONResponse({"error": "unexpected Host header"}, status_code=400)
        resp = await call_next(request)
        resp.headers["X-Content-Type-Options"] = "nosniff"
        resp.headers["Content-Security-Policy"] = ("default-src 'self'; img-src 'self' data:; "
                                                   "style-src 'self' 'unsafe-inline'; script-src 'self'")
        return resp

    def path_of(rel: str) -> Path:
        try:
            return inside(base, rel)
        except Forbidden:
            raise HTTPException(403, "path outside the served directory") from None

    def run_dir(rel: str) -> Path:
        d = path_of(rel)
        if not ((d / "results.jsonl").is_file() or (d / "trials.jsonl").is_file()):
            raise HTTPException(404, f"{rel!r} is not a search or tune directory")
        return d

    @app.get("/")
    def index():
        return RedirectResponse("/static/index.html")

    @app.get("/favicon.ico")
    def favicon():
        return Response(status_code=204)

    @app.get("/static/{name}")
    def static(name: str):
        if not STATIC_RE.fullmatch(name) or not (STATIC / name).is_file():
            raise HTTPException(404, "no such file")
        return Response((STATIC / name).read_bytes(), media_type=TYPES[name.rsplit(".", 1)[1]])

    @app.get("/api/runs")
    def runs():
        return {"root": base.name, "runs": find_runs(base)}

    @app.get("/api/run")
    def run(path: str = Query(...)):
        d = run_dir(path)
        kind, rows = trial_rows(d)
        out: dict[str, Any] = {"path": path, "kind": kind, "trials": rows}
        for n in ("summary.json", "report.json", "state.json", "settings.json"):
            if (d / n).is_file():
                try:
                    obj = json.loads((d / n).read_text())
                except json.JSONDecodeError:
                    continue
                out[n.split(".")[0]] = obj
        schedules = [p.relative_to(base).as_posix() for sub in ("best", "incumbent", "base")
                     for p in [d / sub / "schedule.json"] if p.is_file()]
        out["schedules"] = schedules
        if kind == "tune":
            out["tunedb"] = tunedb_entries(db, d)
        return out

    @app.get("/api/schedule")
    def schedule(path: str = Query(...)):
        p = path_of(path)
        if not p.is_file():
            raise HTTPException(404, "no such schedule file")
        try:
            prog = load_schedule(p)
        except AmkError as err:
            raise HTTPException(400, str(err)) from None
        return {"path": path, **schedule_view(prog)}

    @app.get("/api/trace")
    def trace(path: str = Query(...)):
        p = path_of(path)
        if not p.is_file():
            raise HTTPException(404, "no such file")
        if TRACE_RE.fullmatch(p.name):
            return Response(p.read_bytes(), media_type="application/json")
        from amk.profile import sim_trace

        try:
            prog = load_schedule(p)
        except AmkError as err:
            raise HTTPException(400, str(err)) from None
        if len(prog.tasks) > MAX_TRACE_TASKS:
            raise HTTPException(413, f"{len(prog.tasks)} tasks: trace it with amk profile instead")
        return sim_trace(prog, 1, meta={"source": path})

    @app.get("/api/verdict")
    def verdict(path: str = Query(...), trial: int = Query(...)):
        d = run_dir(path)
        try:
            return verdict_view(d, trial)
        except FileNotFoundError:
            raise HTTPException(404, f"no trial {trial}") from None

    @app.get("/api/review")
    def review(path: str = Query(...)):
        from search.review import decided, pending

        d = run_dir(path)
        return {"pending": pending(d), "decided": decided(d)}

    @app.post("/api/review/decide")
    def review_decide(body: dict = Body(...)):
        from search.review import decide

        d = run_dir(str(body.get("path", "")))
        try:
            return decide(d, str(body.get("id", "")), bool(body.get("approve")), str(body.get("comment") or ""))
        except AmkError as err:
            raise HTTPException(400, str(err)) from None

    @app.post("/api/edit/validate")
    def edit_validate(body: dict = Body(...)):
        try:
            out = validate_edit(base, body)
        except Forbidden:
            raise HTTPException(403, "path outside the served directory") from None
        if "error" in out:
            return JSONResponse(out, status_code=400)
        return out

    return app


def tunedb_entries(db: str | None, run: Path | None = None) -> list[dict[str, Any]]:
    """The tuning database's entries (``open_db(db)``; a tune run's own ``--db`` when its
    settings name one), as rows: model shape, GPU, tp, ms, ratio, roofline %, date, source."""
    from search.tunedb import open_db

    if db is None and run is not None:
        try:
            obj = json.loads((run / "settings.json").read_text())
            db = obj.get("settings", obj).get("db") or None
        except (OSError, json.JSONDecodeError, AttributeError):
            db = None
    try:
        entries = open_db(db).entries()
    except AmkError as err:
        return [{"error": str(err)}]
    return [{"shape": e.shape.describe(), "gpu": e.gpu.describe(), "tp": e.tp, "ms": e.ms,
             "ratio": e.ratio, "roofline_pct": e.roofline_pct, "date": e.date, "source": e.source,
             "correct": e.correct, "file": Path(e.path or "").name} for e in entries]


def serve(root: str | Path, host: str = "127.0.0.1", port: int = 8765, db: str | None = None,
          ready: Any = None) -> None:
    """Run the app with uvicorn until interrupted. ``ready``: called with the URL once the
    socket listens."""
    import uvicorn

    app = create_app(root, db, hosts=["*"] if host in ("0.0.0.0", "::") else [host])
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    if ready is not None:
        orig = server.startup

        async def startup(sockets=None):
            await orig(sockets)
            bound = [s.getsockname() for srv in getattr(server, "servers", []) for s in srv.sockets]
            p = bound[0][1] if bound else port
            ready(f"http://{host if ':' not in host else '[' + host + ']'}:{p}/")

        server.startup = startup
    server.run()
