"""The Python API: compile a model once, generate with it, save it and load it back.

    import amk
    m = amk.compile("config:tiny-llama", tp=2, backend="sim")
    out = m.generate("Hello", max_new_tokens=16)                  # LongTensor [1, T + N]
    out = m.generate(ids, max_new_tokens=16, do_sample=True, temperature=0.8, top_p=0.9, seed=1)
    m.save("build/tiny")                                          # schedule + config + checksum
    m2 = amk.load("build/tiny")                                   # no lowering, no validation

``compile`` runs what ``amk compile`` runs (resolve, import, lower, validate) without the HF
correctness check; ``generate`` follows transformers' ``generate`` conventions (batch size 1):
see ``CompiledModel.generate``. docs/api.md describes shapes, dtypes, the saved directory and
the errors.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from ground.errors import AmkError

#: The saved directory's manifest file and its format tag.
MANIFEST = "amk.json"
SCHEDULE = "schedule.json"
FORMAT = "amk-compiled/1"


# -- configuration --------------------------------------------------------------------------
def resolve_config(config: Any, model: str, tp: int, backend: str, max_seq: int | None = None):
    """The AmkConfig of ``compile``: ``config`` None (the tuned entry for the model's shapes,
    ``tp`` and GPU, else the cost-model heuristic, as ``amk generate`` picks without flags),
    an ``AmkConfig``, a ``LoweringConfig``, a dict (``{"lowering": {...}, "kernel": {...}}``
    or lowering knobs alone), or a path to a config file; ``max_seq`` overrides the KV-cache
    length. Returns (AmkConfig, source line). AmkError names a bad field."""
    import argparse

    from lowering.config import AmkConfig, KernelConfig, LoweringConfig

    if config is None:
        from amk.checks import model_spec
        from search.defaults import command_config, gpu_for

        ns = argparse.Namespace()
        gpu = gpu_for(ns)
        cfg, line = command_config(ns, "amk.compile", model_spec(model)[1], tp, gpu,
                                   max_workers=_target(backend).max_workers)
        if backend != "triton":
            cfg = AmkConfig(cfg.lowering, KernelConfig())
    elif isinstance(config, AmkConfig):
        cfg, line = config, "config: AmkConfig"
    elif isinstance(config, LoweringConfig):
        cfg, line = AmkConfig(config, KernelConfig()), "config: LoweringConfig"
    elif isinstance(config, dict):
        cfg, line = AmkConfig.from_json(config, "config", ranks=tp), "config: dict"
    elif isinstance(config, (str, os.PathLike)):
        cfg, line = AmkConfig.from_file(config, ranks=tp), f"config: {config}"
    else:
        raise AmkError(f"config must be None, an AmkConfig, a LoweringConfig, a dict or a file path, "
                       f"got {type(config).__name__}")
    if max_seq is not None:
        if isinstance(max_seq, bool) or not isinstance(max_seq, int) or max_seq < 1:
            raise AmkError(f"max_seq must be an integer >= 1, got {max_seq!r}")
        cfg = AmkConfig(cfg.lowering.replace(max_seq=max_seq), cfg.kernel)
    return cfg.validate("config", ranks=tp), line


def _target(backend: str):
    from ir.program import Target

    return Target(backend=backend)


def _check_backend(backend: str) -> None:
    from amk.pipeline import BACKENDS

    if backend not in BACKENDS:
        raise AmkError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")


# -- results ----------------------------------------------------------------------------------
@dataclass
class GenerateOutput:
    """What ``generate(..., return_dict_in_generate=True)`` returns.

    ``sequences``: int64 [1, T + N] (prompt then new tokens, as transformers returns);
    ``tokens``: the N new token ids; ``prompt_tokens``: the T prompt ids; ``ttft_s``: seconds
    from the call (after the executor exists) to the first new token, prefill included;
    ``seconds``: the whole decode; ``tokens_per_s``: (N - 1) / (seconds - ttft_s), the decode
    rate after the first token (None for N = 1); ``steps``: decode steps run; ``prefill``:
    whether the prompt went through the prefill; ``prefill_s``: its share of ``ttft_s``."""

    sequences: torch.Tensor
    tokens: list[int]
    prompt_tokens: list[int]
    ttft_s: float
    seconds: float
    tokens_per_s: float | None
    steps: int
    prefill: bool
    prefill_s: float = 0.0
    sampling: dict[str, Any] = field(default_factory=dict)


def encode(tokenizer: Any, text: str, chat: bool = False, model: str = "the model") -> list[int]:
    """Token ids of ``text`` with ``tokenizer``; ``chat``: as the user turn of the tokenizer's
    chat template with the generation prompt appended. AmkError when the text tokenizes to
    nothing, or (``chat``) the tokenizer has no chat template (``model`` names it)."""
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise AmkError(f"--chat: {model}'s tokenizer has no chat template (use a model that "
                           "ships one, e.g. smollm2-135m, or drop --chat)")
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                            add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
    else:
        ids = tokenizer(text)["input_ids"]
    ids = [int(t) for t in ids]
    if not ids:
        raise AmkError("the prompt tokenizes to no tokens")
    return ids


# -- the compiled model -----------------------------------------------------------------------
class CompiledModel:
    """A lowered, validated schedule of one model with its backend (see ``compile``).

    Attributes: ``compilation`` (amk.pipeline.Compilation: resolved HF model, graph, program),
    ``model`` (the MODEL argument), ``tp``, ``backend``, ``config`` (AmkConfig),
    ``config_source`` (where it came from). The executor is built by the first ``generate``
    (or ``prepare``) and reused by later calls."""

    def __init__(self, compilation: Any, model: str, tp: int, backend: str, config: Any,
                 config_source: str = "", *, seed: int = 0, sim_policy: str = "random",
                 dist: Any = None):
        self.compilation = compilation
        self.model = model
        self.tp = tp
        self.backend = backend
        self.config = config
        self.config_source = config_source
        self.seed = seed
        self.sim_policy = sim_policy
        self.dist = dist
        self.notes: list[str] = []  # ranks without query heads, from the split check
        self._decoder = None
        self._prefiller = None

    # properties
    @property
    def program(self):
        """The ScheduleProgram."""
        return self.compilation.program

    @property
    def tokenizer(self):
        """The model's tokenizer (AmkError when the source has none)."""
        return self.compilation.resolved.tokenizer

    @property
    def decoder(self):
        """The pipeline.Decoder over this model's executor (built on first use)."""
        self.prepare()
        return self._decoder

    def prepare(self, prefill: bool = True, warm: bool = False) -> None:
        """Build the executor (and, with ``prefill``, the prefill model in the executor's dtype
        and device) now rather than inside the first timed ``generate``. ``warm``: also run
        one decode step (token 0 at position 0: the triton kernel compiles at its first
        launch) and, with ``prefill``, a one-token prefill, so that the next ``generate``'s
        ``ttft_s`` holds neither compile nor first-call costs. Both write only cache row 0,
        which every sequence rewrites before reading."""
        if self._decoder is None:
            opts = None
            if self.backend == "triton":
                from lowering.triton.blocks import kernel_options

                opts = kernel_options(self.config.kernel)
            if self.dist is not None:
                opts = {**(opts or {}), "dist": self.dist}
            self._decoder = self.compilation.decoder(self.backend, seed=self.seed, policy=self.sim_policy,
                                                     backend_options=opts)
        if prefill and self._prefiller is None:
            from amk.prefill import Prefiller

            self._prefiller = Prefiller(self.compilation.resolved.model, self.program, self._decoder.ex,
                                        self.config.lowering.dtype)
            self._prefiller._prepared()
        if warm:
            self._decoder.step(0, 0)
            if prefill:
                self._prefiller.fill([0])

    # inputs
    def encode(self, text: str, chat: bool = False) -> list[int]:
        """Token ids of ``text`` (see the module function ``encode``)."""
        return encode(self.tokenizer, text, chat=chat, model=self.model)

    def _prompt_ids(self, inputs: Any) -> list[int]:
        if isinstance(inputs, str):
            ids = self.encode(inputs)
        elif isinstance(inputs, torch.Tensor):
            if inputs.dtype.is_floating_point or inputs.dtype == torch.bool:
                raise AmkError(f"input_ids must be an integer tensor, got {inputs.dtype}")
            if inputs.dim() == 2:
                if inputs.shape[0] != 1:
                    raise AmkError(f"input_ids has batch size {inputs.shape[0]}; amk generates "
                                   "one sequence at a time (batch size 1)")
                inputs = inputs[0]
            elif inputs.dim() != 1:
                raise AmkError(f"input_ids must be [T] or [1, T], got shape {list(inputs.shape)}")
            ids = [int(t) for t in inputs.tolist()]
        elif isinstance(inputs, (list, tuple)):
            if inputs and isinstance(inputs[0], (list, tuple)):
                if len(inputs) != 1:
                    raise AmkError(f"input_ids has batch size {len(inputs)}; amk generates one "
                                   "sequence at a time (batch size 1)")
                inputs = inputs[0]
            ids = [int(t) for t in inputs]
        else:
            raise AmkError(f"inputs must be a prompt string, a token list or an int tensor, got "
                           f"{type(inputs).__name__}")
        if not ids:
            raise AmkError("the prompt is empty (no tokens)")
        vocab = self.compilation.graph.spec.vocab
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise AmkError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        return ids

    # generation
    def generate(self, inputs: Any = None, max_new_tokens: int = 32, do_sample: bool = False,
                 temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                 seed: int = 0, eos_token_id: int | Sequence[int] | None = None, streamer: Any = None,
                 prefill: bool = True, return_dict_in_generate: bool = False,
                 input_ids: Any = None):
        """Generate up to ``max_new_tokens`` tokens after a prompt (batch size 1).

        ``inputs`` / ``input_ids``: a prompt string (tokenized without special templates), a
        list of ints, or an integer tensor [T] or [1, T]. Greedy by default (the schedule's
        in-kernel argmax, identical to HF greedy); ``do_sample=True`` draws with
        ``temperature`` (> 0), ``top_k`` (>= 1) and ``top_p`` (in (0, 1]) from a CPU
        ``torch.Generator`` seeded with ``seed`` once per call (amk/sampling.py), so a call is
        reproducible. Stops at a token of ``eos_token_id`` (int or list; default the model's
        generation config), which is kept. ``streamer``: an object with ``put(tensor)`` and
        ``end()`` (transformers' ``TextStreamer`` works): ``put`` gets the prompt ids [1, T]
        first, then each new token as a [1] tensor as it is known. ``prefill``: fill the KV
        cache for the prompt in one forward (amk/prefill.py) instead of one decode step per
        prompt token.

        Returns int64 ``sequences`` [1, T + N] on the CPU, or with
        ``return_dict_in_generate`` a ``GenerateOutput``. Raises AmkError (exit 2) for bad
        arguments or a prompt + max_new_tokens beyond the schedule's ``max_seq``; AmkError
        (exit 1) if the ranks disagree on a token."""
        from amk.pipeline import eos_ids
        from amk.sampling import Sampler, SamplingParams

        if inputs is not None and input_ids is not None:
            raise AmkError("give the prompt once: inputs or input_ids")
        prompt = self._prompt_ids(inputs if inputs is not None else input_ids)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise AmkError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        params = SamplingParams(bool(do_sample), temperature, top_k, top_p).check()
        max_seq = self.config.lowering.max_seq
        if len(prompt) + max_new_tokens - 1 > max_seq:
            raise AmkError(f"prompt ({len(prompt)} tokens) + max_new_tokens {max_new_tokens} exceed "
                           f"the schedule's max_seq {max_seq}; compile with max_seq="
                           f"{len(prompt) + max_new_tokens} (or a smaller max_new_tokens)")
        if eos_token_id is None:
            eos = eos_ids(self.compilation.resolved.model)
        else:
            eos = [int(e) for e in (eos_token_id if isinstance(eos_token_id, (list, tuple)) else [eos_token_id])]
        self.prepare(prefill)
        dec = self._decoder
        ranks = dec.local
        sampler = Sampler(params, seed, ranks) if params.do_sample else None
        if streamer is not None:
            streamer.put(torch.tensor([prompt], dtype=torch.long))
        steps0 = dec.steps
        times: list[float] = []
        pf = self._prefiller if prefill else None
        t0 = time.perf_counter()

        def on_token(tok: int) -> None:
            times.append(time.perf_counter())
            if streamer is not None:
                streamer.put(torch.tensor([tok], dtype=torch.long))

        new = dec.generate(prompt, max_new_tokens, eos, on_token=on_token, sampler=sampler,
                           prefill=pf.fill if pf is not None else None)
        t1 = time.perf_counter()
        if streamer is not None:
            streamer.end()
        ttft = times[0] - t0
        rate = (len(new) - 1) / (t1 - times[0]) if len(new) > 1 and t1 > times[0] else None
        seq = torch.tensor([prompt + new], dtype=torch.long)
        if not return_dict_in_generate:
            return seq
        return GenerateOutput(seq, new, prompt, ttft, t1 - t0, rate, dec.steps - steps0,
                              pf is not None and len(prompt) > 1,
                              pf.seconds if pf is not None and len(prompt) > 1 else 0.0,
                              {"do_sample": params.do_sample, "temperature": params.temperature,
                               "top_k": params.top_k, "top_p": params.top_p, "seed": seed}
                              if params.do_sample else {"do_sample": False})

    # persistence
    def save(self, path: str | os.PathLike) -> Path:
        """Write the compiled model to directory ``path`` (created if missing): ``schedule.json``
        (the validated program), ``amk.json`` (model, tp, backend, config, the schedule's
        sha256, the model's shapes) and, on triton once the kernel is built, ``kernel.py``
        (its generated source). Each file is written atomically, the manifest last, so a
        directory with a manifest is complete. Returns the directory. AmkError names a path
        that cannot be written."""
        from ground.files import atomic_write_json, atomic_write_text
        from ir.jsonio import dumps

        d = Path(path)
        text = dumps(self.program)
        atomic_write_text(d / SCHEDULE, text)
        if self._decoder is not None and hasattr(self._decoder.ex, "emit_source"):
            self._decoder.ex.emit_source(d / "kernel.py")
        verdict = self.compilation.verdict
        atomic_write_json(d / MANIFEST, {
            "format": FORMAT, "model": self.model, "tp": self.tp, "backend": self.backend,
            "config": self.config.to_json(), "config_source": self.config_source,
            "schedule": {"file": SCHEDULE, "sha256": hashlib.sha256(text.encode()).hexdigest()},
            "spec": json.loads(json.dumps(self.compilation.graph.spec.to_json())),
            "validation": {"ok": True, "seconds": round(self.compilation.validate_s, 4),
                           "stats": getattr(verdict, "stats", {}) if verdict is not None else {}},
        })
        return d


