"""One rank of a tests/test_baselines_tp.py run (started R times with torchrun variables).

Usage: python tests/tp_baselines_driver.py MODE MODEL OUT_DIR N_TOKENS PROMPT_LEN

MODE:
- ``cpu-eager``: CPU, gloo, fp32. The TP eager baseline, and the compiled baseline with a
  compiler that always fails (so the uncompiled fallback and its recorded reason run).
- ``cpu-compiled``: CPU, gloo, fp32. The compiled baseline with inductor, no CUDA graph.
- ``gpu``: CUDA + NCCL (default group "cpu:gloo,cuda:nccl"), bf16: ``run_tp_baselines``
  as ``amk bench --tp R`` would call it; rank 0 also judges the tokens against the
  single-GPU HF reference (``make_reference``).

Rank 0 writes OUT_DIR/result.json. The prompt is drawn from a fixed seed.
"""

from __future__ import annotations

import json
import os
import sys

MODE = sys.argv[1]
if MODE.startswith("cpu"):
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a CPU mesh over gloo, even on a GPU machine

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from amk.baselines import judge, make_reference  # noqa: E402
from amk.baselines_tp import (gather_tp, hf_tp_compiled_graph, hf_tp_eager,  # noqa: E402
                              load_tp_model, prepare_tp_checkpoint, run_tp_baselines,
                              tp_sharded_parameters)
from lowering.triton.dist import DistContext, env_world  # noqa: E402


def broken_backend(gm, example_inputs):
    """A torch.compile backend that always fails: exercises the uncompiled fallback."""
    raise RuntimeError("test: compiler refused")


def main() -> None:
    model_arg, out_dir = sys.argv[2], sys.argv[3]
    n_tokens, prompt_len = int(sys.argv[4]), int(sys.argv[5])
    rank, world, local = env_world()
    torch.set_num_threads(1)  # two ranks share a 2-core CI machine
    if MODE == "gpu":
        torch.cuda.set_device(local)
        dist.init_process_group("cpu:gloo,cuda:nccl", rank=rank, world_size=world)
        device = torch.device("cuda", local)
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        device = torch.device("cpu")
    ctx = DistContext(rank=rank, world=world, local_rank=local, device=device)
    from models.sources import resolve_model

    cfg = resolve_model(model_arg, weights=False).config
    g = torch.Generator().manual_seed(1234)
    prompt = torch.randint(0, cfg.vocab_size, (1, prompt_len), generator=g)
    out: dict = {"world": world}
    try:
        if MODE == "gpu":
            ref_model = resolve_model(model_arg, dtype="bf16").model if rank == 0 else None
            rows = run_tp_baselines(model_arg, ctx, prompt, n_tokens,
                                    os.path.join(out_dir, "ckpt"), model=ref_model)
            if rank == 0:
                ref = make_reference(ref_model.to(device), prompt.to(device), n_tokens)
                out["reference"] = ref.tokens
                out["rows"] = [dict(judge(r, ref).to_json(), tokens=r.tokens) for r in rows]
        else:
            ckpt = prepare_tp_checkpoint(model_arg, ctx, os.path.join(out_dir, "ckpt"),
                                         dtype="fp32")
            model = load_tp_model(ckpt, ctx, dtype="fp32")
            out["sharded"] = {k: [list(a), list(b)]
                              for k, (a, b) in tp_sharded_parameters(model).items()}
            rows = []
            if MODE == "cpu-eager":
                rows.append(gather_tp(ctx, hf_tp_eager(model, ctx, prompt, n_tokens)))
                rows.append(gather_tp(ctx, hf_tp_compiled_graph(
                    model, ctx, prompt, n_tokens, cuda_graph=False,
                    compile_backend=broken_backend)))
                rows.append(gather_tp(ctx, hf_tp_compiled_graph(  # a named mode: its row name
                    model, ctx, prompt, n_tokens, cuda_graph=False,
                    compile_backend=broken_backend, mode="max-autotune-no-cudagraphs")))
            else:
                rows.append(gather_tp(ctx, hf_tp_compiled_graph(model, ctx, prompt, n_tokens,
                                                                cuda_graph=False)))
            out["rows"] = [dict(r.to_json(), tokens=r.tokens) for r in rows]
        out["prompt"] = prompt[0].tolist()
        if rank == 0:
            with open(os.path.join(out_dir, "result.json"), "w") as f:
                json.dump(out, f, default=str)
    finally:
        ctx.close()


if __name__ == "__main__":
    main()
    # Every result is written and the process group closed. Leave without running C++
    # static destructors: a torch background thread still joinable there aborts the rank
    # ("terminate called without an active exception", exit -6) in about one CPU run in
    # three, after the work has succeeded. An exception in main() still exits non-zero.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
