"""The search loop of `amk search`: propose -> evaluate -> decide -> record -> checkpoint.

One trial:

1. a proposer proposes a candidate (trial 0 is always the lowering's default config, the
   *start*; after a plateau, one restart from a random point);
2. the evaluator runs it in a subprocess (lower -> validate -> correctness gate -> timing);
3. ``decide`` turns the result into a verdict: KEEP (the new incumbent), REVERT (correct,
   not faster beyond noise), REJECTED (the validator or the lowering refused it; no backend
   time spent), FAIL (wrong outputs, a crash, a timing below the roofline floor), TIMEOUT;
4. the record is appended to results.jsonl and results.tsv (fsync), the proposer is told,
   the incumbent's schedule is saved on KEEP, and state.json is rewritten.

Stopping rules: the budget (``trials`` in total, counting trial 0, and/or ``minutes`` of
search time summed over resumed runs); a plateau (``plateau`` consecutive trials without a
KEEP triggers ONE restart from a random point; the second plateau stops the search); the
best candidate within ``target_pct`` percent of the roofline; a proposer with nothing left.

Resume: the state is a pure function of results.jsonl (``replay_state``), so a search
killed at any point continues from its last finished trial; trial numbers continue.
"""

from __future__ import annotations

import json
import os
import shlex
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from ground.errors import AmkError
from search.evaluator import Evaluator, new_workdir
from search.proposers import (
    LLM_MAX_FAILURES, LLMProposer, OptunaProposer, Proposal, ProposalContext, ProposalSkipped, ProposerUnavailable,
    RandomProposer, ReplayProposer, check_request_failures, mutations, redact,
)
from ground.files import atomic_write_json
from search.records import Record, ResultsStore, append_line, apply_overrides, resume_settings, settings_from_json
from search.space import SearchSpace, same_type, space_for

STATE_VERSION = 1
# Relative margin a predicted latency must beat: the cost model is deterministic, so any
# real improvement counts; this only absorbs float rounding.
PREDICTED_EPS = 1e-9
MAX_SKIPS = 3          # consecutive skipped proposals before falling back to a mutation
MAX_RESTART_TRIES = 5  # random restart points tried before giving up on the restart


def absolute_model_arg(model: str) -> str:
    """``model`` with a local path made absolute (recipes, aliases and missing paths are
    returned unchanged: ``models.sources.parse_model_arg`` reports those). The evaluation
    worker runs in another working directory, so a relative path would name nothing there."""
    from models.sources import ALIASES, RECIPE_PREFIX

    if not model or model.startswith(RECIPE_PREFIX) or model in ALIASES:
        return model
    p = Path(os.path.expanduser(model))
    return str(p.resolve()) if p.exists() else model


