"""Multi-rank programs on the Triton backend with every rank in one process.

``TritonExecutor`` without a ``dist`` context runs all R ranks of a program in this process:
one arena slice per rank in one allocation, remote puts and signals resolved through the
slice distance (the same peer-delta mechanism the NVSHMEM runtime uses with real peer
pointers). Under the interpreter one worker runs a topological order of all ranks' tasks;
on a GPU (``gpu`` marker) the R x W queues run as R x W persistent CTAs. Each must match
the sim backend, and tensor-parallel lowered models must match HF.
"""

from __future__ import annotations

import pytest
import torch

import lowering.triton  # noqa: F401  (sets TRITON_INTERPRET=1 without a GPU)
from ir.examples import allreduce
from lowering.sim import SimExecutor
from lowering.triton import TritonExecutor, TritonWatchdogError
from lowering.triton import table as T
from lowering.triton import layout as L
from lowering.triton.lang import interpreting
from lowering.triton.ops.gemv import ROLES as GEMV
from lowering.triton.ops.gemv import gemv_mirrors

INTERP = interpreting()
DEV = "cpu" if INTERP else "cuda"
needs_device = pytest.mark.skipif(not INTERP and not torch.cuda.is_available(),
                                  reason="needs the interpreter or a CUDA GPU")


def gpu(fn):
    fn = pytest.mark.skipif(INTERP or not torch.cuda.is_available(),
                            reason="needs compiled Triton on a CUDA GPU")(fn)
    return pytest.mark.gpu(fn)


@needs_device
@pytest.mark.parametrize("ranks,reuse", [(2, "slots"), (3, "slots"), (2, "credit"), (4, "credit")])
def test_allreduce_across_colocated_ranks(ranks, reuse):
    p = allreduce(ranks=ranks, n=8, workers=2, reuse=reuse)
    ex = TritonExecutor(p, None, check=False, device=DEV)
    assert ex.local_ranks == list(range(ranks))
    for e in range(4):
        xs = [torch.arange(8, dtype=torch.float32) * (r + 1) + e for r in range(ranks)]
        for r in range(ranks):
            ex.write(f"x.r{r}", r, xs[r])
        ex.step(e)
        want = sum(xs)
        for r in range(ranks):
            assert torch.equal(ex.read(f"y.r{r}", r), want), (e, r)


def test_merge_tables_rebases_waits_and_signals():
    p = allreduce(ranks=2, n=8, workers=2, reuse="slots")
    lay = {r: T.shift_layout(T.build_layout(p, r), r * 4096 * 16) for r in range(2)}
    q = p.queues()
    tabs, variants = [], []
    for r in range(2):
        t = T.build_table(p, r, [q.get((r, w), []) for w in range(2)], lay[r],
                          {1 - r: (1 - 2 * r) * 4096 * 16}, variants)
        variants = t.variants
        tabs.append(t)
    queues = [[(ti, i) for i in range(int(t.qstart[w]), int(t.qstart[w + 1]))]
              for ti, t in enumerate(tabs) for w in range(2)]
    m = T.merge_tables(tabs, queues)
    assert m.workers == 4 and m.n_tasks == sum(t.n_tasks for t in tabs)
    assert m.task_ranks == [0] * tabs[0].n_tasks + [1] * tabs[1].n_tasks
    # every row's wait / signal index points at the same entry as in its own table
    for row, (ti, i) in zip(m.rows, [x for qq in queues for x in qq]):
        src = tabs[ti].rows[i]
        for k in range(int(src[T.F_NWAIT])):
            assert (m.waits[row[T.F_WAIT0] + k] == tabs[ti].waits[src[T.F_WAIT0] + k]).all()
        for k in range(int(src[T.F_NSIG])):
            assert (m.signals[row[T.F_SIG0] + k] == tabs[ti].signals[src[T.F_SIG0] + k]).all()
    # remote signals of rank 0 land in rank 1's slice (and back), scoped sys
    remote = [s for s in m.signals.tolist() if s[2] == T.SCOPE_SYS]
    assert remote, "the all-reduce signals peers"


def _tp_program(name: str, ranks: int, dtype: str = "f32", fuse: bool = False, workers: int = 2,
                wave: bool = False, late_append: bool = False):
    """A tiny recipe lowered for ``ranks`` ranks (tile 32; with ``wave`` tile 8, the wave
    knob's granularity), its init_fn and the HF model."""
    from tests.test_triton_megakernel import lowered

    return lowered(name, workers, dtype=dtype, tile=8 if wave else 32, fuse=fuse, ranks=ranks,
                   wave=wave, late_append=late_append)


