"""The multi-GPU megakernel end to end (``multigpu`` marker: run by scripts/device_test.sh on
an NVLink machine; skipped, and listed, elsewhere): ``amk generate --tp R --backend triton``
spawns one process per GPU, the ranks exchange partial sums through NVSHMEM inside the
kernel, and the greedy tokens must equal HF's. Needs nvshmem4py on the machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _generate(model: str, ranks: int, extra: list[str] = ()) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    r = subprocess.run([sys.executable, "-m", "amk", "generate", model, "--prompt", "The capital of France is",
                        "--max-new-tokens", "16", "--tp", str(ranks), "--backend", "triton", "--verify",
                        "--json", *extra], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-4000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.multigpu(2)
@pytest.mark.parametrize("fuse", [False, True, "reduce"])
def test_two_gpus_match_hf_greedy(tmp_path, fuse):
    # fp32, so that HF greedy (fp32) is the exact reference; bf16 is judged by amk bench's rules.
    # "reduce": fused, with the all-reduce's peer stores in the GEMV tiles and its sum in the
    # consumers' prologue (allreduce fused, fuse_reduce)
    knobs = {"fuse": bool(fuse), "tile": 16, "workers": 8, "policy": "balanced"}
    if fuse == "reduce":
        knobs.update(allreduce="fused", fuse_reduce=True)
    cfg = tmp_path / "knobs.json"
    cfg.write_text(json.dumps(knobs))
    out = _generate("config:smollm2-135m", 2, ["--config", str(cfg)])
    assert out["ranks"] == 2 and out["match"], out


@pytest.mark.multigpu(4)
def test_four_gpus_match_hf_greedy():
    out = _generate("config:smollm2-135m", 4)  # 9 query / 3 KV heads over 4 ranks: uneven split
    assert out["ranks"] == 4 and out["match"], out
