"""The validator's entry point: ``validate(program) -> Verdict``.

Runs, in order: structure (validator/structure.py), deadlock (validator/deadlock.py:
unsatisfiable waits, the graph over all ranks with a cycle witness, the exact monotone
simulation, collective participation and order), happens-before (validator/hb.py: the
counter-edge fixpoint over an unrolled window of epochs) and races
(validator/races.py: element-granular coverage, unordered writes, remote delivery,
cross-epoch reuse). Semantics: ir/program.py and docs/validator.md.

``validate`` never raises on a malformed program: structure problems are findings, and an
unexpected internal exception becomes an ``InternalError`` finding (a rejection: when the
validator cannot decide, the schedule is not accepted).
"""

from __future__ import annotations

import gc
import time
import traceback
from typing import Any, Callable

from validator.analysis import run_deep_checks
from validator.structure import check_structure
from validator.verdict import Finding, Verdict

Progress = Callable[[str], None]


def _internal(stage: str, exc: BaseException) -> Finding:
    tb = traceback.format_exception(type(exc), exc, exc.__traceback__)
    return Finding("InternalError", f"the validator failed in its {stage} stage ({exc!r}); "
                   f"the schedule is rejected because it could not be checked",
                   witness={"stage": stage, "traceback": "".join(tb[-6:])})


def validate(program: Any, *, backend: str | None = None,
             progress: Progress | None = None) -> Verdict:
    """Statically check ``program`` (a :class:`ir.program.ScheduleProgram`).

    ``backend`` overrides ``program.target.backend`` for the op-support check.
    ``progress`` (optional) is called with a short stage name as each stage starts.
    Returns a :class:`Verdict`: ``ok`` iff no errors; ``stats`` holds counts and the time
    of each stage in seconds. Never raises on malformed input.
    """
    # The checks allocate many small containers and no reference cycles; the cyclic GC
    # would rescan the (large) program on every generation-0 overflow, doubling the time.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _validate(program, backend, progress)
    finally:
        if gc_was_enabled:
            gc.enable()


def _validate(program: Any, backend: str | None, progress: Progress | None) -> Verdict:
    t0 = time.perf_counter()
    t0_cpu = time.process_time()
    timings: dict[str, float] = {}
    cpu: dict[str, float] = {}
    stats: dict[str, Any] = {"timings_s": timings, "cpu_s": cpu}
    errors: list[Finding] = []

    def stage(name: str, fn, *args):
        if progress is not None:
            progress(name)
        t, c = time.perf_counter(), time.process_time()
        try:
            return fn(*args)
        except Exception as exc:  # never raise: an internal failure is a rejection
            errors.append(_internal(name, exc))
            return None
        finally:
            timings[name] = round(time.perf_counter() - t, 4)
            cpu[name] = round(time.process_time() - c, 4)

    st = stage("structure", check_structure, program, backend)
    if st is not None:
        errors.extend(st.findings)
        if st.suppressed:
            stats["suppressed_findings"] = dict(st.suppressed)
    for key in ("ranks", "workers", "slots"):
        stats[key] = getattr(program, key, None)
    for key in ("tasks", "buffers", "counters"):
        v = getattr(program, key, None)
        stats[key] = len(v) if isinstance(v, (list, tuple)) else None
    if st is None or st.fatal:
        stats["deep_checks"] = "skipped: structure errors make them meaningless"
    else:
        res = stage("deep", run_deep_checks, st.index, stage)
        if res is not None:
            errors.extend(res.findings)
            stats.update(res.stats)
        stats["deep_checks"] = "done"
    stats["total_s"] = round(time.perf_counter() - t0, 4)
    stats["total_cpu_s"] = round(time.process_time() - t0_cpu, 4)
    return Verdict(errors=errors, stats=stats)
