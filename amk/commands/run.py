"""``amk run FILE``: execute a schedule file for N decode steps on the sim or triton backend.

FILE is a ScheduleProgram in text (``.amk``) or JSON (``.json``) form (ir/io.py). The
program is validated first (validator.validate, against the chosen backend's op set); a
rejected program is refused with the verdict's findings unless ``--unsafe``, which skips
validation (a loud warning goes to stderr). The program then runs ``--steps`` epochs with
seeded inputs (the rule is ``InputPlan``'s docstring and docs/run.md) and a digest of every
io_output buffer is printed. With ``--backend triton`` the sim also runs on the same inputs
and every io_output (after every step) and every activation / kv_cache buffer (after the
last step) is compared: ``matches sim: yes/no (max abs err)``.

``--config FILE`` and the kernel knobs' flags (lowering.config.KernelConfig; ``--backend
triton`` only) set the megakernel's warps and blocks; the file's lowering part is checked but
not used (FILE is lowered already).

Exit codes: 0 ran (and, on triton, matched the sim); 1 refused by the validator, the run
failed (sim deadlock, triton watchdog, an op refused its operands) or triton disagreed with
the sim; 2 unusable input (missing or unparsable file with file:line:column, bad option,
a feature the backend does not have, e.g. several ranks on triton). ``--json`` prints one
JSON object on stdout in every case (``ok``, and ``error`` / ``kind`` on failure).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, NoReturn

from ground.errors import AmkError

#: Standard deviation of the seeded float inputs (mean 0).
INPUT_STD = 0.5
#: Ops whose operands hold positions / token ids: role name -> how amk run fills it.
POS_ROLE, TOKEN_ROLE = "pos", "token"
#: Sim policies (lowering/sim.py POLICIES; repeated so that `amk --help` does not import torch).
POLICIES = ("in_order", "random", "adversarial")
#: triton vs sim: an output matches when max|triton - sim| <= TOL[dtype] * max(1, max|sim|)
#: (NaN / inf in the same places, int32 exactly equal). f32: the two backends sum GEMV and
#: attention products in different orders (~1e-6 relative per op, compounded over a model);
#: bf16 / f16: one rounding of an intermediate may flip by an ulp (2^-8 / 2^-11) and
#: propagate, the margin the triton GPU tests use for bf16 models (tests/test_triton_megakernel.py).
TOL = {"f32": 1e-4, "f16": 5e-3, "bf16": 3e-2}


HELP = "execute a schedule file on a backend (sim or triton) with seeded inputs"
DESCRIPTION = """\
Run a schedule program (text .amk or .json) for N decode steps on the sim (CPU reference) or
triton (persistent megakernel) backend with seeded inputs, and print a digest of every io_output
buffer. The program is validated first and refused if rejected, unless --unsafe. With --backend
triton the sim runs too and the outputs are compared. Exit 0 ran (and matched), 1 refused /
failed / mismatched, 2 unusable input."""


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `run` subcommand to the root parser."""
    p = subparsers.add_parser("run", help=HELP, description=DESCRIPTION)
    p.add_argument("file", metavar="FILE", help="schedule program (.amk text or .json)")
    p.add_argument("--backend", choices=("sim", "triton"), default="sim",
                   help="sim: CPU reference executor, any number of ranks (default); triton: the "
                        "persistent megakernel on one GPU, or the Triton CPU interpreter when no "
                        "GPU is present (one worker over the linearized queues)")
    p.add_argument("--steps", type=int, default=3, metavar="N",
                   help="decode steps (epochs) to run (default 3: exercises slot and credit reuse)")
    p.add_argument("--seed", type=int, default=0, metavar="S",
                   help="seed of the inputs and of the sim's interleaving (default 0)")
    p.add_argument("--sim-policy", choices=POLICIES, default="random",
                   help="the sim's interleaving policy (docs/sim.md; default random)")
    p.add_argument("--unsafe", action="store_true",
                   help="skip validation and run the program anyway (deadlocks end in an error; "
                        "races may silently give wrong results)")
    p.add_argument("--timeout", type=float, default=2.0, metavar="SECONDS",
                   help="triton on a GPU: watchdog bound per counter wait (default 2 s). Under "
                        "the interpreter the watchdog counts polls instead (2 per wait)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--config", metavar="FILE", default=None,
                   help="config file (docs/lowering.md): --backend triton runs with its kernel part; its "
                        "lowering part is checked but not used (FILE is lowered already)")
    from lowering.config import KernelConfig
    from lowering.knobs import add_flags

    add_flags(p.add_argument_group("kernel knobs of --backend triton (docs/triton.md)"), KernelConfig)
    p.set_defaults(func=run)


