"""amk: compile HF decoder models into validated persistent multi-GPU megakernels.

The Python API (amk/api.py, docs/api.md): ``amk.compile(model, tp=, backend=, config=)``
returns a ``CompiledModel`` with ``generate(...)`` and ``save(dir)``; ``amk.load(dir)`` reads a
saved one back. ``amk.distribute(fn, world=, shapes=, dtype=, backend=, config=)``
(amk/distributed.py, docs/dist.md) returns the fused, validated version of a function written
with torch.distributed collectives. They are imported on first use, so ``import amk`` stays
cheap.
"""

__version__ = "0.1.0"

_API = ("compile", "load", "CompiledModel", "GenerateOutput")
_DIST = ("distribute",)


def __getattr__(name: str):
    if name in _API:
        from amk import api

        return getattr(api, name)
    if name in _DIST:
        from amk import distributed

        return getattr(distributed, name)
    raise AttributeError(f"module 'amk' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_API) + list(_DIST))
