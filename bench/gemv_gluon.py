"""Does a warp-specialised Gluon worker stream a decode step's GEMV weights at the HBM roofline?

One persistent Gluon kernel (grid = SMs) runs the GEMV tiles of one batch-1 decode step of a
model's shape (default Llama-3.2-1B: per layer q/k/v 3072 x 2048, o 2048 x 2048, gate/up
16384 x 2048, down 2048 x 8192, 16 layers, then the 128256 x 2048 LM head; 2.47 GB of bf16)
as per-CTA task lists (``lowering/triton/gluon_probe.py``). Variants (``--variants``, specs
``KIND:RxC[:S][:wN][:lN][:rN][:dep][:nocompute][:nocopy]``):

* ``ws``    a 1-warp loader partition streams pages of R x C bf16 through TMA into an S-page
            shared-memory ring across task boundaries; N compute warps consume them
* ``wscp``  the same, the loader's L warps copying with cp.async (16-byte, no TMA)
* ``pipe``  no warp specialisation: the same TMA ring issued by the compute warps S - 1
            pages ahead (isolates the loader role)
* ``sync``  no ring: plain loads of each page into registers, then its multiply-adds
* ``:nocompute``  (``ws``, ``wscp``) the compute warps release each page unread: the weight
            stream's own ceiling (no output, not checked)
* ``:nocopy``  (``ws``) the loader copies the ring's first S pages only, then marks each page
            ready without copying: the compute warps re-read resident pages, their own
            ceiling (the rate at which a worker could drain pages that landed during a wait;
            output not checked)
* ``:mN``  the launch's register cap (``:m128`` with ``--ctas`` twice the SMs: two CTAs an SM)
* ``:dep``  (v2) before reading its activation vector, a task waits until every tile of the
            previous matrix is stored (per-matrix completion counters); weights do not wait

Activations: one input vector per matrix, no data dependency between matrices (``:dep`` adds
the wait, not the data flow). Every variant is checked against torch (y = W @ x in fp32 from
the same bf16 inputs) and timed with CUDA events; the table gives ms per step, GB/s of
weights, the fraction of a device-to-device copy measured in the same run, and the same for
torch.mv per matrix replayed in a CUDA graph. ``--isolate SECONDS`` runs each variant in its
own process with that time limit, so a hung variant costs only its own row.

    python bench/gemv_gluon.py [--model llama-3.2-1b] [--tile 64] [--policy greedy]
        [--variants ws:32x256:6:w4,pipe:32x256:6:w4,sync:32x256:w4] [--reps 30]
        [--isolate 90] [--out FILE]

Without a Hopper-class GPU: one line on stderr, exit code 2.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python bench/gemv_gluon.py` from a source checkout
    sys.path.insert(0, str(ROOT))

from ground.errors import AmkError  # noqa: E402
from lowering.triton import gluon_probe as G  # noqa: E402

NAME = "bench/gemv_gluon.py"
DEFAULT_VARIANTS = ("ws:32x256:6:w4,ws:32x256:6:w4:nocompute,ws:64x256:3:w8,wscp:32x256:6:w4,"
                    "pipe:32x256:6:w4,pipe:64x256:3:w8,sync:32x256:w4,ws:32x256:6:w4:dep,pipe:32x256:6:w4:dep")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line; AmkError (exit 2) for a bad variant spec or task-list shape."""
    ap = argparse.ArgumentParser(prog=NAME, description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.2-1b", help="a built-in config:NAME shape")
    ap.add_argument("--layers", type=int, default=None, help="keep only the first N layers (+ LM head)")
    ap.add_argument("--tile", type=int, default=64, help="rows per task")
    ap.add_argument("--policy", default="greedy", choices=["greedy", "rr"], help="tile-to-CTA assignment")
    ap.add_argument("--variants", default=DEFAULT_VARIANTS)
    ap.add_argument("--warps", type=int, default=4, help="compute warps where a spec does not say")
    ap.add_argument("--x-f32", action="store_true", help="activation vectors in fp32 (default bf16)")
    ap.add_argument("--ctas", type=int, default=None, help="persistent CTAs (default: the SM count)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--no-torch", action="store_true", help="skip the torch.mv CUDA-graph baseline")
    ap.add_argument("--isolate", type=float, default=0,
                    help="run each variant in its own process, killed after this many seconds (0: in process)")
    ap.add_argument("--row-json", action="store_true", help=argparse.SUPPRESS)  # child mode of --isolate
    ap.add_argument("--out", help="JSON result file (written whole or not at all)")
    a = ap.parse_args(argv)
    a.specs = [G.parse_variant(s, a.warps, x_f32=a.x_f32) for s in a.variants.split(",") if s.strip()]
    if not a.specs:
        raise AmkError("--variants names no variant")
    if a.reps < 1 or (a.layers is not None and a.layers < 1):
        raise AmkError("--reps and --layers must be at least 1")
    return a


def matrices(a: argparse.Namespace) -> list:
    """The step's matrices, cut to ``--layers`` (arena rows and offsets rebuilt)."""
    ms = G.model_matrices(a.model)
    if a.layers is None:
        return ms
    keep = [m for m in ms if m.name == "lm_head" or int(m.name[1:].split(".")[0]) < a.layers]
    # re-pack offsets over what is kept
    out, arena_rows, xoff, yoff = [], {}, 0, 0
    for m in keep:
        out.append(G.Matrix(m.name, m.rows, m.k, m.arena, arena_rows.get(m.arena, 0), xoff, yoff))
        arena_rows[m.arena] = arena_rows.get(m.arena, 0) + m.rows
        xoff += m.k
        yoff += m.rows
    return out


def require_gpu() -> None:
    """Raise AmkError (one line, exit 2) unless a CUDA GPU of compute capability >= 9 is here."""
    import torch

    if not torch.cuda.is_available():
        raise AmkError("needs a CUDA GPU (Hopper or newer: Gluon warp specialisation and TMA); none is visible")
    cap = torch.cuda.get_device_capability()
    if cap[0] < 9:
        raise AmkError(f"needs compute capability 9.0 or newer (TMA, setmaxnreg); "
                       f"{torch.cuda.get_device_name()} is {cap[0]}.{cap[1]}")


class Step:
    """Device buffers of one step: the weight arenas, activation vectors, outputs, the task
    table, completion counters, and the fp32 reference output."""

    def __init__(self, ms: list, ctas: int, tile: int, policy: str, page_rows: int, page_cols: int, x_f32: bool):
        import torch

        self.ms = ms
        self.tl = G.build_tasks(ms, ctas, tile, page_rows, page_cols, policy)
        g = torch.Generator(device="cuda").manual_seed(0)
        self.w = [torch.empty(r, k, device="cuda", dtype=torch.bfloat16)
                  for r, k in zip(self.tl.arena_rows(), self.tl.arena_k())]
        for w in self.w:  # chunks: a 2 GB randn would need an fp32 temporary of 4 GB
            for r0 in range(0, w.shape[0], 16384):
                w[r0:r0 + 16384] = torch.randn(w[r0:r0 + 16384].shape, device="cuda", generator=g)
        nx = sum(m.k for m in ms)
        self.x = torch.randn(nx, device="cuda", generator=g).to(torch.float32 if x_f32 else torch.bfloat16)
        self.y = torch.empty(sum(m.rows for m in ms), device="cuda", dtype=torch.float32)
        self.table = torch.tensor(self.tl.table, dtype=torch.int32, device="cuda").reshape(-1)
        self.starts = torch.tensor(self.tl.starts, dtype=torch.int32, device="cuda")
        self.tiles = torch.tensor(self.tl.tiles, dtype=torch.int32, device="cuda")
        self.ctr = torch.zeros(len(ms), dtype=torch.int32, device="cuda")
        self.epoch = 0
        self.ref = torch.empty_like(self.y)
        for m in ms:
            w = self.w[m.arena]
            xm = self.x[m.xoff:m.xoff + m.k].float()
            for r0 in range(0, m.rows, 16384):
                r1 = min(m.rows, r0 + 16384)
                self.ref[m.yoff + r0:m.yoff + r1] = w[m.row0 + r0:m.row0 + r1].float() @ xm

    def error(self) -> float:
        """Largest |y - ref| over the largest |ref| (inf if any output is not finite)."""
        import torch

        if not bool(torch.isfinite(self.y).all()):
            return float("inf")
        return float((self.y - self.ref).abs().max() / self.ref.abs().max())


def launcher(v, st: Step):
    """A zero-argument callable launching variant ``v`` over ``st`` (one step per call), and
    a function returning the compiled kernel's metadata."""
    k = G.kernels()[v.kind]
    cx, opts = G.launch_args(v)
    if v.kind in ("ws", "pipe"):
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        lay = G.smem_layout(v)
        descs = [TensorDescriptor.from_tensor(w, [v.rows, v.cols], lay) for w in st.w]
        wargs = (descs[0], descs[-1])
    else:
        wargs = (st.w[0], st.w[-1])
    grid = (st.tl.ctas,)
    box = {}

    def run():
        st.epoch += 1
        box["k"] = k[grid](st.table, st.starts, st.x, st.y, st.tiles, st.ctr, st.epoch, *wargs, **cx, **opts)

    def meta():
        c = box.get("k")
        if c is None:
            return {}
        return dict(regs=getattr(c, "n_regs", None), spills=getattr(c, "n_spills", None),
                    shared=int(c.metadata.shared), warps_total=int(c.metadata.num_warps))

    return run, meta


def measure_variant(a: argparse.Namespace, v, ms: list, ctas: int) -> dict:
    """Correctness and timing of one variant: ms per step (median, p10, p90), GB/s of weights,
    relative error against torch and the compiled kernel's registers, spills and shared memory.
    A failure (compile error, wrong result) is a row with ``error``."""
    import torch

    from ground.timing import time_per_call

    row = dict(variant=v.label(), kind=v.kind, rows=v.rows, cols=v.cols, stages=v.stages if v.kind != "sync" else None,
               warps=v.warps, loader_warps=v.loader_warps if v.kind in ("ws", "wscp") else None, dep=v.dep)
    try:
        st = Step(ms, ctas, a.tile, a.policy, v.rows, v.cols, a.x_f32)
        run, meta = launcher(v, st)
        st.y.fill_(float("nan"))
        run()
        torch.cuda.synchronize()
        row.update(meta())
        if v.checked:
            row["rel_err"] = st.error()
        elif not v.compute:
            row["note"] = "stream only: pages released unread, output not computed"
        else:
            row["note"] = "consumer only: the first pages copied once and re-read, output not checked"
        if v.checked and not row["rel_err"] <= 1e-4:
            row["error"] = f"wrong result: max |y - ref| / max |ref| = {row['rel_err']:.3g}"
            return row
        t = time_per_call(run, a.reps, warmup=3, device="cuda")
        row.update(ms=t.median_ms, p10_ms=t.p10_ms, p90_ms=t.p90_ms, bytes=st.tl.nbytes,
                   gbs=st.tl.nbytes / t.median_ms / 1e6)
        run()  # the timed calls must not have broken the result (counters, ring phases)
        torch.cuda.synchronize()
        if v.checked and not st.error() <= 1e-4:
            row["error"] = f"wrong result after timing: {st.error():.3g}"
    except Exception as e:  # one variant failing must not lose the others
        row["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
    return row


def torch_baseline(a: argparse.Namespace, ms: list, ctas: int) -> dict:
    """torch.mv per matrix (bf16 in and out, cuBLAS) replayed in one CUDA graph."""
    import torch

    from ground.timing import time_per_call

    st = Step(ms, ctas, a.tile, a.policy, 1, 8, False)
    yb = torch.empty(st.y.shape, device="cuda", dtype=torch.bfloat16)
    views = [(st.w[m.arena][m.row0:m.row0 + m.rows], st.x[m.xoff:m.xoff + m.k], yb[m.yoff:m.yoff + m.rows])
             for m in ms]

    def step():
        for w, x, y in views:
            torch.mv(w, x, out=y)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    g.replay()
    torch.cuda.synchronize()
    err = float((yb.float() - st.ref).abs().max() / st.ref.abs().max())
    t = time_per_call(g.replay, a.reps, warmup=3, device="cuda")
    return dict(variant="torch.mv x matrices, CUDA graph", kind="torch", ms=t.median_ms, p10_ms=t.p10_ms,
                p90_ms=t.p90_ms, bytes=st.tl.nbytes, gbs=st.tl.nbytes / t.median_ms / 1e6, rel_err=err)


def child_argv(argv: list[str], spec: str) -> list[str]:
    """The command line of the child process that measures variant ``spec`` for ``--isolate``:
    the parent's flags without ``--variants``, ``--out``, ``--isolate`` and ``--no-torch``, then
    that one variant in child mode (one JSON row on stdout, no baseline)."""
    keep, skip = [], False
    for tok in argv:
        if skip:
            skip = False
        elif tok in ("--variants", "--out", "--isolate"):
            skip = True
        elif not tok.startswith(("--variants=", "--out=", "--isolate=")) and tok != "--no-torch":
            keep.append(tok)
    return [*keep, "--variants", spec, "--no-torch", "--row-json"]


def isolated(a: argparse.Namespace, argv: list[str], v) -> dict:
    """Run one variant in a child process (this script, ``child_argv``) with ``--isolate``
    seconds; a timeout or crash is a row with ``error``."""
    cmd = [sys.executable, str(Path(__file__).resolve()), *child_argv(argv, v.spec())]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.isolate, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return dict(variant=v.label(), kind=v.kind, error=f"timed out after {a.isolate:g} s (a hang: deadlock?)")
    for line in reversed(p.stdout.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    tail = (p.stderr.strip().splitlines() or ["no output"])[-1][:300]
    return dict(variant=v.label(), kind=v.kind, error=f"exit {p.returncode}: {tail}")


def print_table(rows: list[dict], head: str) -> None:
    """The table of the rows on stdout (rich where installed, plain columns otherwise)."""
    cols = ("variant", "ms/step", "p10-p90", "GB/s", "of copy", "rel err", "regs", "smem KiB", "note")
    cells = []
    for r in rows:
        if "ms" in r:
            cells.append((r["variant"], f"{r['ms']:.3f}", f"{r['p10_ms']:.3f}-{r['p90_ms']:.3f}", f"{r['gbs']:.0f}",
                          f"{r.get('of_copy', 0):.1%}", f"{r['rel_err']:.1e}" if "rel_err" in r else "-",
                          str(r.get("regs", "-")),
                          f"{r['shared'] / 1024:.0f}" if r.get("shared") is not None else "-",
                          r.get("error", r.get("note", ""))))
        else:
            cells.append((r["variant"], "-", "-", "-", "-", "-", "-", "-", r.get("error", "")))
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # the GPU image may lack rich: plain columns
        print(head)
        for c in [cols, *cells]:
            print("  ".join(f"{v:<24}" if i in (0, 8) else f"{v:>12}" for i, v in enumerate(c)).rstrip())
        return
    t = Table(title=head, title_justify="left")
    for c in cols:
        t.add_column(c, justify="left" if c in ("variant", "note") else "right")
    for c in cells:
        t.add_row(*c)
    Console(width=200).print(t)


def main(argv: list[str] | None = None) -> int:
    """Run the probe (module doc); returns the exit code (0 when every variant ran correct,
    1 when one failed). AmkError: a bad argument or no GPU (exit 2)."""
    argv = sys.argv[1:] if argv is None else argv
    a = parse_args(argv)
    ms = matrices(a)
    for v in a.specs:  # a task list the page shape cannot cut: refuse before touching the GPU
        G.build_tasks(ms, a.ctas or 132, a.tile, v.rows, v.cols, a.policy)
    if a.out:  # an unwritable result path fails now, not after minutes of measuring
        from amk.output import check_writable_dir

        check_writable_dir(Path(a.out).parent, "--out")
    require_gpu()
    import torch
    import triton

    from ground.timing import measure_hbm_bandwidth
    from lowering.triton.runtime import tma_scratch

    triton.set_allocator(tma_scratch)
    ctas = a.ctas or torch.cuda.get_device_properties(0).multi_processor_count
    if a.row_json:  # child of --isolate: one variant, one JSON line
        print(json.dumps(measure_variant(a, a.specs[0], ms, ctas)))
        return 0
    t0 = time.time()
    rows = [isolated(a, argv, v) if a.isolate else measure_variant(a, v, ms, ctas) for v in a.specs]
    torch.cuda.empty_cache()
    copy = measure_hbm_bandwidth("cuda", 1 << 30, 20) / 1e9
    if not a.no_torch:
        try:
            rows.insert(0, torch_baseline(a, ms, ctas))
        except Exception as e:  # the baseline failing must not lose the variants
            rows.insert(0, dict(variant="torch.mv x matrices, CUDA graph", kind="torch",
                                error=f"{type(e).__name__}: {str(e)[:300]}"))
    for r in rows:
        if "gbs" in r:
            r["of_copy"] = r["gbs"] / copy
    dev = torch.cuda.get_device_name(0)
    nbytes = sum(m.nbytes for m in ms)
    head = (f"{dev}, {ctas} CTAs, {a.model}: {len(ms)} GEMVs, {nbytes / 1e9:.3f} GB bf16 weights, "
            f"tiles of {a.tile} rows ({a.policy}), copy {copy:.0f} GB/s (roofline {nbytes / copy / 1e6:.3f} ms)")
    print_table(rows, head)
    if a.out:
        from ground.files import atomic_write_json

        atomic_write_json(a.out, dict(device=dev, ctas=ctas, model=a.model, layers=a.layers, tile=a.tile,
                                      policy=a.policy, x_f32=a.x_f32, weight_bytes=nbytes, copy_gbs=copy,
                                      roofline_ms=nbytes / copy / 1e6, triton=triton.__version__,
                                      torch=torch.__version__, seconds=round(time.time() - t0, 1),
                                      command="python bench/gemv_gluon.py " + " ".join(argv), rows=rows))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    from ground.errors import run_main

    run_main(main, NAME)
