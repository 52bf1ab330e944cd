"""The records of a search: results.tsv, results.jsonl, state.json, the incumbent schedule.

Layout of a search directory ``OUT``::

    OUT/results.jsonl   one full JSON record per finished trial (the source of truth)
    OUT/results.tsv     the same trials, one row each, human-readable (columns: TSV_COLUMNS)
    OUT/state.json      the search's arguments and loop state, rewritten after every trial
    OUT/incumbent/      config.json + schedule.json (+ schedule.amk) of the current incumbent
    OUT/best/           the same for the best candidate so far
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
from typing import Any, Iterable

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
    ``baseline`` | ``optuna`` | ``mutation`` | ``random`` | ``llm`` | ``replay``;
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
            "positions": ",".join(str(p) for p in c.get("positions", [])) or None,
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
class ResultsStore:
    """results.jsonl + results.tsv of one search directory."""

    def __init__(self, out_dir: str | os.PathLike):
        self.dir = Path(out_dir)
        self.jsonl = self.dir / "results.jsonl"
        self.tsv = self.dir / "results.tsv"

    def load(self) -> list[Record]:
        """The finished trials, in order. A torn (unterminated or unparsable) LAST line, left
        by a kill in the middle of an append, is cut off the file; a bad line elsewhere is
        an error (the file was edited or corrupted). Rebuilds the TSV when it lags."""
        if not self.jsonl.exists():
            return []
        raw = self.jsonl.read_bytes()
        lines = raw.split(b"\n")
        records: list[Record] = []
        good_len = 0
        for i, line in enumerate(lines):
            last = i == len(lines) - 1
            if not line.strip():
                if not last:
                    good_len += len(line) + 1
                continue
            try:
                rec = Record.from_json(json.loads(line))
                if last:  # no trailing newline: the append was cut short
                    raise ValueError("unterminated last line")
            except (ValueError, TypeError) as err:
                if last:
                    break
                from ground.errors import AmkError

                raise AmkError(f"{self.jsonl}:{i + 1}: unreadable trial record ({err})") \
                    from None
            records.append(rec)
            good_len += len(line) + 1
        if good_len != len(raw):
            with open(self.jsonl, "r+b") as f:
                f.truncate(good_len)
                f.flush()
                os.fsync(f.fileno())
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
