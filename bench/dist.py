"""The multi-GPU benchmark of the communication patterns: amk's fused kernel against the
original torch.distributed function on NCCL and PyTorch's symmetric-memory fused ops.

Usage (on a 2-GPU NVLink machine, from the repo root):

    torchrun --nproc-per-node 2 bench/dist.py --quick [--out FILE] [--sizes 1024,4096x4096x2048]

(amk's rows need nvshmem4py: ``pip install 'amk[gpu]'``, or its cp312 wheel carried in a
``.whl*/`` folder on the GPU machines, docs/gpu-testing.md.)

For each pattern (models/collectives.py: all-gather + matmul, matmul + reduce-scatter,
matmul + all-reduce, the same with RMSNorm, the Ulysses combine) and each size M, N, K
(bf16; without ``--sizes`` / ``--quick`` the cubes 256 .. 8192; for the Ulysses combine
S = M, the rank's head columns C = K / R), every rank times, in this one call:

* ``nccl``: the original function (the code a user writes: torch ops and a
  torch.distributed collective) on NCCL, called eagerly;
* ``nccl_graph``: the same calls captured once in a CUDA graph and replayed (what a user
  who removes the host's launch overhead runs; NCCL supports graph capture);
* ``symm_mem``: PyTorch's symmetric-memory fused op where one exists
  (``torch.ops.symm_mem.fused_all_gather_matmul``, ``fused_matmul_reduce_scatter``); a row
  says ``unavailable: REASON`` where none exists or it cannot run;
* ``amk``: the pattern lowered to a schedule (lowering/collectives.py), validated, run as the
  Triton megakernel over NVSHMEM, one launch per call replayed from a CUDA graph
  (lowering.triton.graph.StepGraph; the kernel's error records are read after each repeat,
  and the output is checked again after the timed calls); the all-reduce both one-shot and
  two-shot unless ``--allreduce`` picks one.

Each method runs ``--repeats`` times (at least 2) after ``--warmup`` untimed calls; a repeat is
``--iters`` calls, each between CUDA events (device time of the call, launch gaps included). A repeat's time is the median per
call of the slowest rank. Correctness: every rank's output of each method against the
original's on the same inputs: max |err| <= ``TOL_REL`` x max |original| (a few bf16 roundings
of the partial sums); a method that fails it gets no speedup.

Speedups are honest by construction: against the *fastest* NCCL repeat (eager or graphed), and each other
method is charged its *slowest* repeat (so a speedup above 1 holds in every repeat). Rank 0
prints a rich table and writes the JSON report atomically (``--out``). Exit code: 0 when every
verdict holds, 1 when one does not, 2 for bad arguments or no GPUs. The environment
``NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1`` is always
set (no multicast on the shared machines).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python bench/dist.py` from a source checkout
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from ground.errors import AmkError, rank_exit_code  # noqa: E402
from lowering.config import CollectiveConfig, KernelConfig, collective_part  # noqa: E402
from lowering.knobs import add_flags, given, knob_named  # noqa: E402
from lowering.triton.dist import NO_MULTICAST_ENV  # noqa: E402

PATTERNS = ("allgather_matmul", "matmul_reduce_scatter", "matmul_allreduce", "matmul_allreduce_rmsnorm",
            "ulysses_combine")
METHODS = ("nccl", "nccl_graph", "symm_mem", "amk")
#: the baselines a speedup is computed against (the fastest repeat of any of them)
NCCL_METHODS = ("nccl", "nccl_graph")
FULL = (256, 512, 1024, 2048, 4096, 8192)
QUICK = (1024, 4096)
#: a method's output is right when max |out - original| <= TOL_REL * max |original|
TOL_REL = 2e-2
EPS = 1e-6


# ====================================================================== the originals
def allgather_matmul(x, w, group=None):
    import torch.distributed as dist
    g = torch.empty(dist.get_world_size(group) * x.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(g, x, group=group)
    return g @ w


def matmul_reduce_scatter(x, w, group=None):
    import torch.distributed as dist
    y = x @ w
    out = torch.empty(y.shape[0] // dist.get_world_size(group), y.shape[1], dtype=y.dtype, device=y.device)
    dist.reduce_scatter_tensor(out, y, group=group)
    return out


def matmul_allreduce(x, w, g=None, eps=EPS, group=None):
    import torch.distributed as dist
    y = x @ w
    dist.all_reduce(y, group=group)
    if g is None:
        return y
    h = y.float()  # HF LlamaRMSNorm
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return g * h.to(y.dtype)


def ulysses_combine(o, w, group=None):
    import torch.distributed as dist
    world = dist.get_world_size(group)
    s, c = o.shape
    out = torch.empty_like(o)
    dist.all_to_all_single(out, o, group=group)
    return out.reshape(world, s // world, c).permute(1, 0, 2).reshape(s // world, world * c) @ w


def pattern_of(name: str, world: int, m: int, n: int, k: int):
    """The models.collectives pattern of bench pattern ``name`` at global sizes M, N, K."""
    from models.collectives import AllGatherMatmul, MatmulAllReduce, MatmulReduceScatter, UlyssesCombine
    if name == "allgather_matmul":
        return AllGatherMatmul(world, "bf16", m=m, n=n, k=k)
    if name == "matmul_reduce_scatter":
        return MatmulReduceScatter(world, "bf16", m=m, n=n, k=k)
    if name.startswith("matmul_allreduce"):
        return MatmulAllReduce(world, "bf16", m=m, n=n, k=k, norm=name.endswith("rmsnorm"), eps=EPS)
    return UlyssesCombine(world, "bf16", s=m, c=k // world, n=n)


def original(name: str, ins: dict) -> torch.Tensor:
    """Run the original function of ``name`` on this rank's operands."""
    if name == "allgather_matmul":
        return allgather_matmul(ins["x"], ins["w"])
    if name == "matmul_reduce_scatter":
        return matmul_reduce_scatter(ins["x"], ins["w"])
    if name.startswith("matmul_allreduce"):
        return matmul_allreduce(ins["x"], ins["w"], ins.get("g"))
    return ulysses_combine(ins["o"], ins["w"])


