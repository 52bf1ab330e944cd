"""The offline edit proposer of ``amk search --edits``: schedule edits, not knob values.

In an edit search every candidate is an edit list (ir/edits.py) against the BASE schedule, the
lowering of the start config. Each trial the proposer takes the incumbent's list, applies it
to the base, looks at the result through ``lowering.views.timeline`` (a predicted step on the
cost model) and builds a pool of one-edit extensions:

* ``move`` of tasks on the critical path (latest first) and of tasks of the most loaded worker
  to the idlest workers of their rank (fewest tasks, then most idle time);
* ``split`` of the longest GEMV-family tiles on the critical path;
* ``merge`` of the two smallest neighbouring tiles of a GEMV-family stage;
* ``refine_wait`` on stage-wide waits of critical-path tasks;
* ``replace`` (re-place a stage by a placement policy) of the stages of the critical path and
  of the most loaded workers' tasks: a single move cannot lower the most loaded worker's task
  count when several workers tie for it, a re-placed stage can.

Each candidate is applied and scored by the cost model (``lowering.costmodel.estimate``, the
sim backend's timing) and the timeline's makespan; only those that lower one of the two are
kept, ranked by (estimate, makespan).

With a MEASURED per-task profile (``durations``: task id -> seconds, from the trace of
``amk profile --trace``, ``lowering.trace.task_durations``; ``amk search --edits --profile
TRACE``) the timeline runs on the measured durations (``lowering.views.timeline(...,
durations=)``): the critical path, the loaded workers (most busy time on the measured
timeline, the idlest by least busy time) and the longest tiles come from it, and candidates
are ranked by the measured timeline's makespan first, the cost model's estimate as the
tie-break (a candidate must lower the makespan, or keep it and lower the estimate). A task
of an edited schedule keeps its measured duration while its op and operand regions are those
of the measured task of that id (a move keeps them); a task an edit created or reshaped
(split halves, a merged tile) takes the cost model's duration scaled by the measured /
predicted ratio of its stage (summed over the stage's measured tasks: the tiles it came
from are of that stage). Candidates are NOT validated here: the worker validates
every edited schedule before anything runs, so an unsafe move shows up as a REJECTED trial
with the validator's error classes and witnesses. The proposer never proposes again an edit
the validator rejected (whatever list it came in) nor an edit list already evaluated; both
come from the finished trials, so a resumed search proposes what it would have.

No key, no network: this is plain Python over the schedule.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from ground.errors import AmkError
from ir.edits import GEMV_FAMILY, parse_edits, stage_of
from search.proposers import Proposal, ProposalContext
from search.records import Record

#: pool limits per kind of edit (the pool is scored by the cost model, one apply each)
MAX_MOVES = 16
MAX_SPLITS = 3
MAX_MERGES = 6
MAX_REFINES = 4
MAX_REPLACE_STAGES = 8
#: relative margin a score must beat (float rounding only: the cost model is deterministic)
EPS = 1e-9
#: seconds one proposal may spend scoring its pool: a Llama-3.2-1B schedule (8,900 tasks)
#: takes ~1 s per candidate (the predicted timeline), and its pool holds ~50
SCORE_BUDGET_S = 20.0


def edit_key(edit: dict[str, Any]) -> str:
    """A canonical string of one edit (JSON, sorted keys): the unit of 'already rejected'."""
    return json.dumps(edit, sort_keys=True, separators=(",", ":"))


def list_key(edits: list[dict[str, Any]]) -> str:
    """A canonical string of an edit list (order matters)."""
    return json.dumps(edits, sort_keys=True, separators=(",", ":"))


def describe_edit(e: dict[str, Any]) -> str:
    """One short line for an edit: ``move l0.q.t3.r0 -> w5``, ``split l0.q.t3.r0``, ..."""
    op = e["op"]
    if op == "move":
        return f"move {e['task']} -> w{e['worker']}"
    if op == "merge":
        return f"merge {e['a']} + {e['b']}"
    if op == "refine_wait":
        return f"refine_wait {e['counter']} at {e.get('task', '*')}"
    rest = ", ".join(f"{k}={v}" for k, v in e.items() if k != "op")
    return f"{op} {rest}"


def interleave_kinds(edits: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``edits`` reordered round-robin over their ops (move, split, merge, refine_wait,
    replace, in first-seen order), each op's own order kept, so that a proposal whose
    scoring budget runs out has looked at every kind of edit."""
    by_op: dict[str, list[dict[str, Any]]] = {}
    for e in edits:
        by_op.setdefault(e["op"], []).append(e)
    out: list[dict[str, Any]] = []
    queues = list(by_op.values())
    while any(queues):
        for q in queues:
            if q:
                out.append(q.pop(0))
    return out