def _decode(ex, ranks, tokens):
    out = []
    for e, tok in enumerate(tokens):
        for r in range(ranks):
            ex.write(f"token.r{r}", r, torch.tensor([tok], dtype=torch.int32))
            ex.write(f"pos.r{r}", r, torch.tensor([e], dtype=torch.int32))
        ex.step(e)
        logits = torch.cat([ex.read(f"logits.r{r}", r).float().reshape(-1) for r in range(ranks)])
        nxt = {int(ex.read(f"next.r{r}", r).item()) for r in range(ranks)}
        assert len(nxt) == 1, f"ranks disagree on the next token: {nxt}"
        out.append((logits, nxt.pop()))
    return out


@needs_device
@pytest.mark.parametrize("name,ranks,fuse,wave", [("tiny-llama", 2, False, False), ("tiny-qwen2", 3, True, False),
                                                  ("tiny-llama", 4, True, False), ("tiny-llama", 1, True, True),
                                                  ("tiny-qwen3", 2, False, True), ("tiny-qwen2", 2, "late", False)])
def test_tensor_parallel_model_matches_sim_and_hf(name, ranks, fuse, wave):
    """fuse "late": fused with late_append (rope_attention_kv, appends after the attention)."""
    prog, init, model = _tp_program(name, ranks, fuse=bool(fuse), wave=wave, late_append=fuse == "late")
    ex = TritonExecutor(prog, init, check=False, device=DEV)
    if ranks > 1:  # the all-reduce's puts and reduces run on 16-byte vectors (table flag vec)
        _assert_vector_moves(ex)
    sim = SimExecutor(prog, init, check=False, policy="in_order")
    toks = [5, 17, 33]
    got, want = _decode(ex, ranks, toks), _decode(sim, ranks, toks)
    from transformers import DynamicCache

    from amk.pipeline import hf_cache_kwargs
    cache = DynamicCache()
    with torch.no_grad():
        for (lg, nt), (ls, ns), (pos, tok) in zip(got, want, enumerate(toks)):
            ref = model(input_ids=torch.tensor([[tok]]), position_ids=torch.tensor([[pos]]),
                        use_cache=True, **hf_cache_kwargs(model, cache))
            lh = ref.logits[0, -1].float()
            torch.testing.assert_close(lg.cpu(), ls, rtol=1e-4, atol=2e-5)
            torch.testing.assert_close(lg.cpu(), lh, rtol=1e-4, atol=2e-5)
            assert nt == ns == int(torch.argmax(lh))


@needs_device
def test_q8_0_tensor_parallel_matches_sim():
    """q8_0 weights at tp 2 (tiny Llama: rank 1 holds one head, so its o-projection rows have
    one 32-column block each, a [rows, 1] f16 scale region): the megakernel matches the sim."""
    from tests.test_triton_megakernel import lowered

    prog, init, _ = lowered("tiny-llama", 2, tile=32, fuse=True, ranks=2, weights="int8", weight_group=32)
    one = [t for t in prog.tasks if t.id.startswith("l0.attn.w.") and t.rank == 1]
    assert one and all(t.ins[-1].ranges[1].stop.const == 1 for t in one)
    ex = TritonExecutor(prog, init, check=False, device=DEV)
    assert all(v.flag("gscale") for v in ex.table.variants if v.flag("scale"))
    sim = SimExecutor(prog, init, check=False, policy="in_order")
    for (lg, nt), (ls, ns) in zip(_decode(ex, 2, [5, 17, 33]), _decode(sim, 2, [5, 17, 33])):
        torch.testing.assert_close(lg.cpu(), ls, rtol=1e-4, atol=2e-5)
        assert nt == ns


def _assert_vector_moves(ex) -> None:
    """Every reduce and every put of a hidden-state row (all-reduce) has the ``vec`` flag;
    the LM head's argmax pairs (two fp32 per chunk) may not."""
    var = ex.table.variants
    for tid, op, row in zip(ex.table.task_ids, ex.table.task_ops, ex.table.rows):
        if op == "reduce" or (op == "put" and not tid.startswith("lm.")):
            v = var[int(row[T.F_OP])]
            assert v.flag("vec"), (tid, v)


