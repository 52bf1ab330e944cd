"""amk: compile HF decoder models into validated persistent multi-GPU megakernels.

The Python API (amk/api.py, docs/api.md): ``amk.compile(model, tp=, backend=, config=)``
returns a ``CompiledModel`` with ``generate(...)`` and ``save(dir)``; ``amk.load(dir)`` reads a
saved one back. They are imported on first use, so ``import amk`` stays cheap.
"""

__version__ = "0.1.0"

_API = ("compile", "load", "CompiledModel", "GenerateOutput")


def __getattr__(name: str):
    if name in _API:
        from amk import api

        return getattr(api, name)
    raise AttributeError(f"module 'amk' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_API))