# ====================================================================== command line
def parse_sizes(text: str, world: int | None = None) -> list[tuple[int, int, int]]:
    """``256,1024x512x2048`` -> [(256, 256, 256), (1024, 512, 2048)] (a number is a cube;
    ``MxNxK`` otherwise). Raises AmkError naming the bad item."""
    out = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        parts = item.lower().split("x")
        try:
            dims = [int(p) for p in parts]
        except ValueError:
            raise AmkError(f"--sizes: {item!r} is not a number or MxNxK") from None
        if len(dims) == 1:
            dims *= 3
        if len(dims) != 3 or not all(1 <= d <= 65536 for d in dims):
            raise AmkError(f"--sizes: {item!r} must be N or MxNxK with each dimension in 1..65536")
        out.append(tuple(dims))
    if not out:
        raise AmkError("--sizes: no sizes given")
    return out


def parse_list(text: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    vals = [t.strip() for t in text.split(",") if t.strip()]
    bad = [v for v in vals if v not in allowed]
    if bad or not vals:
        raise AmkError(f"{flag}: {', '.join(bad) or 'nothing'} is not one of {', '.join(allowed)}")
    return vals


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="bench/dist.py", description=" ".join(__doc__.split("\n\n")[0].split()))
    sz = ap.add_mutually_exclusive_group()
    sz.add_argument("--sizes", default=None, help="comma list of N (a cube) or MxNxK (default: 256..8192 cubes)")
    sz.add_argument("--quick", action="store_true", help=f"the cubes {', '.join(map(str, QUICK))} only")
    ap.add_argument("--patterns", default=",".join(PATTERNS), help="comma list of " + ", ".join(PATTERNS))
    ap.add_argument("--methods", default=",".join(METHODS), help="comma list of " + ", ".join(METHODS))
    ap.add_argument("--iters", type=int, default=20, help="timed calls per repeat (default 20)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed calls before each repeat (default 5)")
    ap.add_argument("--repeats", type=int, default=2, help="repeats of each method, at least 2 (default 2)")
    ap.add_argument("--timeout-s", type=float, default=10.0, help="amk kernel watchdog per wait (default 10 s)")
    ap.add_argument("--out", default=None, help="write the JSON report to this file (rank 0)")
    ap.add_argument("--config", default=None, help="a config file: its \"collective\" and \"kernel\" parts")
    add_flags(ap.add_argument_group("collective knobs (lowering/config.py CollectiveConfig)"), CollectiveConfig,
              defaults={"workers": "one per SM"})
    add_flags(ap.add_argument_group("kernel knobs (lowering/config.py KernelConfig)"), KernelConfig)
    return ap