# ------------------------------------------------------------------------------ inputs
def _seed_of(*parts: Any) -> int:
    """A 63-bit torch seed from ``parts`` (stable across processes, unlike ``hash``)."""
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


@dataclass
class InputPlan:
    """How ``amk run`` fills a program's inputs, deterministically from ``seed``.

    Buffers of kind weight, kv_cache and io_input hold data before a step starts
    (docs/ir.md), so they are filled; activation, scratch and io_output buffers start
    poisoned (NaN / INT_POISON), as both backends do, so a read before a write shows.

    * float buffers: values ~ N(0, INPUT_STD^2) drawn in float32 and cast to the buffer's
      dtype; weights and kv caches once, io_input buffers afresh before every step;
    * int32 buffers read as a ``pos`` operand (rope, kv_append, attention and their fused
      forms): the step index ``e`` in every element (positions 0, 1, 2, ...);
    * int32 buffers read as the ``token`` operand of ``embed``: one token id per step,
      ``floor(u * V)`` with u ~ U[0, 1) drawn per (seed, step) and shared by all token
      buffers (every rank's token agrees), V the smallest vocabulary (table rows) of the
      embeds reading the buffer;
    * any other int32 buffer: 0.

    Values depend on (seed, buffer name, step) and not on the rank, so every rank's copy
    of a symmetric buffer starts equal (replicated weights, the same token on every rank).
    """

    program: Any
    seed: int
    steps: int
    roles: dict[str, str] = field(default_factory=dict)   # int32 buffer -> POS_ROLE / TOKEN_ROLE
    vocab: dict[str, int] = field(default_factory=dict)   # token buffer -> V
    _weights: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from ir.ops import OPS

        bufs = self.program.buffer_map()
        for t in self.program.tasks:
            spec = OPS.get(t.op)
            if spec is None:
                continue
            for role, reg in zip(spec.ins, t.ins):
                b = bufs.get(reg.buffer)
                if b is None or b.dtype != "i32":
                    continue
                if role == POS_ROLE:
                    self.roles[b.name] = POS_ROLE
                elif role == TOKEN_ROLE and t.op == "embed" and self.roles.get(b.name) != POS_ROLE:
                    self.roles[b.name] = TOKEN_ROLE
                    table = t.ins[0].shape() if t.ins else ()
                    if len(table) == 2 and table[0] > 0:
                        self.vocab[b.name] = min(self.vocab.get(b.name, table[0]), table[0])

    def filled(self) -> list[Any]:
        """The buffers this plan fills (kinds weight, kv_cache, io_input)."""
        return [b for b in self.program.buffers if b.kind in ("weight", "kv_cache", "io_input")]

    def describe(self) -> dict[str, list[str]]:
        """Buffer names per rule: ``random``, ``positions``, ``tokens``, ``zeros``."""
        out: dict[str, list[str]] = {"random": [], "positions": [], "tokens": [], "zeros": []}
        for b in self.filled():
            if b.dtype != "i32":
                out["random"].append(b.name)
            elif self.roles.get(b.name) == POS_ROLE:
                out["positions"].append(b.name)
            elif self.roles.get(b.name) == TOKEN_ROLE and b.name in self.vocab:
                out["tokens"].append(b.name)
            else:
                out["zeros"].append(b.name)
        return out

    def value(self, b: Any, epoch: int):
        """The contents of buffer ``b`` for step ``epoch`` (a torch tensor of ``b.numel``
        elements, float32 or int32, int8 / float8_e4m3fn for quantized weights; the executors
        cast to the buffer's dtype)."""
        import torch

        if b.dtype == "i32":
            role = self.roles.get(b.name)
            if role == POS_ROLE:
                return torch.full((b.numel,), epoch, dtype=torch.int32)
            if role == TOKEN_ROLE and b.name in self.vocab:
                # One token stream for all token buffers (token.r0, token.r1, ... of a
                # tensor-parallel program must agree): uniform u per step, scaled to V.
                g = torch.Generator().manual_seed(_seed_of(self.seed, TOKEN_ROLE, epoch))
                u = torch.rand(b.numel, generator=g, dtype=torch.float64)
                v = self.vocab[b.name]
                return (u * v).floor().clamp_(max=v - 1).to(torch.int32)
            return torch.zeros(b.numel, dtype=torch.int32)
        if b.kind == "weight":  # drawn once; both backends copy it (the sim may share it read-only)
            w = self._weights.get(b.name)
            if w is None:
                g = torch.Generator().manual_seed(_seed_of(self.seed, b.name))
                if b.dtype == "i8":  # quantized weights: the whole int8 range, not zeros
                    w = torch.randint(-127, 128, (b.numel,), generator=g, dtype=torch.int8)
                elif b.dtype == "f8e4m3":
                    w = torch.randn(b.numel, generator=g).to(torch.float8_e4m3fn)
                else:
                    w = torch.randn(b.numel, generator=g) * INPUT_STD
                self._weights[b.name] = w
            return w
        step = epoch if b.kind == "io_input" else "init"
        g = torch.Generator().manual_seed(_seed_of(self.seed, b.name, step))
        return torch.randn(b.numel, generator=g) * INPUT_STD

    def init_fn(self) -> Callable[[Any, int], Any]:
        """``init_fn(buffer, rank)`` for SimExecutor / TritonExecutor (step-0 inputs)."""
        def init(b: Any, rank: int):
            if b.kind in ("weight", "kv_cache", "io_input"):
                return self.value(b, 0)
            return None
        return init

    def on_start(self, ex: Any) -> Callable[[int, int], None]:
        """An ``on_start(epoch, rank)`` hook writing step ``epoch``'s io_input buffers."""
        held = _held(self.program)
        inputs = [b for b in self.program.buffers if b.kind == "io_input"]

        def hook(epoch: int, rank: int) -> None:
            for b in inputs:
                if rank in held[b.name]:
                    ex.write(b.name, rank, self.value(b, epoch))
        return hook

    def check_positions(self) -> None:
        """Refuse ``steps`` beyond a KV cache: position e = step index must stay below every
        cache's sequence length (axis -2 of the cache region). Raises AmkError (exit 2)."""
        from ir.ops import OPS

        if not any(r == POS_ROLE for r in self.roles.values()):
            return
        for t in self.program.tasks:
            spec = OPS.get(t.op)
            if spec is None:
                continue
            for roles, regs in ((spec.ins, t.ins), (spec.outs, t.outs)):
                for role, reg in zip(roles, regs):
                    if role not in ("kc", "vc"):
                        continue
                    shape = reg.shape()
                    if len(shape) >= 2 and self.steps > shape[-2]:
                        raise AmkError(
                            f"--steps {self.steps}: positions run 0..{self.steps - 1}, but task {t.id}'s "
                            f"KV cache {reg.buffer} holds {shape[-2]} positions; use --steps "
                            f"{shape[-2]} or fewer")


