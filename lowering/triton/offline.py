"""Offline compile of a generated megakernel for ``sm_<arch>`` without a GPU (Triton's own LLVM
and ptxas), and its command line::

    TRITON_INTERPRET=0 python -m lowering.triton.offline kernel.py --arch 90

``kernel.py`` is a source written by ``TritonExecutor.emit_source``, whose last line
(``# amk-launch: {json}``) holds the launch's constexprs, warps and register cap. Prints
one JSON object: shared memory, registers and spills per thread (from cuobjdump when Triton
ships it) and which PTX features the GPU run depends on (acquire polls, the global timer,
release signals, barriers, vector loads, the L2 evict-first weight loads and prefetches,
the weight ring's bulk copies, the int8 weights' conversions to fp32 (``int8_to_f32``: Triton widens int8 to s16 first; ``int8_prmt``: the int8_convert prmt code), the gemm op's
tensor-core instructions: ``wgmma`` / ``mma_sync`` counts, ...). An unreadable
source, a bad ``--constexprs`` or the interpreter left on: one line on stderr, exit code 2.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import triton

from lowering.triton.blocks import Blocks
from lowering.triton.cache import load_kernel
from lowering.triton.lang import INTERPRET

#: Kernel argument types for an offline compile (pointer args are 16-byte aligned views).
_ARG_TYPES = {"A_BF16": "*bf16", "A_F16": "*fp16", "A_F32": "*fp32", "A_I32": "*i32", "TASKS": "*i64",
              "WAITS": "*i64", "SIGS": "*i64", "QSTART": "*i32", "ERR": "*i64", "EPOCH": "*i64",
              "slots": "i32", "timeout": "i64", "PROF": "*i64", "XS": "*fp32", "xs_w": "i32",
              "STREAMS": "*i64", "SSTART": "*i32", "rbase": "i32"}


def resource_usage(k) -> dict:
    """``{"regs", "local_bytes"}`` per thread of a compiled kernel ``k`` (``triton.compile``'s
    result) from cuobjdump's resource report (Triton's bundled one, else the PATH's); empty
    when neither is present or the kernel has no cubin. Local bytes above 0 are spills."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    tool = str(tool) if tool.exists() else shutil.which("cuobjdump")
    if not tool or "cubin" not in k.asm:
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        res = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True)
    m = re.search(r"REG:(\d+).*?LOCAL:(\d+)", res.stdout)
    return {"regs": int(m.group(1)), "local_bytes": int(m.group(2))} if m else {}


def compile_offline(source: str, constexprs: dict[str, int], arch: int = 90, num_warps: int = 4,
                    maxnreg: int | None = None) -> dict:
    """Compile a generated megakernel for ``sm_<arch>`` without a GPU (Triton's own LLVM and
    ptxas) and report what the GPU run depends on: shared memory, registers and spills per
    thread (from cuobjdump when Triton ships it) and whether the PTX holds the acquire
    polls, the global timer, the release signals and barriers; ``wgmma`` / ``mma_sync``:
    how many Hopper warpgroup / warp-level tensor-core instructions it holds (tl.dot).

    Must run in a process with ``TRITON_INTERPRET=0`` (the jit functions must be compiled
    ones); ``python -m lowering.triton.offline FILE`` does that. Raises RuntimeError
    otherwise. ``maxnreg``: ptxas's register cap per thread (None: its own choice).
    """
    if INTERPRET:
        raise RuntimeError("compile_offline needs TRITON_INTERPRET=0 in this process")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = load_kernel(source)
    constexprs = {"PROFILE": False, "GEMV_STAGES": 1, "PREFETCH": 0, **constexprs}
    sig = {n: ("constexpr" if n in constexprs else _ARG_TYPES[n]) for n in fn.arg_names}
    # pointers are 16-byte aligned; xs_w (scratch row, elements) is a multiple of 16 (runtime)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if _ARG_TYPES.get(n, "")[:1] == "*" or n == "xs_w"}
    k = triton.compile(ASTSource(fn, sig, constexprs=dict(constexprs), attrs=attrs),
                       target=GPUTarget("cuda", arch, 32),
                       options=dict(num_warps=num_warps, **({"maxnreg": maxnreg} if maxnreg else {})))
    ptx = k.asm["ptx"]
    out = dict(arch=arch, num_warps=num_warps, maxnreg=maxnreg, shared=int(k.metadata.shared),
               acquire_polls="ld.acquire.gpu.global.b32" in ptx, global_timer="%globaltimer" in ptx,
               acquire_polls_sys="ld.acquire.sys.global.b32" in ptx,
               l2_prefetch="cp.async.bulk.prefetch.L2" in ptx, async_copy="cp.async" in ptx,
               l2_prefetch_evict_first="cp.async.bulk.prefetch.L2.global.L2::cache_hint" in ptx,
               evict_first_loads=len(re.findall(r"ld\.global\.L1::evict_first\.L2::cache_hint", ptx)),
               tma_copies=ptx.count("cp.async.bulk.tensor"),
               int8_to_f32=len(re.findall(r"cvt\.rn\.f32\.s(8|16)\b", ptx)),
               int8_prmt=ptx.count("0f4B000080"),
               ring_copies=ptx.count("cp.async.bulk.shared::cluster.global"),
               ring_waits=ptx.count("mbarrier.try_wait.parity"), ring_page_loads=ptx.count("ld.shared.v4.b32 {"),
               row_prefetch="prefetch.global.L1" in ptx,
               release_gpu="gpu.release.add" in ptx, release_sys="sys.release.add" in ptx,
               relaxed_red_sys="red.relaxed.sys.global.add" in ptx,
               barrier="bar.sync" in ptx, vector_loads=bool(re.search(r"ld\.global(\.[\w:]+)*\.v4", ptx)),
               vector_stores=bool(re.search(r"st\.global(\.\w+)*\.v4", ptx)),
               wgmma=ptx.count("wgmma.mma_async"), mma_sync=ptx.count("mma.sync"),
               regs=None, local_bytes=None)
    out.update(resource_usage(k))
    return out


