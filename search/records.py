"""The records of a search: results.tsv, results.jsonl, state.json, the incumbent schedule.

Layout of a search directory ``OUT``::

    OUT/results.jsonl   one full JSON record per finished trial (the source of truth)
    OUT/results.tsv     the same trials, one row each, human-readable (columns: TSV_COLUMNS)
    OUT/state.json      the search's arguments and loop state, rewritten after every trial
    OUT/incumbent/      config.json + schedule.json (+ schedule.amk) of the current incumbent
    OUT/best/           the same for the best candidate so far (+ edits.json in an edit search)
    OUT/base/           schedule.json (+ .amk) of an edit search's base: the lowered start config
    OUT/study.journal   the optuna study (JournalStorage), when the optuna proposer is used
    OUT/proposer.log    JSONL events of the proposers (skipped LLM answers, ...)
    OUT/worker.log      stderr of the evaluation subprocesses
    OUT/summary.json, OUT/latency.png   written at the end

Durability: a trial is appended to results.jsonl and results.tsv with flush + fsync before
the state is written; every other file is written to a temporary name and moved into place
with ``os.replace`` (atomic on POSIX), so a SIGKILL at any point leaves either the old or
the new version. On resume the JSONL is authoritative: a torn last line is dropped, and a
TSV that lacks rows the JSONL has is rebuilt from it.

Rule: no latency without its verdict. ``Record.row()`` refuses to format a latency for a
record without a status, and every row carries ``timing_source`` (``predicted`` for the
cost model on the sim backend, ``measured`` for CUDA-event timings on the triton backend).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from ground.files import atomic_write_text, finite

STATUSES = ("KEEP", "REVERT", "REJECTED", "FAIL", "TIMEOUT")

TSV_COLUMNS = (
    "trial", "parent", "proposer", "candidate_id", "status", "reason",
    "max_abs_err", "argmax_agree", "positions",
    "timing_source", "latency_ms", "latency_spread_ms", "incumbent_ms",
    "speedup_vs_start", "pct_roofline", "roofline_ms", "eval_s", "description",
)


@dataclass
class Record:
    """One finished trial.

    trial: 0-based trial number (0 = the default config); parent: the trial whose config
    this one was derived from (None for the baseline and random restarts); proposer:
    ``baseline`` | ``optuna`` | ``mutation`` | ``random`` | ``llm`` | ``replay`` | ``edits``;
    status: one of STATUSES; reason: why (always set except for a plain KEEP/REVERT).
    correctness: ``{"max_abs_err", "argmax_agree", "positions", ...}`` or None when the
    gate did not run. latency_ms: median per decode step (None unless the candidate
    passed the correctness gate and its timing was accepted); latency_spread_ms: p90-p10.
    timing_source: ``predicted`` | ``measured`` | None. incumbent_ms: the incumbent's
    latency it was compared with (same source). speedup_vs_start: baseline latency /
    this latency. pct_roofline: roofline floor / latency * 100. eval_s: wall seconds of
    the evaluation. extra: everything else (verdict findings, program stats, A/A noise).
    """

    trial: int
    parent: int | None
    proposer: str
    candidate_id: str
    config: dict[str, Any]
    status: str
    reason: str = ""
    correctness: dict[str, Any] | None = None
    latency_ms: float | None = None
    latency_spread_ms: float | None = None
    timing_source: str | None = None
    incumbent_ms: float | None = None
    speedup_vs_start: float | None = None
    pct_roofline: float | None = None
    roofline_ms: float | None = None
    eval_s: float | None = None
    description: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"record status {self.status!r} is not one of {STATUSES}")
        if self.latency_ms is not None and self.timing_source not in ("predicted", "measured"):
            raise ValueError("a latency needs its timing_source (predicted or measured)")

    def to_json(self) -> dict[str, Any]:
        return finite(asdict(self))

    @staticmethod
    def from_json(d: dict[str, Any]) -> "Record":
        known = {f for f in Record.__dataclass_fields__}
        return Record(**{k: v for k, v in d.items() if k in known})

    def row(self) -> list[str]:
        """The TSV row (strings, in TSV_COLUMNS order). Empty cells are ``-``."""
        c = self.correctness or {}
        vals = {
            "trial": self.trial, "parent": self.parent, "proposer": self.proposer,
            "candidate_id": self.candidate_id, "status": self.status, "reason": self.reason,
            "max_abs_err": _fmt(c.get("max_abs_err"), "{:.3g}"),
            "argmax_agree": _fmt(c.get("argmax_agree"), "{:.3f}"),
            "positions": ",".join(str(p) for p in c.get("positions") or []) or None,
            "timing_source": self.timing_source,
            "latency_ms": _fmt(self.latency_ms, "{:.5g}"),
            "latency_spread_ms": _fmt(self.latency_spread_ms, "{:.3g}"),
            "incumbent_ms": _fmt(self.incumbent_ms, "{:.5g}"),
            "speedup_vs_start": _fmt(self.speedup_vs_start, "{:.4f}"),
            "pct_roofline": _fmt(self.pct_roofline, "{:.2f}"),
            "roofline_ms": _fmt(self.roofline_ms, "{:.5g}"),
            "eval_s": _fmt(self.eval_s, "{:.2f}"),
            "description": self.description,
        }
        return [_cell(vals[k]) for k in TSV_COLUMNS]


def _fmt(v: Any, spec: str) -> str | None:
    if v is None:
        return None
    try:
        return spec.format(float(v))
    except (TypeError, ValueError):
        return str(v)


def _cell(v: Any) -> str:
    if v is None or v == "":
        return "-"
    # TSV: no tabs or newlines inside a cell.
    return " ".join(str(v).replace("\t", " ").split())


def append_line(path: str | os.PathLike, line: str) -> None:
    """Append one line (newline added) and fsync, so a finished trial survives a kill.

    The append-only logs (results.jsonl, results.tsv, proposer.log) grow by whole lines: a
    kill can tear only the last line, which ``ResultsStore.load`` cuts off. Raises AmkError
    naming the file when it cannot be written."""
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(line.rstrip("\n") + "\n")
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:
        from ground.errors import AmkError

        raise AmkError(f"cannot write {path}: {err.strerror or err}") from None


def read_json(path: str | os.PathLike) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


# -- the results files ----------------------------------------------------------------
def resume_settings(resume: str, name: str, what: str, cls: Any) -> tuple[Path, Any, dict[str, Any]]:
    """(the run directory ``resume`` made absolute, its settings, the file's whole object):
    the settings are ``cls`` from the ``settings`` object of DIR/``name``. Raises AmkError
    naming the directory when the file is missing (DIR is not ``what``) or unreadable."""
    from ground.errors import AmkError

    d = Path(os.path.expanduser(resume)).resolve()
    sp = d / name
    if not sp.exists():
        raise AmkError(f"--resume {d}: no {name} there (not {what})")
    try:
        data = read_json(sp)
        return d, settings_from_json(cls, data["settings"]), data
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise AmkError(f"--resume {d}: unreadable {name} ({err})") from None


def apply_overrides(s: Any, overrides: dict[str, Any] | None, allowed: dict[str, str],
                    started: str) -> None:
    """Set each non-None ``overrides`` value on the resumed settings ``s``. ``allowed``: the
    fields that may change on a resume, with their flags; any other field must keep its value
    (AmkError naming the field, both values and the flags that may change)."""
    from ground.errors import AmkError

    for k, v in (overrides or {}).items():
        if v is None:
            continue
        if k not in allowed and getattr(s, k) != v:
            raise AmkError(f"--resume: {k} was {getattr(s, k)!r} when the {started} started; it cannot "
                           f"change to {v!r} (only {', '.join(allowed.values())})")
        setattr(s, k, v)


def settings_from_json(cls: Any, d: dict[str, Any]) -> Any:
    """``cls(**d)`` for a settings dataclass, keeping only the fields ``cls`` has (a file
    written by another version may hold fewer or more)."""
    known = set(cls.__dataclass_fields__)
    return cls(**{k: v for k, v in d.items() if k in known})


def read_log(path: str | os.PathLike, parse: Callable[[Any], Any],
             warn: Callable[[str], None] | None = None) -> list[Any]:
    """The records of a JSON-lines log written by ``append_line``, in order: ``parse(obj)``
    of each line (it raises ValueError or TypeError for an object that is not a record).

    A torn LAST record (no newline at its end, or not a record: a kill in the middle of an
    append) is cut off the file, told through ``warn``, and not returned; a bad line
    elsewhere is an AmkError naming the file and line (the file was edited or corrupted)."""
    from ground.errors import AmkError

    path = Path(path)
    raw = path.read_bytes()
    lines = raw.split(b"\n")
    out: list[Any] = []
    good = 0
    for i, line in enumerate(lines):
        last = i == len(lines) - 1
        if not line.strip():
            good += 0 if last else len(line) + 1
            continue
        try:
            if last:
                raise ValueError("no newline at the end")
            rec = parse(json.loads(line))
        except (ValueError, TypeError) as err:
            if last or (i == len(lines) - 2 and not lines[-1].strip()):
                if warn:
                    warn(f"{path}:{i + 1}: ignoring a half-written last line ({err}); that trial runs again")
                break
            raise AmkError(f"{path}:{i + 1}: unreadable trial record ({err})") from None
        out.append(rec)
        good += len(line) + 1
    if good != len(raw):
        with open(path, "r+b") as f:
            f.truncate(good)
            f.flush()
            os.fsync(f.fileno())
    return out


class ResultsStore:
    """results.jsonl + results.tsv of one search directory."""

    def __init__(self, out_dir: str | os.PathLike):
        self.dir = Path(out_dir)
        self.jsonl = self.dir / "results.jsonl"
        self.tsv = self.dir / "results.tsv"

    def load(self) -> list[Record]:
        """The finished trials, in order (``read_log``: a torn last line is cut off the file, a
        bad line elsewhere is an error). Rebuilds the TSV when it lags."""
        if not self.jsonl.exists():
            return []
        records = read_log(self.jsonl, Record.from_json)
        self._sync_tsv(records)
        return records

    def _sync_tsv(self, records: list[Record]) -> None:
        want = [self.header()] + ["\t".join(r.row()) for r in records]
        have = self.tsv.read_text(encoding="utf-8").splitlines() if self.tsv.exists() else []
        if have != want:
            atomic_write_text(self.tsv, "\n".join(want) + "\n")

    @staticmethod
    def header() -> str:
        return "\t".join(TSV_COLUMNS)

    def append(self, rec: Record) -> None:
        """Append one finished trial: JSONL first (authoritative), then the TSV row."""
        self.dir.mkdir(parents=True, exist_ok=True)
        append_line(self.jsonl, json.dumps(rec.to_json(), sort_keys=True))
        if not self.tsv.exists() or self.tsv.stat().st_size == 0:
            append_line(self.tsv, self.header())
        append_line(self.tsv, "\t".join(rec.row()))


def read_tsv(path: str | os.PathLike) -> list[dict[str, str]]:
    """The rows of a results.tsv as dicts keyed by TSV_COLUMNS."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    if not lines:
        return []
    head = lines[0].split("\t")
    return [dict(zip(head, ln.split("\t"))) for ln in lines[1:] if ln.strip()]


def iter_records(path: str | os.PathLike) -> Iterable[Record]:
    """Records of a results.jsonl (read-only; a torn last line is skipped)."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            yield Record.from_json(json.loads(line))
        except (ValueError, TypeError):
            if i == len(lines) - 1:
                return
            raise