def _held(program: Any) -> dict[str, list[int]]:
    """Buffer name -> the ranks holding a copy (its owner, or every rank if symmetric)."""
    out: dict[str, list[int]] = {}
    for b in program.buffers:
        out[b.name] = list(range(program.ranks)) if b.placement == "symmetric" else [b.rank]
    return out


# ------------------------------------------------------------------------------ digests
def digest(t: Any, dtype: str) -> dict[str, Any]:
    """A short summary of one tensor: shape, dtype, finite (float: no NaN/inf; int32: no
    INT_POISON, i.e. every element was written), count of bad elements, min / max / sum over
    the good elements (None if none), crc32 of the raw bytes (hex; the same bytes give the
    same value on every machine)."""
    import torch

    from lowering.reference import INT_POISON

    flat = t.detach().reshape(-1).cpu()
    good = torch.isfinite(flat) if flat.is_floating_point() else flat != INT_POISON
    vals = flat[good]
    n_bad = int(flat.numel() - vals.numel())
    raw = flat.contiguous().view(torch.uint8).numpy().tobytes()
    d: dict[str, Any] = {"shape": list(t.shape), "dtype": dtype, "finite": n_bad == 0,
                         "nonfinite": n_bad, "min": None, "max": None, "sum": None,
                         "crc32": f"{zlib.crc32(raw):08x}"}
    if vals.numel():
        v64 = vals.double()
        if flat.is_floating_point():
            d.update(min=float(v64.min()), max=float(v64.max()), sum=float(v64.sum()))
        else:
            d.update(min=int(vals.min()), max=int(vals.max()), sum=int(vals.long().sum()))
    return d