def test_vec_flag_needs_flat_aligned_regions():
    """layout.flat_aligned: a region gets the 16-byte vector path only when its flat index is
    its element offset and every slot start and the extent are multiples of the vector."""
    from lowering.triton.layout import Desc, flat_aligned

    row = Desc(off=64, coef=128, n=(1, 1, 64), s=(0, 0, 1))
    assert flat_aligned(row, 8, 2)
    assert not flat_aligned(Desc(off=68, coef=128, n=(1, 1, 64), s=(0, 0, 1)), 8, 2)  # start
    assert not flat_aligned(Desc(off=64, coef=132, n=(1, 1, 64), s=(0, 0, 1)), 8, 2)  # slot 1's start
    assert not flat_aligned(Desc(off=64, coef=128, n=(1, 1, 60), s=(0, 0, 1)), 8, 2)  # extent
    assert not flat_aligned(Desc(off=64, coef=128, n=(1, 1, 64), s=(0, 0, 2)), 8, 2)  # strided
    assert not flat_aligned(Desc(off=0, coef=0, n=(1, 4, 16), s=(0, 32, 1)), 8, 1)  # rows with gaps
    assert flat_aligned(Desc(off=0, coef=0, n=(1, 4, 16), s=(0, 16, 1)), 8, 1)


@needs_device
def test_bf16_tensor_parallel_vector_moves_keep_results(monkeypatch):
    """bf16 at tp 2 (one-shot) and 4 (two-shot): the vectorised puts and reduces (8 elements
    per access) give bit-identical logits and tokens to the generic strided path."""
    from tests.test_triton_megakernel import lowered

    for ranks, algo in ((2, "oneshot"), (4, "twoshot")):
        prog, init, _ = lowered("tiny-llama", 2, dtype="bf16", tile=16, fuse=True, ranks=ranks, allreduce=algo)
        ex = TritonExecutor(prog, init, check=False, device=DEV)
        _assert_vector_moves(ex)
        with monkeypatch.context() as m:
            m.setattr(L, "flat_aligned", lambda *a: False)
            gen = TritonExecutor(prog, init, check=False, device=DEV)
        assert not any(v.flag("vec") for v in gen.table.variants)
        for (lg, nt), (lr, nr) in zip(_decode(ex, ranks, [5, 17]), _decode(gen, ranks, [5, 17])):
            assert torch.equal(lg, lr) and nt == nr


@needs_device
@pytest.mark.parametrize("name,ranks,dtype,algo,x_stage,chunk", [
    ("tiny-llama", 2, "bf16", "fused", True, 8192), ("tiny-qwen2", 3, "bf16", "oneshot", False, 8192),
    ("tiny-llama", 4, "f32", "fused", True, 32)])
def test_fuse_reduce_sums_the_partials_in_the_gemv_prologue(name, ranks, dtype, algo, x_stage, chunk):
    """LoweringConfig.fuse_reduce: the q/k/v, gate/up and LM-head tiles after an all-reduce
    are reduce_norm_gemv tasks that sum the received partials and the residual in their
    prologue (staged in the worker's scratch even with Blocks.x_stage off); logits and tokens
    are bit-identical to the reduce -> norm_gemv pair (reduce's summation order, the same two
    roundings). qwen2: biased q/k/v tiles; ``chunk`` 32 with 4 x 8 GEMV blocks: the x pass in
    chunks shorter than K (96)."""
    from tests.test_triton_megakernel import lowered

    from lowering.triton.runtime import Blocks

    runs = {}
    for fr in (False, True):
        prog, init, _ = lowered(name, 2, dtype=dtype, tile=16, fuse=True, ranks=ranks, allreduce=algo,
                                fuse_reduce=fr)
        small = dict(gemv_n=4, gemv_k=8) if chunk < 64 else {}
        ex = TritonExecutor(prog, init, check=False, device=DEV,
                            blocks=Blocks(x_stage=x_stage, x_chunk=chunk, **small))
        rn = [t for t in prog.tasks if t.op == "reduce_norm_gemv"]
        assert bool(rn) == fr
        if fr:
            assert any(v.op == "reduce_norm_gemv" for v in ex.table.variants)
            assert any(len(t.ins) == 5 for t in rn) == (name == "tiny-qwen2")  # with a bias
        runs[fr] = _decode(ex, ranks, [5, 17, 33])
    for (lf, tf), (lo, to) in zip(runs[True], runs[False]):
        assert torch.equal(lf, lo) and tf == to


