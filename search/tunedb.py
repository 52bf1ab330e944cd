"""The tuning database: the fastest measured config per (model shape, GPU, tensor-parallel degree).

An entry says: on GPU ``gpu`` at ``tp`` ranks, the megakernel of a model of shapes ``shape``
ran ``ms`` ms/token with ``config`` (an AmkConfig JSON ``{"lowering": {...}, "kernel":
{...}}``), correct, against the fastest baseline of the same measurement. ``amk tune`` writes
entries; every command that lowers a model reads them (search/heuristic.py ``resolve_config``).

Files: one JSON file per key, named ``<gpu-slug>-sm<SMs>-tp<R>-<shape hash 8>.json``, in two
directories:

* the shipped entries, ``search/tuned/`` (package data, installed with amk);
* the user's, ``--db DIR``, else ``$AMK_TUNE_DB``, else ``$XDG_CACHE_HOME/amk/tuned``, else
  ``~/.cache/amk/tuned`` (``open_db``). ``put`` writes there only.

Lookup (``TuneDB.lookup``): the exact key (every shape field and the run's dtype, the GPU's
name and SM count, tp) and the current ``kernel_fingerprint()``; an entry measured on another
kernel version is not used. Of a user and a shipped entry of one key the faster wins.
``nearest`` ranks all entries by a distance (log-ratios of the shape's sizes, another GPU,
another tp, a stale fingerprint) for warm starts. A file that cannot be read or does not hold
an entry is an AmkError naming the file and the field (exit code 2).
"""

from __future__ import annotations

import ast
import hashlib
import json
import math
import os
import re
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from ground.errors import AmkError

#: Shipped entries (package data; written by ``amk tune``, not by hand).
SHIPPED_DIR = Path(__file__).resolve().parent / "tuned"

#: Distance terms of ``TuneDB.nearest`` (a shape size's |log ratio| counts 1 per e-fold).
OTHER_GPU, OTHER_DTYPE, STALE = 2.0, 1.0, 0.5

_DTYPES = ("bf16", "f32")


@dataclass(frozen=True, order=True)
class ShapeKey:
    """The shapes a tuned config depends on: a ModelSpec's sizes (elements; ``layers``
    decoder layers) and the run's lowering dtype (``bf16`` | ``f32``)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    layers: int
    dtype: str

    @staticmethod
    def from_spec(spec: Any, dtype: str) -> "ShapeKey":
        """The key of a ``models.graph.ModelSpec`` run in ``dtype`` (the lowering's dtype)."""
        return ShapeKey(int(spec.hidden), int(spec.heads), int(spec.kv_heads), int(spec.head_dim),
                        int(spec.intermediate), int(spec.vocab), int(spec.layers), str(dtype))

    def sizes(self) -> tuple[int, ...]:
        """The integer fields, in order."""
        return tuple(getattr(self, f.name) for f in fields(self) if f.name != "dtype")

    def digest(self) -> str:
        """8 hex digits of sha256 over the fields (the file name's shape part)."""
        text = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:8]

    def describe(self) -> str:
        """One line: ``hidden 2048, 16 layers, 32/8 heads x 64, MLP 8192, vocab 128256, bf16``."""
        return (f"hidden {self.hidden}, {self.layers} layers, {self.heads}/{self.kv_heads} heads x "
                f"{self.head_dim}, MLP {self.intermediate}, vocab {self.vocab}, {self.dtype}")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(obj: Any, where: str) -> "ShapeKey":
        """Read the ``shape`` object of an entry file; AmkError naming ``where`` and the field."""
        if not isinstance(obj, dict):
            raise AmkError(f"{where}: field 'shape': expected an object, got {type(obj).__name__}")
        vals = {}
        for f in fields(ShapeKey):
            v = obj.get(f.name)
            if f.name == "dtype":
                if v not in _DTYPES:
                    raise AmkError(f"{where}: field 'shape.dtype': expected one of {', '.join(_DTYPES)}, got {v!r}")
            elif isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise AmkError(f"{where}: field 'shape.{f.name}': expected a positive integer, got {v!r}")
            vals[f.name] = v
        return ShapeKey(**vals)


