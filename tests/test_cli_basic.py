"""The CLI skeleton: amk --help/--version, amk doctor, amk info, error exits, pytest markers."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from amk.cli import main

ROOT = Path(__file__).resolve().parents[1]
HAS_CUDA = torch.cuda.is_available()


def amk(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run ``python -m amk ARGS`` as a user would (fresh process, real exit code)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "amk", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)


def test_help_lists_commands(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "doctor" in out and "info" in out


def test_version(capsys):
    from amk import __version__

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"amk {__version__}"


def test_no_command_prints_help_and_exits_2(capsys):
    assert main([]) == 2
    assert "usage: amk" in capsys.readouterr().out


def test_doctor_json_on_this_machine(capsys):
    rc = main(["doctor", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert rc == (0 if report["ok"] else 1)
    assert report["python"]["version"].startswith(f"{sys.version_info[0]}.{sys.version_info[1]}")
    for pkg in ("torch", "triton", "transformers", "nvshmem4py"):
        assert pkg in report["packages"]
    assert report["packages"]["torch"]["version"] == torch.__version__.split("+")[0] or \
        report["packages"]["torch"]["version"] == torch.__version__
    assert report["backends"]["sim"]["available"] is True
    if not HAS_CUDA:
        assert report["gpus"] == []
        assert report["backends"]["triton"]["available"] is False
        assert report["backends"]["triton"]["reason"]
        if shutil.which("nvidia-smi") is None:
            assert report["topology"] is None


def test_doctor_human_output(capsys):
    main(["doctor"])
    out = capsys.readouterr().out
    for word in ("Python", "torch", "triton", "transformers", "nvshmem4py", "sim", "backends"):
        assert word in out
    if not HAS_CUDA:
        assert "no GPU" in out


@pytest.mark.gpu
def test_doctor_sees_gpus(capsys):
    main(["doctor", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert len(report["gpus"]) == torch.cuda.device_count() >= 1
    assert report["torch_cuda"] is not None
    assert report["backends"]["triton"]["available"] is True


def test_info_smollm2_subprocess():
    """The acceptance example: real checkpoint, 30 layers, 576, 9/3 heads, vocab 49152."""
    r = amk("info", "smollm2-135m", "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["family"] == "llama" and info["supported"] is True
    assert (info["layers"], info["hidden_size"]) == (30, 576)
    assert (info["num_attention_heads"], info["num_key_value_heads"]) == (9, 3)
    assert info["vocab_size"] == 49152 and info["head_dim"] == 64
    assert info["parameters"]["total"] == 134_515_008
    assert info["parameters"]["lm_head"] == 0  # tied
    assert info["weight_bytes"] == {"bf16": 2 * 134_515_008, "f32": 4 * 134_515_008}
    assert info["kv_cache_bytes_per_token"]["bf16"] == 2 * 30 * 3 * 64 * 2
    assert info["tp_degrees"] == [1, 3]
    assert info["unsupported"] == []


def test_info_human_table(capsys):
    assert main(["info", "config:tiny-qwen3"]) == 0
    out = capsys.readouterr().out
    for word in ("layers", "hidden size", "query heads", "KV heads", "vocabulary", "parameters",
                 "bf16", "f32", "supported", "even TP degrees", "uneven"):
        assert word in out, word


def test_info_big_recipe_is_cheap(capsys):
    assert main(["info", "config:llama-3.1-8b", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["parameters"]["total"] == 8_030_261_248
    assert info["parameters"]["lm_head"] == 128256 * 4096
    assert info["tp_degrees"] == [1, 2, 4, 8]
    assert info["rope"]["rope_type"] == "llama3"


def test_info_no_such_model_exits_2_one_line():
    r = amk("info", "no-such-model")
    assert r.returncode == 2
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("error: unknown model 'no-such-model'")
    assert "Traceback" not in r.stderr


def test_info_corrupt_config_exits_2(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{ not json")
    assert main(["info", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "config.json:1:3: invalid JSON" in err


def test_info_lists_each_unsupported_feature(tmp_path, capsys):
    """A valid checkpoint of a feature amk refuses: described (exit 0), features listed."""
    from safetensors.torch import save_file

    cfg = {"model_type": "mistral", "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "vocab_size": 300, "max_position_embeddings": 1024, "sliding_window": 128,
           "hidden_act": "gelu"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file({"lm_head.weight": torch.zeros(300, 64)}, str(tmp_path / "model.safetensors"))
    assert main(["info", str(tmp_path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["supported"] is False
    assert {u["field"] for u in info["unsupported"]} == {"sliding_window", "hidden_act"}
    assert main(["info", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.count("unsupported") >= 2 and "sliding_window" in out and "hidden_act" in out


def test_info_bad_max_tp(capsys):
    assert main(["info", "config:tiny-llama", "--max-tp", "0"]) == 2
    assert "--max-tp must be >= 1" in capsys.readouterr().err


def test_gpu_markers_skip_without_gpus(tmp_path):
    """conftest.py: gpu/multigpu tests are skipped (and listed by -ra) when GPUs are missing."""
    shutil.copy(ROOT / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_markers.py").write_text(textwrap.dedent("""
        import pytest

        @pytest.mark.gpu
        def test_needs_gpu():
            pass

        @pytest.mark.multigpu
        def test_needs_two():
            pass

        @pytest.mark.multigpu(64)
        def test_needs_many():
            pass

        @pytest.mark.slow
        def test_slow_still_runs():
            pass
    """))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(  # conftest imports lowering.triton
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    r = subprocess.run([sys.executable, "-m", "pytest", "-ra", "-p", "no:cacheprovider",
                        str(tmp_path)], capture_output=True, text=True, cwd=tmp_path,
                       timeout=300, env=env)
    out = r.stdout
    assert r.returncode == 0, out
    assert "SKIPPED" in out and "multigpu: needs 64 CUDA GPUs" in out
    n = torch.cuda.device_count() if HAS_CUDA else 0
    expected_skips = 1 + (n < 1) + (n < 2)
    assert f"{expected_skips} skipped" in out
    assert "PytestUnknownMarkWarning" not in out