def profile_durations(path: str, prog: Any) -> dict[str, float]:
    """The measured task durations (task id -> seconds) of the trace file ``path`` (``amk
    profile --trace``, .json or .json.gz) for the base schedule ``prog``. AmkError (one line,
    exit 2) for an unreadable file, an invalid trace, one without task slices, or one that
    holds fewer than half of ``prog``'s task ids (another config or model was profiled)."""
    from lowering.trace import check_trace, read_trace, task_durations

    obj = read_trace(path)
    problems = check_trace(obj, amk=False)
    if problems:
        raise AmkError(f"--profile {path}: not a valid trace: {problems[0]}"
                       + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
    d = task_durations(obj, f"--profile {path}")
    ids = {t.id for t in prog.tasks}
    hit = len(ids & set(d))
    if 2 * hit < len(ids):
        raise AmkError(f"--profile {path}: only {hit} of the base schedule's {len(ids)} task ids are "
                       f"in the trace ({len(d)} task slices); profile the search's start config "
                       f"(the same model, --tp and --config)")
    return d


def rejected_edits(records: list[Record]) -> dict[str, dict[str, Any]]:
    """Edits the validator (or the edit language) rejected: the last edit of each REJECTED
    trial's list, keyed by ``edit_key``, with the verdict's classes and witnesses."""
    out: dict[str, dict[str, Any]] = {}
    for r in records:
        edits = r.extra.get("edits")
        if r.status == "REJECTED" and edits:
            v = r.extra.get("verdict") or {}
            out[edit_key(edits[-1])] = {"trial": r.trial, "classes": v.get("classes", []),
                                        "witnesses": v.get("witnesses", {}), "reason": r.reason}
    return out


class EditProposer:
    """Local search over schedule edits ranked by the cost model, or by a measured profile
    (module docstring).

    ``base``: a callable returning the base ScheduleProgram (the lowered start config; the
    loop lowers it once); ``seq_len``: the context length of the cost model's prediction;
    ``budget_s``: seconds one proposal may spend scoring; ``durations``: measured task
    durations of the base schedule (task id -> seconds; ``profile_durations``), None to rank
    by the cost model alone.
    """

    name = "edits"

    def __init__(self, base: Callable[[], Any], seq_len: int = 128, budget_s: float = SCORE_BUDGET_S,
                 durations: dict[str, float] | None = None):
        self.base = base
        self.seq_len = seq_len
        self.budget_s = budget_s
        self.durations = dict(durations) if durations else None
        self._measured: dict[str, tuple[Any, float]] | None = None  # id -> (work, seconds)
        self._ratio: dict[str, float] = {}

    # -- the measured profile -------------------------------------------------------------
    def _calibrate(self) -> None:
        """From the base schedule: each measured task's work (op and regions) and the
        measured / predicted ratio per stage."""
        from lowering.views import model_durations

        prog = self.base()
        model = model_durations(prog, self.seq_len)
        self._measured, num, den = {}, {}, {}
        for t in prog.tasks:
            if t.id in self.durations:
                sec = self.durations[t.id]
                self._measured[t.id] = ((t.op, t.ins, t.outs), sec)
                st = stage_of(t.id)
                num[st] = num.get(st, 0.0) + sec
                den[st] = den.get(st, 0.0) + model[t.id]
        self._ratio = {st: num[st] / den[st] for st in num if den[st] > 0}

    def durations_for(self, prog: Any) -> dict[str, float] | None:
        """Task id -> seconds for every task of ``prog`` (an edited base schedule): measured
        where the task's work is the measured task's, else the cost model's scaled by its
        stage's measured / predicted ratio (class docstring); None without a profile."""
        if not self.durations:
            return None
        from lowering.views import model_durations

        if self._measured is None:
            self._calibrate()
        out = {}
        for t in prog.tasks:
            m = self._measured.get(t.id)
            out[t.id] = m[1] if m and m[0] == (t.op, t.ins, t.outs) else None
        model = model_durations(prog, self.seq_len) if None in out.values() else {}
        for t in prog.tasks:
            if out[t.id] is None:
                out[t.id] = model[t.id] * self._ratio.get(stage_of(t.id), 1.0)
        return out

    def timeline(self, prog: Any) -> Any:
        """``lowering.views.timeline`` of ``prog``, on the measured durations when given."""
        from lowering.views import timeline

        return timeline(prog, self.seq_len, durations=self.durations_for(prog))

    def ranking(self) -> str:
        """How candidates are ranked, for the proposal's note."""
        if self.durations:
            return f"ranked by the measured profile ({len(self._measured or {})} tasks)"
        return "ranked by the cost model"

    def _key(self, s: tuple[float, float]) -> tuple[float, float]:
        """The sort key of a score: (makespan, estimate) on a measured profile, else as is."""
        return (s[1], s[0]) if self.durations else s

    def better(self, s: tuple[float, float], ref: tuple[float, float]) -> bool:
        """Whether score ``s`` beats the incumbent's ``ref`` (module docstring)."""
        if self.durations:
            return s[1] < ref[1] * (1 - EPS) or (s[1] <= ref[1] * (1 + EPS) and s[0] < ref[0] * (1 - EPS))
        return s[0] < ref[0] * (1 - EPS) or s[1] < ref[1] * (1 - EPS)

    # -- scoring ------------------------------------------------------------------------
    def _apply(self, prog: Any, edits: list[dict[str, Any]]) -> Any:
        from lowering.placement import apply_edits

        return apply_edits(prog, parse_edits(edits, "proposed edits"))

    def score(self, prog: Any, tl: Any = None) -> tuple[float, float]:
        """(cost-model step latency in ms, timeline makespan in ms) of ``prog``, the timeline
        on the measured durations when given (``tl``: that timeline, already run); a schedule
        whose timeline gets stuck (a deadlock) scores infinite makespan."""
        from lowering.costmodel import estimate

        tl = tl if tl is not None else self.timeline(prog)
        span = float("inf") if tl.stuck else tl.makespan * 1e3
        return estimate(prog, seq_len=self.seq_len).predicted_latency_s * 1e3, span

    # -- the pool -----------------------------------------------------------------------
    def candidates(self, prog: Any, tl: Any = None) -> list[dict[str, Any]]:
        """One-edit candidates for ``prog`` (module docstring), most promising kinds first,
        without duplicates (``tl``: its timeline, already run). On a measured profile the
        loaded and idlest workers are those of the most and least busy time, else of the most
        and fewest tasks."""
        tl = tl if tl is not None else self.timeline(prog)
        tasks = prog.tasks
        measured = bool(self.durations)
        count: dict[tuple[int, int], int] = {}
        for t in tasks:
            count[(t.rank, t.worker)] = count.get((t.rank, t.worker), 0) + 1
        span = tl.makespan

        def idlest(rank: int, n: int = 2) -> list[int]:
            ws = range(prog.workers)
            if measured:
                return sorted(ws, key=lambda w: (tl.busy.get((rank, w), 0.0),
                                                 count.get((rank, w), 0), w))[:n]
            return sorted(ws, key=lambda w: (count.get((rank, w), 0),
                                             tl.busy.get((rank, w), 0.0) - span, w))[:n]

        out: dict[str, dict[str, Any]] = {}

        def add(e: dict[str, Any]) -> None:
            out.setdefault(edit_key(e), e)

        crit = [tasks[k] for k in reversed(tl.critical)]  # latest first
        loaded = []
        load = (lambda r, w: tl.busy.get((r, w), 0.0)) if measured else \
            (lambda r, w: count.get((r, w), 0))
        for r in range(prog.ranks):
            top = max((load(r, w) for w in range(prog.workers)), default=0)
            loaded += [t for t in tasks if t.rank == r and load(r, t.worker) == top]
        moves = 0
        for t in crit[:8] + loaded[::-1][:8]:
            for w in idlest(t.rank):
                if w != t.worker and moves < MAX_MOVES:
                    add({"op": "move", "task": t.id, "worker": w})
                    moves += 1
        dur = {k: tl.end[k] - tl.start[k] for k in tl.end}
        gemv_crit = sorted((k for k in tl.critical if tasks[k].op in GEMV_FAMILY),
                           key=lambda k: -dur.get(k, 0.0))
        for k in gemv_crit[:MAX_SPLITS]:
            add({"op": "split", "task": tasks[k].id})
        for a, b in self._merge_pairs(prog, dur)[:MAX_MERGES]:
            add({"op": "merge", "a": a, "b": b})
        n_sig = prog.signals_per_epoch()
        refines = 0
        for t in crit:
            for w in t.waits:
                if refines < MAX_REFINES and w.offset == 0 and w.threshold > 1 and \
                        w.threshold == n_sig.get(w.counter, 0):
                    add({"op": "refine_wait", "counter": w.counter, "task": t.id})
                    refines += 1
        from ir.edits import POLICIES

        stages: list[str] = []
        for t in crit + loaded[::-1]:
            st = stage_of(t.id)
            if st not in stages:
                stages.append(st)
        for st in stages[:MAX_REPLACE_STAGES]:
            for pol in POLICIES:
                add({"op": "replace", "stage": st, "policy": pol})
        return list(out.values())

    @staticmethod
    def _merge_pairs(prog: Any, dur: dict[int, float]) -> list[tuple[str, str]]:
        """Neighbouring tiles (by output rows) of one GEMV-family stage and rank, smallest
        combined predicted time first."""
        groups: dict[tuple[str, int], list[int]] = {}
        for k, t in enumerate(prog.tasks):
            if t.op in GEMV_FAMILY and t.outs:
                groups.setdefault((stage_of(t.id), t.rank), []).append(k)
        pairs = []
        for ks in groups.values():
            def lo(k: int) -> int:
                return prog.tasks[k].outs[0].ranges[-1].start.const
            ks = sorted(ks, key=lo)
            for a, b in zip(ks, ks[1:]):
                ta, tb = prog.tasks[a], prog.tasks[b]
                if ta.outs[0].buffer == tb.outs[0].buffer and \
                        ta.outs[0].ranges[-1].stop.const == tb.outs[0].ranges[-1].start.const:
                    pairs.append((dur.get(a, 0.0) + dur.get(b, 0.0), ta.id, tb.id))
        pairs.sort()
        return [(a, b) for _, a, b in pairs]

    # -- the proposer interface -----------------------------------------------------------
    def propose(self, ctx: ProposalContext) -> Proposal | None:
        """The best-scoring unseen one-edit extension of the incumbent's edit list, or None
        when no candidate beats the incumbent (``better``)."""
        inc = ctx.incumbent
        if inc is None:
            return None
        inc_edits = list(inc.extra.get("edits") or [])
        banned = rejected_edits(ctx.records)
        tried = {list_key(r.extra.get("edits") or []) for r in ctx.records}
        try:
            prog = self._apply(self.base(), inc_edits)
        except AmkError:
            return None
        import time

        t0 = time.monotonic()
        tl = self.timeline(prog)  # the incumbent's: its score and its pool
        ref = self.score(prog, tl)
        pool = [e for e in interleave_kinds(self.candidates(prog, tl))
                if edit_key(e) not in banned and list_key(inc_edits + [e]) not in tried]
        scored, looked = [], 0
        for i, e in enumerate(pool):
            if scored and time.monotonic() - t0 > self.budget_s:
                break  # the budget is spent and something beats the incumbent: propose it
            looked += 1
            try:
                s = self.score(self._apply(prog, [e]))
            except AmkError:  # the edit does not apply here (e.g. tiles that cannot merge)
                continue
            if self.better(s, ref):
                scored.append((s, i, e))
        if not scored:
            return None
        scored.sort(key=lambda x: (self._key(x[0]), x[1]))
        (pred, span), _, e = scored[0]
        what = "measured timeline" if self.durations else "timeline"
        note = (f"{describe_edit(e)}: predicted {pred:.4g} ms (incumbent {ref[0]:.4g}), "
                f"{what} {span:.4g} ms (incumbent {ref[1]:.4g}); {self.ranking()}: "
                f"{len(scored)} of {looked} scored candidates beat the incumbent; pool {len(pool)}")
        return Proposal(dict(inc.config), "edits", inc.trial, note, predicted_ms=pred,
                        meta={"edits": inc_edits + [e]})

    def observe(self, proposal: Proposal, record: Record) -> None:
        pass  # everything it needs is in the finished trials (resume-safe)

    def close(self) -> None:
        pass


# -- the LLM proposes edits ------------------------------------------------------------------
EDIT_TOOL = "propose_edits"


class LLMEditProposer:
    """Edit lists from a language model (the anthropic SDK, as ``search.proposers.LLMProposer``;
    ``client`` injected in tests, else built from ANTHROPIC_API_KEY).

    The request offers one tool, ``propose_edits``, whose input is ``{"edits": [...], "why"}``:
    the edits to APPEND to the incumbent's list. The prompt carries the edit ops, the
    incumbent's list, the summary of its schedule (``lowering.views``: stages, the predicted
    critical path, idle time per worker), the last results with their verdicts and the edits
    the validator rejected with their error classes and witnesses. The answer is checked with
    ``ir.edits.parse_edits``; a malformed one, an edit the validator already rejected or an
    evaluated list raises ``ProposalSkipped`` (the loop logs it and asks again, then falls
    back to the offline edit proposer).
    """

    name = "llm"

    def __init__(self, space: Any, client: Any = None, *, base: Callable[[], Any],
                 seq_len: int = 128, model: str | None = None, max_tokens: int = 2048,
                 history: int = 12):
        import os

        from search.proposers import API_KEY_ENV, DEFAULT_LLM_MODEL

        if client is None:
            if not os.environ.get(API_KEY_ENV):
                raise AmkError(f"--proposer llm needs {API_KEY_ENV} to be set "
                               "(or use --edits alone, the offline edit proposer)")
            import anthropic

            client = anthropic.Anthropic(max_retries=2)
        self.client = client
        self.space = space
        self.base = base
        self.seq_len = seq_len
        self.model = model or os.environ.get("AMK_LLM_MODEL") or DEFAULT_LLM_MODEL
        self.max_tokens = max_tokens
        self.history = history

    def tool(self) -> dict[str, Any]:
        from ir.edits import SCHEMA

        return {"name": EDIT_TOOL,
                "description": "Propose schedule edits to append to the incumbent's edit list "
                               "(usually one). Each edit is an object with an op and its fields.",
                "input_schema": {
                    "type": "object", "required": ["edits"],
                    "properties": {
                        "edits": {"type": "array", "minItems": 1, "items": {
                            "type": "object", "required": ["op"],
                            "properties": {"op": {"enum": list(SCHEMA)}}}},
                        "why": {"type": "string"}}}}

    def prompt(self, ctx: ProposalContext) -> str:
        """The user message (class docstring); never the whole program."""
        from ir.edits import OP_HELP, SCHEMA
        from lowering.views import format_summary, summary
        from search.proposers import redact
        from search.records import TSV_COLUMNS

        inc = ctx.incumbent
        inc_edits = list(inc.extra.get("edits") or []) if inc else []
        from lowering.placement import apply_edits

        prog = apply_edits(self.base(), parse_edits(inc_edits, "the incumbent's edits"))
        lines = [
            "You are improving the schedule of a persistent multi-GPU decode megakernel (amk) "
            "by editing it. Every edited schedule is statically validated (deadlock/race "
            "checks), checked against HF eager, then timed "
            f"({ctx.timing_source}). Answer ONLY by calling `{EDIT_TOOL}`.",
            "", "## Edit ops (fields: name kind, * = required)"]
        for op, spec in SCHEMA.items():
            fields = ", ".join(f"{k}{'*' if req else ''}:{kind}" for k, (kind, req) in spec.items())
            lines.append(f"- {op}({fields}): {OP_HELP[op]}")
        lines += ["", "## Incumbent",
                  f"trial {inc.trial if inc else '-'}, latency {inc.latency_ms if inc else '-'} ms; "
                  f"its edit list: {json.dumps(inc_edits)}",
                  format_summary(summary(prog, self.seq_len))]
        recent = ctx.records[-self.history:]
        if recent:
            lines += ["", "## Last results (TSV; status is the verdict)", "\t".join(TSV_COLUMNS)]
            lines += ["\t".join(r.row()) for r in recent]
        rej = rejected_edits(ctx.records)
        if rej:
            lines += ["", "## Edits the validator rejected (never propose them again)"]
            for k, v in list(rej.items())[-8:]:
                w = json.dumps(v["witnesses"], separators=(",", ":"), default=str)
                lines.append(f"- {k}: {', '.join(v['classes']) or v['reason'][:200]}; "
                             f"witness {w[:800]}")
        return redact("\n".join(lines))

    def propose(self, ctx: ProposalContext) -> Proposal | None:
        from search.proposers import ProposalSkipped, redact

        try:
            resp = self.client.messages.create(
                model=self.model, max_tokens=self.max_tokens, tools=[self.tool()],
                tool_choice={"type": "auto"},
                messages=[{"role": "user", "content": self.prompt(ctx)}])
        except Exception as err:  # SDK/network errors: skip this proposal, never crash
            raise ProposalSkipped(redact(" ".join(
                f"LLM request failed: {type(err).__name__}: {err}".split()))[:500],
                kind="request") from None
        blocks = getattr(resp, "content", None) or []

        def get(b: Any, k: str) -> Any:
            return b.get(k) if isinstance(b, dict) else getattr(b, k, None)

        calls = [b for b in blocks if get(b, "type") == "tool_use" and get(b, "name") == EDIT_TOOL]
        raw = redact(json.dumps([get(b, "input") for b in calls], default=str))[:2000]
        if len(calls) != 1 or not isinstance(get(calls[0], "input"), dict):
            raise ProposalSkipped(f"malformed LLM answer: expected one {EDIT_TOOL} call with an "
                                  f"object, got {len(calls)}", raw)
        inp = get(calls[0], "input")
        inc = ctx.incumbent
        inc_edits = list(inc.extra.get("edits") or []) if inc else []
        try:
            new = [edit_to_json(e) for e in parse_edits(inp.get("edits"), "the LLM's edits")]
        except AmkError as err:
            raise ProposalSkipped(redact(f"malformed LLM answer: {err}")[:500], raw) from None
        banned = rejected_edits(ctx.records)
        for e in new:
            if edit_key(e) in banned:
                raise ProposalSkipped(f"LLM proposed an edit the validator rejected in trial "
                                      f"{banned[edit_key(e)]['trial']}: {edit_key(e)}", raw)
        full = inc_edits + new
        if any(list_key(r.extra.get("edits") or []) == list_key(full) for r in ctx.records):
            raise ProposalSkipped("LLM proposed an already evaluated edit list", raw)
        why = " ".join(str(inp.get("why") or "").split())[:160]
        note = "; ".join(describe_edit(e) for e in new)[:200] + (f" ({why})" if why else "")
        return Proposal(dict(inc.config), "llm", inc.trial, redact(note), meta={"edits": full})

    def observe(self, proposal: Proposal, record: Record) -> None:
        pass

    def close(self) -> None:
        pass


def edit_to_json(e: Any) -> dict[str, Any]:
    """An ``ir.edits.Edit`` back to its JSON object (``op`` first)."""
    return {"op": e.op, **e.fields}
