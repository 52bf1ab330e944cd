"""Proposers: where the next candidate config of `amk search` comes from.

All proposers share one interface (``Proposer``): ``propose(ctx) -> Proposal | None`` (None:
nothing left to propose), ``observe(proposal, record)`` after the trial finished, and
``close()``. A proposer returns DATA (a candidate dict of knob values), never code; the loop
checks it against the search space before anything else happens.

- ``OptunaProposer`` (offline default): a pool of candidates, from optuna's TPE sampler
  (ask/tell; the study lives in a JournalStorage file so it survives a kill) and from
  mutations of the incumbent, is ranked by the cost model (``ctx.predict``) before
  anything is measured; the best unseen one is proposed. TPE proposals that lose the
  ranking are told to the study as PRUNED with the cost model's prediction as their
  step-0 intermediate value, so TPE learns from the ranking too.
- ``LLMProposer``: asks a model through the anthropic SDK, only when ANTHROPIC_API_KEY is
  set (or a client is injected, as the tests do with a mocked transport). The request
  carries one tool whose ``input_schema`` IS the candidate schema; the prompt carries the
  incumbent's schedule summary, the IR docs, the last results rows with their verdicts
  and the reasons recent candidates failed. A malformed answer (no tool call, wrong
  knobs or values, a repeat) or a failed request raises ``ProposalSkipped``: the loop
  logs it, says so on the console and falls back to a mutation; after
  ``--llm-max-failures`` failed requests in a row it stops unless ``--llm-fallback``.
  The API key is never written anywhere: every logged text goes through ``redact``.
  The client, the request, the tool-call parsing and the failure rule are functions
  (``llm_client``, ``ask_llm``, ``tool_input``, ``check_request_failures``) that
  `amk tune`'s LLM proposer (search/tuneproposer.py) uses too.
- ``ReplayProposer``: the configs of an earlier search's results.jsonl, in trial order.
- ``RandomProposer``: a uniformly random unseen candidate (plateau restarts).

TPE: Bergstra et al., "Algorithms for Hyper-Parameter Optimization", NeurIPS 2011, as
implemented by optuna's ``TPESampler``.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

from ground.errors import AmkError
from search.records import Record, iter_records
from search.space import SearchSpace

API_KEY_ENV = "ANTHROPIC_API_KEY"
DEFAULT_LLM_MODEL = "claude-sonnet-5-5"
TOOL_NAME = "propose_config"
#: Consecutive failed LLM requests (each already retried by the SDK) after which a run stops,
#: unless --llm-fallback asks to continue without the LLM (--llm-max-failures).
LLM_MAX_FAILURES = 3


class ProposalSkipped(Exception):
    """A proposer produced nothing usable this time (e.g. a malformed LLM answer).

    ``reason``: one line, already redacted; ``raw``: the (redacted, truncated) answer;
    ``kind``: ``answer`` (an answer came back but is unusable) or ``request`` (the request
    itself failed: network, HTTP or API error, after the client's own retries). The loop
    stops the search after too many ``request`` skips in a row (``--llm-max-failures``).
    """

    def __init__(self, reason: str, raw: str = "", kind: str = "answer"):
        super().__init__(reason)
        self.reason = reason
        self.raw = raw
        self.kind = kind


@dataclass
class Proposal:
    """A candidate and where it came from.

    config: knob values (a point of the space); proposer: the label recorded in the
    results (``optuna``, ``mutation``, ``random``, ``llm``, ``replay``, ``baseline``);
    parent: the trial it was derived from (None: not derived from one); note: a short
    why; predicted_ms: the cost model's prediction used to rank it (None: not ranked
    or the lowering failed); meta: proposer-private data (e.g. the optuna trial number).
    """

    config: dict[str, Any]
    proposer: str
    parent: int | None = None
    note: str = ""
    predicted_ms: float | None = None
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class ProposalContext:
    """What a proposer may look at.

    trial: the number the proposal will get; records: finished trials in order;
    incumbent: the current incumbent's record (None before the baseline finished);
    seen: candidate ids already evaluated (a proposer must not propose them again);
    predict: config -> cost-model latency in ms (None when it cannot be lowered or the
    validator rejects it); summary: config -> a JSON-able summary of its lowered schedule;
    timing_source: ``predicted`` | ``measured``; seed: the search's seed.
    """

    trial: int
    space: SearchSpace
    records: list[Record]
    incumbent: Record | None
    seen: set[str]
    predict: Callable[[dict[str, Any]], float | None]
    summary: Callable[[dict[str, Any]], dict[str, Any]] = lambda c: {}
    timing_source: str = "predicted"
    seed: int = 0

    def rng(self, salt: str) -> random.Random:
        """A generator determined by (seed, trial, salt): a resumed search re-draws the
        same numbers for the same trial."""
        return random.Random(f"{self.seed}:{self.trial}:{salt}")

    def unseen(self, config: dict[str, Any]) -> bool:
        return self.space.candidate_id(config) not in self.seen


class Proposer(Protocol):
    name: str

    def propose(self, ctx: ProposalContext) -> Proposal | None: ...

    def observe(self, proposal: Proposal, record: Record) -> None: ...

    def close(self) -> None: ...


def redact(text: str) -> str:
    """``text`` with the value of ANTHROPIC_API_KEY (if set) replaced by ``[redacted]``."""
    key = os.environ.get(API_KEY_ENV)
    if key and len(key) >= 4:
        text = text.replace(key, "[redacted]")
    return text


def _rank(cands: list[Proposal], ctx: ProposalContext) -> list[Proposal]:
    """Sort by the cost model's prediction (lowest first); unlowerable ones last, keeping
    their order."""
    for p in cands:
        if p.predicted_ms is None:
            p.predicted_ms = ctx.predict(p.config)
    return sorted(cands, key=lambda p: (p.predicted_ms is None, p.predicted_ms or 0.0))


# -- random / mutation ----------------------------------------------------------------
class RandomProposer:
    """A uniformly random unseen candidate (tries up to ``tries`` draws, then scans the
    space for any unseen point when it is small enough)."""

    name = "random"

    def __init__(self, tries: int = 200):
        self.tries = tries

    def propose(self, ctx: ProposalContext) -> Proposal | None:
        rng = ctx.rng("random")
        for _ in range(self.tries):
            c = ctx.space.random(rng)
            if ctx.unseen(c):
                return Proposal(c, "random", None, "random point")
        if ctx.space.size() <= 100_000:
            rest = [c for c in ctx.space.all() if ctx.unseen(c)]
            if rest:
                return Proposal(rng.choice(rest), "random", None, "random point")
        return None

    def observe(self, proposal: Proposal, record: Record) -> None:
        pass

    def close(self) -> None:
        pass


def mutations(ctx: ProposalContext, n: int) -> list[Proposal]:
    """Up to ``n`` distinct unseen mutations of the incumbent (1 knob, sometimes 2),
    falling back to its unseen one-knob neighbours."""
    if ctx.incumbent is None:
        return []
    base = ctx.incumbent.config
    rng = ctx.rng("mutation")
    out: dict[str, Proposal] = {}
    for _ in range(8 * n):
        if len(out) >= n:
            break
        c = ctx.space.mutate(base, rng, n_knobs=2 if rng.random() < 0.3 else 1)
        cid = ctx.space.candidate_id(c)
        if cid not in ctx.seen and cid not in out:
            out[cid] = Proposal(c, "mutation", ctx.incumbent.trial,
                                ctx.space.describe(c, base))
    if len(out) < n:
        for c in ctx.space.neighbours(base):
            cid = ctx.space.candidate_id(c)
            if cid not in ctx.seen and cid not in out:
                out[cid] = Proposal(c, "mutation", ctx.incumbent.trial,
                                    ctx.space.describe(c, base))
            if len(out) >= n:
                break
    return list(out.values())


# -- optuna TPE + mutation, ranked by the cost model ----------------------------------
class OptunaProposer:
    """Optuna TPE (ask/tell over a JournalStorage) plus mutation of the incumbent; the pool
    is ranked by the cost model and the best unseen candidate is proposed.

    journal: path of the journal file (created if missing; an existing study with the
    same name is loaded, which is how a killed search resumes). n_tpe / n_mutations:
    pool sizes per proposal. Trials that a kill left RUNNING are marked FAIL on open.
    """

    name = "optuna"
    STUDY = "amk-search"

    def __init__(self, space: SearchSpace, journal: str | os.PathLike, *, seed: int = 0,
                 n_tpe: int = 2, n_mutations: int = 3, n_startup: int = 6):
        import optuna
        from optuna.storages import JournalStorage
        from optuna.storages.journal import JournalFileBackend

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.optuna = optuna
        self.space = space
        self.dists = space.optuna_distributions()
        self.n_tpe, self.n_mutations = n_tpe, n_mutations
        storage = JournalStorage(JournalFileBackend(str(journal)))
        self.sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=n_startup)
        self.study = optuna.create_study(study_name=self.STUDY, storage=storage,
                                         sampler=self.sampler, direction="minimize",
                                         load_if_exists=True)
        from optuna.trial import TrialState

        self.TrialState = TrialState
        for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            self.study.tell(t.number, state=TrialState.FAIL)

    def sync(self, records: Sequence[Record]) -> int:
        """Add to the study every finished trial it does not know (records are the source
        of truth; a kill between the results append and the tell leaves such a gap).
        Returns how many were added."""
        known = {t.user_attrs.get("amk_trial") for t in self.study.get_trials(deepcopy=False)}
        added = 0
        for r in records:
            if r.trial in known or self.space.check(r.config):
                continue
            self._add(r)
            added += 1
        return added

    def _value(self, record: Record) -> float | None:
        ok = record.status in ("KEEP", "REVERT") and record.latency_ms is not None
        return float(record.latency_ms) if ok else None

    def _add(self, r: Record) -> None:
        from optuna.trial import create_trial

        v = self._value(r)
        params = self.space.canonical(r.config)
        t = create_trial(state=self.TrialState.COMPLETE if v is not None
                         else self.TrialState.FAIL, value=v, params=params,
                         distributions=self.dists,
                         user_attrs={"amk_trial": r.trial, "cid": r.candidate_id})
        self.study.add_trial(t)

    def _ask(self, ctx: ProposalContext) -> list[Proposal]:
        """Up to n_tpe unseen TPE proposals; asked trials that repeat a seen candidate are
        told the outcome recorded for it (so the study stays consistent) and skipped."""
        by_cid = {r.candidate_id: r for r in ctx.records}
        out: list[Proposal] = []
        for _ in range(self.n_tpe * 4):
            if len(out) >= self.n_tpe:
                break
            trial = self.study.ask(self.dists)
            c = self.space.canonical(dict(trial.params))
            cid = self.space.candidate_id(c)
            if cid in ctx.seen or any(self.space.candidate_id(p.config) == cid for p in out):
                rec = by_cid.get(cid)
                v = self._value(rec) if rec else None
                if v is not None:
                    self.study.tell(trial, v)
                else:
                    self.study.tell(trial, state=self.TrialState.FAIL)
                continue
            out.append(Proposal(c, "optuna", ctx.incumbent.trial if ctx.incumbent else None,
                                "TPE", meta={"optuna_trial": trial.number, "trial": trial}))
        return out

    def propose(self, ctx: ProposalContext) -> Proposal | None:
        pool = self._ask(ctx) + mutations(ctx, self.n_mutations)
        if not pool:
            return RandomProposer().propose(ctx)
        ranked = _rank(pool, ctx)
        best = ranked[0]
        for p in ranked[1:]:
            t = p.meta.get("trial")
            if t is not None:  # lost the cost-model ranking: pruned, with its prediction
                if p.predicted_ms is not None:
                    t.report(float(p.predicted_ms), step=0)
                self.study.tell(t, state=self.TrialState.PRUNED)
        if best.predicted_ms is not None:
            best.note = (best.note + "; " if best.note else "") + \
                f"ranked 1/{len(ranked)} by cost model ({best.predicted_ms:.4g} ms predicted)"
        return best

    def observe(self, proposal: Proposal, record: Record) -> None:
        t = proposal.meta.get("trial")
        v = self._value(record)
        if t is None:
            self._add(record)
            return
        t.set_user_attr("amk_trial", record.trial)
        t.set_user_attr("cid", record.candidate_id)
        if v is not None:
            self.study.tell(t, v)
        else:
            self.study.tell(t, state=self.TrialState.FAIL)

    def close(self) -> None:
        # Any trial still RUNNING (asked, never evaluated) is closed as FAIL.
        for t in self.study.get_trials(deepcopy=False, states=(self.TrialState.RUNNING,)):
            self.study.tell(t.number, state=self.TrialState.FAIL)


# -- replay ---------------------------------------------------------------------------
class ReplayProposer:
    """The configs of an earlier search (its results.jsonl, or a directory holding one),
    in trial order; configs that are not points of this search's space are skipped with a
    ProposalSkipped (logged by the loop). Returns None when the file is exhausted."""

    name = "replay"

    def __init__(self, source: str | os.PathLike):
        p = Path(source)
        if p.is_dir():
            p = p / "results.jsonl"
        if not p.exists():
            raise AmkError(f"replay source {p} does not exist (give a results.jsonl or a "
                           "search directory)")
        try:
            self.records = list(iter_records(p))
        except (ValueError, TypeError) as err:
            raise AmkError(f"replay source {p} is not a results.jsonl: {err}") from None
        self.pos = 0

    def propose(self, ctx: ProposalContext) -> Proposal | None:
        while self.pos < len(self.records):
            r = self.records[self.pos]
            self.pos += 1
            problems = ctx.space.check(r.config)
            if problems:
                raise ProposalSkipped(f"replayed trial {r.trial}: " + "; ".join(problems))
            c = ctx.space.canonical(r.config)
            if ctx.unseen(c):
                return Proposal(c, "replay", None, f"replay of trial {r.trial}")
        return None

    def observe(self, proposal: Proposal, record: Record) -> None:
        pass

    def close(self) -> None:
        pass


# -- the anthropic client, shared by the LLM proposers of `amk search` and `amk tune` ---
class ProposerUnavailable(AmkError):
    """The proposer's backend failed too often in a row (e.g. the LLM API is unreachable);
    the run stops after writing its state and summary."""


def llm_client(client: Any, offline: str) -> Any:
    """``client`` when given (the tests inject one over a mocked transport), else an
    ``anthropic.Anthropic`` that reads ANTHROPIC_API_KEY (and ANTHROPIC_BASE_URL) itself.
    Raises AmkError naming the variable when the key is not set; ``offline`` names the
    command's offline proposer in that message."""
    if client is not None:
        return client
    if not os.environ.get(API_KEY_ENV):
        raise AmkError(f"--proposer llm needs {API_KEY_ENV} to be set "
                       f"(or use --proposer {offline}, the offline default)")
    import anthropic

    return anthropic.Anthropic(max_retries=2)