def launch_meta(source: str) -> tuple[dict, int, int | None]:
    """(constexprs, num_warps, maxnreg) of an emitted kernel source: its ``# amk-launch:``
    line (TritonExecutor.emit_source) over the default Blocks' sizes; 4 warps and no
    register cap where the line does not say."""
    import json

    b = Blocks()
    cx = dict(BLOCK=b.elementwise, GEMV_N=b.gemv_n, GEMV_K=b.gemv_k, ROPE_BLOCK=b.rope, ATT_T=b.attention_t,
              ATT_D=b.attention_d, ATT_Q=b.attention_q, PAIR_BLOCK=b.pairs, GEMV_NQ=b.gemv_n)
    warps, maxnreg = 4, None
    for line in source.splitlines():
        if line.startswith("# amk-launch: "):
            meta = json.loads(line[len("# amk-launch: "):])
            cx.update(meta.get("constexprs", {}))
            warps = meta.get("num_warps", warps)
            maxnreg = meta.get("maxnreg")
    return cx, warps, maxnreg


def main(argv: list[str] | None = None) -> int:
    """The command line (module doc); returns the exit code."""
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="python -m lowering.triton.offline",
                                 description="Compile a generated megakernel source offline (no GPU needed).")
    ap.add_argument("source", help="a kernel source written by TritonExecutor.emit_source")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--num-warps", type=int, default=None, help="default: the emitted launch's, else 4")
    ap.add_argument("--constexprs", default="{}", help="JSON: block sizes overriding the emitted launch's")
    ap.add_argument("--maxnreg", type=int, default=None, help="register cap per thread")
    a = ap.parse_args(argv)
    try:
        text = Path(a.source).read_text()
        cx, warps, maxnreg = launch_meta(text)
        extra = json.loads(a.constexprs)
        if not isinstance(extra, dict):
            raise ValueError("not a JSON object")
    except OSError as e:
        return _fail(ap.prog, f"cannot read {a.source}: {e.strerror or e}")
    except ValueError as e:  # a bad --constexprs or amk-launch line (json.JSONDecodeError is one)
        return _fail(ap.prog, f"--constexprs or the source's amk-launch line is not a JSON object: {e}")
    if INTERPRET:
        return _fail(ap.prog, "the offline compile needs TRITON_INTERPRET=0 (the Triton interpreter is on)")
    cx.update(extra)
    print(json.dumps(compile_offline(text, cx, a.arch, a.num_warps or warps, a.maxnreg or maxnreg)))
    return 0


def _fail(prog: str, message: str) -> int:
    """Print ``prog: error: message`` (one line, stderr); returns the exit code 2."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
