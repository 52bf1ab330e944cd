"""The kernel cache: a generated megakernel source (codegen.py) written to a file named by its
hash and imported, so that Triton's JIT (which needs a source file) compiles it; identical
sources share one module and one compile. ``$AMK_CACHE_DIR/triton`` or the temp dir.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile
from pathlib import Path


def cache_dir() -> Path:
    """Where generated kernels are written: ``$AMK_CACHE_DIR/triton`` or the temp dir."""
    base = os.environ.get("AMK_CACHE_DIR") or os.path.join(tempfile.gettempdir(), "amk-cache")
    d = Path(base) / "triton"
    d.mkdir(parents=True, exist_ok=True)
    return d


def load_kernel(source: str):
    """Write ``source`` to the cache (named by its hash) and import it; returns the jit
    kernel ``amk_megakernel``. Identical sources share one module (and one compile)."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    mod_name = f"amk_megakernel_{digest}"
    mod = sys.modules.get(mod_name)
    if mod is None:
        path = cache_dir() / f"{mod_name}.py"
        if not path.exists() or path.read_text() != source:
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(source)
            os.replace(tmp, path)
        spec = importlib.util.spec_from_file_location(mod_name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = mod
        spec.loader.exec_module(mod)
    return mod.amk_megakernel
