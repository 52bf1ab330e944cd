"""A PNG plot of a search: latency per trial, the incumbent's path, the roofline floor.

matplotlib with the non-interactive Agg backend (no display needed). The y axis says
whether the latencies are ``predicted`` (the cost model, sim backend) or ``measured``
(CUDA events, triton backend); trials without a latency (REJECTED / FAIL / TIMEOUT) are
marked along the bottom so a reader sees them too.
"""

from __future__ import annotations

import io
import os
from typing import Sequence

from ground.files import atomic_write_bytes
from search.records import Record

_COLORS = {"KEEP": "tab:green", "REVERT": "tab:gray", "REJECTED": "tab:orange",
           "FAIL": "tab:red", "TIMEOUT": "tab:purple"}


def plot_latency(records: Sequence[Record], path: str | os.PathLike, title: str = "") -> str:
    """Write the plot to ``path`` (PNG) and return the path.

    records: the search's trials in order. Raises ValueError when ``records`` is empty,
    AmkError when the file cannot be written (it is written atomically).
    """
    if not records:
        raise ValueError("no trials to plot")
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    sources = {r.timing_source for r in records if r.latency_ms is not None}
    label = "/".join(sorted(sources)) or "no"
    fig, ax = plt.subplots(figsize=(9, 4.8), dpi=110)
    timed = [r for r in records if r.latency_ms is not None]
    for status, color in _COLORS.items():
        pts = [r for r in timed if r.status == status]
        if pts:
            ax.scatter([r.trial for r in pts], [r.latency_ms for r in pts], s=22, c=color,
                       label=f"{status} ({len(pts)})", zorder=3)
    # Best-so-far staircase over the trials that were kept.
    best_x, best_y, best = [], [], None
    for r in records:
        if r.status == "KEEP" and r.latency_ms is not None:
            best = r.latency_ms if best is None else min(best, r.latency_ms)
        if best is not None:
            best_x.append(r.trial)
            best_y.append(best)
    if best_x:
        ax.step(best_x, best_y, where="post", color="tab:green", lw=1.2, label="best so far")
    floors = [r.roofline_ms for r in records if r.roofline_ms]
    if floors:
        ax.axhline(min(floors), color="black", ls="--", lw=1, label="roofline floor")
    untimed = [r for r in records if r.latency_ms is None]
    if untimed:
        ymin = min([r.latency_ms for r in timed] + floors) if (timed or floors) else 1.0
        for status in ("REJECTED", "FAIL", "TIMEOUT"):
            pts = [r.trial for r in untimed if r.status == status]
            if pts:
                ax.scatter(pts, [ymin * 0.97] * len(pts), marker="x", c=_COLORS[status],
                           label=f"{status} ({len(pts)}, no latency)", zorder=3)
    ax.set_xlabel("trial")
    ax.set_ylabel(f"{label} latency per decode step (ms)")
    ax.set_title(title or f"amk search: {label} latency over trials")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
    return str(path)
