"""The LLM proposer of `amk tune` (``--proposer llm``): each round a language model, through the
anthropic SDK, proposes up to K whole-config candidates.

The request carries one tool, ``propose_configs``, whose input is ``{"candidates": [{"changes":
{knob: value, ...}, "why": "..."}, ...]}``: ``changes`` is the JSON schema of a partial candidate
of the tuning space (``TuneSpace.json_schema(required=False)``: every knob with its values and
its help line), the knobs a candidate changes against the incumbent (all of them: a full
config). The prompt (``TuneLLMProposer.prompt``) holds the same schema, the incumbent's full
config and latency, the shares of the step per op family that the round's ranking uses (and
their source: the in-kernel profile or the cost model), the trials so far (their knob changes
against the incumbent, status, ms and reason, the screen's refusals included), the nearest
entries of the tuning database (``TuneDB.nearest``) and the errors of the earlier answers.

A candidate naming an unknown or fixed knob, a value off the knob's list, or repeating an
evaluated config is a *proposer error* (returned, never raised); the others are made
candidates of the run (``TuneSpace.settle``: a knob the change leaves without effect goes
back to its default) and the tuner screens and evaluates them like every other candidate.
The client, the key handling, the request and its failure policy are the search's
(search/proposers.py): ``llm_client``, ``ask_llm``, ``tool_input``, ``redact``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from search.proposers import DEFAULT_LLM_MODEL, ProposalSkipped, ask_llm, llm_client, redact, tool_input
from search.tunespace import TuneSpace, candidate_id

TUNE_TOOL = "propose_configs"
#: Candidates asked for per round (``--llm-candidates``).
DEFAULT_K = 4


@dataclass
class TuneContext:
    """What the LLM proposer of a tuning round sees.

    incumbent: ``{"trial", "id", "ms", "config"}`` (ms of ``timing_source``); shares: op family
    -> share of the step (sums to 1) and ``shares_source`` naming where they come from;
    trials: the trial rows so far (search/tune.py's rows: ``trial``, ``kind``, ``config``,
    ``status``, ``ms``, ``reason``); nearest: ``(distance, search.tunedb.Entry)`` of the
    database; errors: the proposer errors of earlier answers (one line each); seen: candidate
    ids already tried (never proposed again); round: the round number.
    """

    incumbent: dict[str, Any]
    shares: dict[str, float]
    shares_source: str
    timing_source: str
    trials: list[dict[str, Any]] = field(default_factory=list)
    nearest: list[tuple[float, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    seen: set[str] = field(default_factory=set)
    round: int = 0


@dataclass
class TuneAnswer:
    """One answer: ``candidates`` as ``(config, note)`` ready for the tuner, ``errors`` (one
    line per unusable candidate), the answer's ``text`` and its redacted ``raw`` form."""

    candidates: list[tuple[dict[str, Any], str]]
    errors: list[str]
    text: str
    raw: str


