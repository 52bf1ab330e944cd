"""`amk tune`: find a model's fastest whole configuration (lowering and kernel knobs) on this
GPU at this --tp, and store it in the tuning database.

The run, in a directory DIR:

1. **Baselines** (triton, optional): measured at the start by the caller (``amk tune`` uses
   ``amk bench``'s code), twice per mode; stored in DIR/baselines.json.
2. **Warm start**: the heuristic config (search.heuristic) and the nearest entries of the
   tuning database (``TuneDB.nearest``; an entry of another --tp, GPU or shape is adapted:
   its kernel part and the knobs that still validate are kept, ``TuneSpace.adapt``). Each is
   evaluated; the fastest correct one is the *incumbent*.
3. **Rounds** until the budget (``trials`` evaluated candidates, ``minutes`` of tuning time
   over all resumed runs) runs out or no move is left: the knobs are ranked by the share of
   the step their op family takes (``shares``: the incumbent's in-kernel profile on the GPU,
   the cost model's estimate on the sim), the one-knob neighbours of the incumbent along the
   top-ranked knobs are tried first, then a few random two-knob mutations. A candidate is kept
   only when it is correct and its A/B against the incumbent beats it by more than the noise
   (the evaluator's ``min_gain``; on the sim: a lower predicted latency); a kept candidate
   ends the round (the next one ranks again from the new incumbent). With ``proposer`` ``llm``
   a language model proposes each round's candidates instead (search/tuneproposer.py: it sees
   the space, the incumbent, the shares, the trials and the nearest database entries); its
   unusable candidates are proposer errors, and a round it gives nothing usable falls back to
   the local moves above (said on the console, counted in the summary). After
   ``llm_max_failures`` failed requests in a row the run stops (ProposerUnavailable, its
   report written) unless ``llm_fallback``. Prompts and answers go to DIR/proposer.log.
4. **The end**: DIR/best/config.json (a config file for ``--config``), DIR/report.json and
   DIR/report.md, and the entry in the tuning database (``TuneDB.put``: a faster entry of the
   same key is kept unless ``replace``).

Every candidate is screened first (``TuneSpace.screen``): a refused one costs no backend time
and is recorded as REJECTED with its reason. Evaluation is ``amk search``'s: the worker
subprocess (search/worker.py) lowers, validates, runs the correctness gate against the eager
model and times (triton: interleaved A/B against the incumbent, which runs with its own kernel
knobs; sim: the cost model's PREDICTED latency, never a measurement), with the roofline floor.

Durability: every finished trial is one line of DIR/trials.jsonl, appended with fsync before
the next starts; the settings are DIR/settings.json. ``resume`` replays the file: the
incumbent, the evaluated candidate ids (never evaluated twice), the trial count and the time
used; a torn last line (a kill during the append) is dropped with a warning.
"""

from __future__ import annotations

import json
import os
import random
import shlex
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from ground.errors import AmkError
from ground.files import atomic_write_json, atomic_write_text
from search.proposers import LLM_MAX_FAILURES, ProposalSkipped, ProposerUnavailable, check_request_failures, redact
from search.records import append_line, apply_overrides, read_json, read_log, resume_settings, settings_from_json
from search.tunespace import FAMILIES, OP_FAMILY, SMEM_PER_BLOCK_SM90, TuneSpace, candidate_id

#: Relative margin a predicted latency must beat (the cost model is deterministic).
PREDICTED_EPS = 1e-9
#: The GPU name of the sim's database entries (predicted latencies).
SIM_GPU = "sim (cost model)"
#: Minutes of tuning when neither a trial nor a minute budget is given.
DEFAULT_MINUTES = 20.0
#: Rows of DIR/trials.jsonl that are no trial: the incumbent's profile, a proposer event.
NOT_TRIALS = ("profile", "proposer")


@dataclass
class TuneSettings:
    """Everything that defines a tuning run (DIR/settings.json; a resume reuses it).

    model: MODEL argument; out: DIR; tp: ranks; backend: triton | sim; trials: evaluated
    candidates in all (None: no limit); minutes: tuning time over all resumed runs (None: no
    limit); db: the tuning database's user directory (None: open_db's default); dtype /
    max_seq: fixed lowering fields; positions / seq_len / tolerance / timing: the evaluation's
    (search.loop.SearchSettings); timeout_s: per candidate; seed: prompts, interleavings and
    mutations; baselines: baseline modes (``eager`` and torch.compile modes; [] none); replace:
    overwrite a faster database entry of the same key; hooks: test-only worker hooks; gpu:
    {"name", "sms"} of the device the run tunes for (None: the sim); max_workers: co-resident
    workers per rank; ring: search the weight ring; per_round: one-knob neighbours tried per
    round; mutations: random two-knob mutations per round; warm: database entries tried at
    the start; profile: rank the knobs by the in-kernel profile (triton); hbm_bw: the
    bandwidth of the roofline floor in bytes/s (None: the worker measures it on the GPU);
    proposer: ``local`` (profile-first one-knob moves and mutations) | ``llm``
    (search/tuneproposer.py); llm_model: its model id; llm_candidates: candidates per answer;
    llm_fallback / llm_max_failures: the search's failure policy (search/loop.py).
    """

    model: str
    out: str
    tp: int = 1
    backend: str = "triton"
    trials: int | None = None
    minutes: float | None = None
    db: str | None = None
    dtype: str = "bf16"
    max_seq: int = 256
    positions: list[int] = field(default_factory=lambda: [0, 3, 7])
    seq_len: int = 128
    timeout_s: float = 600.0
    timing: dict[str, Any] = field(default_factory=lambda: {
        "rounds": 7, "steps": 20, "warmup": 3, "min_gain": 0.01})
    tolerance: dict[str, Any] | None = None
    seed: int = 0
    baselines: list[str] = field(default_factory=list)
    replace: bool = False
    hooks: dict[str, str] = field(default_factory=dict)
    gpu: dict[str, Any] | None = None
    max_workers: int = 132
    ring: bool = False
    per_round: int = 6
    mutations: int = 2
    warm: int = 3
    profile: bool = True
    hbm_bw: float | None = None
    proposer: str = "local"
    llm_model: str | None = None
    llm_candidates: int = 4
    llm_fallback: bool = False
    llm_max_failures: int = LLM_MAX_FAILURES

    def check(self) -> None:
        """Raise AmkError naming the bad setting."""
        if self.proposer not in ("local", "llm"):
            raise AmkError(f"--proposer must be local or llm, got {self.proposer!r}")
        if self.llm_candidates < 1:
            raise AmkError(f"--llm-candidates must be >= 1, got {self.llm_candidates}")
        if self.llm_max_failures < 1:
            raise AmkError(f"--llm-max-failures must be >= 1, got {self.llm_max_failures}")
        if self.tp < 1:
            raise AmkError(f"--tp must be >= 1, got {self.tp}")
        if self.backend not in ("sim", "triton"):
            raise AmkError(f"--backend must be triton or sim, got {self.backend!r}")
        if self.trials is not None and self.trials < 1:
            raise AmkError(f"--trials must be >= 1, got {self.trials}")
        if self.minutes is not None and self.minutes <= 0:
            raise AmkError(f"--minutes must be > 0, got {self.minutes}")
        if self.dtype not in ("f32", "bf16"):
            raise AmkError(f"--dtype must be f32 or bf16, got {self.dtype!r}")
        if max(self.positions) >= self.max_seq or not 1 <= self.seq_len <= self.max_seq:
            raise AmkError(f"--seq-len and the checked positions must be below --max-seq {self.max_seq}")
        if self.timeout_s <= 0:
            raise AmkError(f"--timeout must be > 0, got {self.timeout_s}")

    def gate_tolerance(self) -> dict[str, Any]:
        if self.tolerance:
            return dict(self.tolerance)
        return {"rel_err": 2e-3, "min_argmax_agree": 1.0} if self.dtype == "f32" else \
            {"rel_err": 5e-2, "min_argmax_agree": 0.5}

    @property
    def timing_source(self) -> str:
        return "predicted" if self.backend == "sim" else "measured"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(d: dict[str, Any]) -> "TuneSettings":
        return settings_from_json(TuneSettings, d)


