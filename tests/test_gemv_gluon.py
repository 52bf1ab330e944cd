"""The Gluon GEMV-stream probe (lowering/triton/gluon_probe.py, bench/gemv_gluon.py).

CPU: the decode-step task lists (every row once, the model's weight bytes, per-CTA matrix
order and waits, load balance), bad input, the script's refusal without a GPU. With the GPU
machines' Triton (AMK_DEVICE_TRITON): every variant compiles offline for sm_90 without spills,
partitioned into warp groups where it is warp-specialised, with TMA or cp.async copies where
it uses them. GPU: every variant matches torch on a one-layer step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ground.errors import AmkError
from lowering.triton import gluon_probe as G

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gemv_gluon.py"


def _linear_weight_bytes(name: str) -> int:
    """bf16 bytes of every nn.Linear weight of the HF model of ``config:NAME`` (built on the
    meta device: shapes only), the LM head counted once whether tied or not."""
    import transformers

    from models.recipes import build_config

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(build_config(name))
    return sum(m.weight.numel() * 2 for m in model.modules() if isinstance(m, torch.nn.Linear))


@pytest.mark.parametrize("policy", ["greedy", "rr"])
@pytest.mark.parametrize("tile,rows,cols", [(64, 32, 256), (32, 16, 128), (256, 64, 256)])
def test_task_list_covers_every_row_once(policy, tile, rows, cols):
    """Llama-3.2-1B on 132 CTAs: the tiles of each matrix cover its rows exactly once, a task's
    rows are a multiple of the page's, each CTA's list runs in matrix order and waits (for the
    previous matrix) exactly at its first tile of each matrix; the table's bytes are the
    model's GEMV weight bytes (2.47 GB) and the per-CTA bytes add up to them."""
    ms = G.model_matrices("llama-3.2-1b")
    tl = G.build_tasks(ms, 132, tile, rows, cols, policy)
    assert [m.name for m in ms[:4]] == ["l0.qkv", "l0.o", "l0.gate_up", "l0.down"] and ms[-1].name == "lm_head"
    assert (ms[0].rows, ms[0].k, ms[2].rows, ms[3].k, ms[-1].rows) == (3072, 2048, 16384, 8192, 128256)
    assert len(tl.starts) == 133 and tl.starts[-1] == len(tl.table)
    hits = {m.name: torch.zeros(m.rows, dtype=torch.int32) for m in ms}
    for c in range(132):
        last = -1
        for arena, row0, n, k, xoff, yoff, mi, wait in tl.table[tl.starts[c]:tl.starts[c + 1]]:
            m = ms[mi]
            assert (arena, k, xoff) == (m.arena, m.k, m.xoff) and n % rows == 0 and 0 < n <= tile
            assert row0 - m.row0 == yoff - m.yoff
            hits[m.name][row0 - m.row0:row0 - m.row0 + n] += 1
            assert mi >= last
            assert wait == (mi - 1 if mi != last and mi > 0 else -1)
            last = mi
    assert all(bool((h == 1).all()) for h in hits.values())
    assert tl.tiles == [-(-m.rows // tile) for m in ms]
    assert tl.nbytes == sum(tl.cta_bytes) == sum(m.nbytes for m in ms) == _linear_weight_bytes("llama-3.2-1b")
    assert tl.nbytes == 2_471_493_632
    assert tl.arena_rows() == [472320, 32768] and tl.arena_k() == [2048, 8192]
    if policy == "greedy":  # no CTA ends more than one tile's bytes above another
        assert max(tl.cta_bytes) - min(tl.cta_bytes) <= tile * 8192 * 2


def test_task_list_refuses_shapes_the_pages_cannot_cut():
    """A tile that is not a multiple of the page's rows, a K that is not a multiple of its
    columns, an unknown policy or model: AmkError naming the numbers."""
    ms = G.model_matrices("llama-3.2-1b")
    with pytest.raises(AmkError, match="tile of 48 rows is not a multiple of the page's 32 rows"):
        G.build_tasks(ms, 132, 48, 32, 256)
    with pytest.raises(AmkError, match="K = 2048, not a multiple of the page's 3072 columns"):
        G.build_tasks(ms, 132, 64, 32, 3072)
    with pytest.raises(AmkError, match="unknown assignment policy 'lpt'"):
        G.build_tasks(ms, 132, 64, 32, 256, "lpt")
    with pytest.raises(AmkError, match="unknown model shape 'llama-9b'"):
        G.model_matrices("llama-9b")


def test_variant_specs_round_trip_and_refuse():
    """parse_variant reads KIND:RxC[:S][:wN][:lN][:dep], Variant.spec writes it back; pages TMA
    cannot copy, rings over 200 KiB and unknown kinds are refused in one line."""
    v = G.parse_variant("ws:32x256:6:w8:l1:dep")
    assert (v.kind, v.rows, v.cols, v.stages, v.warps, v.dep) == ("ws", 32, 256, 6, 8, True)
    assert G.parse_variant(v.spec()) == v and v.label() == "ws:32x256:S6:w8:l1:dep"
    assert G.parse_variant("sync:64x256", warps=8).warps == 8
    assert G.parse_variant("ws:32x256:3:m128").maxnreg == 128
    nc = G.parse_variant("ws:32x256:6:nocompute")
    assert not nc.compute and G.parse_variant(nc.spec()) == nc and nc.label().endswith(":nocompute")
    ny = G.parse_variant("ws:64x256:3:w8:nocopy")
    assert not ny.copy and ny.compute and not ny.checked and G.parse_variant(ny.spec()) == ny
    assert ny.label().endswith(":nocopy") and v.checked and not nc.checked
    for spec, msg in [("ws:32x512:4", "at most 256 rows and 256 columns"), ("ws:64x256:16", "exceeds 200 KiB"),
                      ("tma:32x256", "unknown variant kind 'tma'"), ("ws:32", "expected KIND:RxC"),
                      ("pipe:24x256", "powers of two"),
                      ("pipe:32x256:4:nocompute", "nocompute needs a warp-specialised"),
                      ("pipe:32x256:4:nocopy", "nocopy needs the TMA loader"),
                      ("wscp:32x256:4:nocopy", "nocopy needs the TMA loader"),
                      ("ws:32x256:4:nocompute:nocopy", "nocopy needs the TMA loader")]:
        with pytest.raises(AmkError, match=msg):
            G.parse_variant(spec)


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=timeout)


def test_script_refuses_bad_variants_in_one_line():
    """A bad --variants spec or a tile the page cannot cut: one error line, exit code 2, before
    any GPU is looked for."""
    r = _run("--variants", "ws:32x256:4,ws:48x256:4")
    assert r.returncode == 2 and r.stderr.strip() == (
        "bench/gemv_gluon.py: error: variant 'ws:48x256:4': page shape 48x256: rows and cols must be powers of two, "
        "cols >= 8"), r.stderr
    r = _run("--variants", "ws:64x256:3", "--tile", "32")
    assert r.returncode == 2 and "tile of 32 rows is not a multiple of the page's 64 rows" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_script_refuses_an_unwritable_out_before_measuring(tmp_path):
    """--out under a plain file: one line naming the folder, exit code 2, before any GPU work."""
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    r = _run("--variants", "sync:32x256", "--out", str(blocker / "r.json"))
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"bench/gemv_gluon.py: error: --out: cannot write to {blocker}: ")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the script would run")
def test_script_refuses_without_a_gpu(tmp_path):
    """Without a GPU: one line naming what is missing, exit code 2, no result file."""
    r = _run("--out", str(tmp_path / "r.json"))
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.strip() == ("bench/gemv_gluon.py: error: needs a CUDA GPU (Hopper or newer: Gluon warp "
                                "specialisation and TMA); none is visible")
    assert not (tmp_path / "r.json").exists()


