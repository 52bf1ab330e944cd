"""Synthetic large schedules shaped like a tensor-parallel decoder lowering (for benchmarks).

``transformer_schedule(ranks, workers, layers, ...)`` builds a valid ScheduleProgram with, per
layer and rank: RMSNorm, q/k/v GEMV tiles spread over all workers, per-KV-head RoPE /
KV-append / decode attention, o-projection tiles producing a partial sum, a one-shot
all-reduce (chunked; every chunk is put to every peer with put-with-signal, copied locally,
and reduced with the residual), RMSNorm, gate/up tiles, SiLU*mul tiles, down tiles and a
second all-reduce. Counters sequence the phases; all-reduce receive buffers are made safe
across decode steps with credits (``reuse="credit"``: one slot, the reducer returns a credit
to every writer) or with double buffering (``reuse="slots"``: two slots and one arrival
counter per (destination, source) pair, because a counter shared by several sources can be
satisfied by a fast rank's next-step signal).

Objects are built directly (no string parsing) so 150k+ tasks build in a few seconds.
The program is realistic in shape, not a numerically meaningful model.
"""

from __future__ import annotations

from ir.program import (
    Bound, Buffer, Counter, Range, Region, ScheduleProgram, Signal, Target, Task, Wait,
)


_RANGES: dict[tuple, tuple[Range, ...]] = {}
_SHARE = [True]


def _r(*bounds) -> tuple[Range, ...]:
    """The ranges tuple for ``bounds``; equal tuples are one shared object, as the text
    parser (ir/text.py) produces them (unless built with ``share=False``)."""
    got = _RANGES.get(bounds) if _SHARE[0] else None
    if got is not None:
        return got
    out = []
    for b in bounds:
        if len(b) == 2:
            out.append(Range(Bound(b[0]), Bound(b[1])))
        else:  # (start_const, stop_const, slot_coef)
            out.append(Range(Bound(b[0], b[2]), Bound(b[1], b[2])))
    got = _RANGES[bounds] = tuple(out)
    return got


def transformer_schedule(ranks: int = 4, workers: int = 64, layers: int = 50,
                         hidden: int = 2048, inter: int = 8192, head_dim: int = 64,
                         q_heads: int = 32, kv_heads: int = 8, seq: int = 1024,
                         qkv_tiles: int = 128, o_tiles: int = 128, gu_tiles: int = 256,
                         act_tiles: int = 64, down_tiles: int = 128, chunks: int = 8,
                         reuse: str = "credit", dtype: str = "bf16",
                         share: bool = True) -> ScheduleProgram:
    """A valid synthetic decode-step schedule; see the module doc. Sizes are per model;
    heads and the intermediate size are split evenly over ``ranks``. ``share``: equal
    range, wait and signal tuples are one object, as ir/text.py parses them (the validator
    reads each distinct one once); False builds fresh objects everywhere.

    Raises ValueError for an unknown ``reuse`` or sizes that do not split evenly."""
    _SHARE[0] = share
    if reuse not in ("credit", "slots"):
        raise ValueError(f"reuse must be 'credit' or 'slots', got {reuse!r}")
    hq, hk = q_heads // ranks, kv_heads // ranks
    if hq < 1 or hk < 1 or hq % hk or hidden % chunks or hidden % o_tiles or hidden % down_tiles:
        raise ValueError("sizes do not split evenly over ranks / tiles")
    syn = _Synth(ranks, workers, hidden, inter, head_dim, q_heads, kv_heads, seq,
                 dict(qkv=qkv_tiles, o=o_tiles, gu=gu_tiles, act=act_tiles, down=down_tiles),
                 chunks, reuse, dtype, share, layers)
    syn.declare()
    for layer in range(layers):
        syn.layer(layer)
    return syn.prog


