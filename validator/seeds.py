"""Hand-built valid multi-rank schedules: seeds of the adversarial corpus (validator/corpus.py).

Each builder returns a small ``ScheduleProgram`` that is safe under the semantics of
ir/program.py for any number of decode steps (checked by tests/test_oracle.py with the
oracle and, once it exists, by the static validator). They exercise the patterns that the
mutations of the corpus break:

* ``allreduce_per_source``: one-shot all-reduce, double-buffered receive slots, one arrival
  counter per (destination, source) pair, reduce split in column tiles over workers. (With
  a single arrival counter per rank and three or more ranks, a peer one step ahead can
  satisfy a slow rank's wait with its next-step signal while another peer's put is still
  in flight: ``shared_arrival_allreduce`` builds that unsafe variant for tests.)
* ``mini_block``: rmsnorm -> gemv tiles over several workers -> one-shot all-reduce ->
  reduce tiles with the residual, twice (two collectives per step), with either slots and
  per-source counters or one slot and credits.
* ``allgather``: every rank puts its vector into every peer's gather buffer.
* ``argmax``: vocabulary-parallel lm_head tiles, a local argmax, an exchange of
  (value, index) pairs and ``argmax_combine`` on every rank.
* ``pipeline``: a rank-to-rank pipeline whose chunked puts are completed by ``quiet``
  (chunks spread over workers, then a local counter and a relay signal) or by ``fence``
  (chunks on one worker, then a signal to the same destination), with credits.
* ``ring_allgather``: a ring in which each rank forwards chunks to its successor; a
  ``fence`` between steps orders the puts so that one counter can be waited on step by
  step; credits guard reuse.
* ``relay_broadcast``: rank 0 puts to every peer, ``quiet``, then a signal chain 0 -> 1 ->
  2 -> ... through which every peer learns its data arrived.
* ``two_collectives``: an all-reduce then an independent all-gather, in the same order on
  every rank (the seed of the collective-order mutation).

``seed_programs()`` returns the whole list used by the corpus.
"""

from __future__ import annotations

from ir.builder import ProgramBuilder
from ir.examples import allreduce
from ir.program import ScheduleProgram, Target

_TARGET = Target(name="generic", sms=132, max_workers=8)


def _rows(n: int, parts: int) -> list[tuple[int, int]]:
    """Split ``range(n)`` into ``parts`` contiguous non-empty blocks (sizes differ by <= 1)."""
    parts = max(1, min(parts, n))
    q, rem = divmod(n, parts)
    out, a = [], 0
    for i in range(parts):
        b = a + q + (1 if i < rem else 0)
        out.append((a, b))
        a = b
    return out


def _allreduce_buffers(b: ProgramBuilder, ranks: int, n: int) -> None:
    """A double-buffered one-shot all-reduce's buffers: the symmetric receive slots
    ``rx[2, ranks, n]`` and per rank the input ``x.rR[n]`` and the output ``y.rR[n]``."""
    b.buffer("rx", "activation", "f32", (2, ranks, n), placement="symmetric")
    for r in range(ranks):
        b.buffer(f"x.r{r}", "io_input", "f32", (n,), rank=r)
        b.buffer(f"y.r{r}", "io_output", "f32", (n,), rank=r)


def _per_source(b: ProgramBuilder, r: int, ranks: int, name: str) -> None:
    """Rank r's arrival counters ``c.<name>.rR.fP``: one per source rank p != r."""
    for p in range(ranks):
        if p != r:
            b.counter(f"c.{name}.r{r}.f{p}", r)