def compare(got: Any, ref: Any, dtype: str) -> tuple[bool, float, str]:
    """Whether ``got`` (triton) matches ``ref`` (sim) for a buffer of ``dtype``: int32
    exactly; floats with NaN / +-inf in the same places and max|got - ref| <= TOL[dtype] *
    max(1, max|ref|) over the finite elements. Returns (ok, max abs err, reason if not ok)."""
    import torch

    a, b = got.reshape(-1).cpu(), ref.reshape(-1).cpu()
    if a.shape != b.shape:
        return False, math.inf, f"shape {tuple(got.shape)} vs {tuple(ref.shape)}"
    if not b.is_floating_point():
        err = float((a.long() - b.long()).abs().max()) if a.numel() else 0.0
        return err == 0, err, "" if err == 0 else "int32 values differ"
    a, b = a.double(), b.double()
    fa, fb = torch.isfinite(a), torch.isfinite(b)
    if not torch.equal(fa, fb) or not torch.equal(a[~fa].nan_to_num(0.0, 1.0, -1.0),
                                                 b[~fb].nan_to_num(0.0, 1.0, -1.0)):
        return False, math.inf, "NaN / inf in different places"
    if not fa.any():
        return True, 0.0, ""
    err = float((a[fa] - b[fa]).abs().max())
    scale = max(1.0, float(b[fb].abs().max()))
    bound = TOL.get(dtype, 1e-4) * scale
    return err <= bound, err, "" if err <= bound else f"max abs err {err:.3g} > {bound:.3g}"


# ------------------------------------------------------------------------------ execution
class _RunFailed(Exception):
    """The program ran and failed: ``kind`` (deadlock, watchdog, task_error, run_error)."""

    def __init__(self, kind: str, message: str, detail: dict[str, Any] | None = None):
        super().__init__(message)
        self.kind = kind
        self.detail = detail or {}


def _make_executor(backend: str, prog: Any, plan: InputPlan, args: argparse.Namespace):
    """Construct the backend's executor (check=False: amk run validated already, or
    --unsafe). Structural refusals are AmkError (exit 2)."""
    init = plan.init_fn()
    if backend == "sim":
        from lowering.sim import SimError, SimExecutor

        try:
            return SimExecutor(prog, init, seed=args.seed, policy=args.sim_policy, check=False)
        except SimError as e:
            raise AmkError(f"{args.file}: the sim cannot execute this program: {e}") from None
    from lowering.triton.blocks import kernel_options
    from lowering.triton.runtime import TritonExecutor

    return TritonExecutor(prog, init, check=False, timeout_s=args.timeout, **kernel_options(args.kernel_config))