def test_table_refuses_an_unaligned_reduce_norm_gemv(monkeypatch):
    from tests.test_triton_megakernel import lowered

    prog, init, _ = lowered("tiny-llama", 2, tile=16, fuse=True, ranks=2, fuse_reduce=True)
    monkeypatch.setattr(L, "flat_aligned", lambda *a: False)
    with pytest.raises(T.TableError, match="reduce_norm_gemv kernel needs contiguous"):
        TritonExecutor(prog, init, check=False, device=DEV)


@needs_device
@pytest.mark.parametrize("ranks,dtype,fuse", [(2, "bf16", True), (4, "bf16", True), (3, "f32", False)])
def test_fused_allreduce_stores_peers_from_the_gemv(ranks, dtype, fuse):
    """allreduce "fused": the row-parallel GEMV tiles store their partial rows into every
    peer's receive buffer themselves (mirror outputs, R - 1 per tile) and signal the peers;
    no put task is left in the layers (only the LM head's argmax pairs). Logits and tokens are
    bit-identical to the one-shot all-reduce with put tasks (same sums, same order); the fused
    run also signals with Blocks.lean_release."""
    from tests.test_triton_megakernel import lowered

    from lowering.triton.runtime import Blocks

    runs = {}
    for algo in ("oneshot", "fused"):
        prog, init, _ = lowered("tiny-llama", 2, dtype=dtype, tile=16, fuse=fuse, ranks=ranks, allreduce=algo)
        # fused: also with Blocks.lean_release (one thread-0 fence, relaxed peer signals)
        ex = TritonExecutor(prog, init, check=False, device=DEV, blocks=Blocks(lean_release=algo == "fused"))
        puts = [t.id for t in prog.tasks if t.op == "put"]
        mirrored = [t for t in prog.tasks if t.op in GEMV and len(t.outs) > 1]
        if algo == "fused":
            assert all(i.startswith("lm.") for i in puts), puts
            assert mirrored and all(len(t.outs) == ranks for t in mirrored)
            assert all({m.rank for m in t.outs} == set(range(ranks)) for t in mirrored)
            var = [v for v in ex.table.variants if v.op in GEMV and v.flag("mirror")]
            assert var and all(gemv_mirrors(v) == ranks - 1 for v in var), var
        else:
            assert not mirrored and any(not i.startswith("lm.") for i in puts)
        runs[algo] = _decode(ex, ranks, [5, 17, 33])
    for (lf, tf), (lo, to) in zip(runs["fused"], runs["oneshot"]):
        assert torch.equal(lf, lo) and tf == to


def test_table_refuses_a_mirror_that_is_not_the_output_on_a_peer():
    """A mirror output must be y's own region on another rank (the kernel stores it at y's
    offsets plus one delta); anything else is a TableError naming the task."""
    import dataclasses

    from ir.program import Range
    from tests.test_triton_megakernel import lowered

    prog, _, _ = lowered("tiny-llama", 2, tile=16, ranks=2, allreduce="fused")
    t = next(t for t in prog.tasks if t.rank == 0 and t.op in GEMV and len(t.outs) == 2)
    y, m = t.outs
    cols = m.ranges[-1]
    shifted = Range.of(cols.start.const + 16, cols.stop.const + 16)
    for reg in (dataclasses.replace(m, rank=y.rank), dataclasses.replace(m, ranges=(*m.ranges[:-1], shifted))):
        i = prog.tasks.index(t)
        prog.tasks[i] = dataclasses.replace(t, outs=(y, reg))
        with pytest.raises(T.TableError, match=f"task {t.id}: mirror output 1"):
            TritonExecutor(prog, None, check=False, device=DEV)
        prog.tasks[i] = t


