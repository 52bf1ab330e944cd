import sys, re
from pathlib import Path
from lowering.triton.offline import launch_meta
from lowering.triton.cache import load_kernel
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from lowering.triton.offline import _ARG_TYPES
text = Path(sys.argv[1]).read_text()
cx, warps, maxnreg = launch_meta(text)
fn = load_kernel(text)
constexprs = {"PROFILE": False, **cx}
sig = {n: ("constexpr" if n in constexprs else _ARG_TYPES[n]) for n in fn.arg_names}
attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if _ARG_TYPES.get(n, "")[:1] == "*" or n == "xs_w"}
k = triton.compile(ASTSource(fn, sig, constexprs=constexprs, attrs=attrs), target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
ptx = k.asm["ptx"]
print(triton.__version__, "wgmma", ptx.count("wgmma.mma_async"), "mma.sync", ptx.count("mma.sync"), "ldmatrix", ptx.count("ldmatrix"), "ld.global.v", len(re.findall(r"ld\.global(\.\w+)*\.v\d", ptx)), "ld.global", ptx.count("ld.global"), "shared", k.metadata.shared)
import collections
c = collections.Counter(re.findall(r"\b(ld\.global[\w.]*|cp\.async[\w.:]*|ld\.shared[\w.]*|st\.shared[\w.]*)", ptx))
print(c.most_common(20))
