"""Repository-wide pytest configuration: markers and GPU auto-skip.

Markers:
- ``gpu``: needs one CUDA GPU; skipped (and listed as skipped by ``-ra``) when none is present.
- ``multigpu``: needs at least 2 CUDA GPUs; skipped otherwise. A test may use ``multigpu(n)``
  via ``@pytest.mark.multigpu(4)`` to require n GPUs.
- ``slow``: takes more than ~30 s on a 2-core CPU machine. Slow tests still run by default;
  deselect with ``-m "not slow"``.

The repo root is put on ``sys.path`` so the tests run from a source checkout without
installing (as on the GPU machines, where amk is used from the tree).
"""

from __future__ import annotations

import functools
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.abspath(__file__))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# Triton picks interpreter or compiler when each @triton.jit function is created, including
# its own standard library (tl.zeros, ...) at the first `import triton`. Any test may import
# triton first (amk doctor reads its version), so lowering.triton, which makes that choice
# (the CPU interpreter unless torch sees a CUDA GPU), is imported before any test module.
import lowering.triton  # noqa: E402,F401


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line(
        "markers", "multigpu(n=2): needs at least n CUDA GPUs (skipped with fewer)")
    config.addinivalue_line("markers", "slow: takes more than ~30 s on a 2-core CPU machine")


@functools.lru_cache(maxsize=1)
def cuda_device_count() -> int:
    """Number of visible CUDA GPUs; 0 when torch has no CUDA or no GPU is present."""
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # a broken driver install must skip GPU tests, not crash collection
        return 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    n_gpus = None
    for item in items:
        multi = item.get_closest_marker("multigpu")
        gpu = item.get_closest_marker("gpu")
        if multi is None and gpu is None:
            continue
        if n_gpus is None:
            n_gpus = cuda_device_count()
        if multi is not None:
            need = int(multi.args[0]) if multi.args else int(multi.kwargs.get("n", 2))
            if n_gpus < need:
                item.add_marker(pytest.mark.skip(
                    reason=f"multigpu: needs {need} CUDA GPUs, found {n_gpus}"))
                continue
        if gpu is not None and n_gpus < 1:
            item.add_marker(pytest.mark.skip(reason="gpu: no CUDA GPU present"))


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct checkpoint (fp32, CPU), loaded once per pytest run.

    A ``models.sources.ResolvedModel``: ``.model``, ``.tokenizer``, ``.config``. Shared by every
    test: do not modify its weights.
    """
    from models.sources import resolve_model

    return resolve_model("smollm2-135m")
