"""Carry torch inductor's kernel-tuning results from one GPU machine to the next.

With coordinate-descent tuning on (one of the settings torchao's ``quantize_`` switches on),
torch.compile tunes each generated Triton kernel at its first launch and stores the winner in
the inductor cache, beside the kernel's source, as a small JSON file ``<key>.best_config``
(torch/_inductor/runtime/autotune_cache.py: the key hashes the kernel source's file name, itself a
hash of the source, and the torch build). A fresh machine with the same image and the same cache
folder (``TORCHINDUCTOR_CACHE_DIR``) generates the same kernels at the same paths and reads a
``.best_config`` it finds there instead of tuning again. The whole cache of a Llama-3.1-8B
decode step is hundreds of MB, more than a device call brings back; its tuning results are a
few KB. Tuning that one call had no time to finish resumes in the next: every kernel tuned so
far is saved, as the cache stores each result when that kernel's tuning ends.

Usage (on a GPU machine; ``--cache`` defaults to ``$TORCHINDUCTOR_CACHE_DIR``, else torch's
default folder)::

    python bench/inductor_tuning.py save OUT.tgz     # every *.best_config under the cache
    python bench/inductor_tuning.py load IN.tgz      # back into the cache (--missing-ok: no file, no error)

``--out FILE`` also writes what was done as JSON (action, archive, cache folder, how many
results), atomically: a suite's record of how much tuning a call started from. ``save``
writes the archive atomically. Exit code 0; 2, with one line, for a missing or unreadable
archive, or one holding anything but ``.best_config`` files under relative paths.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import tarfile
from pathlib import Path, PurePosixPath

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ground.errors import AmkError, run_main  # noqa: E402
from ground.files import atomic_write_bytes, atomic_write_json  # noqa: E402

NAME = "bench/inductor_tuning.py"
SUFFIX = ".best_config"


def default_cache() -> Path:
    """The inductor cache folder: ``$TORCHINDUCTOR_CACHE_DIR``, else torch's default
    (``/tmp/torchinductor_<user>``)."""
    env = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if env:
        return Path(env)
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return Path(default_cache_dir())


def save(archive: Path, cache: Path) -> int:
    """Write every ``*.best_config`` file under ``cache`` into the gzip tar ``archive`` (paths
    relative to ``cache``; atomically). Returns how many. Raises AmkError when ``cache`` is not
    a folder."""
    if not cache.is_dir():
        raise AmkError(f"{cache}: no inductor cache folder here")
    files = sorted(p for p in cache.rglob(f"*{SUFFIX}") if p.is_file())
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for p in files:
            tar.add(p, arcname=p.relative_to(cache).as_posix(), recursive=False)
    atomic_write_bytes(archive, buf.getvalue())
    return len(files)


def _checked_members(tar: tarfile.TarFile, archive: Path) -> list[tarfile.TarInfo]:
    """The archive's members, each a regular ``*.best_config`` file under a relative path
    without ``..``. Raises AmkError naming the first member that is not."""
    members = tar.getmembers()
    for m in members:
        path = PurePosixPath(m.name)
        if (not m.isfile() or path.is_absolute() or ".." in path.parts or path.suffix != SUFFIX):
            raise AmkError(f"{archive}: member {m.name!r} is not a {SUFFIX} file under a relative path")
    return members


def load(archive: Path, cache: Path) -> int:
    """Extract the ``*.best_config`` files of ``archive`` (written by ``save``) into ``cache``
    (created if missing), replacing files of the same name. Returns how many. Raises AmkError
    for a missing or unreadable archive or an unexpected member (nothing is extracted then)."""
    if not archive.is_file():
        raise AmkError(f"{archive}: no such archive")
    try:
        with tarfile.open(archive, mode="r:gz") as tar:
            members = _checked_members(tar, archive)
            cache.mkdir(parents=True, exist_ok=True)
            for m in members:
                data = tar.extractfile(m).read()
                atomic_write_bytes(cache / m.name, data, durable=False)
    except (tarfile.TarError, OSError, EOFError) as err:
        raise AmkError(f"{archive}: not a readable gzip tar ({err})") from None
    return len(members)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=NAME, description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=("save", "load"))
    ap.add_argument("archive", type=Path, help="the gzip tar of .best_config files")
    ap.add_argument("--cache", type=Path, default=None,
                    help="the inductor cache folder (default: $TORCHINDUCTOR_CACHE_DIR, else torch's default)")
    ap.add_argument("--missing-ok", action="store_true", help="load: no archive is not an error (nothing loaded)")
    ap.add_argument("--out", type=Path, default=None, help="write what was done as JSON")
    args = ap.parse_args(argv)
    cache = args.cache or default_cache()
    if args.action == "save":
        n = save(args.archive, cache)
        print(f"saved {n} tuning results from {cache} to {args.archive} ({args.archive.stat().st_size} bytes)")
    elif args.missing_ok and not args.archive.exists():
        n = 0
        print(f"{args.archive}: no archive; nothing loaded")
    else:
        n = load(args.archive, cache)
        print(f"loaded {n} tuning results from {args.archive} into {cache}")
    if args.out:
        atomic_write_json(args.out, {"action": args.action, "archive": str(args.archive), "cache": str(cache),
                                     "results": n})
    return 0


if __name__ == "__main__":
    run_main(main, NAME)