@dataclass
class Settings:
    """The validated command line."""

    sizes: list[tuple[int, int, int]]
    patterns: list[str]
    methods: list[str]
    iters: int
    warmup: int
    repeats: int
    timeout_s: float
    out: str | None
    collective: dict
    kernel: dict
    both_allreduce: bool

    def to_json(self) -> dict:
        return dict(self.__dict__, sizes=[list(s) for s in self.sizes])


def validate(args: argparse.Namespace) -> Settings:
    """Check the parsed arguments; raises AmkError (exit 2) naming the bad option."""
    sizes = parse_sizes(args.sizes) if args.sizes else [(s, s, s) for s in (QUICK if args.quick else FULL)]
    for name, v, lo, hi in (("iters", args.iters, 1, 10_000), ("warmup", args.warmup, 0, 10_000),
                            ("repeats", args.repeats, 2, 100)):
        if not lo <= v <= hi:
            raise AmkError(f"--{name}: {v} is outside [{lo}, {hi}]")
    if not 0 < args.timeout_s <= 600:
        raise AmkError(f"--timeout-s: {args.timeout_s} is outside (0, 600]")
    if args.out:
        parent = Path(args.out).resolve().parent
        if not parent.is_dir():
            raise AmkError(f"--out: directory {parent} does not exist")
    coll, ker = {}, {}
    if args.config:
        from ground.files import read_json
        obj = read_json(args.config, "config file")
        coll = collective_part(obj, args.config)
        part = obj.get("kernel", {}) if isinstance(obj, dict) else {}
        if not isinstance(part, dict):
            raise AmkError(f"{args.config}: \"kernel\" must be a JSON object of kernel knobs, got "
                           f"{type(part).__name__}")
        ker = dict(part)
    for cls, part in ((CollectiveConfig, coll), (KernelConfig, ker)):
        for name, v in given(args, cls).items():
            why = knob_named(cls, name).problem(v)
            if why:
                raise AmkError(f"{knob_named(cls, name).flag}: {why}")
            part[name] = v
    CollectiveConfig.from_json(coll, args.config or "bench/dist.py")
    KernelConfig.from_json(ker, args.config or "bench/dist.py", combinations=False)
    return Settings(sizes, parse_list(args.patterns, PATTERNS, "--patterns"), parse_list(args.methods, METHODS,
                    "--methods"), args.iters, args.warmup, args.repeats, args.timeout_s, args.out, coll, ker,
                    both_allreduce="allreduce" not in coll)


def check_shapes(st: Settings, world: int) -> None:
    """Refuse a size a pattern cannot split over ``world`` ranks (AmkError naming both)."""
    for name in st.patterns:
        for m, n, k in st.sizes:
            try:
                pattern_of(name, world, m, n, k).check()
            except AmkError as e:
                raise AmkError(f"--sizes {m}x{n}x{k}: {name} at {world} ranks: {e}") from None
            if name == "ulysses_combine" and k % world:
                raise AmkError(f"--sizes {m}x{n}x{k}: ulysses_combine needs K = R * C, but K={k} is not "
                               f"divisible by the world size {world}")


# ====================================================================== the report (CPU)
def method_row(name: str, dims: tuple[int, int, int], method: str, per_rank: list[dict], flops: int) -> dict:
    """One row from every rank's result of one method: ``{"unavailable": why}``, ``{"error":
    why}`` or ``{"repeats_ms": [median per repeat], "max_abs_err", "tol"}``."""
    m, n, k = dims
    row = {"pattern": name, "M": m, "N": n, "K": k, "method": method, "flops_per_rank": flops}
    why = next((r["unavailable"] for r in per_rank if r.get("unavailable")), None)
    if why:
        return dict(row, status="unavailable", detail=why, ok=None)
    err = next((f"rank {i}: {r['error']}" for i, r in enumerate(per_rank) if r.get("error")), None)
    if err:
        return dict(row, status="failed", detail=err, ok=False)
    reps = [max(r["repeats_ms"][i] for r in per_rank) for i in range(len(per_rank[0]["repeats_ms"]))]
    worst = max(r["max_abs_err"] for r in per_rank)
    tol = min(r["tol"] for r in per_rank)
    extra = {key: per_rank[0][key] for key in ("validate_s", "tasks", "workers") if key in per_rank[0]}
    return dict(row, status="ran", repeats_ms=reps, max_abs_err=worst, tol=tol, ok=bool(worst <= tol),
                per_rank=per_rank, **extra)