def ask_llm(client: Any, model: str, max_tokens: int, tool: dict[str, Any], prompt: str) -> Any:
    """One Messages API request offering the single ``tool``; the response. Any SDK or
    network error (after the client's own retries) raises ProposalSkipped of kind
    ``request`` with a redacted one-line reason."""
    try:
        return client.messages.create(
            model=model, max_tokens=max_tokens, tools=[tool], tool_choice={"type": "auto"},
            messages=[{"role": "user", "content": prompt}])
    except Exception as err:  # SDK/network errors: skip this proposal, never crash
        cause = err.__cause__ or err.__context__
        detail = f" ({type(cause).__name__}: {cause})" if cause is not None and \
            str(cause) and str(cause) not in str(err) else ""
        raise ProposalSkipped(redact(" ".join(
            f"LLM request failed: {type(err).__name__}: {err}{detail}".split()))[:500],
            kind="request") from None


def tool_input(resp: Any, name: str) -> tuple[dict[str, Any], str, str]:
    """(the input object of the one ``name`` tool call, the answer's text, the redacted raw
    answer truncated to 2000 chars) of a Messages API response. Raises ProposalSkipped
    (kind ``answer``) when there is not exactly one such call or its input is no object."""
    blocks = getattr(resp, "content", None)
    if blocks is None and isinstance(resp, dict):
        blocks = resp.get("content")
    blocks = blocks or []

    def get(b, k):
        return b.get(k) if isinstance(b, dict) else getattr(b, k, None)

    calls = [b for b in blocks if get(b, "type") == "tool_use"]
    text = " ".join(str(get(b, "text") or "") for b in blocks if get(b, "type") == "text")
    raw = redact(json.dumps([{"type": get(b, "type"), "name": get(b, "name"),
                              "input": get(b, "input"), "text": get(b, "text")}
                             for b in blocks], default=str))[:2000]
    mine = [b for b in calls if get(b, "name") == name]
    if len(mine) != 1:
        raise ProposalSkipped(f"malformed LLM answer: expected one {name} call, got "
                              f"{len(mine)} (tool calls: {[get(b, 'name') for b in calls]})", raw)
    inp = get(mine[0], "input")
    if not isinstance(inp, dict):
        raise ProposalSkipped("malformed LLM answer: tool input is not an object", raw)
    return inp, text, raw