def _model_arg(model: str) -> str:
    """``model`` with a filesystem path made absolute (a saved directory must find it from
    any working directory); aliases and ``config:NAME`` unchanged."""
    if not model.startswith("config:") and os.path.exists(model):
        return os.path.abspath(model)
    return model


def compile(model: str, tp: int = 1, backend: str = "sim", config: Any = None, *,
            max_seq: int | None = None, seed: int = 0, sim_policy: str = "random",
            dist: Any = None, resolved: Any = None, config_source: str | None = None) -> CompiledModel:
    """Resolve ``model`` (a MODEL argument: ``config:NAME``, an alias such as ``smollm2-135m``,
    a ``.gguf`` file or an HF directory), lower it for ``tp`` ranks and validate the schedule
    for ``backend`` (``sim`` or ``triton``). ``config``: see ``resolve_config``; ``max_seq``:
    the KV-cache length (positions 0 .. max_seq - 1). ``seed`` / ``sim_policy``: the sim's
    interleaving; ``dist``: a ``lowering.triton.dist.DistContext`` for one rank of a
    multi-process triton run; ``resolved``: the already resolved model (pipeline.resolve of
    ``model``), not resolved again; ``config_source``: the line saying where ``config`` came
    from (kept as ``CompiledModel.config_source``). Raises AmkError (exit 2) for bad input or a model that cannot
    be split, AmkError (exit 1) when the validator rejects the schedule."""
    from amk import pipeline
    from amk.checks import check_counts, check_model_split

    if isinstance(tp, bool) or not isinstance(tp, int):
        raise AmkError(f"tp must be an integer, got {tp!r}")
    _check_backend(backend)
    check_counts(tp)
    cfg, line = resolve_config(config, model, tp, backend, max_seq)
    split = check_model_split(model, tp, cfg.lowering)
    if resolved is None:
        resolved = pipeline.resolve(model)
    compilation = pipeline.Compilation.build(model, tp, cfg.lowering, _target(backend), resolved=resolved)
    if not compilation.verdict.ok:
        f = compilation.verdict.errors[0]
        raise AmkError(f"the validator rejected the schedule: {f.cls}: {f.message}", exit_code=1)
    m = CompiledModel(compilation, _model_arg(model), tp, backend, cfg, config_source or line, seed=seed,
                      sim_policy=sim_policy, dist=dist)
    m.notes = split.notes
    return m