@dataclass
class SearchSettings:
    """Everything that defines a search (saved in state.json; a resume reuses it).

    model: MODEL argument; tp: ranks; backend: sim | triton; proposer: optuna | llm |
    replay | edits (an edit search: every candidate is a schedule edit list against the
    lowered start config, search/edit_proposer.py); trials: total trials including trial 0 (None: no limit); minutes: search
    time budget over all runs (None: no limit); out: the search directory; seed: seeds
    the proposers, prompts and interleavings; dtype / max_seq: fixed lowering fields;
    positions: decode positions compared with HF eager; seq_len: context length the
    latency refers to; timeout_s: per-candidate evaluation limit; plateau: trials without
    KEEP before a restart (then stop); target_pct: stop when the best is within this
    percent of the roofline (e.g. 80: best latency <= roofline / 0.8); replay: the results
    to replay; llm_model: model id for the LLM proposer; isolation: persistent | fresh
    worker; timing: A/B parameters (rounds, steps, warmup, min_gain); tolerance: gate
    tolerances (rel_err, min_argmax_agree; defaults by dtype); max_workers: the target's
    co-residency limit (default: 132 SMs of an H100); sim_policy: the sim's interleaving
    policy for the gate; hooks: test-only dotted names passed to the worker;
    llm_fallback: after a failed LLM request, continue with a mutation however many
    requests failed in a row; llm_max_failures: without llm_fallback, the search stops
    after this many consecutive failed LLM requests; start: lowering knobs of trial 0 (from
    ``--config`` and the knob flags; None: the lowering's defaults); kernel: the kernel knobs
    (a KernelConfig's JSON, held for the whole search: the triton backend runs every candidate
    with them; {}: the defaults), written with the best lowering knobs to best/config.json;
    edits: an edit search (``--edits``; with proposer ``llm`` the LLM proposes the edits,
    with proposer ``edits`` the offline edit proposer does). approve: ``--approve``, every
    proposal after trial 0 waits for a reviewer's decision (search/review.py, ``amk ui``).
    profile: ``--profile TRACE``, a trace of the base schedule written by ``amk profile
    --trace`` whose measured task durations rank the offline edit proposer's candidates
    (search/edit_proposer.py); an edit search only, kept by a resume.
    pattern: a communication pattern's search (``amk search FILE.py:FUNC``; None: a model's):
    ``{"function": "FILE.py:FUNC", "world": R, "shapes": {param: dims}, "spec": the captured
    pattern (search.patterns.pattern_to_json)}``; ``model`` is then the function, ``tp`` the
    world size, ``start`` and the candidates collective knobs (search/patterns.py).
    """

    model: str
    out: str
    tp: int = 1
    backend: str = "sim"
    proposer: str = "optuna"
    trials: int | None = 30
    minutes: float | None = None
    seed: int = 0
    dtype: str = "f32"
    max_seq: int = 256
    positions: list[int] = field(default_factory=lambda: [0, 3, 7])
    seq_len: int = 128
    timeout_s: float = 600.0
    plateau: int = 10
    target_pct: float | None = None
    replay: str | None = None
    llm_model: str | None = None
    isolation: str = "persistent"
    timing: dict[str, Any] = field(default_factory=lambda: {
        "rounds": 7, "steps": 20, "warmup": 3, "min_gain": 0.01})
    tolerance: dict[str, Any] | None = None
    max_workers: int = 132
    sim_policy: str = "random"
    hooks: dict[str, str] = field(default_factory=dict)
    llm_fallback: bool = False
    llm_max_failures: int = LLM_MAX_FAILURES
    start: dict[str, Any] | None = None
    kernel: dict[str, Any] = field(default_factory=dict)
    config_source: str | None = None  # where start and kernel came from (search/defaults.py)
    edits: bool = False  # with proposer llm: the LLM proposes edit lists (an edit search)
    approve: bool = False  # hold each proposal after trial 0 for review (search/review.py)
    profile: str | None = None  # a trace of the base schedule: measured task durations
    pattern: dict[str, Any] | None = None  # a communication pattern's search (amk search FILE.py:FUNC)

    def check(self) -> None:
        """Raise AmkError naming the bad setting."""
        if self.tp < 1:
            raise AmkError(f"--tp must be >= 1, got {self.tp}")
        if self.backend not in ("sim", "triton"):
            raise AmkError(f"--backend must be sim or triton, got {self.backend!r}")
        if self.proposer not in ("optuna", "llm", "replay", "edits"):
            raise AmkError(f"--proposer must be optuna, llm, replay or edits, got {self.proposer!r}")
        if self.edits and self.proposer not in ("edits", "llm"):
            raise AmkError(f"--edits proposes schedule edits offline (--proposer edits) or "
                           f"with --proposer llm, not with --proposer {self.proposer}")
        if self.proposer == "replay" and not self.replay:
            raise AmkError("--proposer replay needs --replay RESULTS (a results.jsonl or a "
                           "search directory)")
        if self.trials is not None and self.trials < 1:
            raise AmkError(f"--trials must be >= 1, got {self.trials}")
        if self.minutes is not None and self.minutes <= 0:
            raise AmkError(f"--minutes must be > 0, got {self.minutes}")
        if self.trials is None and self.minutes is None:
            raise AmkError("give a budget: --trials N and/or --minutes M")
        if not self.positions or min(self.positions) < 0:
            raise AmkError(f"--positions must be non-negative, got {self.positions}")
        if max(self.positions) >= self.max_seq:
            raise AmkError(f"--positions {max(self.positions)} must be below --max-seq "
                           f"{self.max_seq}")
        if not 1 <= self.seq_len <= self.max_seq:
            raise AmkError(f"--seq-len must be in 1..{self.max_seq} (--max-seq), got "
                           f"{self.seq_len}")
        if self.plateau < 1:
            raise AmkError(f"--plateau must be >= 1, got {self.plateau}")
        if self.target_pct is not None and not 0 < self.target_pct <= 100:
            raise AmkError(f"--target-pct must be in (0, 100], got {self.target_pct}")
        if self.timeout_s <= 0:
            raise AmkError(f"--timeout must be > 0, got {self.timeout_s}")
        if self.profile and not self.edit_mode:
            raise AmkError("--profile TRACE ranks the offline edit proposer's candidates by measured "
                           "task durations: it needs --edits")
        if self.llm_max_failures < 1:
            raise AmkError(f"--llm-max-failures must be >= 1, got {self.llm_max_failures}")
        if self.pattern is not None and self.edit_mode:
            raise AmkError("a pattern's search proposes collective knobs: --edits and --proposer edits "
                           "take a model")

    def absolute(self) -> "SearchSettings":
        """A copy whose paths (out, a local model, replay) are absolute, resolved against
        the current working directory once; every later use (the worker subprocess, a
        resume from elsewhere) then names the same files."""
        return replace(self, out=str(Path(os.path.expanduser(self.out)).resolve()),
                       model=self.model if self.pattern else absolute_model_arg(self.model),
                       replay=str(Path(os.path.expanduser(self.replay)).resolve())
                       if self.replay else None,
                       profile=str(Path(os.path.expanduser(self.profile)).resolve())
                       if self.profile else None)

    @property
    def edit_mode(self) -> bool:
        """True for an edit search (``--edits``): candidates are edit lists against the base."""
        return self.proposer == "edits" or (self.edits and self.proposer == "llm")

    def gate_tolerance(self) -> dict[str, Any]:
        """Correctness tolerances: f32 agrees with HF eager to ~1e-6 relative and must
        pick the same argmax; bf16 rounding allows 5e-2 relative and argmax flips on
        near-ties."""
        if self.tolerance:
            return dict(self.tolerance)
        if self.dtype == "f32":
            return {"rel_err": 2e-3, "min_argmax_agree": 1.0}
        return {"rel_err": 5e-2, "min_argmax_agree": 0.5}

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(d: dict[str, Any]) -> "SearchSettings":
        return settings_from_json(SearchSettings, d)


@dataclass
class LoopState:
    """The loop's state, a pure function of the finished trials (see ``replay_state``).

    baseline: trial 0's record when it passed (the start of speedups); incumbent: the
    current incumbent (parent of mutations, A/B reference); best: the fastest KEEP so far;
    plateau: trials since the last KEEP (or restart); restarts: restarts done;
    restart_pending / restart_tries: a restart is under way; stop_reason: set when a
    stopping rule fired.
    """

    baseline: Record | None = None
    incumbent: Record | None = None
    best: Record | None = None
    plateau: int = 0
    restarts: int = 0
    restart_pending: bool = False
    restart_tries: int = 0
    stop_reason: str | None = None

    def apply(self, rec: Record, s: SearchSettings) -> None:
        """Advance the state by one finished trial (used live and on resume)."""
        if rec.trial == 0 and rec.status == "KEEP":
            self.baseline = rec
        if self.baseline is None and rec.status == "KEEP":
            self.baseline = rec  # trial 0 failed: the first correct candidate is the start
        is_restart = bool(rec.extra.get("restart"))
        if rec.status == "KEEP":
            self.incumbent = rec
            if self.best is None or (rec.latency_ms is not None and self.best.latency_ms is not None
                                     and rec.latency_ms < self.best.latency_ms):
                self.best = rec
            self.plateau = 0
            if is_restart:
                self.restart_pending, self.restart_tries = False, 0
        else:
            self.plateau += 1
            if is_restart:
                self.restart_tries += 1
                if self.restart_tries >= MAX_RESTART_TRIES:
                    self.restart_pending, self.restart_tries = False, 0
        if self.plateau >= s.plateau and not self.restart_pending:
            if self.restarts < 1 and not s.edit_mode:  # an edit search has no random point
                self.restarts += 1
                self.restart_pending, self.restart_tries, self.plateau = True, 0, 0
            else:
                self.stop_reason = (f"plateau: {s.plateau} trials without improvement after "
                                    "a restart")
        if s.target_pct is not None and self.best is not None and \
                (self.best.pct_roofline or 0) >= s.target_pct:
            self.stop_reason = (f"best is at {self.best.pct_roofline:.1f}% of the roofline "
                                f"(target {s.target_pct:g}%)")