def _execute(ex: Any, prog: Any, plan: InputPlan, steps: int, backend: str,
             capture: list[str]) -> tuple[Any, dict[tuple[str, int, int], Any]]:
    """Run ``steps`` epochs; returns (stats, {(buffer, rank, epoch): tensor}) with copies of
    the ``capture`` buffers after each step on each rank holding them. Failures of the run
    become _RunFailed."""
    held = _held(prog)
    seen: dict[tuple[str, int, int], Any] = {}

    def on_end(epoch: int, rank: int) -> None:
        for name in capture:
            if rank in held[name]:
                seen[(name, rank, epoch)] = ex.read(name, rank)

    if backend == "sim":
        from lowering.sim import SimDeadlock, SimError, SimTaskError

        try:
            stats = ex.run_steps(steps, on_start=plan.on_start(ex), on_end=on_end)
        except SimDeadlock as e:
            raise _RunFailed("deadlock", f"sim: {e}", {"blocked": e.blocked, "counters": e.counters}) from None
        except SimTaskError as e:
            raise _RunFailed("task_error", f"sim: {e}", {"task": e.task, "epoch": e.epoch}) from None
        except SimError as e:
            raise _RunFailed("run_error", f"sim: {e}") from None
        return stats, seen
    from lowering.triton.runtime import TritonTaskError, TritonWatchdogError

    try:
        stats = ex.run_steps(steps, on_start=plan.on_start(ex), on_end=on_end)
    except TritonWatchdogError as e:
        # The kernel's worker numbers are its grid's (one linear worker under the
        # interpreter); name each stuck task's own rank and worker too.
        where = {t.id: f"@r{t.rank}.w{t.worker}" for t in prog.tasks}
        stuck = [{**s, "location": where.get(s.get("task"), "?")} for s in e.stuck]
        locs = ", ".join(f"{s.get('task')} {s['location']}" for s in stuck)
        raise _RunFailed("watchdog", f"triton: {e} [stuck task(s): {locs}]", {"stuck": stuck}) from None
    except TritonTaskError as e:
        raise _RunFailed("task_error", f"triton: {e}", {"task": e.task, "epoch": e.epoch}) from None
    return stats, seen


def _compare_runs(prog: Any, steps: int, tri: dict, sim: dict) -> dict[str, Any]:
    """Compare captured buffers: io_output after every step, activation / kv_cache after the
    last one. Returns {matches, max_abs_err, compared, worst, mismatches}."""
    bufs = prog.buffer_map()
    worst: dict[str, Any] | None = None
    mismatches: list[dict[str, Any]] = []
    compared = 0
    max_err = 0.0
    for key in sorted(tri, key=lambda k: (k[2], k[0], k[1])):
        name, rank, epoch = key
        b = bufs[name]
        if b.kind != "io_output" and epoch != steps - 1:
            continue
        if key not in sim:
            continue
        ok, err, why = compare(tri[key], sim[key], b.dtype)
        compared += 1
        row = {"buffer": name, "rank": rank, "step": epoch, "kind": b.kind, "max_abs_err": err}
        if worst is None or err > worst["max_abs_err"]:
            worst = row
        max_err = max(max_err, err)
        if not ok:
            mismatches.append({**row, "reason": why})
    return {"matches": not mismatches, "max_abs_err": max_err, "compared": compared,
            "worst": worst, "mismatches": mismatches}


