"""amk: compile HF decoder models into validated persistent multi-GPU megakernels."""

__version__ = "0.1.0"