def replay_state(records: list[Record], s: SearchSettings) -> LoopState:
    st = LoopState()
    for r in records:
        st.apply(r, s)
    return st


# -- the decision -----------------------------------------------------------------------
def decide(res: dict[str, Any], proposal: Proposal, trial: int, state: LoopState,
           space: SearchSpace, s: SearchSettings) -> Record:
    """The verdict of one evaluated candidate, as a Record (see the module docstring).

    A latency is recorded only for a candidate that passed the correctness gate and whose
    timing was accepted (not below the floor); it always comes with its status and its
    ``timing_source``.
    """
    cid = candidate_key(space, proposal)
    base = state.incumbent.config if state.incumbent else None
    edits = proposal.meta.get("edits")
    if edits is not None:
        desc = f"{len(edits)} edit(s) on the base"
    else:
        desc = space.describe(proposal.config)
    if base is not None and proposal.parent is not None and edits is None:
        desc += f" [{space.describe(proposal.config, base)}]"
    if proposal.note:
        desc += f" ({proposal.note})"
    rec = Record(trial=trial, parent=proposal.parent, proposer=proposal.proposer,
                 candidate_id=cid, config=space.canonical(proposal.config), status="FAIL",
                 eval_s=res.get("wall_s"), description=redact(desc)[:400],
                 correctness=_correctness(res.get("correctness")),
                 roofline_ms=res.get("floor_ms"))
    rec.extra = {k: res[k] for k in ("program", "verdict", "times", "stage", "worker_pid")
                 if k in res}
    if edits is not None:
        rec.extra["edits"] = list(edits)
    if proposal.meta.get("restart"):
        rec.extra["restart"] = True
    if proposal.meta.get("fallback"):
        rec.extra["fallback"] = redact(str(proposal.meta["fallback"]))[:400]
    if proposal.predicted_ms is not None:
        rec.extra["ranked_predicted_ms"] = proposal.predicted_ms
    status = res.get("status")
    if status == "timeout":
        rec.status, rec.reason = "TIMEOUT", res.get("reason", "timed out")
        return rec
    if status == "rejected":
        rec.status, rec.reason = "REJECTED", res.get("reason", "")
        return rec
    if status != "ok":
        rec.status, rec.reason = "FAIL", res.get("reason", "") or f"evaluation {status}"
        return rec
    timing = res.get("timing") or {}
    lat = timing.get("median_ms")
    source = timing.get("source")
    floor = res.get("floor_ms")
    if lat is None or source not in ("predicted", "measured"):
        rec.status, rec.reason = "FAIL", "the evaluation returned no usable timing"
        return rec
    # The parent re-checks the floor: a worker that skipped its check must not slip through.
    from search.evaluator import below_floor

    if floor is not None and below_floor(lat, floor):
        rec.status, rec.reason = "FAIL", (f"timing {lat:.4g} ms ({source}) is below the "
                                          f"roofline floor {floor:.4g} ms: measurement error")
        return rec
    rec.latency_ms, rec.timing_source = float(lat), source
    rec.latency_spread_ms = timing.get("spread_ms")
    if floor:
        rec.pct_roofline = floor / rec.latency_ms * 100.0
    if "ab" in timing:
        rec.extra["ab"] = {k: v for k, v in timing["ab"].items() if k != "raw"}
    inc = state.incumbent
    if source == "measured" and timing.get("incumbent_ms") is not None:
        rec.incumbent_ms = timing["incumbent_ms"]
    elif inc is not None:
        rec.incumbent_ms = inc.latency_ms
    start = state.baseline.latency_ms if state.baseline else None
    rec.speedup_vs_start = (start / rec.latency_ms) if start else 1.0
    if inc is None:
        rec.status = "KEEP"
        rec.reason = "start: the default config" if trial == 0 else \
            "first correct candidate (the start failed)"
    elif proposal.meta.get("restart"):
        rec.status, rec.reason = "KEEP", "restart from a random point after a plateau"
    elif source == "predicted":
        better = rec.latency_ms < inc.latency_ms * (1 - PREDICTED_EPS)
        rec.status = "KEEP" if better else "REVERT"
        rec.reason = (f"predicted {rec.latency_ms / inc.latency_ms:.4f}x the incumbent "
                      f"(trial {inc.trial})")
    else:
        ab = timing.get("ab") or {}
        rec.status = "KEEP" if ab.get("faster") else "REVERT"
        rec.reason = (f"A/B ratio {ab.get('ratio', float('nan')):.4f} vs threshold "
                      f"{ab.get('threshold', float('nan')):.4f} (A/A noise "
                      f"{ab.get('noise', float('nan')):.4f}) against trial {inc.trial}")
    return rec


def candidate_key(space: SearchSpace, proposal: Proposal) -> str:
    """The candidate id of a proposal: the config's id, plus a hash of its edit list in an
    edit search (every candidate there shares the base config)."""
    cid = space.candidate_id(proposal.config)
    edits = proposal.meta.get("edits")
    if edits:
        import hashlib

        from search.edit_proposer import list_key

        cid += "+e" + hashlib.sha1(list_key(edits).encode()).hexdigest()[:10]
    return cid


def _correctness(c: dict[str, Any] | None) -> dict[str, Any] | None:
    if not c:
        return None
    out = {k: c.get(k) for k in ("passed", "max_abs_err", "rel_err", "argmax_agree",
                                 "positions", "finite", "why")}
    # a pattern's check (search/patterns.py): the tolerance and every rank's error
    out.update({k: c[k] for k in ("tolerance", "ranks") if k in c})
    return out


