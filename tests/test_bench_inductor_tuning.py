"""bench/inductor_tuning.py: inductor's tuning results saved from one cache folder and loaded
into another, and archives it must refuse."""

import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import inductor_tuning as it  # noqa: E402
from ground.errors import AmkError  # noqa: E402


def _cache(root: Path) -> Path:
    (root / "ab").mkdir(parents=True)
    (root / "ab" / "cabc.py").write_text("kernel source")  # not carried
    (root / "ab" / "k1.best_config").write_text('{"XBLOCK": 8, "found_by_coordesc": true}')
    (root / "cd" / "deep").mkdir(parents=True)
    (root / "cd" / "deep" / "k2.best_config").write_text('{"XBLOCK": 16}')
    return root


def test_save_then_load_carries_only_the_tuning_results(tmp_path):
    src = _cache(tmp_path / "src")
    archive = tmp_path / "out" / "t.tgz"
    assert it.save(archive, src) == 2
    with tarfile.open(archive) as tar:
        assert sorted(tar.getnames()) == ["ab/k1.best_config", "cd/deep/k2.best_config"]
    dst = tmp_path / "fresh"
    assert it.load(archive, dst) == 2
    for rel in ("ab/k1.best_config", "cd/deep/k2.best_config"):
        assert (dst / rel).read_text() == (src / rel).read_text()
    assert not (dst / "ab" / "cabc.py").exists()


def _archive(path: Path, name: str, data: bytes = b"{}") -> Path:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    path.write_bytes(buf.getvalue())
    return path


@pytest.mark.parametrize("name", ["../escape.best_config", "/abs/k.best_config", "ab/kernel.py"])
def test_load_refuses_members_that_are_not_tuning_results(tmp_path, name):
    archive = _archive(tmp_path / "bad.tgz", name)
    with pytest.raises(AmkError, match="is not a .best_config file"):
        it.load(archive, tmp_path / "cache")
    assert not (tmp_path / "cache").exists() and not (tmp_path / "escape.best_config").exists()


def test_command_line_errors_are_one_line_exit_2(tmp_path):
    (tmp_path / "junk.tgz").write_bytes(b"not a tar")
    cache = ["--cache", str(tmp_path / "c")]
    script = [sys.executable, str(ROOT / "bench" / "inductor_tuning.py")]
    for args in (["load", str(tmp_path / "missing.tgz"), *cache], ["load", str(tmp_path / "junk.tgz"), *cache],
                 ["save", str(tmp_path / "o.tgz"), "--cache", str(tmp_path / "nothing")]):
        r = subprocess.run([*script, *args], capture_output=True, text=True)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and "error:" in r.stderr, (args, r.stderr)
    r = subprocess.run([*script, "load", str(tmp_path / "missing.tgz"), "--missing-ok", *cache,
                        "--out", str(tmp_path / "r.json")], capture_output=True, text=True)
    assert r.returncode == 0 and "nothing loaded" in r.stdout
    assert json.loads((tmp_path / "r.json").read_text())["results"] == 0