@dataclass(frozen=True)
class GpuKey:
    """A GPU as torch names it: ``name`` (get_device_properties().name) and ``sms``
    (multi_processor_count)."""

    name: str
    sms: int

    @staticmethod
    def local() -> "GpuKey | None":
        """The first visible CUDA GPU, None without CUDA (or without torch)."""
        try:
            import torch
        except ImportError:
            return None
        if not torch.cuda.is_available():
            return None
        p = torch.cuda.get_device_properties(0)
        return GpuKey(str(p.name), int(p.multi_processor_count))

    @staticmethod
    def parse(text: str) -> "GpuKey":
        """``--gpu NAME[:SMS]``: a GPU by name; SMS defaults to the SM count of a known
        name (H100, H200: 132) and is required otherwise. AmkError for a bad value."""
        name, _, sms = text.rpartition(":") if ":" in text else (text, "", "")
        name = name.strip()
        if not name:
            raise AmkError(f"--gpu {text!r}: expected NAME[:SMS], e.g. 'NVIDIA H100 80GB HBM3:132'")
        if sms:
            try:
                n = int(sms)
            except ValueError:
                raise AmkError(f"--gpu {text!r}: SMS must be an integer, got {sms!r}") from None
            if n < 1:
                raise AmkError(f"--gpu {text!r}: SMS must be >= 1, got {n}")
            return GpuKey(name, n)
        if re.search(r"\bH(100|200)\b", name, re.I):
            return GpuKey(name, 132)
        raise AmkError(f"--gpu {text!r}: give the SM count too (NAME:SMS; torch's "
                       "multi_processor_count)")

    def slug(self) -> str:
        """The name for file names: ``nvidia-h100-80gb-hbm3``."""
        return re.sub(r"[^a-z0-9]+", "-", self.name.lower()).strip("-") or "gpu"

    def describe(self) -> str:
        return f"{self.name} ({self.sms} SMs)"

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "sms": self.sms}

    @staticmethod
    def from_json(obj: Any, where: str) -> "GpuKey":
        if not isinstance(obj, dict):
            raise AmkError(f"{where}: field 'gpu': expected an object, got {type(obj).__name__}")
        name, sms = obj.get("name"), obj.get("sms")
        if not isinstance(name, str) or not name:
            raise AmkError(f"{where}: field 'gpu.name': expected a non-empty string, got {name!r}")
        if isinstance(sms, bool) or not isinstance(sms, int) or sms < 1:
            raise AmkError(f"{where}: field 'gpu.sms': expected a positive integer, got {sms!r}")
        return GpuKey(name, sms)


def _vm_version() -> int:
    """``VM_VERSION`` of lowering/triton/__init__.py, read as text (importing the package
    would import torch and Triton)."""
    import lowering

    path = Path(lowering.__file__).resolve().parent / "triton" / "__init__.py"
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "VM_VERSION" for t in node.targets):
            return int(ast.literal_eval(node.value))
    raise AssertionError(f"{path} defines no VM_VERSION")


_FINGERPRINT: str | None = None


def kernel_fingerprint(config: dict[str, Any] | None = None) -> str:
    """12 hex digits naming the meaning of a config: sha256 over the declarations of its knobs
    (LoweringConfig and KernelConfig: name, default, kind, allowed values, what it needs) and
    the kernel's ``VM_VERSION``. Without ``config``: every declared knob (what a new entry
    records). With ``config`` (``{"lowering": {...}, "kernel": {...}}``): the knobs it names,
    a name no longer declared counted as gone; so a knob added later (at a default that keeps
    the old behaviour) leaves an older entry current, while a changed declaration, a removed
    knob or another VM_VERSION makes it stale. A stale entry was measured on a kernel whose
    configs mean something else (or run at another speed) and is not used by ``lookup``.
    Cheap: no Triton import."""
    global _FINGERPRINT
    if config is None and _FINGERPRINT is not None:
        return _FINGERPRINT
    from lowering.config import KernelConfig, LoweringConfig
    from lowering.knobs import knobs_of

    decl = []
    for part, cls in (("lowering", LoweringConfig), ("kernel", KernelConfig)):
        named = None if config is None else set((config.get(part) or {}))
        for k in knobs_of(cls):
            if named is None or k.name in named:
                decl.append([cls.__name__, k.name, repr(k.default), k.kind.__name__, [repr(c) for c in k.choices],
                             k.lo, k.hi, k.pow2, k.multiple, k.zero, k.values, k.multi_rank,
                             [n.text for n in k.needs]] + (["single_rank"] if k.single_rank else []))
        if named is not None:
            decl += [[cls.__name__, n, "gone"] for n in sorted(named - {k.name for k in knobs_of(cls)})]
    text = json.dumps({"knobs": decl, "vm_version": _vm_version()}, sort_keys=True)
    fp = hashlib.sha256(text.encode()).hexdigest()[:12]
    if config is None:
        _FINGERPRINT = fp
    return fp