# -- the search -------------------------------------------------------------------------
@dataclass
class SearchResult:
    """What ``run_search`` returns: the records, the final state, the stop reason, paths."""

    records: list[Record]
    state: LoopState
    stop_reason: str
    out: Path
    plot: str | None = None
    settings: SearchSettings | None = None


class Search:
    """A search bound to its directory (build it with ``open_search``).

    The settings' paths are made absolute here, once (``SearchSettings.absolute``); the
    directory is created and checked for writing before any trial (AmkError otherwise).
    """

    def __init__(self, settings: SearchSettings, *, console: Any = None,
                 proposer: Any = None, evaluator: Any = None, llm_client: Any = None,
                 started_s: float = 0.0):
        self.s = settings.absolute()
        self.s.check()
        if settings.backend == "triton" and not settings.hooks.get("timer"):
            import torch

            if not torch.cuda.is_available():
                raise AmkError("--backend triton times the megakernel with CUDA events and "
                               "needs a CUDA GPU; none is visible here (use --backend sim)")
        self.out = Path(self.s.out)
        self.store = ResultsStore(self.out)
        self.console = console
        self.elapsed_before = started_s
        self._spec = None
        self._graph = None
        self.space = self._build_space()
        if self.s.start:
            self.start_candidate()  # a start outside the space is refused before any trial
        created = not self.out.exists()
        _prepare_dir(self.out)
        self.records = self.store.load()
        self.state = replay_state(self.records, self.s)
        self.request_failures = 0  # consecutive failed proposer requests (LLM API errors)
        try:
            self.proposer = proposer or self._make_proposer(llm_client)
        except BaseException:
            if created and not any(self.out.iterdir()):
                self.out.rmdir()  # leave no empty directory behind a refused start
            raise
        self.evaluator = evaluator or Evaluator(self.out / "worker.log", self.s.timeout_s,
                                                self.s.isolation)
        self._pred_cache: dict[str, float | None] = {}
        self._sum_cache: dict[str, dict[str, Any]] = {}

    # -- setup ----------------------------------------------------------------------
    def _model_spec(self):
        if self._spec is None:
            from models.graph import build_graph, spec_from_config
            from models.sources import load_config, parse_model_arg

            cfg = load_config(parse_model_arg(self.s.model))
            self._spec = spec_from_config(cfg)
            self._graph = build_graph(self._spec, name=self.s.model)
        return self._spec

    @property
    def pattern(self) -> Any:
        """The searched communication pattern (models.collectives), None for a model."""
        if not self.s.pattern:
            return None
        if getattr(self, "_pattern", None) is None:
            from search.patterns import pattern_from_json

            self._pattern = pattern_from_json(self.s.pattern["spec"])
        return self._pattern

    def _build_space(self) -> SearchSpace:
        if self.s.pattern:
            from search.patterns import pattern_space

            return pattern_space(self.s.pattern["spec"]["kind"], self.s.start)
        spec = self._model_spec()
        space = space_for(spec, self.s.tp, self.s.max_workers,
                          fixed={"dtype": self.s.dtype, "max_seq": self.s.max_seq})
        if self.s.edit_mode:
            space = with_start_values(space, self.s.start or {})
        return space

    def start_candidate(self) -> dict[str, Any]:
        """Trial 0's candidate from ``settings.start`` (knobs left out: the lowering's
        defaults). Raises AmkError naming a knob the search holds at another value or a value
        outside the space."""
        from lowering.knobs import flag_of

        cand = {}
        for k, v in (self.s.start or {}).items():
            if k in self.space.names:
                cand[k] = v
            elif self.space.fixed.get(k, v) != v:
                raise AmkError(f"start config: {flag_of(k)} {v!r}: this search holds {k} at "
                               f"{self.space.fixed[k]!r} (for this "
                               f"{'pattern' if self.s.pattern else 'model and --tp'})")
        problems = self.space.check(cand)
        if problems:
            raise AmkError("start config: not a point of the search space: " + "; ".join(problems))
        return self.space.canonical(cand)

    def _make_proposer(self, llm_client: Any):
        if self.s.proposer == "optuna":
            try:
                p = OptunaProposer(self.space, self.out / "study.journal",
                                   seed=self.s.seed + len(self.records))
            except ImportError as e:  # a core dependency, absent from a bare GPU image
                raise AmkError(f"--proposer optuna needs the optuna package ({e}): pip install optuna, "
                               "or use --proposer replay / llm") from None
            p.sync(self.records)
            return p
        if self.s.edit_mode:
            from search.edit_proposer import EditProposer, LLMEditProposer

            if self.s.proposer == "llm":
                self.profile_durations()  # a bad trace is refused before any trial
                return LLMEditProposer(self.space, llm_client, base=self.base_program,
                                       seq_len=self.s.seq_len, model=self.s.llm_model)
            return EditProposer(self.base_program, self.s.seq_len,
                                durations=self.profile_durations())
        if self.s.proposer == "llm":
            return LLMProposer(self.space, llm_client, model=self.s.llm_model)
        return ReplayProposer(self.s.replay)

    def profile_durations(self) -> dict[str, float] | None:
        """The measured task durations of ``--profile TRACE`` (read and matched against the
        base schedule once; search.edit_proposer.profile_durations), None without one."""
        if not self.s.profile:
            return None
        if getattr(self, "_durations", None) is None:
            from search.edit_proposer import profile_durations

            self._durations = profile_durations(self.s.profile, self.base_program())
        return self._durations

    def base_config(self) -> dict[str, Any]:
        """The candidate config of trial 0: the start config, else the lowering's default.
        In an edit search it is every candidate's config (the base of the edit lists)."""
        return self.start_candidate() if self.s.start else self.space.default()

    def base_program(self) -> Any:
        """The base schedule of an edit search: the lowering of ``base_config`` (a copy)."""
        if getattr(self, "_base_prog", None) is None:
            self._base_prog = self._lower(self.base_config())
        return self._base_prog.copy()

    def target_json(self) -> dict[str, Any]:
        return {"name": "h100-like" if self.s.backend == "triton" else "generic",
                "sms": self.s.max_workers, "max_workers": self.s.max_workers,
                "backend": self.s.backend}

    # -- the cost model in the parent (ranking, LLM summaries) -------------------------
    def _lower(self, config: dict[str, Any]):
        if self.s.pattern:
            from search.patterns import lower_candidate
            from search.trial import make_target

            return lower_candidate(self.pattern, self.space.lowering_config(config),
                                   make_target(self.target_json()))[0]
        from search.worker import lower_config, make_target

        self._model_spec()
        return lower_config(self._graph, self.s.tp, self.space.lowering_config(config),
                            make_target(self.target_json()))

    def predict(self, config: dict[str, Any]) -> float | None:
        """Cost-model latency (ms) of a candidate, or None when it cannot be lowered."""
        cid = self.space.candidate_id(config)
        if cid not in self._pred_cache:
            from lowering.costmodel import estimate

            try:
                prog = self._lower(config)
                self._pred_cache[cid] = estimate(prog, seq_len=self.s.seq_len) \
                    .predicted_latency_s * 1e3
            except AmkError:
                self._pred_cache[cid] = None
        return self._pred_cache[cid]

    def summary(self, config: dict[str, Any]) -> dict[str, Any]:
        cid = self.space.candidate_id(config)
        if cid not in self._sum_cache:
            from search.worker import program_summary

            try:
                # a pattern's program has no KV cache: one token of context, as its trials
                self._sum_cache[cid] = program_summary(self._lower(config),
                                                       1 if self.s.pattern else self.s.seq_len)
            except AmkError as err:
                self._sum_cache[cid] = {"error": str(err)}
        return self._sum_cache[cid]

    # -- state file -----------------------------------------------------------------
    def checkpoint(self, elapsed_s: float, finished: bool = False) -> None:
        st = self.state
        atomic_write_json(self.out / "state.json", {
            "version": STATE_VERSION, "settings": self.s.to_json(), "space": self.space.to_json(),
            "trials_done": len(self.records), "elapsed_s": elapsed_s,
            "incumbent": st.incumbent.trial if st.incumbent else None,
            "best": st.best.trial if st.best else None,
            "baseline": st.baseline.trial if st.baseline else None,
            "plateau": st.plateau, "restarts": st.restarts,
            "restart_pending": st.restart_pending, "stop_reason": st.stop_reason,
            "finished": finished, "updated": time.strftime("%Y-%m-%dT%H:%M:%S"),
        })

    def _save_schedule(self, rec: Record, where: str) -> None:
        """Write ``OUT/where/``: config.json (the config file ``amk compile / generate / run /
        bench --config`` read: the candidate's lowering knobs, with any that do nothing at its
        other knobs set back to their defaults, the same program, and the search's kernel
        knobs), trial.json (where it came from: trial, candidate id, latency, ...),
        schedule.json and schedule.amk."""
        from ir.io import save_program

        d = self.out / where
        prog = self._lower(rec.config)
        edits = rec.extra.get("edits")
        if edits is not None:  # an edit search: the base schedule plus the trial's edit list
            from ir.edits import parse_edits
            from lowering.placement import apply_edits

            base_dir = self.out / "base"
            if not (base_dir / "schedule.json").exists():
                base_dir.mkdir(parents=True, exist_ok=True)
                save_program(prog, base_dir / "schedule.json")
                save_program(prog, base_dir / "schedule.amk")
            prog = apply_edits(prog, parse_edits(edits, f"trial {rec.trial}'s edits"))
            d.mkdir(parents=True, exist_ok=True)
            atomic_write_json(d / "edits.json", list(edits))
        from search.space import program_fingerprint

        evaluated = (rec.extra.get("program") or {}).get("fingerprint")
        same = evaluated is None or evaluated == program_fingerprint(prog)
        if not same:  # the search process and the worker lowered different schedules
            self._say(f"[red]trial {rec.trial}: the saved schedule differs from the one "
                      "evaluated (lowering is not deterministic?)[/]")
        save_program(prog, d / "schedule.json")
        save_program(prog, d / "schedule.amk")
        if self.s.pattern:
            self._save_pattern_config(rec, d, same)
            return
        from lowering.config import AmkConfig, KernelConfig, LoweringConfig
        from lowering.knobs import without_inert

        low = LoweringConfig.from_json(self.space.lowering_config(rec.config), "candidate config",
                                       combinations=False)
        config = AmkConfig(without_inert(low, self.s.tp),
                           KernelConfig.from_json(dict(self.s.kernel), "the search's kernel knobs")).to_json()
        atomic_write_json(d / "config.json", config)
        atomic_write_json(d / "trial.json", {
            "trial": rec.trial, "candidate_id": rec.candidate_id, "config_file": "config.json",
            "lowering_config": config["lowering"], "model": self.s.model, "tp": self.s.tp,
            "backend": self.s.backend, "latency_ms": rec.latency_ms,
            "timing_source": rec.timing_source, "pct_roofline": rec.pct_roofline,
            "status": rec.status, "same_schedule_as_evaluated": same,
            "compile": use_command(self.s, d / "config.json"),
            **({"edits_file": "edits.json", "edits": len(edits),
                "replay": edit_command(self.out, d)} if edits is not None else {})})

    def _save_pattern_config(self, rec: Record, d: Path, same: bool) -> None:
        """A pattern's ``OUT/where/config.json``: ``{"collective": ...}`` (with the search's
        ``"kernel"`` knobs when it has any), what ``amk dist --config`` and
        ``amk.distribute(config=...)`` take: knobs that do nothing at the candidate's other
        knobs set back to their defaults (search.patterns.config_for_file); and trial.json."""
        from search.patterns import config_for_file

        config: dict[str, Any] = {"collective": config_for_file(self.pattern.kind,
                                                                self.space.lowering_config(rec.config))}
        if self.s.kernel:
            from lowering.config import KernelConfig

            config["kernel"] = KernelConfig.from_json(dict(self.s.kernel), "the search's kernel knobs").to_json()
        atomic_write_json(d / "config.json", config)
        atomic_write_json(d / "trial.json", {
            "trial": rec.trial, "candidate_id": rec.candidate_id, "config_file": "config.json",
            "collective_config": config["collective"], "function": self.s.model,
            "pattern": self.pattern.kind, "world": self.s.tp, "backend": self.s.backend,
            "latency_ms": rec.latency_ms, "timing_source": rec.timing_source,
            "pct_roofline": rec.pct_roofline, "status": rec.status,
            "same_schedule_as_evaluated": same, "use": use_command(self.s, d / "config.json")})

    def _log_proposer(self, event: dict[str, Any]) -> None:
        append_line(self.out / "proposer.log", redact(json.dumps(event, sort_keys=True)))

    # -- one trial -------------------------------------------------------------------
    def _context(self, trial: int) -> ProposalContext:
        return ProposalContext(
            trial=trial, space=self.space, records=self.records,
            incumbent=self.state.incumbent,
            seen={r.candidate_id for r in self.records}, predict=self.predict,
            summary=self.summary,
            timing_source="predicted" if self.s.backend == "sim" else "measured",
            seed=self.s.seed)

    def propose(self, trial: int) -> Proposal | None:
        """The next proposal, or None when the proposer has nothing left."""
        ctx = self._context(trial)
        if not self.records:
            meta: dict[str, Any] = {"edits": []} if self.s.edit_mode else {}
            if self.s.start:
                return Proposal(self.start_candidate(), "baseline", None, "the start config",
                                meta=meta)
            return Proposal(self.space.default(), "baseline", None, "the lowering's default",
                            meta=meta)
        if self.state.restart_pending:
            p = RandomProposer().propose(ctx)
            if p is not None:
                p.meta["restart"] = True
                p.note = "restart after plateau"
                return p
        why = ""
        for attempt in range(MAX_SKIPS):
            try:
                p = self.proposer.propose(ctx)
            except ProposalSkipped as skip:
                self._log_proposer({"trial": trial, "attempt": attempt,
                                    "proposer": self.s.proposer, "event": "skipped",
                                    "kind": skip.kind, "reason": skip.reason,
                                    "raw": skip.raw[:2000]})
                why = skip.reason
                if skip.kind == "request":
                    self.request_failures += 1
                    self._request_failed(trial, skip)
                    break  # the client already retried this request: fall back now
                self.request_failures = 0  # an answer came back
                self._say(f"[yellow]trial {trial}: proposal skipped: {_esc(skip.reason)}[/]")
                continue
            self.request_failures = 0
            if p is None:
                return None
            problems = self.space.check(p.config)
            if problems:  # a proposer handed us something outside the space
                why = "proposal outside the search space: " + "; ".join(problems)
                self._log_proposer({"trial": trial, "event": "invalid", "proposer": p.proposer,
                                    "reason": "; ".join(problems)})
                continue
            if self.s.edit_mode and p.config != self.space.canonical(self.base_config()):
                why = "an edit search proposes edit lists against the base config only"
                self._log_proposer({"trial": trial, "event": "invalid", "proposer": p.proposer,
                                    "reason": why})
                continue
            if candidate_key(self.space, p) in ctx.seen:
                why = "proposal repeats an evaluated candidate"
                self._log_proposer({"trial": trial, "event": "repeat", "proposer": p.proposer})
                continue
            return p
        return self._fallback(trial, ctx, why or "no usable proposal")

    def _request_failed(self, trial: int, skip: ProposalSkipped) -> None:
        """A proposer request failed: stop the search (ProposerUnavailable) after
        ``llm_max_failures`` such failures in a row, unless ``llm_fallback``."""
        check_request_failures(self.s.proposer, self.request_failures, self.s.llm_max_failures,
                               self.s.llm_fallback, skip, f"amk search --resume {shlex.quote(str(self.out))}",
                               "mutations of the incumbent")

    def _fallback(self, trial: int, ctx: ProposalContext, why: str) -> Proposal | None:
        """A mutation of the incumbent (or a random point) in place of the proposer's
        candidate; said on the console, logged, and marked in the record
        (``extra["fallback"]``, counted in the summary)."""
        if self.s.edit_mode:  # a knob mutation is no edit list: the offline edit proposer
            from search.edit_proposer import EditProposer

            if self.s.proposer == "edits":  # it had nothing: the search stops
                self._log_proposer({"trial": trial, "event": "no-proposal",
                                    "proposer": self.s.proposer, "reason": why})
                return None
            p = EditProposer(self.base_program, self.s.seq_len,
                             durations=self.profile_durations()).propose(ctx)
        else:
            muts = mutations(ctx, 1)
            p = muts[0] if muts else RandomProposer().propose(ctx)
        self._log_proposer({"trial": trial, "event": "fallback", "proposer": self.s.proposer,
                            "reason": why, "to": p.proposer if p else None})
        if p is None:
            return None
        p.note += f" (fallback: {why})"[:200]
        p.meta["fallback"] = why
        self._say(f"[yellow]trial {trial}: fallback to a {p.proposer}: the {self.s.proposer} "
                  f"proposer gave no usable candidate ({_esc(why)})[/]")
        return p

    def request(self, proposal: Proposal, trial: int) -> dict[str, Any]:
        inc = self.state.incumbent
        if self.s.pattern:  # search/patterns.py evaluate
            return {
                "pattern": dict(self.s.pattern["spec"]), "ranks": self.s.tp, "backend": self.s.backend,
                "config": self.space.lowering_config(proposal.config),
                "incumbent": self.space.lowering_config(inc.config) if inc else None,
                "target": self.target_json(), "seed": self.s.seed * 1_000_003 + trial,
                "sim_policy": self.s.sim_policy, "timing": dict(self.s.timing),
                "hooks": dict(self.s.hooks), "trial": trial, "kernel": dict(self.s.kernel),
                "timeout_s": self.s.timeout_s,
            }
        return {
            "model": self.s.model, "ranks": self.s.tp, "backend": self.s.backend,
            "config": self.space.lowering_config(proposal.config),
            "incumbent": self.space.lowering_config(inc.config) if inc else None,
            "target": self.target_json(), "positions": list(self.s.positions),
            "prompt_seed": self.s.seed * 1_000_003 + trial,  # fresh prompt per trial
            "sim_seed": self.s.seed * 7919 + trial, "sim_policy": self.s.sim_policy,
            "seq_len": self.s.seq_len, "tolerance": self.s.gate_tolerance(),
            "timing": dict(self.s.timing), "hooks": dict(self.s.hooks), "trial": trial,
            "kernel": dict(self.s.kernel),
            **({"edits": list(proposal.meta.get("edits") or []),
                "incumbent_edits": list((inc.extra.get("edits") if inc else None) or [])}
               if self.s.edit_mode else {}),
        }

    def review(self, trial: int, proposal: Proposal) -> dict[str, Any] | None:
        """With ``approve``: hold the proposal for review (search/review.py) and wait. None
        when it may be evaluated (approved, trial 0, or no review); otherwise the evaluation
        result of a rejected proposal (status ``rejected``, stage ``review``)."""
        if not self.s.approve or trial == 0:
            return None
        from search.review import ReviewGate

        edits = proposal.meta.get("edits")
        item = {"candidate_id": candidate_key(self.space, proposal), "proposer": proposal.proposer,
                "parent": proposal.parent, "note": redact(proposal.note)[:400],
                "config": self.space.canonical(proposal.config),
                "description": redact(self.space.describe(proposal.config))[:400],
                "predicted_ms": proposal.predicted_ms,
                "edits": list(edits) if edits is not None else None,
                "base_schedule": "base/schedule.json" if self.s.edit_mode else None}
        ok, comment = ReviewGate(self.out, say=self._say).ask(trial, item)
        self._log_proposer({"trial": trial, "event": "approved" if ok else "rejected-in-review",
                            "proposer": proposal.proposer, "comment": comment[:400]})
        if ok:
            self._say(f"trial {trial}: approved in review")
            return None
        return {"status": "rejected", "stage": "review",
                "reason": "rejected in review" + (f": {comment}" if comment else "")}

    def run_trial(self, trial: int, proposal: Proposal) -> Record:
        res = self.review(trial, proposal)
        if res is None:
            res = self.evaluator.evaluate(self.request(proposal, trial),
                                          new_workdir(self.out / "work", trial))
        rec = decide(res, proposal, trial, self.state, self.space, self.s)
        self.store.append(rec)          # durable first: the trial is now complete
        self.records.append(rec)
        prev_best = self.state.best
        self.state.apply(rec, self.s)
        try:
            self.proposer.observe(proposal, rec)
        except Exception as err:  # the proposer's bookkeeping must not lose the trial
            self._log_proposer({"trial": trial, "event": "observe-failed", "reason": str(err)})
        if rec.status == "KEEP":
            self._save_schedule(rec, "incumbent")
            if self.state.best is rec and prev_best is not rec:
                self._save_schedule(rec, "best")
        return rec

    # -- output ----------------------------------------------------------------------
    def _say(self, text: str) -> None:
        if self.console is not None:  # one line each, unwrapped: logs stay greppable
            self.console.print(redact(text), soft_wrap=True)

    def budget_left(self, elapsed_s: float) -> str | None:
        """None while the budget allows another trial, else the reason to stop."""
        if self.s.trials is not None and len(self.records) >= self.s.trials:
            return f"budget: {self.s.trials} trials"
        if self.s.minutes is not None and elapsed_s >= self.s.minutes * 60:
            return f"budget: {self.s.minutes:g} minutes"
        return None

    def run(self, on_trial: Callable[[Record, "Search"], None] | None = None) -> SearchResult:
        """Run until a stopping rule fires; returns the SearchResult."""
        t_start = time.monotonic() - self.elapsed_before
        stop = None
        failure: ProposerUnavailable | None = None
        try:
            self.checkpoint(self.elapsed_before)
            while True:
                elapsed = time.monotonic() - t_start
                stop = self.state.stop_reason or self.budget_left(elapsed)
                if stop:
                    break
                trial = len(self.records)
                try:
                    proposal = self.propose(trial)
                except ProposerUnavailable as err:
                    failure, stop = err, str(err)
                    break
                if proposal is None:
                    stop = "the proposer has nothing left to propose"
                    break
                rec = self.run_trial(trial, proposal)
                self.checkpoint(time.monotonic() - t_start)
                if on_trial:
                    on_trial(rec, self)
            self.state.stop_reason = self.state.stop_reason or stop
            self.checkpoint(time.monotonic() - t_start, finished=failure is None)
        finally:
            self.evaluator.close()
            try:
                self.proposer.close()
            except Exception:
                pass
        state = self.state
        state.stop_reason = state.stop_reason or stop
        plot = None
        if self.records:
            from search.plot import plot_latency

            plot = plot_latency(self.records, self.out / "latency.png",
                                f"amk search {self.s.model} "
                                f"{'--world' if self.s.pattern else '--tp'} {self.s.tp} "
                                f"({self.s.backend})")
        atomic_write_json(self.out / "summary.json", summarize(self.records, state, self.s,
                                                               stop or ""))
        if failure is not None:  # state and summary are written; the CLI prints one line
            raise failure
        return SearchResult(self.records, state, stop or "", self.out, plot, self.s)