def add_speedups(rows: list[dict]) -> list[dict]:
    """Each ran row's ``time_ms`` (its slowest repeat), ``tflops`` and ``speedup`` against the
    fastest correct NCCL repeat (eager or graphed) of its pattern and size; None where the
    row is wrong or has no NCCL row to compare with. The NCCL row's own speedup (<= 1) shows its spread."""
    base: dict[tuple, float] = {}
    for r in rows:
        if r["method"] in NCCL_METHODS and r["status"] == "ran" and r["ok"]:
            key = (r["pattern"], r["M"], r["N"], r["K"])
            base[key] = min(base.get(key, float("inf")), min(r["repeats_ms"]))
    for r in rows:
        if r["status"] != "ran":
            r.update(time_ms=None, tflops=None, speedup=None)
            continue
        t = max(r["repeats_ms"])
        b = base.get((r["pattern"], r["M"], r["N"], r["K"]))
        r["time_ms"] = t
        r["tflops"] = r["flops_per_rank"] / (t * 1e-3) / 1e12 if t > 0 else None
        r["speedup"] = b / t if (b is not None and t > 0 and r["ok"]) else None
    return rows


def summary(rows: list[dict]) -> list[dict]:
    """Per pattern and size: the fastest correct method and its speedup over NCCL."""
    out = []
    keys = list(dict.fromkeys((r["pattern"], r["M"], r["N"], r["K"]) for r in rows))
    for key in keys:
        ok = [r for r in rows if (r["pattern"], r["M"], r["N"], r["K"]) == key and r["status"] == "ran" and r["ok"]]
        if not ok:
            out.append(dict(zip(("pattern", "M", "N", "K"), key), fastest=None, speedup=None))
            continue
        best = min(ok, key=lambda r: r["time_ms"])
        out.append(dict(zip(("pattern", "M", "N", "K"), key), fastest=best["method"], time_ms=best["time_ms"],
                        speedup=best["speedup"]))
    return out


def build_report(meta: dict, rows: list[dict]) -> dict:
    rows = add_speedups(rows)
    return dict(meta, rows=rows, summary=summary(rows),
                all_verdicts=all(r["ok"] is not False for r in rows))