#: Variants compiled offline: (spec, warp-specialised, TMA copies, cp.async copies, acquire polls).
OFFLINE = [("ws:32x256:6:w4", True, True, False, False), ("ws:64x256:3:w8", True, True, False, False),
           ("ws:32x256:6:w4:nocompute", True, True, False, False),
           ("ws:64x256:3:w8:nocopy", True, True, False, False),
           ("wscp:32x256:6:w4", True, False, True, False), ("pipe:32x256:6:w4", False, True, False, False),
           ("sync:32x256:w4", False, False, False, False), ("ws:32x256:6:w4:dep", True, True, False, True),
           ("pipe:32x256:6:w4:dep", False, True, False, True), ("ws:32x256:3:w4:m128", True, True, False, False)]


@pytest.fixture(scope="module")
def offline_reports():
    """compile_offline reports of the OFFLINE variants, compiled for sm_90 with the GPU
    machines' Triton in one subprocess."""
    env = dict(os.environ, TRITON_INTERPRET="0",
               PYTHONPATH=os.pathsep.join([os.environ["AMK_DEVICE_TRITON"], str(ROOT)]))
    r = subprocess.run([sys.executable, "-m", "lowering.triton.gluon_probe", *[s for s, *_ in OFFLINE]],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    reps = [json.loads(line) for line in r.stdout.strip().splitlines()]
    assert len(reps) == len(OFFLINE)
    return reps


@pytest.mark.skipif(not os.environ.get("AMK_DEVICE_TRITON"),
                    reason="AMK_DEVICE_TRITON (a folder holding the GPU machines' Triton, .ci/run installs 3.6) unset")
@pytest.mark.parametrize("i", range(len(OFFLINE)), ids=[s for s, *_ in OFFLINE])
def test_device_triton_compiles_each_variant(offline_reports, i):
    """With the GPU machines' Triton (3.6), each variant compiles for sm_90 without spills; the
    warp-specialised ones are partitioned (a ttg.warp_specialize region, setmaxnreg in the PTX,
    a loader warpgroup on top of the compute warps) and the others are not; TMA copies
    (cp.async.bulk.tensor), 16-byte cp.async copies and acquire polls are present exactly where
    the variant uses them; the ring's pages are in shared memory and the compute warps read
    them in 16-byte loads, except in the stream-only variant."""
    spec, ws, tma, cp, dep = OFFLINE[i]
    rep = offline_reports[i]
    v = G.parse_variant(spec)
    assert rep["variant"] == v.label()
    assert rep["local_bytes"] in (0, None), rep
    if v.maxnreg and rep["regs"] is not None:  # the cap that lets two CTAs share an SM holds
        assert rep["regs"] <= v.maxnreg, rep
    assert rep["warp_specialize"] == ws and (rep["setmaxnreg"] > 0) == ws, rep
    assert rep["num_warps"] == v.warps + (4 if ws else 0), rep
    assert (rep["tma_copies"] > 0) == tma and (rep["cp_async"] > 0) == cp and rep["acquire"] == dep, rep
    if v.kind == "sync":
        assert rep["shared"] == 0 and rep["global_vector_loads"] >= v.rows // v.warps, rep
    else:
        assert rep["shared"] >= v.stages * v.page_bytes and rep["mbarrier_waits"] >= 1, rep
        assert (rep["page_loads"] > 0) == v.compute, rep


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_every_variant_matches_torch(tmp_path):
    """On a Hopper GPU, one layer + LM head: every default variant (each in its own process,
    60 s at most) and the torch baseline run and match torch (the stream-only row says it is
    unchecked), and the JSON names the device, the command and each row's GB/s."""
    out = tmp_path / "r.json"
    r = _run("--layers", "1", "--reps", "3", "--isolate", "60", "--out", str(out), timeout=900)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    res = json.loads(out.read_text())
    assert res["device"] and res["command"].startswith("python bench/gemv_gluon.py")
    assert all("error" not in row and row["gbs"] > 0 for row in res["rows"]), res["rows"]
    for row in res["rows"]:  # every row computed is checked; the stream-only row says it is not
        assert row["rel_err"] <= 1e-4 if "nocompute" not in row["variant"] else "output not computed" in row["note"]


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_nocopy_reads_resident_pages(tmp_path):
    """On a Hopper GPU, the consumer-only variant runs to the end (its loader marks pages
    ready without copying, so no page wait can hang), says its output is not checked, and
    the streaming variant beside it is checked against torch."""
    out = tmp_path / "r.json"
    r = _run("--layers", "1", "--reps", "3", "--isolate", "60", "--no-torch",
             "--variants", "ws:64x256:3:w8,ws:64x256:3:w8:nocopy", "--out", str(out), timeout=600)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    rows = {row["variant"]: row for row in json.loads(out.read_text())["rows"]}
    streaming, resident = rows["ws:64x256:S3:w8:l1"], rows["ws:64x256:S3:w8:l1:nocopy"]
    assert "error" not in streaming and streaming["rel_err"] <= 1e-4, streaming
    assert "error" not in resident and resident["gbs"] > 0 and "not checked" in resident["note"], resident


def test_isolated_child_measures_one_variant_with_the_parents_shape():
    """--isolate's child command keeps the parent's shape flags (model, tile, policy, x dtype,
    reps) and drops the variant list, the result file, the time limit and the baseline; the
    child's variant spec parses back to the parent's variant."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gemv_gluon", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    v = G.parse_variant("wscp:32x256:6:w8:l2:dep")
    argv = ["--tile", "16", "--variants", "ws:16x256", "--out=r.json", "--isolate", "90", "--x-f32", "--no-torch",
            "--policy", "rr", "--reps=5"]
    got = mod.child_argv(argv, v.spec())
    assert got == ["--tile", "16", "--x-f32", "--policy", "rr", "--reps=5", "--variants", v.spec(), "--no-torch",
                   "--row-json"]
    assert G.parse_variant(got[got.index("--variants") + 1]) == v