def _esc(text: str) -> str:
    """``text`` safe inside rich markup (error messages hold brackets: ``[Errno 111]``)."""
    from rich.markup import escape

    return escape(text)


def _prepare_dir(d: Path) -> None:
    """Create the search directory and check that files can be created in it; AmkError
    (one line, exit 2) otherwise, before any trial runs."""
    import tempfile

    try:
        d.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=d):
            pass
    except OSError as err:
        raise AmkError(f"cannot write the search directory {d}: {err.strerror or err}") \
            from None


def summarize(records: list[Record], state: LoopState, s: SearchSettings,
              stop: str) -> dict[str, Any]:
    """The end-of-search summary (also written to summary.json)."""
    counts: dict[str, int] = {}
    for r in records:
        counts[r.status] = counts.get(r.status, 0) + 1
    best, base = state.best, state.baseline

    def brief(r: Record | None) -> dict[str, Any] | None:
        if r is None:
            return None
        return {"trial": r.trial, "candidate_id": r.candidate_id, "config": r.config,
                "latency_ms": r.latency_ms, "timing_source": r.timing_source,
                "pct_roofline": r.pct_roofline, "roofline_ms": r.roofline_ms}

    return {"model": s.model, "tp": s.tp, "backend": s.backend, "proposer": s.proposer,
            "trials": len(records), "by_status": counts, "stop_reason": stop,
            "timing_source": "predicted" if s.backend == "sim" else "measured",
            "start": brief(base), "best": brief(best),
            "speedup_vs_start": (base.latency_ms / best.latency_ms)
            if best and base and best.latency_ms else None,
            "restarts": state.restarts,
            "fallbacks": sum(1 for r in records if r.extra.get("fallback")),
            "best_config_file": str(Path(s.out) / "best" / "config.json") if best else None,
            **({"edits": edit_log(records),
                "best_edits_file": str(Path(s.out) / "best" / "edits.json") if best else None,
                "replay_best": edit_command(Path(s.out), Path(s.out) / "best") if best else None}
               if s.edit_mode else {}),
            **({"pattern": s.pattern["spec"]["kind"], "world": s.tp} if s.pattern else {}),
            "use_best": use_command(s, Path(s.out) / "best" / "config.json") if best else None}


