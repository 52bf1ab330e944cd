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
    reads each distinct one once); False builds fresh objects everywhere."""
    _SHARE[0] = share
    if reuse not in ("credit", "slots"):
        raise ValueError(f"reuse must be 'credit' or 'slots', got {reuse!r}")
    R, W, H, D = ranks, workers, hidden, head_dim
    hq, hk, ir = q_heads // R, kv_heads // R, inter // R
    if hq < 1 or hk < 1 or hq % hk or H % chunks or H % o_tiles or H % down_tiles:
        raise ValueError("sizes do not split evenly over ranks / tiles")
    slots = 2 if reuse == "slots" else 1
    nqkv = (hq + 2 * hk) * D
    prog = ScheduleProgram(
        name=f"synth-{R}r{W}w{layers}l-{reuse}", ranks=R, workers=W,
        target=Target(name="synthetic", sms=132, max_workers=132, backend="sim"),
        slots=slots, max_epochs=1 << 20, config={"synthetic": True, "reuse": reuse})
    B, C, T = prog.buffers, prog.counters, prog.tasks

    def buf(name, kind, shape, rank=0, sym=False, dt=dtype):
        B.append(Buffer(name, kind, dt, tuple(shape), "symmetric" if sym else "local",
                        None if sym else rank))

    shared: dict[tuple, tuple] = {}  # equal wait / signal tuples are one object (as parsed)

    def task(tid, r, w, op, ins=(), outs=(), params=None, waits=(), signals=(), group=None):
        waits, signals = tuple(waits), tuple(signals)
        if share:
            waits = shared.setdefault(waits, waits)
            signals = shared.setdefault(signals, signals)
        T.append(Task(tid, r, w, op, tuple(ins), tuple(outs), dict(params or {}),
                      waits, signals, group))

    def reg(name, r, *bounds):
        return Region(name, r, _r(*bounds))

    for r in range(R):
        buf(f"pos.r{r}", "io_input", (1,), r, dt="i32")
        buf(f"invf.r{r}", "weight", (D // 2,), r, dt="f32")
        buf(f"x0.r{r}", "io_input", (H,), r)
    for layer in range(layers):
        L = f"l{layer}"
        rx_shape = (2, R, H) if slots == 2 else (R, H)
        buf(f"{L}.rx1", "activation", rx_shape, sym=True)
        buf(f"{L}.rx2", "activation", rx_shape, sym=True)
        for r in range(R):
            S = f"{L}.r{r}"
            for nm, kind, shp in (("wn1", "weight", (H,)), ("wn2", "weight", (H,)),
                                  ("wqkv", "weight", (nqkv, H)), ("wo", "weight", (H, hq * D)),
                                  ("wgu", "weight", (2 * ir, H)), ("wd", "weight", (H, ir)),
                                  ("kc", "kv_cache", (hk, seq, D)),
                                  ("vc", "kv_cache", (hk, seq, D)),
                                  ("xn", "activation", (H,)), ("qkv", "activation", (nqkv,)),
                                  ("qr", "activation", (hq * D,)), ("kr", "activation", (hk * D,)),
                                  ("att", "activation", (hq * D,)), ("p1", "activation", (H,)),
                                  ("h", "activation", (H,)), ("hn", "activation", (H,)),
                                  ("gu", "activation", (2 * ir,)), ("act", "activation", (ir,)),
                                  ("p2", "activation", (H,)),
                                  ("x", "io_output" if layer == layers - 1 else "activation",
                                   (H,))):
                buf(f"{S}.{nm}", kind, shp, r)
            for nm in ("n1", "qkv", "att", "o", "ar1", "n2", "gu", "act", "down", "ar2"):
                C.append(Counter(f"{S}.c.{nm}", r))
            for a in ("a1", "a2"):
                for j in range(chunks):
                    if reuse == "credit":
                        C.append(Counter(f"{S}.c.{a}.{j}", r))
                        C.append(Counter(f"{S}.c.{a}.cr.{j}", r))
                    else:
                        for p in range(R):
                            if p != r:
                                C.append(Counter(f"{S}.c.{a}.{j}.from{p}", r))

    def tiles(r, n_rows, n_tiles, first_wait, make, sig):
        """Tile i on worker i % W; the first tile of each worker carries ``first_wait``."""
        step = n_rows // n_tiles
        for i in range(n_tiles):
            w = i % W
            waits = (first_wait,) if (first_wait is not None and i < W) else ()
            make(i, w, i * step, (i + 1) * step, waits, (Signal(sig, 1),))

    def allreduce(layer, r, a, src, resid, dst, wait, done_sig):
        """One-shot all-reduce of src (rank r's partial) into dst = sum + resid."""
        L = f"l{layer}"
        S = f"{L}.r{r}"
        rx = f"{L}.rx{a[-1]}"
        cw = H // chunks
        grp = f"{L}.{a}"
        for j in range(chunks):
            w = j % W
            c0, c1 = j * cw, (j + 1) * cw
            for k, p in enumerate(q for q in range(R) if q != r):
                waits = [wait] if k == 0 else []
                if reuse == "credit":
                    waits.append(Wait(f"{S}.c.{a}.cr.{j}", R - 1, -1))
                    dst_reg = reg(rx, p, (r, r + 1), (c0, c1))
                    sig = Signal(f"{L}.r{p}.c.{a}.{j}", 1)
                else:
                    dst_reg = reg(rx, p, (0, 1, 1), (r, r + 1), (c0, c1))
                    sig = Signal(f"{L}.r{p}.c.{a}.{j}.from{r}", 1)
                task(f"{S}.{a}.put{j}.to{p}", r, w, "put", [reg(src, r, (c0, c1))], [dst_reg],
                     waits=waits, signals=[sig], group=grp)
            own = reg(rx, r, (r, r + 1), (c0, c1)) if slots == 1 else \
                reg(rx, r, (0, 1, 1), (r, r + 1), (c0, c1))
            task(f"{S}.{a}.self{j}", r, w, "copy", [reg(src, r, (c0, c1))], [own],
                 waits=[wait] if R == 1 else [], group=grp)
            if reuse == "credit":
                rwaits = [Wait(f"{S}.c.{a}.{j}", R - 1)] if R > 1 else []
                credits = [Signal(f"{L}.r{p}.c.{a}.cr.{j}", 1) for p in range(R) if p != r]
                allp = reg(rx, r, (0, R), (c0, c1))
            else:
                rwaits = [Wait(f"{S}.c.{a}.{j}.from{p}", 1) for p in range(R) if p != r]
                credits = []
                allp = reg(rx, r, (0, 1, 1), (0, R), (c0, c1))
            task(f"{S}.{a}.sum{j}", r, w, "reduce", [allp, reg(resid, r, (c0, c1))],
                 [reg(dst, r, (c0, c1))], waits=rwaits,
                 signals=credits + [Signal(done_sig, 1)], group=grp)

    for layer in range(layers):
        L = f"l{layer}"
        for r in range(R):
            S = f"{L}.r{r}"
            xin = f"x0.r{r}" if layer == 0 else f"l{layer - 1}.r{r}.x"
            w_in = [] if layer == 0 else [Wait(f"l{layer - 1}.r{r}.c.ar2", chunks)]
            task(f"{S}.n1", r, 0, "rmsnorm", [reg(xin, r, (0, H)), reg(f"{S}.wn1", r, (0, H))],
                 [reg(f"{S}.xn", r, (0, H))], {"dim": H, "eps": 1e-5}, w_in,
                 [Signal(f"{S}.c.n1", 1)])

            def qkv(i, w, a, b, waits, sig, S=S, r=r):
                task(f"{S}.qkv{i}", r, w, "gemv",
                     [reg(f"{S}.xn", r, (0, H)), reg(f"{S}.wqkv", r, (a, b), (0, H))],
                     [reg(f"{S}.qkv", r, (a, b))], waits=waits, signals=sig)
            tiles(r, nqkv, qkv_tiles, Wait(f"{S}.c.n1", 1), qkv, f"{S}.c.qkv")
            gq = hq // hk
            for g in range(hk):
                w = g % W
                q0, q1 = g * gq * D, (g + 1) * gq * D
                k0, k1 = hq * D + g * D, hq * D + (g + 1) * D
                v0, v1 = (hq + hk) * D + g * D, (hq + hk) * D + (g + 1) * D
                pos = reg(f"pos.r{r}", r, (0, 1))
                task(f"{S}.ropeq{g}", r, w, "rope",
                     [reg(f"{S}.qkv", r, (q0, q1)), reg(f"invf.r{r}", r, (0, D // 2)), pos],
                     [reg(f"{S}.qr", r, (q0, q1))], {"head_dim": D},
                     [Wait(f"{S}.c.qkv", qkv_tiles)])
                task(f"{S}.ropek{g}", r, w, "rope",
                     [reg(f"{S}.qkv", r, (k0, k1)), reg(f"invf.r{r}", r, (0, D // 2)), pos],
                     [reg(f"{S}.kr", r, (g * D, (g + 1) * D))], {"head_dim": D})
                task(f"{S}.kv{g}", r, w, "kv_append",
                     [reg(f"{S}.kr", r, (g * D, (g + 1) * D)), reg(f"{S}.qkv", r, (v0, v1)), pos],
                     [reg(f"{S}.kc", r, (g, g + 1), (0, seq), (0, D)),
                      reg(f"{S}.vc", r, (g, g + 1), (0, seq), (0, D))], {"head_dim": D})
                task(f"{S}.attn{g}", r, w, "attention",
                     [reg(f"{S}.qr", r, (q0, q1)),
                      reg(f"{S}.kc", r, (g, g + 1), (0, seq), (0, D)),
                      reg(f"{S}.vc", r, (g, g + 1), (0, seq), (0, D)), pos],
                     [reg(f"{S}.att", r, (q0, q1))], {"head_dim": D, "scale": D ** -0.5},
                     signals=[Signal(f"{S}.c.att", 1)])

            def oproj(i, w, a, b, waits, sig, S=S, r=r):
                task(f"{S}.o{i}", r, w, "gemv",
                     [reg(f"{S}.att", r, (0, hq * D)), reg(f"{S}.wo", r, (a, b), (0, hq * D))],
                     [reg(f"{S}.p1", r, (a, b))], waits=waits, signals=sig)
            tiles(r, H, o_tiles, Wait(f"{S}.c.att", hk), oproj, f"{S}.c.o")
        for r in range(R):
            S = f"{L}.r{r}"
            xin = f"x0.r{r}" if layer == 0 else f"l{layer - 1}.r{r}.x"
            allreduce(layer, r, "a1", f"{S}.p1", xin, f"{S}.h", Wait(f"{S}.c.o", o_tiles),
                      f"{S}.c.ar1")
        for r in range(R):
            S = f"{L}.r{r}"
            task(f"{S}.n2", r, 0, "rmsnorm", [reg(f"{S}.h", r, (0, H)),
                                              reg(f"{S}.wn2", r, (0, H))],
                 [reg(f"{S}.hn", r, (0, H))], {"dim": H, "eps": 1e-5},
                 [Wait(f"{S}.c.ar1", chunks)], [Signal(f"{S}.c.n2", 1)])

            def gu(i, w, a, b, waits, sig, S=S, r=r):
                task(f"{S}.gu{i}", r, w, "gemv",
                     [reg(f"{S}.hn", r, (0, H)), reg(f"{S}.wgu", r, (a, b), (0, H))],
                     [reg(f"{S}.gu", r, (a, b))], waits=waits, signals=sig)
            tiles(r, 2 * ir, gu_tiles, Wait(f"{S}.c.n2", 1), gu, f"{S}.c.gu")

            def act(i, w, a, b, waits, sig, S=S, r=r):
                task(f"{S}.act{i}", r, w, "silu_mul",
                     [reg(f"{S}.gu", r, (a, b)), reg(f"{S}.gu", r, (ir + a, ir + b))],
                     [reg(f"{S}.act", r, (a, b))], waits=waits, signals=sig)
            tiles(r, ir, act_tiles, Wait(f"{S}.c.gu", gu_tiles), act, f"{S}.c.act")

            def down(i, w, a, b, waits, sig, S=S, r=r):
                task(f"{S}.d{i}", r, w, "gemv",
                     [reg(f"{S}.act", r, (0, ir)), reg(f"{S}.wd", r, (a, b), (0, ir))],
                     [reg(f"{S}.p2", r, (a, b))], waits=waits, signals=sig)
            tiles(r, H, down_tiles, Wait(f"{S}.c.act", act_tiles), down, f"{S}.c.down")
        for r in range(R):
            S = f"{L}.r{r}"
            allreduce(layer, r, "a2", f"{S}.p2", f"{S}.h", f"{S}.x",
                      Wait(f"{S}.c.down", down_tiles), f"{S}.c.ar2")
    return prog


def schedule_for_tasks(target_tasks: int, ranks: int = 4, workers: int = 64,
                       reuse: str = "credit", share: bool = True) -> ScheduleProgram:
    """The synthetic schedule with the number of layers that reaches ``target_tasks``."""
    one = len(transformer_schedule(ranks, workers, 1, reuse=reuse).tasks)
    layers = max(1, -(-target_tasks // one))
    return transformer_schedule(ranks, workers, layers, reuse=reuse, share=share)