def check_request_failures(proposer: str, failures: int, limit: int, fallback: bool,
                           skip: ProposalSkipped, resume: str, instead: str) -> None:
    """After a failed proposer request (``failures`` in a row): raise ProposerUnavailable,
    one redacted line naming the last error and how to go on (``resume``: the command that
    resumes the run; ``instead``: what --llm-fallback continues with), once ``failures``
    reaches ``limit`` unless ``fallback``."""
    if failures >= limit and not fallback:
        raise ProposerUnavailable(redact(
            f"--proposer {proposer}: {failures} requests in a row failed (last: "
            f"{skip.reason.removeprefix('LLM request failed: ')}); check the network, "
            f"ANTHROPIC_BASE_URL and the key, or continue with {instead}: "
            f"{resume} --llm-fallback"))


# -- LLM ------------------------------------------------------------------------------
def ir_docs(limit: int = 12000) -> str:
    """The IR documentation for the LLM prompt: docs/ir.md when present, else the
    semantics docstrings of ir/program.py and ir/ops.py; truncated to ``limit`` chars."""
    root = Path(__file__).resolve().parent.parent
    md = root / "docs" / "ir.md"
    if md.exists():
        text = md.read_text(encoding="utf-8")
    else:
        import ir.ops
        import ir.program

        text = (ir.program.__doc__ or "") + "\n" + (ir.ops.__doc__ or "")
    return text if len(text) <= limit else text[:limit] + "\n[... truncated]"