def edit_command(out: Path, d: Path) -> str:
    """The ``amk edit`` command line that rebuilds an edit search's saved schedule from the
    base schedule and its edit list."""
    return (f"amk edit {shlex.quote(str(out / 'base' / 'schedule.json'))} "
            f"{shlex.quote(str(d / 'edits.json'))} --out NEW.amk")


def edit_log(records: list[Record]) -> dict[str, Any]:
    """The proposal log of an edit search: edit lists proposed (trials after the baseline),
    rejected by the validator or the edit language (per error class: count, the first
    trial, its last edit and one witness), failed the correctness gate, failed otherwise,
    timed out, kept and reverted."""
    props = [r for r in records if r.trial > 0 and r.extra.get("edits") is not None]
    by_class: dict[str, dict[str, Any]] = {}
    for r in props:
        if r.status != "REJECTED":
            continue
        v = r.extra.get("verdict") or {}
        classes = v.get("classes") or (["EditError"] if r.extra.get("stage") == "edit"
                                       else ["LoweringError"])
        for c in classes:
            e = by_class.setdefault(c, {"count": 0, "trial": r.trial,
                                        "edit": (r.extra.get("edits") or [None])[-1],
                                        "witness": (v.get("witnesses") or {}).get(c),
                                        "reason": r.reason[:300]})
            e["count"] += 1
    n = {k: sum(1 for r in props if r.status == k) for k in ("KEEP", "REVERT", "REJECTED", "TIMEOUT")}
    gate = sum(1 for r in props if r.status == "FAIL" and r.extra.get("stage") == "correctness")
    return {"proposed": len(props), "rejected": n["REJECTED"], "rejected_by_class": by_class,
            "failed_gate": gate, "failed_other": sum(1 for r in props if r.status == "FAIL") - gate,
            "timeout": n["TIMEOUT"], "kept": n["KEEP"], "reverted": n["REVERT"]}