@pytest.mark.skipif(not INTERP, reason="offline compile runs without a GPU")
@pytest.mark.parametrize("triton_path", ["local", "device"])
def test_allreduce_moves_compile_to_16_byte_vectors(tmp_path, triton_path):
    """A bf16 all-reduce program (puts and reduces only) compiled offline for sm_90 loads and
    stores 16-byte vectors (ld/st.global.v4): the ``vec`` path's alignment facts reach
    Triton's analysis. ``device``: with the GPU machines' Triton (AMK_DEVICE_TRITON)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    if triton_path == "device" and not os.environ.get("AMK_DEVICE_TRITON"):
        pytest.skip("AMK_DEVICE_TRITON (the GPU machines' Triton, .ci/run installs 3.6) unset")
    root = Path(__file__).resolve().parents[1]
    ex = TritonExecutor(allreduce(ranks=2, n=256, workers=2, dtype="bf16"), None, check=False, device=DEV)
    assert all(v.flag("vec") for v in ex.table.variants if v.op in ("put", "reduce"))
    src = ex.emit_source(tmp_path / "kernel.py")
    path = [os.environ["AMK_DEVICE_TRITON"]] if triton_path == "device" else []
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=os.pathsep.join([*path, str(root)]))
    code = "import sys; from lowering.triton.offline import main; sys.exit(main(sys.argv[1:]))"
    res = subprocess.run([sys.executable, "-c", code, str(src), "--arch", "90"], capture_output=True,
                         text=True, env=env, cwd=root, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    rep = json.loads(res.stdout.strip().splitlines()[-1])
    assert rep["vector_loads"] and rep["vector_stores"], rep


@pytest.mark.skipif(not INTERP, reason="offline compile runs without a GPU")
@pytest.mark.parametrize("triton_path", ["local", "device"])
def test_lean_release_compiles_to_one_fence_and_relaxed_peer_signals(tmp_path, triton_path):
    """Blocks.lean_release: the peer signals of a multi-rank program compile to
    ``red.relaxed.sys`` (after a thread-0 ``fence.acq_rel.sys``) and no ``red``/``atom``
    ``.release.sys``; without it they are release atomics at system scope."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from lowering.triton.runtime import Blocks

    if triton_path == "device" and not os.environ.get("AMK_DEVICE_TRITON"):
        pytest.skip("AMK_DEVICE_TRITON (the GPU machines' Triton, .ci/run installs 3.6) unset")
    root = Path(__file__).resolve().parents[1]
    path = [os.environ["AMK_DEVICE_TRITON"]] if triton_path == "device" else []
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=os.pathsep.join([*path, str(root)]))
    code = "import sys; from lowering.triton.offline import main; sys.exit(main(sys.argv[1:]))"
    for lean in (True, False):
        ex = TritonExecutor(allreduce(ranks=2, n=256, workers=2, dtype="bf16"), None, check=False, device=DEV,
                            blocks=Blocks(lean_release=lean))
        src = ex.emit_source(tmp_path / f"kernel_{int(lean)}.py")
        res = subprocess.run([sys.executable, "-c", code, str(src), "--arch", "90"], capture_output=True,
                             text=True, env=env, cwd=root, timeout=600)
        assert res.returncode == 0, res.stderr[-3000:]
        rep = json.loads(res.stdout.strip().splitlines()[-1])
        assert rep["relaxed_red_sys"] is lean and rep["release_sys"] is not lean, (lean, rep)


@needs_device
def test_watchdog_names_the_rank_of_a_stuck_task():
    """Drop one rank's signal from the all-reduce: the peer's wait must time out, and the
    report must name the task and its rank."""
    p = allreduce(ranks=2, n=8, workers=1, reuse="slots")
    victim = next(t for t in p.tasks if t.rank == 0 and any(
        p.counter_map()[s.counter].rank == 1 for s in t.signals))
    victim.signals = [s for s in victim.signals if p.counter_map()[s.counter].rank != 1]
    ex = TritonExecutor(p, None, check=False, device=DEV, timeout_s=0.5)
    for r in range(2):
        ex.write(f"x.r{r}", r, torch.ones(8))
    with pytest.raises(TritonWatchdogError) as e:
        ex.step(0)
    assert any(s["task"].endswith("(rank 1)") for s in e.value.stuck), e.value.stuck


@gpu
@pytest.mark.parametrize("ranks", [2, 4])
def test_gpu_colocated_ranks_with_worker_queues(ranks):
    prog, init, model = _tp_program("tiny-llama", ranks, dtype="bf16", fuse=True, workers=4)
    ex = TritonExecutor(prog, init, check=False, num_warps=4)
    assert not ex.linear and ex.workers == 4 * ranks
    sim = SimExecutor(prog, init, check=False, policy="in_order")
    toks = [5, 17, 33, 2]
    for (lg, nt), (ls, ns) in zip(_decode(ex, ranks, toks), _decode(sim, ranks, toks)):
        assert (lg.cpu() - ls).abs().max() <= 0.02 * ls.abs().max()
        assert nt == int(torch.argmax(lg))