class LLMProposer:
    """Proposals from a language model through the anthropic SDK (Messages API, one tool
    whose input schema is the candidate schema).

    client: an object with ``messages.create(**kwargs)`` (an ``anthropic.Anthropic``);
    when None, one is built from ANTHROPIC_API_KEY, and without the key AmkError is
    raised (the LLM proposer is used only when a key is set). model: the model id
    (``--llm-model`` / AMK_LLM_MODEL; default DEFAULT_LLM_MODEL). history: how many
    recent results rows go into the prompt.
    """

    name = "llm"

    def __init__(self, space: SearchSpace, client: Any = None, *, model: str | None = None,
                 max_tokens: int = 1024, history: int = 20, docs: str | None = None):
        self.client = llm_client(client, "optuna")
        self.space = space
        self.model = model or os.environ.get("AMK_LLM_MODEL") or DEFAULT_LLM_MODEL
        self.max_tokens = max_tokens
        self.history = history
        self.docs = docs if docs is not None else ir_docs()

    def tool(self) -> dict[str, Any]:
        """The single tool offered to the model; its input_schema is the candidate schema."""
        return {"name": TOOL_NAME,
                "description": "Propose the next lowering config to evaluate. The input is "
                               "the complete config: one value per knob, from its enum.",
                "input_schema": self.space.json_schema()}

    def prompt(self, ctx: ProposalContext) -> str:
        """The user message: task, knobs, incumbent and its schedule summary, recent rows
        with verdicts, recent failure reasons, the already-evaluated configs, IR docs."""
        from search.records import TSV_COLUMNS

        inc = ctx.incumbent
        lines = [
            "You are tuning the schedule of a persistent multi-GPU decode megakernel (amk).",
            f"Goal: minimise the {ctx.timing_source} latency per decode step. Every candidate "
            "is lowered, statically validated (deadlock/race checks), checked for correctness "
            "against HF eager, then timed. Answer ONLY by calling the tool "
            f"`{TOOL_NAME}` with a complete config; do not write code.",
            "",
            "## Knobs",
        ]
        for k in ctx.space.knobs:
            lines.append(f"- {k.name}: one of {list(k.values)} (default {k.default!r}). {k.help}")
        if ctx.space.fixed:
            lines.append(f"Fixed for this search (not knobs): {json.dumps(ctx.space.fixed)}")
        if inc is not None:
            lines += ["", "## Incumbent",
                      f"trial {inc.trial}, config {json.dumps(ctx.space.canonical(inc.config))}, "
                      f"latency {inc.latency_ms} ms ({inc.timing_source})",
                      "schedule summary: " + json.dumps(ctx.summary(inc.config), sort_keys=True)]
        recent = ctx.records[-self.history:]
        if recent:
            lines += ["", "## Last results (TSV; status is the verdict)",
                      "\t".join(TSV_COLUMNS)]
            lines += ["\t".join(r.row()) for r in recent]
        fails = [r for r in ctx.records if r.status in ("REJECTED", "FAIL", "TIMEOUT")][-8:]
        if fails:
            lines += ["", "## Why recent candidates failed"]
            lines += [f"- trial {r.trial} {r.status} {json.dumps(r.config)}: {r.reason}"
                      for r in fails]
        lines += ["", "## Already evaluated (do not propose these again; newest 200)"]
        lines += [json.dumps(ctx.space.canonical(r.config)) for r in ctx.records[-200:]
                  if not ctx.space.check(r.config)]
        lines += ["", "## IR documentation", self.docs]
        return redact("\n".join(lines))

    def propose(self, ctx: ProposalContext) -> Proposal | None:
        resp = ask_llm(self.client, self.model, self.max_tokens, self.tool(), self.prompt(ctx))
        config, text = self.parse(resp)
        cid = self.space.candidate_id(config)
        if cid in ctx.seen:
            raise ProposalSkipped(f"LLM proposed an already evaluated candidate {cid}",
                                  redact(json.dumps(config)))
        note = " ".join(text.split())[:160] if text else "LLM proposal"
        return Proposal(config, "llm", ctx.incumbent.trial if ctx.incumbent else None,
                        redact(note))

    def parse(self, resp: Any) -> tuple[dict[str, Any], str]:
        """The (config, text) of a Messages API response. Raises ProposalSkipped when there
        is not exactly one ``propose_config`` call or its input does not fit the schema."""
        inp, text, raw = tool_input(resp, TOOL_NAME)
        problems = self.space.check(inp)
        missing = [k for k in self.space.names if k not in inp]
        if missing:
            problems.append(f"missing knobs {missing}")
        if problems:
            raise ProposalSkipped("malformed LLM answer: " + "; ".join(problems), raw)
        return self.space.canonical(inp), text

    def observe(self, proposal: Proposal, record: Record) -> None:
        pass

    def close(self) -> None:
        pass