def render(report: dict, console=None) -> None:
    """Print the report as a rich table and one line per pattern and size."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table
    con = console or Console(highlight=False, width=None if sys.stdout.isatty() else 200)
    con.print(f"[bold]amk dist bench[/]  {report.get('device', '?')} x {report.get('world')}  bf16  "
              f"torch {report.get('torch', '?')}")
    t = Table(title="median ms per call (slowest rank) per repeat; speedup = fastest NCCL repeat (eager or graphed) / the "
                    "method's slowest repeat")
    for col in ("pattern", "M", "N", "K", "method", "ms per repeat", "TFLOP/s", "vs NCCL", "max err / tol",
                "verdict"):
        t.add_column(col, justify="left" if col in ("pattern", "method", "verdict") else "right")
    for r in report["rows"]:
        dims = (str(r["M"]), str(r["N"]), str(r["K"]))
        if r["status"] != "ran":
            verdict = "[yellow]unavailable[/]" if r["status"] == "unavailable" else "[red]FAILED[/]"
            t.add_row(r["pattern"], *dims, r["method"], "-", "-", "-", "-", verdict)
            continue
        reps = " / ".join(f"{x:.3f}" for x in r["repeats_ms"])
        sp = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        t.add_row(r["pattern"], *dims, r["method"], reps, "-" if r["tflops"] is None else f"{r['tflops']:.3g}",
                  sp, f"{r['max_abs_err']:.3g} / {r['tol']:.3g}", "[green]ok[/]" if r["ok"] else "[red]WRONG[/]")
    con.print(t)
    for r in report["rows"]:
        if r["status"] != "ran":
            con.print(f"{r['pattern']} {r['M']}x{r['N']}x{r['K']} {r['method']}: {r['status']}: "
                      f"{escape(str(r['detail']))}", soft_wrap=True)
    for s in report["summary"]:
        where = f"{s['pattern']} {s['M']}x{s['N']}x{s['K']}"
        if s["fastest"] is None:
            con.print(f"{where}: no method gave a correct result")
        elif s["fastest"] in NCCL_METHODS or s["speedup"] is None:
            con.print(f"{where}: fastest is {s['fastest']} ({s['time_ms']:.3f} ms)")
        else:
            word = "faster than" if s["speedup"] > 1 else "not faster than"
            con.print(f"{where}: fastest is {s['fastest']} ({s['time_ms']:.3f} ms), {s['speedup']:.2f}x NCCL's "
                      f"fastest repeat: {word} NCCL")
    con.print("all verdicts hold" if report["all_verdicts"] else "[red]some verdicts failed[/]")


def write_report(path: str, report: dict) -> Path:
    """Write the report as JSON, atomically (AmkError naming the path when it cannot)."""
    from ground.files import atomic_write_json
    return atomic_write_json(path, report, durable=False)


# ====================================================================== one rank (GPU)
def _why(e: BaseException) -> str:
    """An exception in one short line (the dispatcher's messages run to pages)."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300] if text else ''}"


def _local(fn: Callable[[], dict]) -> dict:
    """Run one rank's part of a measurement; an exception becomes ``{"error": why}`` so the
    rank still joins the gather and the ranks stay in step."""
    try:
        return fn()
    except AmkError as e:
        return {"error": str(e)}
    except Exception as e:  # reported in the row with its type
        import traceback
        traceback.print_exc(file=sys.stderr)
        return {"error": _why(e)}


class Rank:
    """This rank's side of the benchmark."""

    def __init__(self, st: Settings, ctx: Any):
        self.st, self.ctx = st, ctx
        self.dev = ctx.device
        self.R, self.rank = ctx.world, ctx.rank
        self.symm_why: str | None = None
        self.group_name = None
        self.nvshmem_ready = False

    def sync(self) -> None:
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)
        self.ctx.barrier()

    def inputs(self, name: str, p, seed: int) -> dict[str, torch.Tensor]:
        """This rank's operands: x, o ~ N(0, 1), w ~ N(0, 1/K) (outputs of order 1), g = 1 + N(0, 0.01)."""
        gen = torch.Generator(device=self.dev)
        out = {}
        for i, (op, shape) in enumerate(p.operands().items()):
            gen.manual_seed(seed * 1000 + i * 10 + (0 if op == "g" else self.rank))
            t = torch.randn(shape, generator=gen, device=self.dev, dtype=torch.float32)
            if op == "w":
                t = t / shape[0] ** 0.5
            elif op == "g":
                t = 1 + 0.1 * t
            out[op] = t.to(torch.bfloat16)
        return out

    def timed(self, fn: Callable[[], Any]) -> list[float]:
        """``--repeats`` repeats of ``timed_once``."""
        out = []
        for _ in range(self.st.repeats):
            out += self.timed_once(fn)
        return out

    def timed_once(self, fn: Callable[[], Any]) -> list[float]:
        """One repeat: every rank starts together, ``--warmup`` untimed calls, then the median
        ms of ``--iters`` calls, as a one-element list."""
        from ground.timing import time_per_call
        self.sync()
        return [time_per_call(fn, self.st.iters, self.st.warmup, self.dev).median_ms]

    @staticmethod
    def verdict(out: torch.Tensor, ref: torch.Tensor) -> dict:
        if out.shape != ref.shape:
            return {"error": f"output shape {tuple(out.shape)}, the original's {tuple(ref.shape)}"}
        diff = (out.float().cpu() - ref.float().cpu()).abs()
        err = float("inf") if not torch.isfinite(diff).all() else float(diff.max())
        return {"max_abs_err": err, "tol": TOL_REL * max(float(ref.float().abs().max()), 1e-6)}

    # ---------------------------------------------------------------- the methods
    def nccl(self, name: str, ins: dict, ref: torch.Tensor) -> dict:
        return dict(self.verdict(original(name, ins), ref), repeats_ms=self.timed(lambda: original(name, ins)))

    def nccl_graph(self, name: str, ins: dict, ref: torch.Tensor) -> dict:
        """The original function's calls captured in one CUDA graph (after eager warm-up calls
        on a side stream, as torch.cuda.graphs asks), replayed per call."""
        if self.dev.type != "cuda":
            return {"unavailable": "CUDA graphs need a GPU"}
        from amk.baselines import capture_graph, warm_up_on_side_stream

        outs: list[torch.Tensor] = []
        try:  # this rank's device is current (DistContext), as the helpers' streams assume
            warm_up_on_side_stream(lambda: original(name, ins))
            self.sync()
            graph = capture_graph(lambda: outs.append(original(name, ins)))
        except Exception as e:  # a torch or NCCL without collective capture
            return {"unavailable": "graph capture failed: " + _why(e)}
        graph.replay()
        res = self.verdict(outs[-1], ref)
        return dict(res, repeats_ms=self.timed(graph.replay))

    def symm_mem(self, name: str, ins: dict, ref: torch.Tensor) -> dict:
        if name not in ("allgather_matmul", "matmul_reduce_scatter"):
            return {"unavailable": "torch has no fused symmetric-memory op for this pattern"}
        if self.symm_why is None and self.group_name is None:
            try:
                import torch.distributed as dist
                from torch.distributed import _symmetric_memory as symm
                try:  # torch's own CUDA backend (IPC handles), not NVSHMEM, which amk's kernel holds
                    symm.set_backend("CUDA")
                except Exception:
                    pass  # an older torch without backends, or one already chosen
                self.group_name = dist.group.WORLD.group_name
                symm.enable_symm_mem_for_group(self.group_name)
            except Exception as e:
                self.symm_why = _why(e)
        if self.symm_why:
            return {"unavailable": self.symm_why}
        gn = self.group_name
        if name == "allgather_matmul":
            def fn():
                return torch.ops.symm_mem.fused_all_gather_matmul(ins["x"], [ins["w"]], 0, gn)[1][0]
        else:
            def fn():
                return torch.ops.symm_mem.fused_matmul_reduce_scatter(ins["x"], ins["w"], "sum", 0, gn)
        try:
            out = fn()
        except Exception as e:  # e.g. a build without symmetric-memory support
            return {"unavailable": _why(e)}
        return dict(self.verdict(out, ref), repeats_ms=self.timed(fn))

    def amk(self, name: str, p, cfg: CollectiveConfig, ins: dict, ref: torch.Tensor, heap: int) -> dict:
        from amk.bench import cuda_target
        from lowering.collectives import lower_pattern
        from lowering.triton.dist import init_nvshmem
        from lowering.triton.pattern_rank import PatternRank
        from validator import validate

        target = cuda_target(torch.cuda.get_device_properties(self.dev))
        prog, bind = lower_pattern(p, cfg, target)
        t0 = time.perf_counter()
        v = validate(prog, backend="triton")
        validate_s = time.perf_counter() - t0
        if not v.ok:
            return {"error": "the validator rejected the program: " +
                             "; ".join(f"{f.cls}: {f.message}" for f in v.errors[:2])}
        init_nvshmem(self.ctx, heap)  # once, sized for the largest program of the run
        kc = KernelConfig.from_json(self.st.kernel, "bench/dist.py", combinations=False)
        run = PatternRank(prog, bind, self.ctx, kernel=kc, timeout_s=self.st.timeout_s)
        try:
            res = self.verdict(run.run(ins), ref)  # compiles, checks the error records
            self.sync()
            run.capture()
            reps = []
            for _ in range(self.st.repeats):
                reps += self.timed_once(run.replay)
                run.check()  # every repeat's last call finished every queue, no watchdog
            again = self.verdict(run.output(), ref)
            res["max_abs_err"] = max(res["max_abs_err"], again["max_abs_err"])
            res["repeats_ms"] = reps
        finally:
            self.sync()
            run.close()
        return dict(res, validate_s=round(validate_s, 3), tasks=len(prog.tasks), workers=prog.workers)

    # ---------------------------------------------------------------- the run
    def configs(self, name: str) -> list[tuple[str, CollectiveConfig]]:
        cfg = CollectiveConfig.from_json(self.st.collective, "bench/dist.py")
        if name.startswith("matmul_allreduce") and self.st.both_allreduce:
            return [(f"amk {a}", replace(cfg, allreduce=a)) for a in ("oneshot", "twoshot")]
        if name.startswith("matmul_allreduce"):
            return [(f"amk {cfg.allreduce}", cfg)]
        return [("amk", replace(cfg, allreduce="oneshot"))]

    def heap_bytes(self) -> int:
        """The largest arena of any amk program of the run (the NVSHMEM heap is sized once):
        the buffers depend on tile_m (the two-shot's row blocks, as chosen for the real worker
        count) but not on the columns or the chunks, so each is lowered with one column tile and
        one chunk (few tasks)."""
        from amk.bench import cuda_target
        from lowering.collectives import lower_pattern, resolve_config
        from lowering.triton.pattern_rank import PatternRank
        target = cuda_target(torch.cuda.get_device_properties(self.dev))
        progs = []
        for name in self.st.patterns:
            for m, n, k in self.st.sizes:
                p = pattern_of(name, self.R, m, n, k)
                for _, cfg in self.configs(name):
                    one = replace(resolve_config(p, cfg, target), tile_n=n, chunks=1, workers=1)
                    progs.append(lower_pattern(p, one, target)[0])
        return PatternRank.heap_bytes(progs)

    def run(self) -> list[dict]:
        rows = []
        heap = self.heap_bytes() if "amk" in self.st.methods else 0
        for pi, name in enumerate(self.st.patterns):
            for si, (m, n, k) in enumerate(self.st.sizes):
                p = pattern_of(name, self.R, m, n, k)
                ins = self.inputs(name, p, seed=100 * pi + si)
                ref = original(name, ins)
                todo: list[tuple[str, Callable[[], dict]]] = []
                if "nccl" in self.st.methods:
                    todo.append(("nccl", lambda name=name, ins=ins, ref=ref: self.nccl(name, ins, ref)))
                if "nccl_graph" in self.st.methods:
                    todo.append(("nccl_graph", lambda name=name, ins=ins, ref=ref: self.nccl_graph(name, ins, ref)))
                if "symm_mem" in self.st.methods:
                    todo.append(("symm_mem", lambda name=name, ins=ins, ref=ref: self.symm_mem(name, ins, ref)))
                if "amk" in self.st.methods:
                    for label, cfg in self.configs(name):
                        todo.append((label, lambda cfg=cfg, name=name, p=p, ins=ins, ref=ref:
                                     self.amk(name, p, cfg, ins, ref, heap)))
                for method, fn in todo:
                    self.sync()
                    res = _local(fn)
                    per_rank = self.ctx.all_gather_object(res)
                    rows.append(method_row(name, (m, n, k), method, per_rank, p.flops()))
                    if self.rank == 0:
                        r = rows[-1]
                        tag = "ok" if r["ok"] else r["status"] if r["ok"] is None else "WRONG/failed"
                        print(f"[{name} {m}x{n}x{k}] {method}: {tag} "
                              f"{r.get('repeats_ms', r.get('detail', ''))}", file=sys.stderr, flush=True)
                del ins, ref, todo
                if self.dev.type == "cuda":
                    torch.cuda.empty_cache()
        return rows