def _opt_num(obj: dict, name: str, where: str) -> float | None:
    v = obj.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise AmkError(f"{where}: field {name!r}: expected a number or null, got {v!r}")
    return float(v)


def _opt_str(obj: dict, name: str, where: str) -> str | None:
    v = obj.get(name)
    if v is not None and not isinstance(v, str):
        raise AmkError(f"{where}: field {name!r}: expected a string or null, got {v!r}")
    return v


@dataclass
class Entry:
    """One tuned config and its measurement.

    ``config``: AmkConfig JSON; ``ms``: the megakernel's measured ms/token with it;
    ``baseline_ms`` / ``baseline``: the fastest baseline of the same measurement and its name;
    ``ratio``: baseline_ms / ms (> 1: the megakernel is faster); ``roofline_pct``: the share of
    the HBM roofline; ``correct``: the correctness verdict of the measurement; ``date``
    (ISO), ``command`` (what measured it), ``commit`` (the source tree's, if known).
    ``source`` (``shipped`` | ``user``) and ``path`` are set on load, not stored."""

    shape: ShapeKey
    gpu: GpuKey
    tp: int
    fingerprint: str
    config: dict
    ms: float
    baseline_ms: float | None
    baseline: str | None
    ratio: float | None
    roofline_pct: float | None
    correct: bool
    date: str
    command: str
    commit: str | None
    source: str = "user"
    path: str | None = None

    def current(self) -> bool:
        """True when the entry was measured on the kernel this tree builds for its config: its
        fingerprint is ``kernel_fingerprint()`` (recorded by this tree) or that of the knobs
        its config names (recorded before knobs it does not name were added)."""
        return self.fingerprint in (kernel_fingerprint(), kernel_fingerprint(self.config))

    def key(self) -> tuple:
        """(shape, gpu, tp): one file, one entry per key and directory."""
        return (self.shape, self.gpu, self.tp)

    def file_name(self) -> str:
        return file_name(self.shape, self.gpu, self.tp)

    def to_json(self) -> dict[str, Any]:
        """The entry file's object (the key's fields readable at the top)."""
        return {"shape": self.shape.to_json(), "gpu": self.gpu.to_json(), "tp": self.tp,
                "fingerprint": self.fingerprint, "config": self.config, "ms": self.ms,
                "baseline_ms": self.baseline_ms, "baseline": self.baseline, "ratio": self.ratio,
                "roofline_pct": self.roofline_pct, "correct": self.correct, "date": self.date,
                "command": self.command, "commit": self.commit}

    @staticmethod
    def from_json(obj: Any, where: str) -> "Entry":
        """Read an entry file's object; ``where`` names it in errors. Raises AmkError naming
        the field for a missing or ill-typed field, and for a config that does not validate
        (checked only for an entry of the current kernel fingerprint: a stale entry's knobs
        may be gone)."""
        if not isinstance(obj, dict):
            raise AmkError(f"{where}: expected a JSON object (a tuned entry), got {type(obj).__name__}")
        shape = ShapeKey.from_json(obj.get("shape"), where)
        gpu = GpuKey.from_json(obj.get("gpu"), where)
        tp = obj.get("tp")
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise AmkError(f"{where}: field 'tp': expected a positive integer, got {tp!r}")
        fp = obj.get("fingerprint")
        if not isinstance(fp, str) or not re.fullmatch(r"[0-9a-f]{12}", fp):
            raise AmkError(f"{where}: field 'fingerprint': expected 12 hex digits, got {fp!r}")
        config = obj.get("config")
        if not isinstance(config, dict):
            raise AmkError(f"{where}: field 'config': expected an object {{\"lowering\": ..., \"kernel\": ...}}, "
                           f"got {type(config).__name__}")
        if fp in (kernel_fingerprint(), kernel_fingerprint(config)):
            from lowering.config import AmkConfig

            AmkConfig.from_json(config, f"{where}: field 'config'", ranks=tp)
        ms = _opt_num(obj, "ms", where)
        if ms is None or ms <= 0:
            raise AmkError(f"{where}: field 'ms': expected a positive number, got {obj.get('ms')!r}")
        correct = obj.get("correct")
        if not isinstance(correct, bool):
            raise AmkError(f"{where}: field 'correct': expected true or false, got {correct!r}")
        date = obj.get("date")
        if not isinstance(date, str):
            raise AmkError(f"{where}: field 'date': expected a string, got {date!r}")
        command = obj.get("command")
        if not isinstance(command, str):
            raise AmkError(f"{where}: field 'command': expected a string, got {command!r}")
        return Entry(shape, gpu, tp, fp, config, ms, _opt_num(obj, "baseline_ms", where),
                     _opt_str(obj, "baseline", where), _opt_num(obj, "ratio", where),
                     _opt_num(obj, "roofline_pct", where), correct, date, command,
                     _opt_str(obj, "commit", where))

    def describe(self) -> str:
        """``1.234 ms/token, 1.05 x the fastest baseline, 2026-11-27``."""
        vs = f"{self.ratio:.2f} x the fastest baseline" if self.ratio else "no baseline measured"
        return f"{self.ms:.4g} ms/token, {vs}, {self.date}"