def _read_manifest(d: Path) -> dict[str, Any]:
    path = d / MANIFEST
    if not d.is_dir():
        raise AmkError(f"{d}: not a directory (a saved amk model is a directory with {MANIFEST})")
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise AmkError(f"{d}: not a saved amk model ({MANIFEST} is missing)") from None
    except OSError as e:
        raise AmkError(f"{path}: cannot read: {e.strerror or e}") from None
    from ground.files import parse_json

    man = parse_json(text, path)
    if not isinstance(man, dict) or man.get("format") != FORMAT:
        got = man.get("format") if isinstance(man, dict) else type(man).__name__
        raise AmkError(f"{path}: format is {got!r}, expected {FORMAT!r}")
    for key, typ in (("model", str), ("tp", int), ("backend", str), ("config", dict),
                     ("schedule", dict), ("spec", dict)):
        if not isinstance(man.get(key), typ):
            raise AmkError(f"{path}: field {key!r} is missing or not a {typ.__name__}")
    return man


def load(path: str | os.PathLike, *, seed: int = 0, sim_policy: str = "random",
         dist: Any = None) -> CompiledModel:
    """Load a directory written by ``CompiledModel.save`` without lowering or validating: the
    schedule is the one validated at compile time, checked byte for byte against the
    manifest's sha256. The model's weights are loaded again (from the MODEL argument the
    manifest names) and its shapes must equal the saved ones. Raises AmkError (one line, exit
    2) for a missing, corrupt or mismatched directory."""
    from amk import pipeline
    from ir.jsonio import loads
    from lowering.config import AmkConfig
    from validator.verdict import Verdict

    d = Path(path)
    man = _read_manifest(d)
    _check_backend(man["backend"])
    sched = d / str(man["schedule"].get("file", SCHEDULE))
    try:
        text = sched.read_text()
    except OSError as e:
        raise AmkError(f"{sched}: cannot read the saved schedule: {e.strerror or e}") from None
    if hashlib.sha256(text.encode()).hexdigest() != man["schedule"].get("sha256"):
        raise AmkError(f"{sched}: does not match the sha256 in {d / MANIFEST} (changed or corrupt "
                       "since it was validated); compile again")
    try:
        program = loads(text, str(sched))
    except AmkError:
        raise
    except Exception as e:  # noqa: BLE001 - any parse failure is one line
        raise AmkError(f"{sched}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    cfg = AmkConfig.from_json(man["config"], str(d / MANIFEST), ranks=int(man["tp"]))
    if program.ranks != man["tp"]:
        raise AmkError(f"{sched}: the schedule has {program.ranks} ranks, the manifest tp {man['tp']}")
    resolved = pipeline.resolve(man["model"])
    graph = pipeline.import_graph(resolved)
    now = json.loads(json.dumps(graph.spec.to_json()))
    if now != man["spec"]:
        diff = sorted(k for k in set(now) | set(man["spec"]) if now.get(k) != man["spec"].get(k))
        raise AmkError(f"{man['model']}: the model's shapes differ from the saved schedule's "
                       f"({', '.join(diff)}); compile again")
    compilation = pipeline.Compilation(resolved, graph, program, cfg.lowering,
                                       verdict=Verdict(stats={"loaded_from": str(d)}),
                                       validate_s=float(man.get("validation", {}).get("seconds", 0.0)))
    return CompiledModel(compilation, man["model"], int(man["tp"]), man["backend"], cfg,
                         f"saved: {d}", seed=seed, sim_policy=sim_policy, dist=dist)