# ------------------------------------------------------------------------------ output
def _json_safe(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    if hasattr(x, "item") and callable(x.item):
        return x.item()
    return x


def _emit_json(obj: dict[str, Any]) -> None:
    from amk.output import emit_json

    emit_json(_json_safe(obj))


def _fmt(x: Any) -> str:
    return "-" if x is None else (f"{x:.6g}" if isinstance(x, float) else str(x))


def _print_rejected(out: Any, file: str, verdict: Any) -> None:
    """The verdict's findings, as `amk validate` prints them."""
    from rich.markup import escape

    out.print(f"[bold red]rejected[/] {escape(file)}: {len(verdict.errors)} error(s)")
    for f in verdict.errors:
        out.print(f"[bold]{escape(f.cls)}[/]: {escape(f.message)}")
        if f.witness:
            text = json.dumps(_json_safe(f.witness), default=str, indent=1)
            if len(text) > 4000:
                text = text[:4000] + "\n ... (witness truncated; amk validate --json prints all of it)"
            out.print("  witness: " + escape(text).replace("\n", "\n  "))


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape

    err = Console(stderr=True, highlight=False, soft_wrap=True)
    out = Console(highlight=False, soft_wrap=True)
    base = {"ok": False, "file": args.file, "backend": args.backend}

    def fail(kind: str, message: str, code: int, **extra: Any) -> NoReturn:
        if args.json:
            _emit_json({**base, "kind": kind, "error": message, **extra})
        raise AmkError(message, exit_code=code)

    if args.steps < 1:
        fail("input_error", f"--steps must be at least 1, got {args.steps}", 2)
    if not (args.timeout > 0 and math.isfinite(args.timeout)):
        fail("input_error", f"--timeout must be a positive number of seconds, got {args.timeout}", 2)
    from lowering.config import KernelConfig, config_from_args
    from lowering.knobs import given

    kernel_flags = given(args, KernelConfig)
    if kernel_flags and args.backend != "triton":
        fail("input_error", f"--{next(iter(kernel_flags)).replace('_', '-')} is a knob of the triton backend's "
                            f"kernel; --backend {args.backend} has none (add --backend triton)", 2)
    try:
        args.kernel_config = config_from_args(args, "amk run").kernel
    except AmkError as e:
        fail("input_error", str(e), 2)
    if args.backend == "triton":
        # Must precede any `import triton`: it picks the CPU interpreter when no GPU is present.
        try:
            import lowering.triton  # noqa: F401
        except ImportError as e:
            fail("input_error", f"the triton backend cannot be loaded here ({e})", 2)

    from ir.io import load_program

    try:
        prog = load_program(args.file)
    except AmkError as e:
        fail("input_error", str(e), 2)
    base.update(program=prog.name, ranks=prog.ranks, workers=prog.workers, steps=args.steps,
                seed=args.seed, unsafe=bool(args.unsafe))
    if args.steps > prog.max_epochs:
        fail("input_error", f"--steps {args.steps} exceeds the program's max_epochs {prog.max_epochs}", 2)
    plan = InputPlan(prog, args.seed, args.steps)
    try:
        plan.check_positions()
    except AmkError as e:
        fail("input_error", str(e), 2)

    validate_s = None
    if args.unsafe:
        err.print(f"[bold yellow]WARNING: --unsafe: {escape(args.file)} runs WITHOUT validation.[/] "
                  "A deadlock ends in an error (sim: deadlock report; triton: the watchdog), but a "
                  "race or a missing credit may silently give wrong results.")
    else:
        from validator import validate

        verdict = validate(prog, backend=args.backend)
        validate_s = verdict.stats.get("total_s")
        if not verdict.ok:
            classes = ", ".join(sorted({f.cls for f in verdict.errors}))
            msg = (f"{args.file}: rejected by the validator ({classes}); not run "
                   "(amk validate shows the witnesses; --unsafe runs it anyway)")
            if args.json:
                fail("rejected", msg, 1, errors=verdict.to_json()["errors"])
            _print_rejected(out, args.file, verdict)
            raise AmkError(msg, exit_code=1)

    capture = [b.name for b in prog.buffers if b.kind == "io_output"]
    if args.backend == "triton":
        capture += [b.name for b in prog.buffers if b.kind in ("activation", "kv_cache")]

    import lowering.sim  # noqa: F401  (imported before the clock: setup_s is the executor's own time)
    if args.backend == "triton":
        import lowering.triton.runtime  # noqa: F401
    t0 = time.perf_counter()
    try:
        ex = _make_executor(args.backend, prog, plan, args)
    except AmkError as e:
        fail("input_error", f"{args.file}: {e}" if args.file not in str(e) else str(e), e.exit_code)
    setup_s = time.perf_counter() - t0
    try:
        stats, seen = _execute(ex, prog, plan, args.steps, args.backend, capture)
    except _RunFailed as e:
        fail(e.kind, f"{args.file}: {e}", 1, **e.detail)
    except AmkError as e:  # e.g. TritonError: co-residency, incomplete queue
        fail("run_error", f"{args.file}: {args.backend}: {e}", e.exit_code)

    last = args.steps - 1
    outputs = []
    for b in prog.buffers:
        if b.kind != "io_output":
            continue
        for r in _held(prog)[b.name]:
            if (b.name, r, last) in seen:
                outputs.append({"buffer": b.name, "rank": r, **digest(seen[(b.name, r, last)], b.dtype)})
    result: dict[str, Any] = {
        **base, "ok": True, "validated": not args.unsafe, "validate_s": validate_s,
        "setup_s": round(setup_s, 4), "run_s": round(stats.seconds, 4), "tasks": stats.tasks,
        "inputs": plan.describe(), "outputs": outputs,
    }
    if args.backend == "sim":
        result.update(policy=args.sim_policy)
    else:
        interp = getattr(ex, "interpret", False)
        result.update(device=str(ex.device), interpreter=bool(interp), kernel_workers=ex.workers,
                      watchdog=f"{ex.timeout} polls per wait" if interp else f"{args.timeout:g} s per wait")
        sim_ex = _make_executor("sim", prog, plan, args)
        try:
            _, sim_seen = _execute(sim_ex, prog, plan, args.steps, "sim", capture)
            cmp = _compare_runs(prog, args.steps, seen, sim_seen)
        except _RunFailed as e:
            cmp = {"matches": False, "max_abs_err": None, "compared": 0, "worst": None,
                   "mismatches": [], "sim_error": str(e)}
        result["sim"] = {"policy": args.sim_policy, **cmp}
        result["ok"] = bool(cmp["matches"])

    if args.json:
        _emit_json(result)
    else:
        _print_result(out, args, prog, result)
    return 0 if result["ok"] else 1


def _print_result(out: Any, args: argparse.Namespace, prog: Any, res: dict[str, Any]) -> None:
    from rich.markup import escape

    if args.backend == "sim":
        where = f"sim (policy {args.sim_policy}, seed {args.seed})"
    else:
        mode = (f"Triton interpreter, {res['kernel_workers']} worker over the linearized queues"
                if res["interpreter"] else f"{res['kernel_workers']} persistent workers")
        where = f"triton on {res['device']} ({mode}; watchdog {res['watchdog']})"
    val = "NOT validated (--unsafe)" if args.unsafe else f"validated in {res['validate_s'] or 0:.3f} s"
    out.print(f"[bold green]ran[/] {escape(args.file)} on {escape(where)}: {args.steps} step(s), "
              f"{res['tasks']} tasks in {res['run_s']:.3f} s (setup {res['setup_s']:.3f} s; {val})")
    labels = {"random": f"N(0, {INPUT_STD:g}^2)", "positions": "step index", "tokens": "seeded token ids",
              "zeros": "0"}
    parts = []
    for k, names in res["inputs"].items():
        if names:
            shown = ", ".join(names[:6]) + (f" (+{len(names) - 6} more)" if len(names) > 6 else "")
            parts.append(f"{labels[k]}: {shown}")
    out.print("inputs (seed %d): %s" % (args.seed, escape("; ".join(parts) or "none")))
    if not res["outputs"]:
        out.print("no io_output buffers")
    else:
        out.print(f"io_output after step {args.steps - 1}:")
        for o in res["outputs"]:
            fin = "finite" if o["finite"] else f"[bold red]{o['nonfinite']} non-finite/unwritten[/]"
            out.print(f"  {escape(o['buffer'])}@r{o['rank']} {escape(str(o['shape']))} {o['dtype']} {fin} "
                      f"min {_fmt(o['min'])} max {_fmt(o['max'])} sum {_fmt(o['sum'])} crc32 {o['crc32']}")
    sim = res.get("sim")
    if sim is None:
        return
    if sim.get("sim_error"):
        out.print(f"matches sim: [bold red]no[/] (the sim run failed: {escape(sim['sim_error'])})")
    elif sim["matches"]:
        out.print(f"matches sim: [bold green]yes[/] (max abs err {_fmt(sim['max_abs_err'])} over "
                  f"{sim['compared']} buffer comparisons; io_output every step, activation and "
                  "kv_cache after the last)")
    else:
        m = sim["mismatches"][0]
        more = f" (+{len(sim['mismatches']) - 1} more)" if len(sim["mismatches"]) > 1 else ""
        out.print(f"matches sim: [bold red]no[/] (max abs err {_fmt(sim['max_abs_err'])}; first: "
                  f"{escape(m['buffer'])}@r{m['rank']} step {m['step']}: {escape(m['reason'])}{more})")