def file_name(shape: ShapeKey, gpu: GpuKey, tp: int) -> str:
    """The entry file of a key: ``<gpu-slug>-sm<SMs>-tp<R>-<shape hash 8>.json``."""
    return f"{gpu.slug()}-sm{gpu.sms}-tp{tp}-{shape.digest()}.json"


def read_entry(path: Path, source: str) -> Entry:
    """The entry in file ``path``; AmkError naming the file (and the field) when it cannot be
    read, is not JSON (line:column) or does not hold an entry."""
    from ground.files import read_json

    entry = Entry.from_json(read_json(path, "tuned entry"), str(path))
    entry.source, entry.path = source, str(path)
    return entry


def distance(entry: Entry, shape: ShapeKey, gpu: GpuKey | None, tp: int) -> float:
    """How far ``entry`` is from the key (0: the same key, current kernel): the sum of
    |log(a / b)| over the shape's sizes, OTHER_DTYPE for another dtype, OTHER_GPU plus
    |log(SM ratio)| for another GPU (or an unknown one), |log2(tp ratio)| for another tp and
    STALE for an entry of another kernel fingerprint."""
    d = sum(abs(math.log(a / b)) for a, b in zip(entry.shape.sizes(), shape.sizes()))
    d += OTHER_DTYPE * (entry.shape.dtype != shape.dtype)
    if gpu is None or entry.gpu != gpu:
        d += OTHER_GPU
        if gpu is not None:
            d += abs(math.log(entry.gpu.sms / gpu.sms))
    d += abs(math.log2(entry.tp / tp))
    d += STALE * (not entry.current())
    return d