def _exchange(b: ProgramBuilder, r: int, ranks: int, workers: int, n: int, src: str, dst: str,
              tasks: tuple[str, str], arrive: str, done: str, group: str) -> list[int]:
    """Rank r's half of a one-shot exchange into row r of slot ``s`` of the symmetric
    ``dst``: a put of ``src`` to every peer p (worker i % workers, signalling
    ``c.<arrive>.rP.fR`` there) and the copy into its own row (worker 0, signalling
    ``done``). ``tasks``: the put and copy task names. Returns the peers."""
    peers = [p for p in range(ranks) if p != r]
    for i, p in enumerate(peers):
        b.task(f"{tasks[0]}.r{r}.to{p}", r, i % workers, "put", ins=[f"{src}[0:{n}]"],
               outs=[f"{dst}@{p}[s:s+1, {r}:{r + 1}, 0:{n}]"],
               signals=[f"c.{arrive}.r{p}.f{r}+=1"], group=group)
    b.task(f"{tasks[1]}.r{r}", r, 0, "copy", ins=[f"{src}[0:{n}]"],
           outs=[f"{dst}[s:s+1, {r}:{r + 1}, 0:{n}]"], signals=[f"{done}+=1"], group=group)
    return peers


def allreduce_per_source(ranks: int = 3, n: int = 4, workers: int = 1) -> ScheduleProgram:
    """One-shot all-reduce with receive slots (``s = epoch mod 2``) and one arrival counter
    per (destination, source) pair, so a wait counts only its own source's puts.

    Buffers: ``x.rR`` (io_input [n]), ``rx`` (symmetric [2, ranks, n]), ``y.rR`` (io_output
    [n]). Counters: ``c.rx.rD.fS`` owned by D; ``c.self.rR`` for the local copy when the
    reduce runs on another worker."""
    b = ProgramBuilder(f"ar-persrc-{ranks}r{workers}w", ranks, workers, target=_TARGET, slots=2,
                       config={"allreduce": "oneshot", "reuse": "slots", "counters": "per-source"})
    _allreduce_buffers(b, ranks, n)
    for r in range(ranks):
        b.counter(f"c.self.r{r}", r)
        _per_source(b, r, ranks, "rx")
    for r in range(ranks):
        peers = _exchange(b, r, ranks, workers, n, f"x.r{r}", "rx", ("put", "self"), "rx",
                          f"c.self.r{r}", "ar")
        # Column tiles of >= 2 elements: ir/ops.py compares squeezed shapes, so a [k, 1]
        # partials region squeezes to (k,) and cannot reduce into one element.
        for j, (a, e) in enumerate(_rows(n, min(workers, max(1, n // 2)))):
            waits = [f"c.rx.r{r}.f{p}>=1" for p in peers] + [f"c.self.r{r}>=1"]
            b.task(f"sum.r{r}.{j}", r, j % workers, "reduce", ins=[f"rx[s:s+1, 0:{ranks}, {a}:{e}]"],
                   outs=[f"y.r{r}[{a}:{e}]"], waits=waits, group="ar")
    return b.build()


def shared_arrival_allreduce(ranks: int = 3, n: int = 4) -> ScheduleProgram:
    """UNSAFE for ``ranks >= 3`` (a reference for tests, not a seed): the one-shot
    all-reduce with double-buffered slots but ONE arrival counter per rank, waited for in
    full (``ranks - 1``). Counters are never reset and ranks drift: a peer that already
    finished step e can put step e+1's data (into the other slot) and signal, which
    satisfies a slow rank's step-e wait while a third rank's step-e put is still pending."""
    b = ProgramBuilder(f"ar-shared-{ranks}r", ranks, 1, target=_TARGET, slots=2,
                       config={"allreduce": "oneshot", "reuse": "slots", "counters": "shared"})
    _allreduce_buffers(b, ranks, n)
    for r in range(ranks):
        b.counter(f"c.rx.r{r}", r)
    for r in range(ranks):
        for p in range(ranks):
            if p != r:
                b.task(f"put.r{r}.to{p}", r, 0, "put", ins=[f"x.r{r}[0:{n}]"],
                       outs=[f"rx@{p}[s:s+1, {r}:{r + 1}, 0:{n}]"], signals=[f"c.rx.r{p}+=1"],
                       group="ar")
        b.task(f"self.r{r}", r, 0, "copy", ins=[f"x.r{r}[0:{n}]"],
               outs=[f"rx[s:s+1, {r}:{r + 1}, 0:{n}]"], group="ar")
        b.task(f"sum.r{r}", r, 0, "reduce", ins=[f"rx[s:s+1, 0:{ranks}, 0:{n}]"],
               outs=[f"y.r{r}[0:{n}]"], waits=[f"c.rx.r{r}>={ranks - 1}"], group="ar")
    return b.build()


def mini_block(ranks: int = 2, workers: int = 2, hidden: int = 8, tile: int = 4,
               reuse: str = "slots", stages: int = 2) -> ScheduleProgram:
    """``stages`` transformer-like sub-blocks per step: rmsnorm -> row-tiled gemv partials
    on several workers -> one-shot all-reduce of the partials -> column-tiled reduce with
    the residual. ``reuse``: ``slots`` (double-buffered receive slots, per-source arrival
    counters) or ``credit`` (one slot, one arrival counter per rank, credits returned by
    every reduce tile to every writer). Collective groups: ``ar.1`` .. ``ar.<stages>``."""
    if reuse not in ("slots", "credit"):
        raise ValueError(f"reuse must be 'slots' or 'credit', got {reuse!r}")
    H, R, W = hidden, ranks, workers
    slots = 2 if reuse == "slots" else 1
    b = ProgramBuilder(f"mini-block-{R}r{W}w-{reuse}", R, W, target=_TARGET, slots=slots,
                       config={"allreduce": "oneshot", "reuse": reuse, "tile": tile})
    tiles = _rows(H, max(1, H // tile))
    red = _rows(H, min(W, 2))
    sl = "s:s+1, " if slots == 2 else ""
    for k in range(1, stages + 1):
        shape = (2, R, H) if slots == 2 else (R, H)
        b.buffer(f"rx{k}", "activation", "f32", shape, placement="symmetric")
    for r in range(R):
        b.buffer(f"x.r{r}", "io_input", "f32", (H,), rank=r)
        for k in range(1, stages + 1):
            b.buffer(f"ln{k}.r{r}", "weight", "f32", (H,), rank=r)
            b.buffer(f"w{k}.r{r}", "weight", "f32", (H, H), rank=r)
            b.buffer(f"h{k}.r{r}", "activation", "f32", (H,), rank=r)
            b.buffer(f"part{k}.r{r}", "activation", "f32", (H,), rank=r)
            b.buffer(f"y{k}.r{r}", "io_output" if k == stages else "activation", "f32", (H,), rank=r)
            for c in ("h", "part", "self", "y"):
                b.counter(f"c.{c}{k}.r{r}", r)
            if reuse == "slots":
                _per_source(b, r, R, f"rx{k}")
            else:
                b.counter(f"c.rx{k}.r{r}", r)
                b.counter(f"c.cr{k}.r{r}", r)
    for r in range(R):
        peers = [p for p in range(R) if p != r]
        resid = f"x.r{r}"
        resid_wait: list[str] = []
        for k in range(1, stages + 1):
            g = f"ar.{k}"
            b.task(f"norm{k}.r{r}", r, 0, "rmsnorm", ins=[f"{resid}[0:{H}]", f"ln{k}.r{r}[0:{H}]"],
                   outs=[f"h{k}.r{r}[0:{H}]"], params={"dim": H, "eps": 1e-5}, waits=resid_wait,
                   signals=[f"c.h{k}.r{r}+=1"])
            for i, (a, e) in enumerate(tiles):
                b.task(f"gemv{k}.r{r}.{i}", r, i % W, "gemv",
                       ins=[f"h{k}.r{r}[0:{H}]", f"w{k}.r{r}[{a}:{e}, 0:{H}]"],
                       outs=[f"part{k}.r{r}[{a}:{e}]"], waits=[f"c.h{k}.r{r}>=1"],
                       signals=[f"c.part{k}.r{r}+=1"])
            sender = len(tiles) % W
            for p in peers:
                waits = [f"c.part{k}.r{r}>={len(tiles)}"]
                if reuse == "credit":
                    waits.append(f"c.cr{k}.r{r}>={(R - 1) * len(red)}@prev")
                    sig = f"c.rx{k}.r{p}+=1"
                else:
                    sig = f"c.rx{k}.r{p}.f{r}+=1"
                b.task(f"put{k}.r{r}.to{p}", r, sender, "put", ins=[f"part{k}.r{r}[0:{H}]"],
                       outs=[f"rx{k}@{p}[{sl}{r}:{r + 1}, 0:{H}]"], waits=waits, signals=[sig],
                       group=g)
            b.task(f"self{k}.r{r}", r, sender, "copy", ins=[f"part{k}.r{r}[0:{H}]"],
                   outs=[f"rx{k}[{sl}{r}:{r + 1}, 0:{H}]"], waits=[f"c.part{k}.r{r}>={len(tiles)}"],
                   signals=[f"c.self{k}.r{r}+=1"], group=g)
            if reuse == "credit":
                arrive = [f"c.rx{k}.r{r}>={R - 1}"] if R > 1 else []
            else:
                arrive = [f"c.rx{k}.r{r}.f{p}>=1" for p in peers]
            for j, (a, e) in enumerate(red):
                sig = [f"c.y{k}.r{r}+=1"]
                if reuse == "credit":
                    sig += [f"c.cr{k}.r{p}+=1" for p in peers]
                b.task(f"sum{k}.r{r}.{j}", r, j % W, "reduce",
                       ins=[f"rx{k}[{sl}0:{R}, {a}:{e}]", f"{resid}[{a}:{e}]"],
                       outs=[f"y{k}.r{r}[{a}:{e}]"],
                       waits=arrive + [f"c.self{k}.r{r}>=1"] + resid_wait, signals=sig, group=g)
            resid = f"y{k}.r{r}"
            resid_wait = [f"c.y{k}.r{r}>={len(red)}"]
    return b.build()


def allgather(ranks: int = 3, workers: int = 2, n: int = 4, reuse: str = "slots") -> ScheduleProgram:
    """All-gather of one ``n``-vector per rank into ``y.rR[ranks, n]`` on every rank.
    ``slots``: double-buffered gather slots with per-source counters, the copy-out of row
    ``p`` waits only for source ``p``. ``credit``: one slot, one arrival counter, and one
    credit counter per (writer, reader) pair: reader r returns the credit for p's row to p
    once it copied that row out. Per-pair credits matter: with one credit counter per writer,
    a fast reader's next-step credit (its self copy needs nothing remote) could stand in for a
    slow reader's missing one, and the writer would overwrite a row still being read."""
    R, W = ranks, workers
    slots = 2 if reuse == "slots" else 1
    b = ProgramBuilder(f"allgather-{R}r{W}w-{reuse}", R, W, target=_TARGET, slots=slots,
                       config={"allgather": "direct", "reuse": reuse})
    b.buffer("ag", "activation", "f32", (2, R, n) if slots == 2 else (R, n), placement="symmetric")
    sl = "s:s+1, " if slots == 2 else ""
    for r in range(R):
        b.buffer(f"x.r{r}", "io_input", "f32", (n,), rank=r)
        b.buffer(f"y.r{r}", "io_output", "f32", (R, n), rank=r)
        b.counter(f"c.self.r{r}", r)
        if reuse == "slots":
            _per_source(b, r, R, "ag")
        else:
            b.counter(f"c.ag.r{r}", r)
            _per_source(b, r, R, "cr")
    for r in range(R):
        peers = [p for p in range(R) if p != r]
        for i, p in enumerate(peers):
            waits = [f"c.cr.r{r}.f{p}>=1@prev"] if reuse == "credit" else []
            sig = f"c.ag.r{p}.f{r}+=1" if reuse == "slots" else f"c.ag.r{p}+=1"
            b.task(f"put.r{r}.to{p}", r, i % W, "put", ins=[f"x.r{r}[0:{n}]"],
                   outs=[f"ag@{p}[{sl}{r}:{r + 1}, 0:{n}]"], waits=waits, signals=[sig], group="ag")
        b.task(f"self.r{r}", r, R % W, "copy", ins=[f"x.r{r}[0:{n}]"],
               outs=[f"ag[{sl}{r}:{r + 1}, 0:{n}]"], signals=[f"c.self.r{r}+=1"], group="ag")
        for p in range(R):
            if p == r:
                waits = [f"c.self.r{r}>=1"]
            elif reuse == "slots":
                waits = [f"c.ag.r{r}.f{p}>=1"]
            else:
                waits = [f"c.ag.r{r}>={R - 1}"]
            sig = [f"c.cr.r{p}.f{r}+=1"] if reuse == "credit" and p != r else []
            b.task(f"out.r{r}.{p}", r, p % W, "copy", ins=[f"ag[{sl}{p}:{p + 1}, 0:{n}]"],
                   outs=[f"y.r{r}[{p}:{p + 1}, 0:{n}]"], waits=waits, signals=sig, group="ag")
    return b.build()


def argmax(ranks: int = 2, workers: int = 2, hidden: int = 4, vocab_per_rank: int = 6,
           tile: int = 3) -> ScheduleProgram:
    """Vocabulary-parallel lm_head with a cross-rank argmax: gemv tiles -> logits slice ->
    ``argmax`` (with the slice's global offset) -> put the (value, index) pair into every
    peer's ``pairs`` buffer (slots) -> ``argmax_combine`` -> ``token.rR`` (i32)."""
    R, W, V, H = ranks, workers, vocab_per_rank, hidden
    b = ProgramBuilder(f"argmax-{R}r{W}w", R, W, target=_TARGET, slots=2,
                       config={"lm_head": "vocab-parallel", "tile": tile})
    b.buffer("pairs", "activation", "f32", (2, R, 2), placement="symmetric")
    tiles = _rows(V, max(1, V // tile))
    for r in range(R):
        b.buffer(f"h.r{r}", "io_input", "f32", (H,), rank=r)
        b.buffer(f"lm.r{r}", "weight", "f32", (V, H), rank=r)
        b.buffer(f"logits.r{r}", "io_output", "f32", (V,), rank=r)
        b.buffer(f"loc.r{r}", "activation", "f32", (2,), rank=r)
        b.buffer(f"token.r{r}", "io_output", "i32", (1,), rank=r)
        b.counter(f"c.logits.r{r}", r)
        b.counter(f"c.loc.r{r}", r)
        _per_source(b, r, R, "pairs")
    for r in range(R):
        peers = [p for p in range(R) if p != r]
        for i, (a, e) in enumerate(tiles):
            b.task(f"lm.r{r}.{i}", r, i % W, "gemv", ins=[f"h.r{r}[0:{H}]", f"lm.r{r}[{a}:{e}, 0:{H}]"],
                   outs=[f"logits.r{r}[{a}:{e}]"], signals=[f"c.logits.r{r}+=1"])
        w = len(tiles) % W
        b.task(f"amax.r{r}", r, w, "argmax", ins=[f"logits.r{r}[0:{V}]"], outs=[f"loc.r{r}[0:2]"],
               params={"offset": r * V}, waits=[f"c.logits.r{r}>={len(tiles)}"],
               signals=[f"c.loc.r{r}+=1"], group="amax")
        for p in peers:
            b.task(f"put.r{r}.to{p}", r, w, "put", ins=[f"loc.r{r}[0:2]"],
                   outs=[f"pairs@{p}[s:s+1, {r}:{r + 1}, 0:2]"], signals=[f"c.pairs.r{p}.f{r}+=1"],
                   group="amax")
        b.task(f"self.r{r}", r, w, "copy", ins=[f"loc.r{r}[0:2]"],
               outs=[f"pairs[s:s+1, {r}:{r + 1}, 0:2]"], group="amax")
        waits = [f"c.pairs.r{r}.f{p}>=1" for p in peers]
        b.task(f"comb.r{r}", r, w, "argmax_combine", ins=[f"pairs[s:s+1, 0:{R}, 0:2]"],
               outs=[f"token.r{r}[0:1]"], waits=waits, group="amax")
    return b.build()


def pipeline(ranks: int = 2, workers: int = 2, n: int = 8, chunks: int = 2,
             completion: str = "quiet") -> ScheduleProgram:
    """A rank pipeline 0 -> 1 -> ... -> R-1. Stage k adds its bias to the vector received
    from stage k-1 and sends the result on in ``chunks`` puts without signals.
    ``completion="quiet"``: the chunks are spread over workers; each worker completes its
    puts with ``quiet`` and signals a local counter; a relay task then signals the next
    stage. ``completion="fence"``: all chunks on one worker, then ``fence`` and a signal to a
    counter owned by the destination (a fence orders deliveries per destination). The
    receiver returns a credit after reading, and the sender waits for the previous step's
    credit before overwriting the receive buffer."""
    if completion not in ("quiet", "fence"):
        raise ValueError(f"completion must be 'quiet' or 'fence', got {completion!r}")
    R, W = ranks, workers
    b = ProgramBuilder(f"pipeline-{R}r{W}w-{completion}", R, W, target=_TARGET, slots=1,
                       config={"pipeline": completion, "chunks": chunks})
    b.buffer("inbox", "activation", "f32", (n,), placement="symmetric")
    parts = _rows(n, chunks)
    for r in range(R):
        b.buffer(f"bias.r{r}", "weight", "f32", (n,), rank=r)
        b.buffer(f"a.r{r}", "activation", "f32", (n,), rank=r)
        b.counter(f"c.a.r{r}", r)
        b.counter(f"c.in.r{r}", r)
        b.counter(f"c.cr.r{r}", r)
        b.counter(f"c.sent.r{r}", r)
    b.buffer("x.r0", "io_input", "f32", (n,), rank=0)
    b.buffer(f"y.r{R - 1}", "io_output", "f32", (n,), rank=R - 1)
    for r in range(R):
        last = r == R - 1
        if r == 0:
            b.task("stage.r0", 0, 0, "add", ins=[f"x.r0[0:{n}]", f"bias.r0[0:{n}]"],
                   outs=[f"a.r0[0:{n}]"], signals=["c.a.r0+=1"])
        else:
            dst = f"y.r{r}" if last else f"a.r{r}"
            b.task(f"stage.r{r}", r, 0, "add", ins=[f"inbox[0:{n}]", f"bias.r{r}[0:{n}]"],
                   outs=[f"{dst}[0:{n}]"], waits=[f"c.in.r{r}>=1"],
                   signals=[f"c.a.r{r}+=1", f"c.cr.r{r - 1}+=1"])
        if last:
            continue
        d = r + 1
        pre = [f"c.a.r{r}>=1", f"c.cr.r{r}>=1@prev"]
        if completion == "fence":
            w = 1 % W
            for i, (a, e) in enumerate(parts):
                b.task(f"send.r{r}.{i}", r, w, "put", ins=[f"a.r{r}[{a}:{e}]"],
                       outs=[f"inbox@{d}[{a}:{e}]"], waits=pre)
            b.task(f"fence.r{r}", r, w, "fence")
            b.task(f"notify.r{r}", r, w, "nop", signals=[f"c.in.r{d}+=1"])
        else:
            used = sorted({(i + 1) % W for i in range(len(parts))})
            for i, (a, e) in enumerate(parts):
                b.task(f"send.r{r}.{i}", r, (i + 1) % W, "put", ins=[f"a.r{r}[{a}:{e}]"],
                       outs=[f"inbox@{d}[{a}:{e}]"], waits=pre)
            for w in used:
                b.task(f"quiet.r{r}.w{w}", r, w, "quiet", signals=[f"c.sent.r{r}+=1"])
            b.task(f"notify.r{r}", r, 0, "nop", waits=[f"c.sent.r{r}>={len(used)}"],
                   signals=[f"c.in.r{d}+=1"])
    return b.build()


def ring_allgather(ranks: int = 3, workers: int = 1, n: int = 4) -> ScheduleProgram:
    """Ring all-gather: at step k (1..R-1) rank r forwards chunk ``(r - k + 1) mod R`` to
    rank r+1 with put-with-signal on one counter per rank; a ``fence`` between steps makes
    the deliveries to the successor arrive in step order, so step k may wait for
    ``c.ring >= k - 1``. Rank r+1 returns a credit after its copy-out, which runs on the
    forwarding worker after the last forward (every local read of the ring is done); rank
    r's first put of the next step waits for it."""
    R, W = ranks, workers
    b = ProgramBuilder(f"ring-ag-{R}r{W}w", R, W, target=_TARGET, slots=1,
                       config={"allgather": "ring"})
    b.buffer("ring", "activation", "f32", (R, n), placement="symmetric")
    for r in range(R):
        b.buffer(f"x.r{r}", "io_input", "f32", (n,), rank=r)
        b.buffer(f"y.r{r}", "io_output", "f32", (R, n), rank=r)
        b.counter(f"c.ring.r{r}", r)
        b.counter(f"c.cr.r{r}", r)
        b.counter(f"c.own.r{r}", r)
    for r in range(R):
        nxt, prv = (r + 1) % R, (r - 1) % R
        b.task(f"own.r{r}", r, 1 % W, "copy", ins=[f"x.r{r}[0:{n}]"], outs=[f"ring[{r}:{r + 1}, 0:{n}]"],
               signals=[f"c.own.r{r}+=1"], group="ring")
        for k in range(1, R):
            ch = (r - k + 1) % R
            waits = [f"c.own.r{r}>=1"] if k == 1 else [f"c.ring.r{r}>={k - 1}"]
            if k == 1:
                waits.append(f"c.cr.r{r}>=1@prev")
            else:
                b.task(f"fence.r{r}.{k}", r, 0, "fence", group="ring")
            b.task(f"fwd.r{r}.{k}", r, 0, "put", ins=[f"ring[{ch}:{ch + 1}, 0:{n}]"],
                   outs=[f"ring@{nxt}[{ch}:{ch + 1}, 0:{n}]"], waits=waits,
                   signals=[f"c.ring.r{nxt}+=1"], group="ring")
        b.task(f"out.r{r}", r, 0, "copy", ins=[f"ring[0:{R}, 0:{n}]"], outs=[f"y.r{r}[0:{R}, 0:{n}]"],
               waits=[f"c.ring.r{r}>={R - 1}", f"c.own.r{r}>=1"], signals=[f"c.cr.r{prv}+=1"],
               group="ring")
    return b.build()


def relay_broadcast(ranks: int = 3, workers: int = 1, n: int = 4) -> ScheduleProgram:
    """Rank 0 puts ``x`` into every peer's ``bcast`` buffer (no signals), completes them
    with ``quiet`` and signals rank 1; each rank k >= 1 waits, copies its data out and
    relays the signal to rank k+1. Correct only because ``quiet`` (not ``fence``) completes
    the puts to every destination before the first signal. Peers return credits to rank 0."""
    R, W = ranks, workers
    b = ProgramBuilder(f"relay-bcast-{R}r{W}w", R, W, target=_TARGET, slots=1,
                       config={"broadcast": "relay"})
    b.buffer("bcast", "activation", "f32", (n,), placement="symmetric")
    b.buffer("x.r0", "io_input", "f32", (n,), rank=0)
    b.counter("c.cr.r0", 0)
    for r in range(1, R):
        b.buffer(f"y.r{r}", "io_output", "f32", (n,), rank=r)
        b.counter(f"c.go.r{r}", r)
    for i, p in enumerate(range(1, R)):
        b.task(f"put.to{p}", 0, i % W, "put", ins=[f"x.r0[0:{n}]"], outs=[f"bcast@{p}[0:{n}]"],
               waits=[f"c.cr.r0>={R - 1}@prev"], group="bcast")
    used = sorted({i % W for i in range(R - 1)})
    if len(used) == 1:
        b.task("quiet.r0", 0, used[0], "quiet", signals=["c.go.r1+=1"], group="bcast")
    else:  # complete every worker's puts, then one relay start
        b.counter("c.done.r0", 0)
        for w in used:
            b.task(f"quiet.r0.w{w}", 0, w, "quiet", signals=["c.done.r0+=1"], group="bcast")
        b.task("start.r0", 0, 0, "nop", waits=[f"c.done.r0>={len(used)}"], signals=["c.go.r1+=1"],
               group="bcast")
    for r in range(1, R):
        sig = ["c.cr.r0+=1"] + ([f"c.go.r{r + 1}+=1"] if r + 1 < R else [])
        b.task(f"recv.r{r}", r, 0, "copy", ins=[f"bcast[0:{n}]"], outs=[f"y.r{r}[0:{n}]"],
               waits=[f"c.go.r{r}>=1"], signals=sig, group="bcast")
    return b.build()


def two_collectives(ranks: int = 2, workers: int = 1, n: int = 4) -> ScheduleProgram:
    """Two independent collectives per step, in the same order on every rank: an all-reduce
    of ``x`` (group ``ar``) then an all-gather of ``z`` (group ``ag``), both double-buffered
    with per-source arrival counters. Worker ``w`` of each rank handles the sources
    ``p`` with ``p % workers == w``."""
    R, W = ranks, workers
    b = ProgramBuilder(f"ar-ag-{R}r{W}w", R, W, target=_TARGET, slots=2,
                       config={"allreduce": "oneshot", "allgather": "direct"})
    b.buffer("rx", "activation", "f32", (2, R, n), placement="symmetric")
    b.buffer("ag", "activation", "f32", (2, R, n), placement="symmetric")
    for r in range(R):
        b.buffer(f"x.r{r}", "io_input", "f32", (n,), rank=r)
        b.buffer(f"z.r{r}", "io_input", "f32", (n,), rank=r)
        b.buffer(f"y.r{r}", "io_output", "f32", (n,), rank=r)
        b.buffer(f"g.r{r}", "io_output", "f32", (R, n), rank=r)
        for k in ("rx", "ag"):
            b.counter(f"c.{k}self.r{r}", r)
            _per_source(b, r, R, k)
    for r in range(R):
        peers = _exchange(b, r, R, W, n, f"x.r{r}", "rx", ("arput", "arself"), "rx",
                          f"c.rxself.r{r}", "ar")
        b.task(f"arsum.r{r}", r, 0, "reduce", ins=[f"rx[s:s+1, 0:{R}, 0:{n}]"], outs=[f"y.r{r}[0:{n}]"],
               waits=[f"c.rx.r{r}.f{p}>=1" for p in peers] + [f"c.rxself.r{r}>=1"], group="ar")
        _exchange(b, r, R, W, n, f"z.r{r}", "ag", ("agput", "agself"), "ag", f"c.agself.r{r}",
                  "ag")
        for p in range(R):
            wait = f"c.agself.r{r}>=1" if p == r else f"c.ag.r{r}.f{p}>=1"
            b.task(f"agout.r{r}.{p}", r, p % W, "copy", ins=[f"ag[s:s+1, {p}:{p + 1}, 0:{n}]"],
                   outs=[f"g.r{r}[{p}:{p + 1}, 0:{n}]"], waits=[wait], group="ag")
    return b.build()


def hand_seeds() -> list[ScheduleProgram]:
    """Every hand-built seed (this module and ir/examples.py), all valid, in a fixed order
    (the corpus numbers its items by it)."""
    out: list[ScheduleProgram] = []
    for w in (1, 2, 3):
        for r in (2, 3, 4):
            out.append(allreduce(r, 4, w, "credit"))
            out.append(allreduce(r, 4, w, "slots"))
    for build, shapes, variants in _SEEDS:
        for r, w in shapes:
            out.extend(build(ranks=r, workers=w, **v) for v in variants)
    return out


#: the seeds of this module: builder, (ranks, workers) pairs, keyword variants of each
_SEEDS = (
    (allreduce_per_source, ((2, 1), (3, 2), (4, 3)), ({},)),
    (mini_block, ((2, 2), (3, 2), (2, 3), (4, 2)), ({"reuse": "slots"}, {"reuse": "credit"})),
    (allgather, ((2, 2), (3, 2), (4, 1)), ({"reuse": "slots"}, {"reuse": "credit"})),
    (argmax, ((2, 2), (3, 2), (4, 1)), ({},)),
    (pipeline, ((2, 2), (3, 2), (3, 3)), ({"completion": "quiet"}, {"completion": "fence"})),
    (ring_allgather, ((2, 1), (3, 2), (4, 1)), ({},)),
    (relay_broadcast, ((3, 1), (3, 2), (4, 3)), ({},)),
    (two_collectives, ((2, 1), (2, 2), (3, 2)), ({},)),
)