class _Synth:
    """Builds the synthetic schedule: declarations, then per layer the attention half, the
    first all-reduce, the MLP half and the second all-reduce (module doc)."""

    def __init__(self, R, W, H, inter, D, q_heads, kv_heads, seq, tiles, chunks, reuse, dtype,
                 share, layers):
        self.R, self.W, self.H, self.D, self.seq = R, W, H, D, seq
        self.hq, self.hk, self.ir = q_heads // R, kv_heads // R, inter // R
        self.tiles_of, self.chunks, self.reuse, self.dtype = tiles, chunks, reuse, dtype
        self.share, self.layers = share, layers
        self.slots = 2 if reuse == "slots" else 1
        self.nqkv = (self.hq + 2 * self.hk) * D
        self.prog = ScheduleProgram(
            name=f"synth-{R}r{W}w{layers}l-{reuse}", ranks=R, workers=W,
            target=Target(name="synthetic", sms=132, max_workers=132, backend="sim"),
            slots=self.slots, max_epochs=1 << 20,
            config={"synthetic": True, "reuse": reuse})
        self.shared: dict[tuple, tuple] = {}  # equal wait / signal tuples: one object

    # -- primitives --
    def buf(self, name, kind, shape, rank=0, sym=False, dt=None):
        self.prog.buffers.append(Buffer(name, kind, dt or self.dtype, tuple(shape),
                                        "symmetric" if sym else "local", None if sym else rank))

    def task(self, tid, r, w, op, ins=(), outs=(), params=None, waits=(), signals=(),
             group=None):
        waits, signals = tuple(waits), tuple(signals)
        if self.share:
            waits = self.shared.setdefault(waits, waits)
            signals = self.shared.setdefault(signals, signals)
        self.prog.tasks.append(Task(tid, r, w, op, tuple(ins), tuple(outs), dict(params or {}),
                                    waits, signals, group))

    @staticmethod
    def reg(name, r, *bounds):
        return Region(name, r, _r(*bounds))

    # -- declarations --
    def declare(self) -> None:
        """Every buffer and counter: per rank the inputs, per layer and rank the weights,
        caches, activations and phase counters, per layer the all-reduce receive buffers."""
        R, H, D = self.R, self.H, self.D
        for r in range(R):
            self.buf(f"pos.r{r}", "io_input", (1,), r, dt="i32")
            self.buf(f"invf.r{r}", "weight", (D // 2,), r, dt="f32")
            self.buf(f"x0.r{r}", "io_input", (H,), r)
        for layer in range(self.layers):
            rx_shape = (2, R, H) if self.slots == 2 else (R, H)
            self.buf(f"l{layer}.rx1", "activation", rx_shape, sym=True)
            self.buf(f"l{layer}.rx2", "activation", rx_shape, sym=True)
            for r in range(R):
                for nm, kind, shp in self._rank_buffers(layer):
                    self.buf(f"l{layer}.r{r}.{nm}", kind, shp, r)
                self._counters(f"l{layer}.r{r}", r)

    def _rank_buffers(self, layer: int) -> list[tuple[str, str, tuple]]:
        H, D, hq, hk, ir = self.H, self.D, self.hq, self.hk, self.ir
        last = layer == self.layers - 1
        return [("wn1", "weight", (H,)), ("wn2", "weight", (H,)),
                ("wqkv", "weight", (self.nqkv, H)), ("wo", "weight", (H, hq * D)),
                ("wgu", "weight", (2 * ir, H)), ("wd", "weight", (H, ir)),
                ("kc", "kv_cache", (hk, self.seq, D)), ("vc", "kv_cache", (hk, self.seq, D)),
                ("xn", "activation", (H,)), ("qkv", "activation", (self.nqkv,)),
                ("qr", "activation", (hq * D,)), ("kr", "activation", (hk * D,)),
                ("att", "activation", (hq * D,)), ("p1", "activation", (H,)),
                ("h", "activation", (H,)), ("hn", "activation", (H,)),
                ("gu", "activation", (2 * ir,)), ("act", "activation", (ir,)),
                ("p2", "activation", (H,)), ("x", "io_output" if last else "activation", (H,))]

    def _counters(self, S: str, r: int) -> None:
        """Phase counters of rank ``r`` in one layer, and the all-reduce arrival (and credit)
        counters: per chunk one (credits), or one per source rank (double buffering)."""
        C = self.prog.counters
        for nm in ("n1", "qkv", "att", "o", "ar1", "n2", "gu", "act", "down", "ar2"):
            C.append(Counter(f"{S}.c.{nm}", r))
        for a in ("a1", "a2"):
            for j in range(self.chunks):
                if self.reuse == "credit":
                    C.append(Counter(f"{S}.c.{a}.{j}", r))
                    C.append(Counter(f"{S}.c.{a}.cr.{j}", r))
                else:
                    for p in range(self.R):
                        if p != r:
                            C.append(Counter(f"{S}.c.{a}.{j}.from{p}", r))

    # -- one layer --
    def layer(self, layer: int) -> None:
        """Attention on every rank, all-reduce, MLP on every rank, all-reduce."""
        R = self.R
        for r in range(R):
            self._attention(layer, r)
        for r in range(R):
            S = f"l{layer}.r{r}"
            self._allreduce(layer, r, "a1", f"{S}.p1", self._layer_input(layer, r), f"{S}.h",
                            Wait(f"{S}.c.o", self.tiles_of["o"]), f"{S}.c.ar1")
        for r in range(R):
            self._mlp(layer, r)
        for r in range(R):
            S = f"l{layer}.r{r}"
            self._allreduce(layer, r, "a2", f"{S}.p2", f"{S}.h", f"{S}.x",
                            Wait(f"{S}.c.down", self.tiles_of["down"]), f"{S}.c.ar2")

    @staticmethod
    def _layer_input(layer: int, r: int) -> str:
        return f"x0.r{r}" if layer == 0 else f"l{layer - 1}.r{r}.x"

    def _tiles(self, r, n_rows, n_tiles, first_wait, make, sig):
        """Tile i on worker i % W; the first tile of each worker carries ``first_wait``."""
        step = n_rows // n_tiles
        for i in range(n_tiles):
            w = i % self.W
            waits = (first_wait,) if (first_wait is not None and i < self.W) else ()
            make(i, w, i * step, (i + 1) * step, waits, (Signal(sig, 1),))

    def _gemv_tiles(self, r, name, x, x_len, wname, out, n_rows, key, first_wait, S):
        """``n_rows`` output rows of ``out = wname @ x`` in ``tiles_of[key]`` GEMV tiles."""
        reg = self.reg

        def make(i, w, a, b, waits, sig):
            self.task(f"{S}.{name}{i}", r, w, "gemv",
                      [reg(x, r, (0, x_len)), reg(wname, r, (a, b), (0, x_len))],
                      [reg(out, r, (a, b))], waits=waits, signals=sig)
        self._tiles(r, n_rows, self.tiles_of[key], first_wait, make, f"{S}.c.{key}")

    def _attention(self, layer: int, r: int) -> None:
        """RMSNorm, q/k/v GEMV tiles, per KV head RoPE / KV append / attention, and the
        o-projection tiles producing rank r's partial sum p1."""
        S, H, D, hq, hk, reg = f"l{layer}.r{r}", self.H, self.D, self.hq, self.hk, self.reg
        w_in = [] if layer == 0 else [Wait(f"l{layer - 1}.r{r}.c.ar2", self.chunks)]
        self.task(f"{S}.n1", r, 0, "rmsnorm",
                  [reg(self._layer_input(layer, r), r, (0, H)), reg(f"{S}.wn1", r, (0, H))],
                  [reg(f"{S}.xn", r, (0, H))], {"dim": H, "eps": 1e-5}, w_in,
                  [Signal(f"{S}.c.n1", 1)])
        self._gemv_tiles(r, "qkv", f"{S}.xn", H, f"{S}.wqkv", f"{S}.qkv", self.nqkv, "qkv",
                         Wait(f"{S}.c.n1", 1), S)
        for g in range(hk):
            self._head(S, r, g)
        self._gemv_tiles(r, "o", f"{S}.att", hq * D, f"{S}.wo", f"{S}.p1", H, "o",
                         Wait(f"{S}.c.att", hk), S)

    def _head(self, S: str, r: int, g: int) -> None:
        """KV head g of rank r: RoPE of its q heads and k, KV append, decode attention."""
        D, hq, hk, seq, reg = self.D, self.hq, self.hk, self.seq, self.reg
        w, gq = g % self.W, hq // hk
        q0, q1 = g * gq * D, (g + 1) * gq * D
        k0, k1 = hq * D + g * D, hq * D + (g + 1) * D
        v0, v1 = (hq + hk) * D + g * D, (hq + hk) * D + (g + 1) * D
        pos = reg(f"pos.r{r}", r, (0, 1))

        def invf():
            return reg(f"invf.r{r}", r, (0, D // 2))

        def cache(name):
            return reg(f"{S}.{name}", r, (g, g + 1), (0, seq), (0, D))
        self.task(f"{S}.ropeq{g}", r, w, "rope", [reg(f"{S}.qkv", r, (q0, q1)), invf(), pos],
                  [reg(f"{S}.qr", r, (q0, q1))], {"head_dim": D},
                  [Wait(f"{S}.c.qkv", self.tiles_of["qkv"])])
        self.task(f"{S}.ropek{g}", r, w, "rope", [reg(f"{S}.qkv", r, (k0, k1)), invf(), pos],
                  [reg(f"{S}.kr", r, (g * D, (g + 1) * D))], {"head_dim": D})
        self.task(f"{S}.kv{g}", r, w, "kv_append",
                  [reg(f"{S}.kr", r, (g * D, (g + 1) * D)), reg(f"{S}.qkv", r, (v0, v1)), pos],
                  [cache("kc"), cache("vc")], {"head_dim": D})
        self.task(f"{S}.attn{g}", r, w, "attention",
                  [reg(f"{S}.qr", r, (q0, q1)), cache("kc"), cache("vc"), pos],
                  [reg(f"{S}.att", r, (q0, q1))], {"head_dim": D, "scale": D ** -0.5},
                  signals=[Signal(f"{S}.c.att", 1)])

    def _mlp(self, layer: int, r: int) -> None:
        """RMSNorm, gate/up GEMV tiles, SiLU*mul tiles and down tiles (partial sum p2)."""
        S, H, ir, reg, tiles = f"l{layer}.r{r}", self.H, self.ir, self.reg, self.tiles_of
        self.task(f"{S}.n2", r, 0, "rmsnorm", [reg(f"{S}.h", r, (0, H)),
                                               reg(f"{S}.wn2", r, (0, H))],
                  [reg(f"{S}.hn", r, (0, H))], {"dim": H, "eps": 1e-5},
                  [Wait(f"{S}.c.ar1", self.chunks)], [Signal(f"{S}.c.n2", 1)])
        self._gemv_tiles(r, "gu", f"{S}.hn", H, f"{S}.wgu", f"{S}.gu", 2 * ir, "gu",
                         Wait(f"{S}.c.n2", 1), S)

        def act(i, w, a, b, waits, sig):
            self.task(f"{S}.act{i}", r, w, "silu_mul",
                      [reg(f"{S}.gu", r, (a, b)), reg(f"{S}.gu", r, (ir + a, ir + b))],
                      [reg(f"{S}.act", r, (a, b))], waits=waits, signals=sig)
        self._tiles(r, ir, tiles["act"], Wait(f"{S}.c.gu", tiles["gu"]), act, f"{S}.c.act")
        self._gemv_tiles(r, "d", f"{S}.act", ir, f"{S}.wd", f"{S}.p2", H, "down",
                         Wait(f"{S}.c.act", tiles["act"]), S)

    def _allreduce(self, layer, r, a, src, resid, dst, wait, done_sig):
        """One-shot all-reduce of src (rank r's partial) into dst = sum + resid: per chunk,
        a put to every peer, a local copy, and the reduction."""
        S, grp, cw = f"l{layer}.r{r}", f"l{layer}.{a}", self.H // self.chunks
        rx = f"l{layer}.rx{a[-1]}"
        for j in range(self.chunks):
            w, c0, c1 = j % self.W, j * cw, (j + 1) * cw
            self._puts(layer, r, a, src, rx, j, w, c0, c1, wait, grp)
            own = self.reg(rx, r, (r, r + 1), (c0, c1)) if self.slots == 1 else \
                self.reg(rx, r, (0, 1, 1), (r, r + 1), (c0, c1))
            self.task(f"{S}.{a}.self{j}", r, w, "copy", [self.reg(src, r, (c0, c1))], [own],
                      waits=[wait] if self.R == 1 else [], group=grp)
            self._reduce(layer, r, a, rx, j, w, c0, c1, resid, dst, done_sig, grp)

    def _puts(self, layer, r, a, src, rx, j, w, c0, c1, wait, grp) -> None:
        """Chunk j of rank r's partial put to every peer's receive buffer, with its arrival
        signal (and, with credits, a wait for the peer's credit of the previous step)."""
        R, S, L = self.R, f"l{layer}.r{r}", f"l{layer}"
        for k, p in enumerate(q for q in range(R) if q != r):
            waits = [wait] if k == 0 else []
            if self.reuse == "credit":
                waits.append(Wait(f"{S}.c.{a}.cr.{j}", R - 1, -1))
                dst_reg = self.reg(rx, p, (r, r + 1), (c0, c1))
                sig = Signal(f"{L}.r{p}.c.{a}.{j}", 1)
            else:
                dst_reg = self.reg(rx, p, (0, 1, 1), (r, r + 1), (c0, c1))
                sig = Signal(f"{L}.r{p}.c.{a}.{j}.from{r}", 1)
            self.task(f"{S}.{a}.put{j}.to{p}", r, w, "put", [self.reg(src, r, (c0, c1))],
                      [dst_reg], waits=waits, signals=[sig], group=grp)

    def _reduce(self, layer, r, a, rx, j, w, c0, c1, resid, dst, done_sig, grp) -> None:
        """The reduction of chunk j once every peer's part arrived; with credits it returns
        one to every writer."""
        R, L, S = self.R, f"l{layer}", f"l{layer}.r{r}"
        if self.reuse == "credit":
            rwaits = [Wait(f"{S}.c.{a}.{j}", R - 1)] if R > 1 else []
            credits = [Signal(f"{L}.r{p}.c.{a}.cr.{j}", 1) for p in range(R) if p != r]
            allp = self.reg(rx, r, (0, R), (c0, c1))
        else:
            rwaits = [Wait(f"{S}.c.{a}.{j}.from{p}", 1) for p in range(R) if p != r]
            credits = []
            allp = self.reg(rx, r, (0, 1, 1), (0, R), (c0, c1))
        self.task(f"{S}.{a}.sum{j}", r, w, "reduce", [allp, self.reg(resid, r, (c0, c1))],
                  [self.reg(dst, r, (c0, c1))], waits=rwaits,
                  signals=credits + [Signal(done_sig, 1)], group=grp)


def schedule_for_tasks(target_tasks: int, ranks: int = 4, workers: int = 64,
                       reuse: str = "credit", share: bool = True) -> ScheduleProgram:
    """The synthetic schedule with the number of layers that reaches ``target_tasks``."""
    one = len(transformer_schedule(ranks, workers, 1, reuse=reuse).tasks)
    layers = max(1, -(-target_tasks // one))
    return transformer_schedule(ranks, workers, layers, reuse=reuse, share=share)