def _versions() -> dict:
    out = {"torch": torch.__version__, "python": platform.python_version()}
    try:
        import triton
        out["triton"] = triton.__version__
    except Exception:
        out["triton"] = None
    return out


def main(argv: list[str] | None = None) -> int:
    """Entry point (every rank): check the arguments and the machine, run, report on rank 0."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    os.environ.update(NO_MULTICAST_ENV)
    warnings.simplefilter("ignore", FutureWarning)  # the originals' *_tensor collectives are "deprecated"

    def body() -> int:
        st = validate(args)
        if not torch.cuda.is_available() or torch.cuda.device_count() < 1:
            raise AmkError("needs CUDA GPUs, none is visible; run on a multi-GPU machine with "
                           "torchrun --nproc-per-node 2 bench/dist.py ...")
        from lowering.triton.dist import env_world, init_distributed
        world = env_world()
        if world is None or world[1] < 2:
            raise AmkError("start it with torchrun --nproc-per-node R (R >= 2 GPUs): RANK / WORLD_SIZE "
                           + ("say 1 rank" if world else "are not set"))
        check_shapes(st, world[1])
        ctx = init_distributed()
        rows = Rank(st, ctx).run()
        if ctx.rank != 0:
            return 0
        props = torch.cuda.get_device_properties(ctx.device)
        report = build_report(dict(device=props.name, world=ctx.world, env=NO_MULTICAST_ENV,
                                   command="torchrun --nproc-per-node %d bench/dist.py %s" % (ctx.world,
                                                                                            " ".join(argv)),
                                   settings=st.to_json(), tol_rel=TOL_REL, **_versions()), rows)
        render(report)
        if st.out:
            write_report(st.out, report)
        return 0 if report["all_verdicts"] else 1

    return rank_exit_code("bench/dist.py", body)


if __name__ == "__main__":
    raise SystemExit(main())