class TuneLLMProposer:
    """Whole-config candidates of a tuning round from a language model.

    space: the run's TuneSpace; client: an object with ``messages.create(**kwargs)`` (None: an
    ``anthropic.Anthropic`` from ANTHROPIC_API_KEY; AmkError without the key); model: the
    model id (None: $AMK_LLM_MODEL, else DEFAULT_LLM_MODEL); k: candidates per answer;
    history: how many of the latest trials go into the prompt.
    """

    name = "llm"

    def __init__(self, space: TuneSpace, client: Any = None, *, model: str | None = None, k: int = DEFAULT_K,
                 max_tokens: int = 4096, history: int = 60):
        self.client = llm_client(client, "local")
        self.space = space
        self.model = model or os.environ.get("AMK_LLM_MODEL") or DEFAULT_LLM_MODEL
        self.k = k
        self.max_tokens = max_tokens
        self.history = history

    def tool(self) -> dict[str, Any]:
        """The one tool offered: up to ``k`` candidates, each a knob -> value object."""
        item = {"type": "object", "properties": {
            "changes": self.space.json_schema(required=False),
            "why": {"type": "string", "description": "one line: why this should be faster"}},
            "required": ["changes"]}
        return {"name": TUNE_TOOL,
                "description": f"Propose up to {self.k} configs to evaluate next. Each candidate gives the "
                               "knobs it changes against the incumbent (all knobs: a full config), each value "
                               "from its enum.",
                "input_schema": {"type": "object", "properties": {
                    "candidates": {"type": "array", "minItems": 1, "maxItems": self.k, "items": item}},
                    "required": ["candidates"]}}

    def prompt(self, ctx: TuneContext) -> str:
        """The user message (redacted): task, space, incumbent, shares, trials, database
        entries and earlier errors."""
        inc = ctx.incumbent
        lines = [
            "You are tuning a persistent decode megakernel (amk): its lowering knobs (the task schedule)"
            + (" and its Triton kernel knobs." if any(k.part == "kernel" for k in self.space.knobs) else "."),
            f"Goal: minimise the {ctx.timing_source} latency per decode step. Every candidate is screened "
            "(knob rules, resources), lowered, statically validated, checked against the eager model and "
            f"timed against the incumbent. Answer ONLY by calling `{TUNE_TOOL}` with up to {self.k} "
            "candidates; any knob may change.",
            "", "## Knobs (JSON schema of a candidate's changes)",
            json.dumps(self.space.json_schema(required=False), sort_keys=True),
        ]
        if self.space.fixed:
            lines.append(f"Fixed for this run (not knobs): {json.dumps(self.space.fixed, sort_keys=True)}")
        lines += ["", "## Incumbent",
                  f"trial {inc['trial']}, {inc['ms']:.6g} ms ({ctx.timing_source}), config "
                  + json.dumps(inc["config"], sort_keys=True),
                  "", f"## Share of the step per op family (source: {ctx.shares_source})"]
        lines += [f"- {f}: {v * 100:.1f}%" for f, v in ctx.shares.items()]
        lines += ["", "## Trials so far (changes against the incumbent; status; ms; reason)"]
        trials = ctx.trials[-self.history:]
        if not trials:
            lines.append("none")
        for r in trials:
            ms = f"{r['ms']:.6g} ms" if r.get("ms") is not None else "-"
            which = f"trial {r['trial']}" if r.get("trial") is not None else "screened"
            lines.append(f"- {which} [{r.get('kind')}] {self.space.describe(r['config'], inc['config'])}: "
                         f"{r['status']}; {ms}; {r.get('reason') or '-'}")
        lines += ["", "## Nearest entries of the tuning database (shape, GPU, tp, ms, config)"]
        if not ctx.nearest:
            lines.append("none")
        for dist, e in ctx.nearest:
            lines.append(f"- distance {dist:.3g}: shape {json.dumps(e.shape.to_json(), sort_keys=True)}, "
                         f"GPU {e.gpu.name} ({e.gpu.sms} SMs), tp {e.tp}, {e.ms:.6g} ms, config "
                         + json.dumps(e.config, sort_keys=True))
        if ctx.errors:
            lines += ["", "## Errors in your earlier answers (avoid them)"]
            lines += [f"- {e}" for e in ctx.errors[-10:]]
        return redact("\n".join(lines))

    def propose(self, ctx: TuneContext, prompt: str | None = None) -> TuneAnswer:
        """Ask the model (``prompt``: the text of ``prompt(ctx)`` when already built) and check
        its answer. Raises ProposalSkipped: kind ``request`` when the request failed, ``answer``
        when there is no ``propose_configs`` call or its input has no candidate list."""
        resp = ask_llm(self.client, self.model, self.max_tokens, self.tool(), prompt or self.prompt(ctx))
        inp, text, raw = tool_input(resp, TUNE_TOOL)
        return self.check(inp, ctx, text, raw)

    def check(self, inp: dict[str, Any], ctx: TuneContext, text: str = "", raw: str = "") -> TuneAnswer:
        """The candidates of a tool input, checked against the space (see the module
        docstring); raises ProposalSkipped (``answer``) without a ``candidates`` list."""
        items = inp.get("candidates")
        if not isinstance(items, list) or not items:
            raise ProposalSkipped("malformed LLM answer: no candidates list in the tool input", raw)
        errors: list[str] = []
        if len(items) > self.k:
            errors.append(f"{len(items)} candidates, more than the {self.k} asked for: the first {self.k} kept")
            items = items[:self.k]
        base = ctx.incumbent["config"]
        out: list[tuple[dict[str, Any], str]] = []
        ids = set(ctx.seen)
        for i, item in enumerate(items, 1):
            cand, why = self._candidate(item, base)
            if cand is None:
                errors.append(redact(f"candidate {i}: {why}")[:300])
                continue
            cid = candidate_id(cand)
            if cid in ids:
                errors.append(f"candidate {i}: repeats an evaluated or listed config ({cid}: "
                              f"{self.space.describe(cand, base)})")
                continue
            ids.add(cid)
            note = self.space.describe(cand, base) + (f" ({why})" if why else "")
            out.append((cand, redact(" ".join(note.split()))[:200]))
        return TuneAnswer(out, errors, text, raw)

    def _candidate(self, item: Any, base: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
        """(candidate, why) of one answer item, or (None, the problem)."""
        if not isinstance(item, dict) or not isinstance(item.get("changes"), dict):
            return None, "not an object with a 'changes' object"
        changes = dict(item["changes"])
        for part in ("lowering", "kernel"):  # a full config in AmkConfig form: flattened
            if isinstance(changes.get(part), dict):
                changes.update(changes.pop(part))
        cand = base
        for name, value in changes.items():
            if name in self.space.fixed:
                if self.space.fixed[name] != value:
                    return None, f"{name} is fixed at {self.space.fixed[name]!r} for this run"
                continue
            if name not in self.space.names:
                return None, f"unknown knob {name!r}"
            vals = self.space.knob(name).values
            if not any(type(v) is type(value) and v == value for v in vals):
                return None, f"{name}={value!r} is not one of {list(vals)}"
            cand = self.space.with_value(cand, name, value)
        settled = self.space.settle(cand)
        back = [n for n in self.space.changed(cand, settled)]
        why = " ".join(str(item.get("why") or "").split())[:120]
        if back:
            why = (why + "; " if why else "") + f"set back (no effect): {', '.join(back)}"
        return settled, why