def use_command(s: SearchSettings, config_file: Path) -> str:
    """The ``amk compile`` command line that rebuilds a saved schedule from its config (for a
    pattern: the ``amk dist`` line that lowers, validates and runs it with the config)."""
    if s.pattern:
        shapes = " ".join(f"--shape {k}={','.join(map(str, v))}" for k, v in s.pattern["shapes"].items())
        return (f"amk dist {shlex.quote(s.model)} --world {s.tp} {shapes} --dtype {s.dtype} "
                f"--backend {s.backend} --config {shlex.quote(str(config_file))}")
    return (f"amk compile {shlex.quote(s.model)} --tp {s.tp} --backend {s.backend} "
            f"--config {shlex.quote(str(config_file))}")


def open_search(settings: SearchSettings | None = None, *, resume: str | None = None,
                overrides: dict[str, Any] | None = None, **kw: Any) -> Search:
    """Start a new search (``settings``) or resume one (``resume`` = its directory).

    A new search refuses a directory that already holds trials (use resume). A resume
    reads the settings from state.json; ``overrides`` may change only the budget
    (trials, minutes), timeout_s, llm_fallback and llm_max_failures. Paths are resolved
    against the current directory once. Raises AmkError with the reason.
    """
    if resume is not None:
        d, s, data = resume_settings(resume, "state.json", "a search directory", SearchSettings)
        s.out = str(d)
        if (overrides or {}).get("model") is not None:
            overrides = {**overrides, "model": absolute_model_arg(overrides["model"])}
        apply_overrides(s, overrides, {"trials": "--trials", "minutes": "--minutes", "timeout_s": "--timeout",
                                       "llm_fallback": "--llm-fallback", "llm_max_failures": "--llm-max-failures",
                                       "approve": "--approve"},
                        "search")
        search = Search(s, started_s=float(data.get("elapsed_s", 0.0)), **kw)
        if search.space.to_json() != data.get("space"):
            raise AmkError(f"--resume {d}: the search space differs from the one recorded "
                           "(the lowering's knobs changed); start a new search")
        return search
    if settings is None:
        raise AmkError("a new search needs its settings")
    d = Path(os.path.expanduser(settings.out)).resolve()
    if (d / "results.jsonl").exists() and (d / "results.jsonl").stat().st_size > 0:
        raise AmkError(f"--out {d} already holds a search; continue it with --resume {d} "
                       "or choose another directory")
    return Search(settings, **kw)


def with_start_values(space: SearchSpace, start: dict[str, Any]) -> SearchSpace:
    """``space`` with each knob's value in ``start`` added to its allowed values where it is
    missing. An edit search never moves a knob, so its base config (a tuned entry's, e.g.
    132 workers) need not be one of the knob search's grid points; the values are still
    checked by the lowering config when the base is lowered."""
    import dataclasses

    knobs = []
    for k in space.knobs:
        v = start.get(k.name, k.default)
        if v not in k.values and same_type(v, k.values[0]):
            k = dataclasses.replace(k, values=tuple(k.values) + (v,))
        knobs.append(k)
    return dataclasses.replace(space, knobs=knobs)
