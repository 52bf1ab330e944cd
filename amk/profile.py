"""``amk profile``: one decode step as a per-task trace (lowering/trace.py).

Two clocks:

* ``simulated`` (``--backend sim``, any machine): the cost model's timeline of the schedule
  (lowering/views.py); nothing runs, the times are predictions.
* ``gpu`` (``--backend triton``, one CUDA GPU): the megakernel built with its profiling stamps
  (lowering/triton: ``profile=True``, ``vm.PROF_W`` int64 stamps per task row: %globaltimer
  ns at the queue head, waits met and signals released) runs ``seq_len`` decode steps; the
  stamps of the last step are the trace. The profiled kernel stores three more words per
  task, so its step is slightly slower than the plain kernel's. ``--tp R``: one process per
  GPU over NVSHMEM (the ranks' stamps gathered), or with ``--colocate`` the R ranks on one GPU.
"""

from __future__ import annotations

from typing import Any

from ground.errors import AmkError
from ir.program import ScheduleProgram


def sim_trace(prog: ScheduleProgram, seq_len: int, meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``simulated`` trace of ``prog`` at ``seq_len`` tokens in the KV cache."""
    from lowering.trace import build_trace, sim_times

    return build_trace(prog, sim_times(prog, seq_len), clock="simulated", seq_len=seq_len, meta=meta)


def prof_times(prog: ScheduleProgram, prof: Any, task_ids: list[str], task_ranks: list[int]) -> dict:
    """Task times (lowering/trace.py ``TaskTimes``, seconds from the step's first stamp) from
    the profiling buffer ``prof`` (int64 numpy array, one row of ``vm.PROF_W`` stamps per task
    table row: 0 queue head, 1 waits met, 2 signals released; ns) and the table's per-row task
    ids and ranks. Rows whose task is not in ``prog`` or that never ran (zero stamps) are left
    out."""
    index = {(t.rank, t.id): k for k, t in enumerate(prog.tasks)}
    ran = [row for row in range(len(task_ids)) if prof[row, 0] > 0 and prof[row, 2] > 0]
    if not ran:
        raise AmkError("the profiling buffer holds no stamps (did the kernel run with profile=True?)")
    t0 = min(int(prof[row, 0]) for row in ran)
    times = {}
    for row in ran:
        k = index.get((task_ranks[row], task_ids[row]))
        if k is not None:
            a, b, c = (int(prof[row, j]) - t0 for j in range(3))
            times[k] = (a / 1e9, max(a, b) / 1e9, max(a, b, c) / 1e9)
    return times


def gpu_trace(compilation: Any, kernel_cfg: Any, seq_len: int, meta: dict[str, Any] | None = None,
              ctx: Any = None) -> dict[str, Any]:
    """The ``gpu`` trace of ``compilation``'s program (amk.pipeline.Compilation built for the triton
    backend, weights loaded on demand): run ``seq_len`` decode steps with the profiling kernel
    (``kernel_cfg``: its KernelConfig) and turn the last step's stamps into the trace. Needs a
    CUDA GPU (AmkError otherwise). Without ``ctx`` the program's R ranks run co-located on this
    GPU; with ``ctx`` (a ``lowering.triton.dist.DistContext``: one process per GPU over
    NVSHMEM) every rank runs its own kernel and the ranks' stamps are gathered (a collective:
    every rank calls it and gets the whole trace). Each GPU stamps with its own %globaltimer;
    the ranks are put on one axis at the earliest stamp of all, so cross-rank offsets are as
    close as the GPUs' clocks agree."""
    import numpy as np
    import torch

    if not torch.cuda.is_available():
        raise AmkError("amk profile --backend triton needs a CUDA GPU; none is visible here "
                       "(--backend sim gives the simulated trace)")
    from lowering.trace import build_trace
    from lowering.triton import vm
    from lowering.triton.blocks import kernel_options

    opts = {**kernel_options(kernel_cfg), "profile": True, **({"dist": ctx} if ctx is not None else {})}
    dec = compilation.decoder("triton", backend_options=opts)
    ex = dec.ex
    tok = 1
    for pos in range(seq_len):
        tok = dec.step(tok, pos)
    dev = ctx.device if ctx is not None else torch.device("cuda")
    torch.cuda.synchronize(dev)
    prof = ex._prof.view(-1, vm.PROF_W).cpu().numpy()[:, :3].astype(np.int64)
    tab = ex.table
    ids, ranks = list(tab.task_ids), list(tab.task_ranks) or [0] * tab.n_tasks
    extra: dict[str, Any] = {}
    props = torch.cuda.get_device_properties(dev)
    if ctx is not None:
        parts = ctx.all_gather_object({"ids": ids, "ranks": ranks, "prof": prof[:len(ids)].tolist(),
                                       "device": props.name})
        ids = [i for p in parts for i in p["ids"]]
        ranks = [r for p in parts for r in p["ranks"]]
        prof = np.asarray([row for p in parts for row in p["prof"]], dtype=np.int64).reshape(-1, 3)
        extra["devices"] = [p["device"] for p in parts]
        extra["clock_sync"] = ("one process per GPU: each rank's stamps come from its own GPU's "
                               "%globaltimer; cross-rank offsets are as close as those clocks agree")
    times = prof_times(compilation.program, prof, ids, ranks)
    extra.update({"device": props.name, "steps_run": seq_len, "traced_step": seq_len - 1,
                  "kernel": kernel_cfg.to_json(), **(meta or {})})
    return build_trace(compilation.program, times, clock="gpu", seq_len=seq_len, meta=extra)


def trace_summary(trace: dict[str, Any]) -> dict[str, Any]:
    """A short account of a trace: clock, step time, slices, waits, flows, ranks, roofline."""
    ev = trace["traceEvents"]
    other = trace["otherData"]
    return {"clock": other["clock"], "step_us": other["step_us"],
            "tasks": sum(1 for e in ev if e["ph"] == "X" and e.get("cat") != "wait"),
            "waits": sum(1 for e in ev if e["ph"] == "X" and e.get("cat") == "wait"),
            "flows": sum(1 for e in ev if e["ph"] == "s"),
            "ranks": other["ranks"], "workers": other["workers"],
            "roofline_us": other["roofline"]["roofline_us"],
            "predicted_us": other["roofline"]["predicted_latency_us"],
            "step_pct_of_roofline": other["roofline"]["step_pct_of_roofline"]}