# -- the trial log ------------------------------------------------------------------------
def _trial_row(obj: Any) -> dict[str, Any]:
    if not isinstance(obj, dict) or "status" not in obj:
        raise ValueError("not a trial record")
    return obj


class TrialLog:
    """DIR/trials.jsonl: one JSON object per finished trial (evaluated or rejected), appended
    with fsync (search.records.append_line)."""

    def __init__(self, path: Path):
        self.path = path

    def load(self, warn: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
        """The rows, in order. A torn last line (no newline, or not JSON: a kill during the
        append) is cut off the file and reported through ``warn``; a bad line elsewhere is
        an AmkError naming the file and line."""
        if not self.path.exists():
            return []
        return read_log(self.path, _trial_row, warn)

    def append(self, row: dict[str, Any]) -> None:
        from ground.files import finite

        append_line(self.path, json.dumps(finite(row), sort_keys=True, default=str))


# -- shares of the step per op family --------------------------------------------------------
def cost_shares(program: Any, seq_len: int) -> dict[str, float]:
    """The share of a decode step per op family (FAMILIES) predicted by the cost model
    (lowering/costmodel.py) on the busiest rank: each task's bytes at the model's bandwidth
    plus its per-task overhead over the workers, and the cross-rank latency of each
    collective for ``comm``. ``schedule`` holds the ops of no family (embed, norms, argmax)."""
    from lowering.costmodel import (DEFAULT_CROSS_RANK_LATENCY_S, DEFAULT_HBM_BW, DEFAULT_TASK_OVERHEAD_S,
                                    task_bytes)

    bufs = program.buffer_map()
    per_rank: list[dict[str, float]] = [{f: 0.0 for f in FAMILIES} for _ in range(program.ranks)]
    groups: list[set] = [set() for _ in range(program.ranks)]
    for t in program.tasks:
        fam = OP_FAMILY.get(t.op, "schedule")
        per_rank[t.rank][fam] += task_bytes(t, bufs, seq_len) / DEFAULT_HBM_BW \
            + DEFAULT_TASK_OVERHEAD_S / max(1, program.workers)
        if t.group and program.ranks > 1:
            groups[t.rank].add(t.group)
    for r in range(program.ranks):
        per_rank[r]["comm"] += len(groups[r]) * DEFAULT_CROSS_RANK_LATENCY_S
    worst = max(per_rank, key=lambda d: sum(d.values()))
    return _normalise(worst)


def profile_shares(op_us: dict[str, float]) -> dict[str, float]:
    """The share of a step per op family from an in-kernel profile's per-op time."""
    fam = {f: 0.0 for f in FAMILIES}
    for op, us in op_us.items():
        fam[OP_FAMILY.get(op, "schedule")] += float(us)
    return _normalise(fam)


def _normalise(d: dict[str, float]) -> dict[str, float]:
    total = sum(d.values()) or 1.0
    return {k: v / total for k, v in d.items()}


def rank_knobs(space: TuneSpace, shares: dict[str, float]) -> list[tuple[str, float]]:
    """The space's knobs with their scores, best first: a knob scores the share of its op
    family; the ``schedule`` knobs (workers, policy, fuse, ...) act on every op and score half
    the largest family's share plus the share of the ops of no family. Ties keep the
    space's order (lowering knobs first)."""
    top = max((shares.get(f, 0.0) for f in FAMILIES if f != "schedule"), default=0.0)
    score = {f: shares.get(f, 0.0) for f in FAMILIES}
    score["schedule"] = 0.5 * top + shares.get("schedule", 0.0)
    ranked = [(k.name, score.get(k.family, 0.0)) for k in space.knobs]
    order = {n: i for i, (n, _) in enumerate(ranked)}
    return sorted(ranked, key=lambda x: (-x[1], order[x[0]]))


# -- the tuner ------------------------------------------------------------------------------
@dataclass
class Incumbent:
    """The current best: its config, id, trial, latency (``ms``, of ``source``) and profile."""

    config: dict[str, Any]
    id: str
    trial: int
    ms: float
    profile: dict[str, Any] | None = None


class Tuner:
    """A tuning run bound to its directory (``open_tune`` builds it).

    ``evaluator``: search.evaluator.Evaluator-like (``evaluate(request, workdir)``,
    ``close()``); ``console``: a rich Console for warnings (None: silent); ``db``: a
    search.tunedb.TuneDB (None: ``open_db(settings.db)``); ``llm_client``: the client of the
    LLM proposer (None: built from ANTHROPIC_API_KEY; AmkError without it).
    """

    def __init__(self, settings: TuneSettings, *, evaluator: Any = None, console: Any = None, db: Any = None,
                 elapsed_before: float | None = None, llm_client: Any = None):
        self.s = settings
        self.s.check()
        self.out = Path(self.s.out)
        self.console = console
        self._graph = None
        self.spec = self._load_spec()
        gpu = self.s.gpu or {}
        self.space = TuneSpace(self.spec, self.s.tp, self.s.max_workers, dtype=self.s.dtype,
                               max_seq=self.s.max_seq, kernel=self.s.backend == "triton",
                               sms=gpu.get("sms") if self.s.backend == "triton" else None,
                               smem=int(gpu.get("smem") or 0) or SMEM_PER_BLOCK_SM90,
                               colocated=self.s.tp if self.s.backend == "triton" else 1, ring=self.s.ring)
        _prepare_dir(self.out)
        self.log = TrialLog(self.out / "trials.jsonl")
        self.rows = self.log.load(warn=self._warn)
        if db is None:  # a --db that cannot be a database is refused before any trial
            from search.tunedb import open_db

            db = open_db(self.s.db)
        self._db = db
        self.rng = random.Random(self.s.seed * 1_000_003 + len(self.rows))
        self.incumbent: Incumbent | None = None
        self.start: Incumbent | None = None
        self.seen: set[str] = set()
        self.trials = 0
        self.elapsed_before = 0.0
        self.round = 0
        self._replaying = True
        self.llm = None
        if self.s.proposer == "llm":  # no key: refused before any trial
            from search.tuneproposer import TuneLLMProposer

            self.llm = TuneLLMProposer(self.space, llm_client, model=self.s.llm_model, k=self.s.llm_candidates)
        self.request_failures = 0  # consecutive failed LLM requests
        for row in self.rows:
            self._apply(row)
        self._replaying = False
        if elapsed_before is not None:
            self.elapsed_before = elapsed_before
        from search.evaluator import Evaluator

        self.evaluator = evaluator or Evaluator(self.out / "worker.log", self.s.timeout_s)
        self.baselines: list[dict[str, Any]] = self._load_baselines()
        self.stop_reason = ""
        self.confirmed: dict[str, Any] | None = None  # `amk bench` of the best config (run(confirm=...))
        self._t0 = time.monotonic()

    # -- setup -------------------------------------------------------------------------
    def _load_spec(self) -> Any:
        from models.graph import build_graph, spec_from_config
        from models.sources import load_config, parse_model_arg

        spec = spec_from_config(load_config(parse_model_arg(self.s.model)))
        self._graph = build_graph(spec, name=self.s.model)
        return spec

    @property
    def db(self) -> Any:
        if self._db is None:
            from search.tunedb import open_db

            self._db = open_db(self.s.db)
        return self._db

    def _warn(self, text: str) -> None:
        if self.console is not None:
            from rich.markup import escape

            self.console.print(f"[yellow]warning:[/] {escape(text)}", soft_wrap=True)

    def target_json(self) -> dict[str, Any]:
        gpu = self.s.gpu or {}
        if self.s.backend == "triton":
            return {"name": gpu.get("name", "cuda"), "sms": int(gpu.get("sms") or self.s.max_workers),
                    "max_workers": self.s.max_workers, "backend": "triton"}
        return {"name": "generic", "sms": self.s.max_workers, "max_workers": self.s.max_workers,
                "backend": "sim"}

    # -- keys of the database ----------------------------------------------------------------
    def shape_key(self) -> Any:
        from search.tunedb import ShapeKey

        return ShapeKey.from_spec(self.spec, self.s.dtype)

    def gpu_key(self) -> Any:
        """The database's GPU key: the device's name and SMs; the sim's is ``sim (cost model)``
        with the target's workers as its SMs (its entries hold predicted latencies and never
        match a GPU)."""
        from search.tunedb import GpuKey

        if self.s.backend == "sim" or not self.s.gpu:
            return GpuKey(name=SIM_GPU, sms=self.s.max_workers)
        return GpuKey(name=str(self.s.gpu["name"]), sms=int(self.s.gpu["sms"]))

    # -- state -------------------------------------------------------------------------------
    def _apply(self, row: dict[str, Any]) -> None:
        """Advance the state by one recorded row (live and on resume)."""
        if row.get("kind") == "proposer":
            return
        if row.get("kind") == "profile":
            if self.incumbent is not None and row.get("id") == self.incumbent.id:
                self.incumbent.profile = row.get("profile")
            if self._replaying:
                self.elapsed_before = max(self.elapsed_before, float(row.get("elapsed_s") or 0.0))
            return
        self.seen.add(row["id"])
        if row.get("trial") is not None:
            self.trials = max(self.trials, int(row["trial"]) + 1)
        if self._replaying:  # a resumed run: the time the earlier runs used
            self.elapsed_before = max(self.elapsed_before, float(row.get("elapsed_s") or 0.0))
        self.round = max(self.round, int(row.get("round") or 0))
        if row["status"] == "KEEP":
            self.incumbent = Incumbent(row["config"], row["id"], int(row["trial"]), float(row["ms"]),
                                       row.get("profile"))
            if self.start is None:
                self.start = Incumbent(row["config"], row["id"], int(row["trial"]), float(row["ms"]))

    def elapsed(self) -> float:
        return self.elapsed_before + (time.monotonic() - self._t0)

    def budget_left(self) -> str | None:
        """None while the budget allows another trial, else why the run stops."""
        if self.s.trials is not None and self.trials >= self.s.trials:
            return f"budget: {self.s.trials} trials"
        if self.s.minutes is not None and self.elapsed() >= self.s.minutes * 60:
            return f"budget: {self.s.minutes:g} minutes"
        return None

    def checkpoint(self) -> None:
        atomic_write_json(self.out / "settings.json", {"version": 1, "settings": self.s.to_json()})

    # -- baselines ---------------------------------------------------------------------------
    def _load_baselines(self) -> list[dict[str, Any]]:
        p = self.out / "baselines.json"
        if not p.exists():
            return []
        try:
            return list(read_json(p).get("baselines", []))
        except (OSError, ValueError, AttributeError):
            return []

    def measure_baselines(self, fn: Callable[[TuneSettings], list[dict[str, Any]]] | None) -> None:
        """Measure the baselines once per run (``fn(settings)`` -> rows ``{"name", "ms",
        "runs", "correct", "note"}``) and store them in DIR/baselines.json; a resumed run reuses
        them."""
        if self.baselines or not self.s.baselines or self.s.backend != "triton" or fn is None:
            return
        self.baselines = fn(self.s)
        atomic_write_json(self.out / "baselines.json", {"baselines": self.baselines})

    def fastest_baseline(self) -> dict[str, Any] | None:
        ok = [b for b in self.baselines if b.get("correct") and b.get("ms")]
        return min(ok, key=lambda b: b["ms"]) if ok else None

    def ratio(self) -> float | None:
        """The fastest baseline's ms over the incumbent's (`amk bench`'s measurement of it once
        confirmed, else the worker's A/B timing); None without a baseline or on the sim."""
        b = self.fastest_baseline()
        if b is None or self.incumbent is None or self.s.backend != "triton":
            return None
        ms = float(self.confirmed["ms"]) if self.confirmed else self.incumbent.ms
        return b["ms"] / ms

    # -- candidates --------------------------------------------------------------------------
    def warm_candidates(self) -> list[tuple[dict[str, Any], str]]:
        """(config, where it came from) of the warm start: the heuristic config, then the
        nearest database entries adapted to this run."""
        from search.heuristic import heuristic_config

        gpu = self.gpu_key() if self.s.backend == "triton" else None
        out = []
        heur, dropped = self.space.adapt(heuristic_config(self.shape_key(), gpu, self.s.tp,
                                                          qk_norm=bool(getattr(self.spec, "qk_norm", False))))
        out.append((heur, "heuristic" + (f" (set back: {', '.join(dropped)})" if dropped else "")))
        try:
            near = self.db.nearest(self.shape_key(), self.gpu_key(), self.s.tp, k=self.s.warm)
        except AmkError as err:
            self._warn(f"tuning database: {err}")
            near = []
        for dist, entry in near:
            cand, dropped = self.space.adapt(entry.config)
            if self.s.backend == "sim":
                cand["kernel"] = heur["kernel"]
            what = f"db entry {entry.gpu.name} tp {entry.tp} {entry.ms:.4g} ms (distance {dist:.3g})"
            out.append((cand, what + (f" (set back: {', '.join(dropped)})" if dropped else "")))
        return out

    def ranking(self) -> tuple[list[tuple[str, float]], dict[str, float], str]:
        """(ranked knobs, family shares, their source) for the incumbent: its in-kernel profile
        when there is one, else the cost model's estimate of its program."""
        inc = self.incumbent
        if inc is not None and inc.profile and inc.profile.get("op_us"):
            shares, source = profile_shares(inc.profile["op_us"]), "in-kernel profile (measured)"
        else:
            from search.worker import lower_config, make_target

            prog = lower_config(self._graph, self.s.tp, inc.config["lowering"], make_target(self.target_json()))
            shares, source = cost_shares(prog, self.s.seq_len), "cost model (predicted)"
        return rank_knobs(self.space, shares), shares, source

    def round_candidates(self) -> list[tuple[dict[str, Any], str, str]]:
        """(config, kind, note) of one round: the unseen one-knob neighbours of the incumbent
        along the top-ranked knobs (at most ``per_round``), then ``mutations`` random
        two-knob mutations of it (the top half of the ranking)."""
        ranked, _, _ = self.ranking()
        inc = self.incumbent.config
        out, ids = [], set()
        for name, _score in ranked:
            for cand in self.space.neighbours(inc, name):
                cid = candidate_id(cand)
                if cid in self.seen or cid in ids:
                    continue
                out.append((cand, "neighbour", f"{name}: {self.space.describe(cand, inc)}"))
                ids.add(cid)
            if len(out) >= self.s.per_round:
                break
        out = out[:self.s.per_round]
        top = [n for n, _ in ranked[:max(2, len(ranked) // 2)]]
        for _ in range(self.s.mutations):
            for _attempt in range(20):
                cand = self.space.settle(self.space.mutate(inc, self.rng, 2, names=top))
                cid = candidate_id(cand)
                if cid not in self.seen and cid not in ids and cand != inc:
                    out.append((cand, "mutation", self.space.describe(cand, inc)))
                    ids.add(cid)
                    break
        return out

    def next_candidates(self) -> list[tuple[dict[str, Any], str, str]]:
        """(config, kind, note) of the next round: the local moves (``round_candidates``), or
        with ``proposer`` ``llm`` the model's candidates (kind ``llm``), falling back to the local
        moves when the answer holds none usable or the request failed (see the module docstring).
        Raises ProposerUnavailable after ``llm_max_failures`` failed requests in a row."""
        if self.llm is None:
            return self.round_candidates()
        try:
            answer = self._ask_llm()
        except ProposalSkipped as skip:
            self._proposer_row("skipped", skip.reason, raw=skip.raw, kind=skip.kind)
            if skip.kind == "request":
                self.request_failures += 1
                check_request_failures(self.s.proposer, self.request_failures, self.s.llm_max_failures,
                                       self.s.llm_fallback, skip, f"amk tune --resume {shlex.quote(str(self.out))}",
                                       "the local moves")
            else:
                self.request_failures = 0
                self._proposer_row("error", skip.reason)
            return self._fallback(skip.reason)
        self.request_failures = 0
        for e in answer.errors:
            self._proposer_row("error", e)
            self._warn(f"round {self.round}: LLM proposer error: {e}")
        if not answer.candidates:
            return self._fallback("no usable candidate in the answer" +
                                  (f" ({answer.errors[-1]})" if answer.errors else ""))
        return [(c, "llm", note) for c, note in answer.candidates]

    def _ask_llm(self) -> Any:
        """The LLM proposer's answer for this round; the prompt and the answer are logged."""
        from search.tuneproposer import TuneContext

        _, shares, source = self.ranking()
        inc = self.incumbent
        try:
            near = self.db.nearest(self.shape_key(), self.gpu_key(), self.s.tp, k=5)
        except AmkError:
            near = []
        ctx = TuneContext(
            incumbent={"trial": inc.trial, "id": inc.id, "ms": inc.ms, "config": inc.config},
            shares=shares, shares_source=source, timing_source=self.s.timing_source,
            trials=[r for r in self.rows if r.get("kind") not in NOT_TRIALS], nearest=near,
            errors=[r["reason"] for r in self.rows if r.get("kind") == "proposer" and r.get("event") == "error"],
            seen=set(self.seen), round=self.round)
        prompt = self.llm.prompt(ctx)
        self._log_proposer({"round": self.round, "event": "request", "model": self.llm.model, "prompt": prompt})
        answer = self.llm.propose(ctx, prompt)
        self._log_proposer({"round": self.round, "event": "answer", "text": answer.text, "raw": answer.raw,
                            "candidates": len(answer.candidates), "errors": answer.errors})
        return answer

    def _fallback(self, why: str) -> list[tuple[dict[str, Any], str, str]]:
        """This round's local moves in place of the LLM's candidates; said on the console and
        recorded (a ``fallback`` proposer row, counted in the summary)."""
        why = " ".join(why.split())[:300]
        self._proposer_row("fallback", why)
        if self.console is not None:
            from rich.markup import escape

            self.console.print(f"[yellow]round {self.round}: fallback to the local moves: the llm proposer gave "
                               f"no usable candidate ({escape(why)})[/]", soft_wrap=True)
        return [(c, kind, f"{note} (fallback)") for c, kind, note in self.round_candidates()]

    def _proposer_row(self, event: str, reason: str, **extra: Any) -> None:
        """A proposer event in DIR/trials.jsonl (no trial; counted in the summary, its errors
        shown to the model next round) and in DIR/proposer.log."""
        row = {"kind": "proposer", "event": event, "reason": redact(reason), "round": self.round,
               "status": "PROPOSER", "elapsed_s": self.elapsed(), "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
        self._log_proposer({**row, **extra})
        if event != "skipped":
            self.log.append(row)
            self.rows.append(row)

    def _log_proposer(self, event: dict[str, Any]) -> None:
        append_line(self.out / "proposer.log", redact(json.dumps(event, sort_keys=True, default=str)))

    # -- one trial ---------------------------------------------------------------------------
    def request(self, cand: dict[str, Any], trial: int, profile: bool = False) -> dict[str, Any]:
        inc = self.incumbent
        return {
            "model": self.s.model, "ranks": self.s.tp, "backend": self.s.backend,
            "config": cand["lowering"], "kernel": cand["kernel"],
            "incumbent": inc.config["lowering"] if inc else None,
            "incumbent_kernel": inc.config["kernel"] if inc else None,
            "target": self.target_json(), "positions": list(self.s.positions),
            "prompt_seed": self.s.seed * 1_000_003 + trial, "sim_seed": self.s.seed * 7919 + trial,
            "sim_policy": "random", "seq_len": self.s.seq_len, "tolerance": self.s.gate_tolerance(),
            "timing": dict(self.s.timing), "hooks": dict(self.s.hooks), "trial": trial,
            "profile": profile, **({"hbm_bw": self.s.hbm_bw} if self.s.hbm_bw else {}),
        }

    def _use_profile(self) -> bool:
        return self.s.backend == "triton" and self.s.profile

    def try_candidate(self, cand: dict[str, Any], kind: str, note: str) -> dict[str, Any]:
        """Screen, evaluate (unless refused) and record one candidate; returns its row."""
        from search.evaluator import below_floor, new_workdir

        cid = candidate_id(cand)
        inc = self.incumbent
        row: dict[str, Any] = {
            "id": cid, "config": cand, "kind": kind, "note": note, "round": self.round,
            "parent": inc.id if inc else None, "changed": self.space.changed(cand, inc.config) if inc else [],
            "trial": None, "status": "REJECTED", "reason": "", "ms": None, "timing_source": None,
            "incumbent_ms": inc.ms if inc else None, "gain": None}
        why = self.space.screen(cand)
        if why is not None:
            row["reason"] = why
            return self._record(row)
        trial = self.trials
        row["trial"] = trial
        res = self.evaluator.evaluate(self.request(cand, trial), new_workdir(self.out / "work", trial))
        row["eval_s"] = res.get("wall_s")
        row["floor_ms"] = res.get("floor_ms")
        row["correctness"] = res.get("correctness")
        row["profile"] = res.get("profile")
        status = res.get("status")
        if status == "timeout":
            row.update(status="TIMEOUT", reason=res.get("reason", "timed out"))
            return self._record(row)
        if status == "rejected":
            row.update(status="REJECTED", reason=res.get("reason", ""))
            return self._record(row)
        if status != "ok":
            row.update(status="FAIL", reason=res.get("reason", "") or f"evaluation {status}")
            return self._record(row)
        timing = res.get("timing") or {}
        lat, source, floor = timing.get("median_ms"), timing.get("source"), res.get("floor_ms")
        if lat is None or source not in ("predicted", "measured"):
            row.update(status="FAIL", reason="the evaluation returned no usable timing")
            return self._record(row)
        if floor is not None and below_floor(lat, floor):
            row.update(status="FAIL", reason=f"timing {lat:.4g} ms ({source}) is below the roofline floor "
                       f"{floor:.4g} ms: a measurement error")
            return self._record(row)
        row.update(ms=float(lat), timing_source=source)
        if floor:
            row["pct_roofline"] = floor / float(lat) * 100.0
        ab = {k: v for k, v in (timing.get("ab") or {}).items() if k != "raw"}
        if ab:
            row["ab"] = ab
        if timing.get("step"):  # the worker's timer: "cuda-graph" replays or "executor" steps
            row["timing_step"] = timing["step"]
        if inc is None:
            row.update(status="KEEP", reason="the first correct candidate", gain=None)
        elif source == "predicted":
            better = lat < inc.ms * (1 - PREDICTED_EPS)
            row.update(status="KEEP" if better else "REVERT", gain=inc.ms / lat,
                       reason=f"predicted {lat / inc.ms:.4f}x the incumbent (trial {inc.trial})")
        else:
            ratio = float(ab.get("ratio", float("nan")))
            row.update(status="KEEP" if ab.get("faster") else "REVERT", gain=1.0 / ratio if ratio else None,
                       incumbent_ms=timing.get("incumbent_ms"),
                       reason=f"A/B ratio {ratio:.4f} vs threshold {ab.get('threshold', float('nan')):.4f} "
                              f"(A/A noise {ab.get('noise', float('nan')):.4f}) against trial {inc.trial}")
        return self._record(row)

    def _record(self, row: dict[str, Any]) -> dict[str, Any]:
        row["elapsed_s"] = self.elapsed()
        row["time"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        self.log.append(row)            # durable before anything else happens
        self.rows.append(row)
        self._apply(row)
        return row

    def profile_incumbent(self) -> None:
        """On the GPU, the incumbent's in-kernel profile when it has none (one worker request;
        recorded as a ``profile`` row, not a trial)."""
        inc = self.incumbent
        if inc is None or inc.profile or not self._use_profile():
            return
        from search.evaluator import new_workdir

        req = self.request(inc.config, inc.trial)
        req["profile_only"] = True
        res = self.evaluator.evaluate(req, new_workdir(self.out / "work", 10_000 + inc.trial))
        prof = res.get("profile") if res.get("status") == "ok" else None
        if prof is None:
            self._warn(f"no in-kernel profile of trial {inc.trial} ({res.get('reason', res.get('status'))}); "
                       "ranking the knobs by the cost model")
            prof = {"source": "unavailable", "op_us": {}}
        row = {"kind": "profile", "id": inc.id, "profile": prof, "status": "PROFILE",
               "elapsed_s": self.elapsed(), "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
        self.log.append(row)
        self.rows.append(row)
        self._apply(row)

    # -- the run -----------------------------------------------------------------------------
    def run(self, on_row: Callable[[dict[str, Any], "Tuner"], None] | None = None,
            confirm: Callable[[dict[str, Any]], dict[str, Any] | None] | None = None) -> dict[str, Any]:
        """Run until the budget is spent or no move is left; write the results (``finish``)
        and return the summary. ``confirm(config)``: measure the best config the way `amk
        bench` does (``{"ms", "roofline_pct", "correct", "verdict", "command", "file"}``, or
        None when it cannot run here); its ms is what the database entry records."""
        self._t0 = time.monotonic()
        self.checkpoint()
        failure: ProposerUnavailable | None = None
        try:
            stop = self.budget_left()
            for cand, note in ([] if stop else self.warm_candidates()):
                stop = self.budget_left()
                if stop:
                    break
                if candidate_id(cand) in self.seen:  # evaluated before a resume
                    continue
                row = self.try_candidate(cand, "warm", note)
                if on_row:
                    on_row(row, self)
            while not stop:
                stop = self.budget_left()
                if stop:
                    break
                if self.incumbent is None:
                    stop = "no warm-start candidate passed the correctness gate"
                    break
                self.profile_incumbent()
                self.round += 1
                try:
                    cands = self.next_candidates()
                except ProposerUnavailable as err:
                    failure, stop = err, str(err)
                    break
                if not cands:
                    stop = "every one-knob neighbour of the incumbent was tried"
                    break
                for cand, kind, note in cands:
                    stop = self.budget_left()
                    if stop:
                        break
                    row = self.try_candidate(cand, kind, note)
                    if on_row:
                        on_row(row, self)
                    if row["status"] == "KEEP":
                        break
        finally:
            self.evaluator.close()
        self.stop_reason = stop or ""
        if failure is not None:  # the report is written; the run can be resumed
            self.finish()
            raise failure
        if confirm is not None and self.incumbent is not None and self.s.backend == "triton":
            self.confirmed = confirm(self.incumbent.config)
        return self.finish()

    # -- the end -----------------------------------------------------------------------------
    def bench_command(self) -> str:
        """The command that now runs the tuned config: ``amk bench MODEL --tp R`` (its default
        config is the database entry; ``AMK_TUNE_DB=DIR`` in front for a --db of its own). The
        sim's entry is keyed to the sim, not a GPU: its line compiles best/config.json."""
        if self.s.backend == "sim":
            return (f"amk compile {shlex.quote(self.s.model)} --tp {self.s.tp} --backend sim --config "
                    f"{shlex.quote(str(self.out / 'best' / 'config.json'))}")
        env = f"AMK_TUNE_DB={shlex.quote(self.s.db)} " if self.s.db else ""
        return f"{env}amk bench {shlex.quote(self.s.model)} --tp {self.s.tp}"

    def finish(self) -> dict[str, Any]:
        """Write best/config.json, the database entry, report.json and report.md; return the
        summary (what report.json holds)."""
        inc = self.incumbent
        put_ok, put_msg, best_file, failed = None, "", None, None
        if inc is not None:
            best_file = self.out / "best" / "config.json"
            (self.out / "best").mkdir(parents=True, exist_ok=True)
            atomic_write_json(best_file, inc.config)
            try:
                put_ok, put_msg = self.db.put(self.entry(), replace=self.s.replace)
            except AmkError as err:  # the report and best/config.json still get written
                failed = err
                put_ok, put_msg = False, f"not stored: {err}"
        summary = self.summary(put_ok, put_msg, best_file)
        atomic_write_json(self.out / "report.json", summary)
        atomic_write_text(self.out / "report.md", report_markdown(summary))
        if failed is not None:
            raise AmkError(f"{failed} (the run's best is {best_file}; its report {self.out / 'report.md'})")
        return summary

    def entry(self) -> Any:
        """The database entry of the incumbent."""
        from search.tunedb import Entry, kernel_fingerprint

        inc = self.incumbent
        b = self.fastest_baseline()
        c = self.confirmed
        if c is not None:  # `amk bench`'s own measurement of the best config: what a user sees
            ms, pct, correct = float(c["ms"]), c.get("roofline_pct"), bool(c.get("correct"))
        else:
            ms, pct, correct = inc.ms, self._row(inc.trial).get("pct_roofline"), True
        return Entry(shape=self.shape_key(), gpu=self.gpu_key(), tp=self.s.tp, fingerprint=kernel_fingerprint(),
                     config=inc.config, ms=ms, baseline_ms=b["ms"] if b else None,
                     baseline=b["name"] if b else None, ratio=self.ratio(),
                     roofline_pct=pct, correct=correct,
                     date=time.strftime("%Y-%m-%d"), command=self.command(), commit=_commit())

    def command(self) -> str:
        return (f"amk tune {shlex.quote(self.s.model)} --tp {self.s.tp} --backend {self.s.backend}"
                + (f" --trials {self.s.trials}" if self.s.trials else "")
                + (f" --minutes {self.s.minutes:g}" if self.s.minutes else ""))

    def _row(self, trial: int) -> dict[str, Any]:
        for r in self.rows:
            if r.get("trial") == trial:
                return r
        return {}

    def summary(self, put_ok: bool | None = None, put_msg: str = "", best_file: Path | None = None
                ) -> dict[str, Any]:
        """The run's summary: start vs best, every kept step with its gain, rejected counts by
        reason, the shares the rankings used, the baselines and the database's answer."""
        trials = [r for r in self.rows if r.get("kind") not in NOT_TRIALS]
        events = [r for r in self.rows if r.get("kind") == "proposer"]
        by_status: dict[str, int] = {}
        rejected: dict[str, int] = {}
        for r in trials:
            by_status[r["status"]] = by_status.get(r["status"], 0) + 1
            if r["status"] == "REJECTED":
                key = _reason_class(r.get("reason", ""))
                rejected[key] = rejected.get(key, 0) + 1
        kept = [{"trial": r["trial"], "id": r["id"], "kind": r["kind"], "note": r.get("note", ""),
                 "changed": r.get("changed", []), "ms": r["ms"], "gain": r.get("gain")}
                for r in trials if r["status"] == "KEEP"]
        inc, start = self.incumbent, self.start
        shares = None
        if inc is not None:
            try:
                _, fam, src = self.ranking()
                shares = {"source": src, "families": fam}
            except AmkError:
                shares = None
        b = self.fastest_baseline()
        src = self.s.timing_source
        return {
            "ok": inc is not None, "model": self.s.model, "tp": self.s.tp, "backend": self.s.backend,
            "timing_source": src,
            "timing_note": ("the sim's latency is the cost model's PREDICTION (lowering/costmodel.py), "
                            "not a measurement" if src == "predicted" else
                            "measured: interleaved A/B of " + _step_timer(trials) + " per token (CUDA events)"
                            + (f"; the {self.s.tp} ranks run co-located on one GPU in the evaluation worker"
                               if self.s.tp > 1 else "")),
            "gpu": self.s.gpu, "trials": self.trials, "rows": len(trials), "by_status": by_status,
            "rejected_by_reason": rejected, "stop_reason": self.stop_reason,
            "proposer": self.s.proposer,
            "proposer_errors": sum(1 for r in events if r.get("event") == "error"),
            "fallbacks": sum(1 for r in events if r.get("event") == "fallback"),
            "elapsed_s": self.elapsed(), "budget": {"trials": self.s.trials, "minutes": self.s.minutes},
            "start": {"trial": start.trial, "id": start.id, "ms": start.ms, "config": start.config} if start else None,
            "best": {"trial": inc.trial, "id": inc.id, "ms": inc.ms, "config": inc.config} if inc else None,
            "speedup_vs_start": start.ms / inc.ms if inc and start else None,
            "kept": kept, "shares": shares, "baselines": self.baselines,
            "confirmed": self.confirmed,
            "fastest_baseline": b, "ratio_vs_fastest_baseline": self.ratio(),
            "best_config_file": str(best_file) if best_file else None,
            "db": {"dir": str(getattr(self.db, "user_dir", "") or ""), "written": put_ok, "message": put_msg},
            "use": self.bench_command() if inc is not None else None,
            "out": str(self.out),
        }


def _step_timer(trials: list[dict[str, Any]]) -> str:
    """What the trials' A/B timing replayed (search/worker.py): a CUDA-graph replay of one
    megakernel step, one executor step with its host round trip, or both across a resumed
    run; the executor's wording when the rows do not say (runs recorded before the field)."""
    steps = {r.get("timing_step") for r in trials if r.get("timing_step")}
    if steps == {"cuda-graph"}:
        return "CUDA-graph replays of one megakernel step"
    if "cuda-graph" in steps:
        return "CUDA-graph replays or executor steps (see each trial's timing_step)"
    return "one executor step"


def _reason_class(reason: str) -> str:
    """A rejection reason without its values, for counting (``does nothing``, ``resources``,
    ``rule``, ``validator``, ``lowering``)."""
    if "does nothing" in reason:
        return "a knob does nothing"
    if reason.startswith("resources:"):
        return "resources (" + reason.split(":", 1)[1].split(" need", 1)[0].strip()[:60] + ")" \
            if "shared memory" in reason else "resources (registers or threads)"
    if reason.startswith("validator:"):
        return "validator"
    if reason.startswith("lowering refused"):
        return "lowering refused"
    if "needs" in reason or "of at least" in reason:
        return "a rule between knobs"
    return reason[:60]


def _commit() -> str | None:
    """The source tree's git commit (None outside a git checkout)."""
    import subprocess

    try:
        out = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parent.parent, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def report_markdown(s: dict[str, Any]) -> str:
    """DIR/report.md from the summary."""
    src = s["timing_source"]
    lines = [f"# amk tune {s['model']} --tp {s['tp']} ({s['backend']})", "",
             f"Latency: **{src}**: {s['timing_note']}.", ""]
    if s["gpu"]:
        lines.append(f"GPU: {s['gpu'].get('name')} ({s['gpu'].get('sms')} SMs)")
    lines += [f"Trials evaluated: {s['trials']}; rows: {s['rows']} "
              f"({', '.join(f'{k} {v}' for k, v in sorted(s['by_status'].items()))}); "
              f"stopped: {s['stop_reason'] or '-'}; {s['elapsed_s'] / 60:.1f} minutes.", ""]
    if s.get("proposer") == "llm":
        lines += [f"Proposer: llm; {s['proposer_errors']} proposer errors, {s['fallbacks']} rounds fell back to "
                  "the local moves (prompts and answers: proposer.log).", ""]
    st, b = s["start"], s["best"]
    if b:
        lines += ["| | trial | ms/token | config id |", "|---|---|---|---|",
                  f"| start | {st['trial']} | {st['ms']:.4g} | {st['id']} |",
                  f"| best | {b['trial']} | {b['ms']:.4g} | {b['id']} |", ""]
        if s["speedup_vs_start"]:
            lines.append(f"Speedup of the best over the start: {s['speedup_vs_start']:.3f}x ({src}).")
        fb = s.get("fastest_baseline")
        if fb and s.get("ratio_vs_fastest_baseline"):
            lines.append(f"Fastest baseline: {fb['name']} {fb['ms']:.4g} ms/token; the best is "
                         f"{s['ratio_vs_fastest_baseline']:.3f}x its speed.")
        lines.append("")
    else:
        lines += ["No candidate passed the correctness gate.", ""]
    lines += ["## Kept steps", "", "| trial | kind | change | ms/token | gain |", "|---|---|---|---|---|"]
    for k in s["kept"]:
        gain = f"{k['gain']:.4f}x" if k.get("gain") else "-"
        lines.append(f"| {k['trial']} | {k['kind']} | {k['note'] or ', '.join(k['changed'])} | {k['ms']:.4g} | {gain} |")
    lines += ["", "## Rejected before evaluation or by the validator", ""]
    if s["rejected_by_reason"]:
        lines += ["| reason | count |", "|---|---|"]
        lines += [f"| {r} | {n} |" for r, n in sorted(s["rejected_by_reason"].items(), key=lambda x: -x[1])]
    else:
        lines.append("none")
    lines += ["", "## Shares of the step used to rank the knobs", ""]
    if s["shares"]:
        lines.append(f"Source: {s['shares']['source']}.")
        lines.append("")
        lines += ["| family | share |", "|---|---|"]
        lines += [f"| {f} | {v * 100:.1f}% |" for f, v in s["shares"]["families"].items()]
    else:
        lines.append("none")
    lines += ["", "## Baselines", ""]
    if s["baselines"]:
        lines += ["| baseline | ms/token (fastest of the runs) | runs | correct |", "|---|---|---|---|"]
        for x in s["baselines"]:
            ms = f"{x['ms']:.4g}" if x.get("ms") else "-"
            lines.append(f"| {x['name']} | {ms} | {', '.join(f'{v:.4g}' for v in x.get('runs', []))} | "
                         f"{x.get('correct')} |")
    else:
        lines.append("none measured" + (" (the sim has none)" if s["backend"] == "sim" else ""))
    lines += ["", "## Database", "", f"{s['db']['message'] or '-'}", ""]
    if s["use"]:
        if s["backend"] == "sim":
            lines += ["## Use", "", f"`{s['use']}` (the sim's entry is keyed to the sim, not to a GPU).", ""]
        else:
            lines += ["## Use", "", f"`{s['use']}` (the tuned entry is its default config), or "
                      f"`--config {s['best_config_file']}` with any command.", ""]
    return "\n".join(lines)


def _prepare_dir(d: Path) -> None:
    import tempfile

    try:
        d.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=d):
            pass
    except OSError as err:
        raise AmkError(f"cannot write the tuning directory {d}: {err.strerror or err}") from None


def open_tune(settings: TuneSettings | None = None, *, resume: str | None = None,
              overrides: dict[str, Any] | None = None, **kw: Any) -> Tuner:
    """A new tuning run (``settings``) or a resumed one (``resume`` = its directory: the
    settings come from DIR/settings.json; ``overrides`` may change trials, minutes, timeout_s,
    replace and db). A new run refuses a directory that already holds trials. Raises AmkError."""
    if resume is not None:
        d, s, _ = resume_settings(resume, "settings.json", "an amk tune directory", TuneSettings)
        s.out = str(d)
        apply_overrides(s, overrides, {"trials": "--trials", "minutes": "--minutes", "timeout_s": "--timeout",
                                       "db": "--db", "replace": "--replace", "llm_fallback": "--llm-fallback",
                                       "llm_max_failures": "--llm-max-failures"}, "run")
        return Tuner(s, **kw)
    if settings is None:
        raise AmkError("a new tuning run needs its settings")
    s = replace(settings, out=str(Path(os.path.expanduser(settings.out)).resolve()))
    from search.loop import absolute_model_arg

    s.model = absolute_model_arg(s.model)
    if s.db:
        s.db = str(Path(os.path.expanduser(s.db)).resolve())
    if s.trials is None and s.minutes is None:
        s.minutes = DEFAULT_MINUTES
    d = Path(s.out)
    if (d / "trials.jsonl").exists() and (d / "trials.jsonl").stat().st_size > 0:
        raise AmkError(f"--out {d} already holds a tuning run; continue it with --resume {d} or choose "
                       "another directory")
    return Tuner(s, **kw)