class TuneDB:
    """The shipped entries and the user's (``user_dir``; None: shipped only, ``put`` refused)."""

    def __init__(self, user_dir: Path | None, shipped_dir: Path | None = SHIPPED_DIR):
        self.user_dir = Path(user_dir) if user_dir is not None else None
        self.shipped_dir = Path(shipped_dir) if shipped_dir is not None else None

    def _dirs(self) -> list[tuple[Path, str]]:
        return [(d, s) for d, s in ((self.user_dir, "user"), (self.shipped_dir, "shipped"))
                if d is not None and d.is_dir()]

    def entries(self) -> list[Entry]:
        """Every entry of both directories (user first). AmkError for a bad file."""
        out = []
        for d, source in self._dirs():
            for p in sorted(d.glob("*.json")):
                out.append(read_entry(p, source))
        return out

    def _of_key(self, shape: ShapeKey, gpu: GpuKey, tp: int) -> list[Entry]:
        """The entries stored under the key's file name, in either directory."""
        out = []
        name = file_name(shape, gpu, tp)
        for d, source in self._dirs():
            p = d / name
            if p.is_file():
                e = read_entry(p, source)
                if e.key() != (shape, gpu, tp):
                    raise AmkError(f"{p}: holds the entry of another key ({e.shape.describe()} on "
                                   f"{e.gpu.describe()} tp {e.tp}); its name should be {e.file_name()}")
                out.append(e)
        return out

    def lookup(self, shape: ShapeKey, gpu: GpuKey | None, tp: int) -> Entry | None:
        """The entry to run for the key: exact shape, GPU (name and SMs) and tp, the current
        kernel fingerprint, a correct measurement; of a user and a shipped one the faster.
        None without a GPU or without such an entry."""
        if gpu is None:
            return None
        ok = [e for e in self._of_key(shape, gpu, tp) if e.current() and e.correct]
        return min(ok, key=lambda e: e.ms) if ok else None

    def nearest(self, shape: ShapeKey, gpu: GpuKey | None, tp: int, k: int = 3) -> list[tuple[float, Entry]]:
        """The ``k`` entries closest to the key by ``distance`` (warm starts), nearest first;
        stale-fingerprint entries included (their config may name knobs that no longer exist),
        incorrect ones not."""
        scored = [(distance(e, shape, gpu, tp), e) for e in self.entries() if e.correct]
        scored.sort(key=lambda de: (de[0], de[1].ms))
        return scored[:k]

    def put(self, entry: Entry, replace: bool = False) -> tuple[bool, str]:
        """Store ``entry`` in the user directory (atomic write). An existing entry of the key
        that is faster (lower ms) and of the current fingerprint is kept unless ``replace``:
        (False, "kept the existing entry: X ms < Y ms (use --replace)"). A slower or stale one
        is replaced and the message says so. An incorrect measurement is not stored.
        Returns (written, one line). AmkError when there is no user directory or the write fails."""
        from ground.files import atomic_write_json

        if self.user_dir is None:
            raise AmkError("no user tuning database to write to (--db DIR or $AMK_TUNE_DB)")
        if not entry.correct:
            return False, "not stored: the measurement was not correct"
        path = self.user_dir / entry.file_name()
        old = read_entry(path, "user") if path.is_file() else None
        if old is not None and old.key() != entry.key():
            raise AmkError(f"{path}: holds the entry of another key ({old.shape.describe()} on "
                           f"{old.gpu.describe()} tp {old.tp})")
        if old is None:
            msg = f"wrote {path}: {entry.ms:.4g} ms/token"
        elif not old.current():
            msg = (f"replaced {path}: its entry ({old.ms:.4g} ms) was measured on another kernel "
                   f"(fingerprint {old.fingerprint}, now {entry.fingerprint})")
        elif old.ms <= entry.ms and not replace:
            return False, (f"kept the existing entry: {old.ms:.4g} ms < {entry.ms:.4g} ms (use --replace) "
                           f"({path})")
        elif old.ms <= entry.ms:
            msg = f"replaced {path} (--replace): {old.ms:.4g} ms -> {entry.ms:.4g} ms, slower"
        else:
            msg = f"replaced the slower entry in {path}: {old.ms:.4g} ms -> {entry.ms:.4g} ms"
        atomic_write_json(path, entry.to_json())
        shipped = [e for e in self._of_key(entry.shape, entry.gpu, entry.tp)
                   if e.source == "shipped" and e.current() and e.correct]
        if shipped and shipped[0].ms < entry.ms:
            msg += (f"; the shipped entry ({shipped[0].ms:.4g} ms, {shipped[0].path}) is faster and stays "
                    "the one used")
        return True, msg


def user_dir(db: str | None) -> Path:
    """The user database directory: ``db`` (--db DIR), else $AMK_TUNE_DB, else
    $XDG_CACHE_HOME/amk/tuned (an absolute XDG_CACHE_HOME), else ~/.cache/amk/tuned."""
    if db:
        return Path(db).expanduser()
    env = os.environ.get("AMK_TUNE_DB")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "amk" / "tuned"


def shipped_dir() -> Path | None:
    """The shipped entries' directory: ``$AMK_TUNE_SHIPPED`` when set (empty: none, e.g. to
    tune from an empty database), else SHIPPED_DIR."""
    env = os.environ.get("AMK_TUNE_SHIPPED")
    if env is None:
        return SHIPPED_DIR
    return Path(env).expanduser() if env.strip() else None


def open_db(db: str | None) -> TuneDB:
    """The database of a command: the user directory of ``user_dir(db)`` (need not exist yet)
    and the shipped entries (``shipped_dir()``). AmkError when ``db`` names something that is
    not a directory."""
    d = user_dir(db)
    if d.exists() and not d.is_dir():
        raise AmkError(f"{d}: the tuning database must be a directory (--db DIR / $AMK_TUNE_DB)")
    return TuneDB(d, shipped_dir())


__all__ = ["Entry", "GpuKey", "SHIPPED_DIR", "ShapeKey", "TuneDB", "distance", "file_name",
           "kernel_fingerprint", "open_db", "read_entry", "shipped_dir", "user_dir"]
