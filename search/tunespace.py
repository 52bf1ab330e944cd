"""The space of `amk tune`: whole configs, ``{"lowering": {...}, "kernel": {...}}``.

A *candidate* is a full AmkConfig JSON (every field of both parts). Its knobs are

* the lowering's: the knobs and values of ``search.space.space_for`` (the model, the ranks and
  the target decide them), with ``dtype`` and ``max_seq`` fixed for a whole tuning run;
* the Triton kernel's: every field of ``lowering.config.KernelConfig``, its values derived from
  the field's declaration (``lowering.knobs``: a boolean's two values, the ``choices``, the
  powers of two within ``lo``..``hi``) or, where the declared range is too wide to walk,
  from a value list here (``KERNEL_VALUES``). A KernelConfig field with neither is an error
  (``SpaceError``), so a new kernel knob cannot be left out by accident.

Every knob value is first an allowed value of its declaration. A candidate is *screened*
(``TuneSpace.screen``) before it costs any backend time: ``AmkConfig.validate(ranks=R,
combinations=True)`` refuses a bad value, a rule between knobs and every combination in
which a knob does nothing (``--x-reuse 1`` without ``--x-stage 1``, ``--ring-rows 8`` without
``--ring``, ...); then a resource check of the kernel knobs, without a GPU: the CTAs per SM
that the workers need must fit the register file at the block's threads
(``lowering.triton.runtime.regs_for_ctas``), the GEMV pipeline buffers and the weight ring
(``lowering.triton.ring.ring_smem``) must fit the shared memory of one block. A refused
candidate is recorded with the reason and never evaluated.

The canonical id of a candidate is ``"t-"`` + the first 12 hex digits of the sha256 of its
full config JSON with sorted keys.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, fields
from typing import Any, Iterator

from ground.errors import AmkError
from search.space import KnobLookup, SpaceError, space_for
from lowering.config import model_inert

#: Value lists of the kernel knobs whose declared range is too wide (or unbounded) to walk;
#: each value is checked against the declaration (tests/test_tune.py).
KERNEL_VALUES: dict[str, tuple[Any, ...]] = {
    "num_warps": (4, 8, 16),
    "gemv_block": ("16x64", "16x128", "16x256", "32x128", "32x256", "32x512", "64x128", "64x256"),
    "gemv_stages": (1, 2, 3, 4, 5, 6, 7, 8),
    "gemv_unroll": (1, 2, 4, 8),
    "prefetch": (0, 1, 2),
    "prefetch_cap": (0, 16384, 65536),
    "prefetch_rows": (0, 32, 128),
    "roll": (0, 1, 2),
    "attention_block": (16, 32, 64, 128),
    "x_chunk": (2048, 4096, 8192, 16384),
    "w_preload": (0, 512, 1024, 2048),
    "maxnreg": (0, 128, 168),
    # the weight ring is off unless asked for (--ring): its pages take most of the shared memory
    "ring": (0,),
    "ring_rows": (2, 4, 8),
    "ring_cols": (1024, 2048, 4096),
    # the quantized weights' knobs act on int8 / fp8 programs only; tuned entries are bf16
    "q_tma": (False,),
    "q_gemv_n": (0,),
    "int8_convert": ("prmt",),
}
#: ``ring`` when the ring is searched (``TuneSpace(..., ring=True)``).
RING_VALUES = (0, 4, 8, 16)

#: Knobs whose values are an order (neighbours are the adjacent values); ``gemv_block`` is
#: two sizes at once, so every other block is its neighbour.
ORDINAL = {"num_warps", "gemv_stages", "gemv_unroll", "prefetch", "prefetch_cap", "prefetch_rows",
           "roll", "attention_block", "x_chunk", "w_preload", "maxnreg", "ring", "ring_rows", "ring_cols",
           "tile", "workers", "attn_split", "attn_kv_split", "tile_qkv", "tile_gate_up", "tile_lm_head", "tile_reduce",
           "down_split_k", "q_gemv_n"}

#: The op family each knob acts on, for profile-first ordering: ``gemv`` (the weight stream),
#: ``attention``, ``comm`` (the all-reduce and the signals) and ``schedule`` (every task).
FAMILY = {
    "tile": "gemv", "tile_qkv": "gemv", "tile_gate_up": "gemv", "tile_lm_head": "gemv", "wave": "gemv",
    "num_warps": "gemv", "gemv_block": "gemv", "gemv_stages": "gemv", "gemv_unroll": "gemv",
    "prefetch": "gemv", "prefetch_cap": "gemv", "prefetch_rows": "gemv", "roll": "gemv", "x_stage": "gemv",
    "x_reuse": "gemv", "x_chunk": "gemv", "w_preload": "gemv", "gemv_tma": "gemv", "ring": "gemv",
    "ring_rows": "gemv", "ring_cols": "gemv", "maxnreg": "gemv", "down_split_k": "gemv", "q_tma": "gemv",
    "q_gemv_n": "gemv", "int8_convert": "gemv",
    "attn_split": "attention", "attn_kv_split": "attention",
    "attention_block": "attention", "late_append": "attention",
    "allreduce": "comm", "tile_reduce": "comm", "fuse_reduce": "comm", "lean_release": "comm",
    "coalesce_signals": "comm",
    "workers": "schedule", "policy": "schedule", "fuse": "schedule", "row_prefetch": "schedule",
    "elide_waits": "schedule",
}
FAMILIES = ("gemv", "attention", "comm", "schedule")

#: Op -> family (ir.ops names): where a profiled or predicted step spends its time.
OP_FAMILY = {
    "gemv": "gemv", "norm_gemv": "gemv", "gemv_res": "gemv", "swiglu_gemv": "gemv",
    "reduce_norm_gemv": "gemv",
    "attention": "attention", "rope_attention": "attention", "rope_attention_kv": "attention",
    "attention_combine": "attention",
    "kv_append": "attention", "rope_append": "attention", "rope": "attention",
    "put": "comm", "reduce": "comm", "quiet": "comm", "fence": "comm", "argmax_combine": "comm",
}

#: Shared memory one block may use on sm_90 (H100 / H200: 227 KiB, the opt-in limit); the
#: device's own value replaces it when a GPU is visible.
SMEM_PER_BLOCK_SM90 = 232448
#: Shared memory the kernel keeps below the ring (runtime.TritonExecutor._rbase).
RING_BASE = 1024


@dataclass(frozen=True)
class TuneKnob:
    """One knob of the tuning space: ``part`` lowering | kernel, ``values`` in order (adjacent
    values of an ``ordinal`` knob are neighbours), ``family`` (FAMILY), ``help`` (its
    declaration's description)."""

    name: str
    part: str
    values: tuple[Any, ...]
    ordinal: bool
    family: str
    help: str = ""


def kernel_knobs(ring: bool = False, config_cls: Any = None) -> list[TuneKnob]:
    """The kernel knobs of the tuning space, in KernelConfig field order. Raises SpaceError for
    a KernelConfig field without a value rule, or a listed value its declaration refuses."""
    from lowering.config import KernelConfig
    from lowering.knobs import knobs_of

    out = []
    for k in knobs_of(config_cls or KernelConfig):
        if k.name == "ring" and ring:
            vals: tuple[Any, ...] = RING_VALUES
        elif k.name in KERNEL_VALUES:
            vals = KERNEL_VALUES[k.name]
        elif k.kind is bool:
            vals = (False, True)
        elif k.choices:
            vals = tuple(k.choices)
        elif k.kind is int and k.pow2 and k.lo is not None and k.hi is not None and k.hi // max(k.lo, 1) <= 64:
            vals = tuple(v for v in (1 << i for i in range(16)) if k.lo <= v <= k.hi)
        else:
            raise SpaceError(f"search/tunespace.py has no value rule for kernel knob {k.name!r}")
        for v in vals:
            why = k.problem(v)
            if why:
                raise SpaceError(f"search/tunespace.py: kernel knob {k.name!r}: value {v!r}: {why}")
        out.append(TuneKnob(k.name, "kernel", tuple(vals), k.name in ORDINAL, FAMILY.get(k.name, "schedule"),
                            k.help))
    return out


def candidate_id(config: dict[str, Any]) -> str:
    """``t-`` + 12 hex digits of the sha256 of a full config's JSON (sorted keys)."""
    text = json.dumps(config, sort_keys=True, separators=(",", ":"))
    return "t-" + hashlib.sha256(text.encode()).hexdigest()[:12]


class TuneSpace(KnobLookup):
    """The knobs of a tuning run and the checks of its candidates.

    ``spec``: models.graph.ModelSpec; ``ranks``: R; ``max_workers``: the target's co-resident
    workers per rank; ``dtype`` / ``max_seq``: fixed lowering fields; ``backend``: sim | triton
    (``kernel=False`` leaves the kernel knobs out of the walked knobs: the sim's cost model
    does not see them); ``sms``: the GPU's SMs (register check; None: no register check);
    ``smem``: shared memory per block in bytes; ``colocated``: ranks sharing one GPU (their
    CTAs share its SMs); ``ring``: search the weight ring's page count too.
    """

    def __init__(self, spec: Any, ranks: int, max_workers: int, *, dtype: str = "f32", max_seq: int = 256,
                 kernel: bool = True, sms: int | None = None, smem: int = SMEM_PER_BLOCK_SM90,
                 colocated: int = 1, ring: bool = False):
        self.spec, self.ranks, self.max_workers = spec, ranks, max_workers
        self.dtype, self.max_seq = dtype, max_seq
        self.sms, self.smem, self.colocated = sms, smem, colocated
        low = space_for(spec, ranks, max_workers, fixed={"dtype": dtype, "max_seq": max_seq})
        self.lowering_space = low
        self.fixed = dict(low.fixed)
        self.qk_norm = bool(getattr(spec, "qk_norm", False))
        inert_here = {n for n, _ in model_inert(self.qk_norm, {k.name: True for k in low.knobs})}
        self.knobs: list[TuneKnob] = [
            TuneKnob(k.name, "lowering", k.values, k.ordinal, FAMILY.get(k.name, "schedule"), k.help)
            for k in low.knobs if k.name not in inert_here]
        self.kernel_knobs = kernel_knobs(ring)
        if kernel:
            self.knobs += self.kernel_knobs

    # -- points --------------------------------------------------------------------
    def default(self) -> dict[str, Any]:
        """The defaults of both parts with the run's fixed lowering fields."""
        from lowering.config import AmkConfig

        cfg = AmkConfig().to_json()
        cfg["lowering"].update(self.fixed)
        return cfg

    def canonical(self, config: dict[str, Any], source: str = "candidate") -> dict[str, Any]:
        """Every field of both parts (missing ones at their defaults), the fixed lowering
        fields checked. Raises AmkError naming an unknown field, a bad value, or a fixed
        field held at another value."""
        from lowering.config import AmkConfig

        cfg = AmkConfig.from_json(config, source, combinations=False).to_json()
        for k, v in self.fixed.items():
            if k in ("dtype", "max_seq") and cfg["lowering"][k] != v:
                raise AmkError(f"{source}: {k} is {cfg['lowering'][k]!r}; this tuning run holds it at {v!r}")
        return cfg

    def candidate_id(self, config: dict[str, Any]) -> str:
        return candidate_id(self.canonical(config))

    def default_of(self, name: str) -> Any:
        """The default value of knob ``name`` (the run's fixed fields applied)."""
        return self.default()[self.knob(name).part][name]

    def get(self, config: dict[str, Any], name: str) -> Any:
        return config[self.knob(name).part][name]

    def with_value(self, config: dict[str, Any], name: str, value: Any) -> dict[str, Any]:
        """A copy of ``config`` with knob ``name`` at ``value``."""
        part = self.knob(name).part if name in self.names else (
            "lowering" if name in config["lowering"] else "kernel")
        out = {"lowering": dict(config["lowering"]), "kernel": dict(config["kernel"])}
        out[part][name] = value
        return out

    def describe(self, config: dict[str, Any], base: dict[str, Any] | None = None) -> str:
        """The knobs that differ from ``base`` (``gemv_block 32x512->16x128``), or from the
        defaults without a base; ``(same)`` when none."""
        from lowering.knobs import show

        ref = base or self.default()
        diffs = [f"{n} {show(ref[p][n])}->{show(v)}" for p in ("lowering", "kernel")
                 for n, v in config[p].items() if ref[p].get(n) != v]
        return ", ".join(diffs) if diffs else "(same)"

    def changed(self, config: dict[str, Any], base: dict[str, Any]) -> list[str]:
        """Names of the knobs whose value differs between ``config`` and ``base``."""
        return [n for p in ("lowering", "kernel") for n, v in config[p].items() if base[p].get(n) != v]

    # -- the constraint check --------------------------------------------------------
    def screen(self, config: dict[str, Any]) -> str | None:
        """Why ``config`` may not be evaluated (None when it may): a bad value or a knob that
        does nothing (AmkConfig.validate at R ranks), a fixed field changed, more workers
        than the target holds, or a resource the kernel knobs need beyond the device's."""
        from lowering.config import AmkConfig

        try:
            cfg = self.canonical(config)
            AmkConfig.from_json(cfg, "candidate", ranks=self.ranks, combinations=True)
        except AmkError as err:
            return str(err).removeprefix("candidate: ")
        low, ker = cfg["lowering"], cfg["kernel"]
        for name, why in model_inert(self.qk_norm, low):
            return f"{name} does nothing for this model: {why}"
        if low["workers"] > self.max_workers:
            return f"--workers {low['workers']} exceeds the target's {self.max_workers} co-resident workers per rank"
        return self.resources(low, ker)

    def resources(self, low: dict[str, Any], ker: dict[str, Any]) -> str | None:
        """The kernel's resource check without a GPU (see the module docstring); None when
        the knobs fit."""
        from lowering.config import KernelConfig

        kc = KernelConfig(**ker)
        threads = 32 * kc.num_warps
        if kc.gemv_unroll > 2 and kc.gemv_k >= threads:
            return (f"resources: --gemv-unroll {kc.gemv_unroll} needs a K block below 32 x num_warps = {threads}, "
                    f"got --gemv-block {kc.gemv_block}")
        if self.sms:
            from lowering.triton.runtime import regs_for_ctas

            per_sm = -(-low["workers"] * self.colocated // self.sms)
            try:
                regs_for_ctas(per_sm, threads)
            except ValueError:
                return (f"resources: {per_sm} CTAs of {threads} threads per SM ({low['workers']} workers x "
                        f"{self.colocated} rank(s) on {self.sms} SMs) do not fit the register file")
        elem = 2 if self.dtype == "bf16" else 4
        smem = (kc.gemv_stages - 1) * kc.gemv_n * kc.gemv_k * elem if kc.gemv_stages > 1 else 0
        what = f"--gemv-stages {kc.gemv_stages} x --gemv-block {kc.gemv_block}"
        if kc.ring:
            from lowering.triton.ring import ring_smem

            smem += RING_BASE + ring_smem(kc.ring, kc.ring_rows * kc.ring_cols * 2)
            what += f" + --ring {kc.ring} pages of {kc.ring_rows}x{kc.ring_cols}"
        if smem > self.smem:
            return f"resources: {what} need {smem} B of shared memory per worker, the device has {self.smem} B"
        return None

    # -- moves -----------------------------------------------------------------------
    def values_around(self, name: str, current: Any) -> list[Any]:
        """The values a one-knob move of ``name`` from ``current`` tries: the adjacent values
        of an ordinal knob (a current value off the list: the nearest on each side), every
        other value of a categorical one."""
        k = self.knob(name)
        if not k.ordinal:
            return [v for v in k.values if v != current]
        vals = list(k.values)
        if current in vals:
            i = vals.index(current)
            return [vals[j] for j in (i - 1, i + 1) if 0 <= j < len(vals)]
        lower = [v for v in vals if v < current]
        higher = [v for v in vals if v > current]
        return ([max(lower)] if lower else []) + ([min(higher)] if higher else [])

    def neighbours(self, config: dict[str, Any], name: str) -> Iterator[dict[str, Any]]:
        """The one-knob moves of ``config`` along knob ``name``, built so that no knob does
        nothing: a move of a knob that does nothing at ``config``'s other knobs (``--ring-rows``
        without ``--ring``) is skipped, and a knob that the move leaves without effect
        (``--x-reuse`` after ``--x-stage 0``) goes back to its default with it."""
        for v in self.values_around(name, self.get(config, name)):
            cand = self.settle(self.with_value(config, name, v), keep=name)
            if cand is not None:
                yield cand

    def settle(self, config: dict[str, Any], keep: str | None = None) -> dict[str, Any] | None:
        """``config`` with every knob that does nothing set back to its default, or None when
        that knob is ``keep`` (the move itself would do nothing)."""
        from lowering.config import KernelConfig, LoweringConfig
        from lowering.knobs import inert

        out = {"lowering": dict(config["lowering"]), "kernel": dict(config["kernel"])}
        for part, cls in (("lowering", LoweringConfig), ("kernel", KernelConfig)):
            for _ in range(len(out[part]) + 1):
                try:
                    found = list(inert(cls(**out[part]), self.ranks))
                except TypeError:
                    return out  # an unknown field: screen() names it
                if not found:
                    break
                for k, _why in found:
                    if k.name == keep:
                        return None
                    out[part][k.name] = False if k.kind is bool else k.default
        return out

    def mutate(self, config: dict[str, Any], rng: random.Random, n_knobs: int = 2,
               names: list[str] | None = None) -> dict[str, Any]:
        """``config`` with ``n_knobs`` distinct knobs (of ``names``, default all) moved one step
        (an ordinal knob to an adjacent value, a categorical one to any other value)."""
        pool = [n for n in (names or self.names) if self.values_around(n, self.get(config, n))]
        out = config
        for n in rng.sample(pool, min(n_knobs, len(pool))):
            out = self.with_value(out, n, rng.choice(self.values_around(n, self.get(out, n))))
        return out

    def adapt(self, config: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
        """A config of another model shape, GPU or --tp made a candidate of this run: unknown
        fields dropped, the fixed fields set, then every knob whose value is refused or does
        nothing here set back to the default (the kernel part and the knobs that still
        validate are kept). Returns (candidate, the knobs set back, as ``name (why)``)."""
        from lowering.config import AmkConfig, KernelConfig, LoweringConfig

        dropped: list[str] = []
        parts = {}
        for part, cls in (("lowering", LoweringConfig), ("kernel", KernelConfig)):
            known = {f.name for f in fields(cls)}
            src = dict((config or {}).get(part) or {})
            parts[part] = {k: v for k, v in src.items() if k in known}
            dropped += [f"{k} (unknown field)" for k in src if k not in known]
        parts["lowering"].update({k: v for k, v in self.fixed.items() if k in ("dtype", "max_seq")})
        base = AmkConfig().to_json()
        for _ in range(64):
            cand = {p: {**base[p], **parts[p]} for p in parts}
            why = self._first_problem(cand)
            if why is None:
                return cand, dropped
            name, text = why
            part = "lowering" if name in base["lowering"] else "kernel"
            if parts[part].get(name, base[part][name]) == base[part][name]:
                break  # the default itself is refused: the knob's needs are elsewhere
            parts[part][name] = base[part][name]
            dropped.append(f"{name} ({text})")
        cand = {p: {**base[p], **parts[p]} for p in parts}
        return cand, dropped

    def _first_problem(self, cand: dict[str, Any]) -> tuple[str, str] | None:
        """(knob, why) of the first knob of ``cand`` that is refused or does nothing here."""
        from lowering.config import KernelConfig, LoweringConfig
        from lowering.knobs import inert, knobs_of

        for part, cls in (("lowering", LoweringConfig), ("kernel", KernelConfig)):
            for k in knobs_of(cls):
                why = k.problem(cand[part][k.name])
                if why:
                    return k.name, why
            obj = cls(**cand[part])
            for k, why in inert(obj, self.ranks):
                return k.name, why
            try:
                obj.validate("candidate", combinations=False)
            except AmkError as err:
                msg = str(err)
                for k in knobs_of(cls):
                    if f"'{k.name}'" in msg or f"{k.flag} " in msg:
                        return k.name, msg.removeprefix("candidate: ")
                return next(iter(cand[part])), msg
        for name, why in model_inert(self.qk_norm, cand["lowering"]):
            return name, why
        if cand["lowering"]["workers"] > self.max_workers:
            return "workers", f"more than the target's {self.max_workers} workers"
        res = self.resources(cand["lowering"], cand["kernel"])
        if res:
            base = KernelConfig()
            for n in ("ring", "gemv_stages", "gemv_unroll", "num_warps", "gemv_block"):
                if cand["kernel"][n] != getattr(base, n):
                    return n, res
            return "workers", res
        return None

