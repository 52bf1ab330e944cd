"""Multi-GPU bootstrap: one process per GPU, torch.distributed for bootstrap, NVSHMEM for data.

A tensor-parallel run has R processes, rank r driving GPU r (``LOCAL_RANK``). They find each
other the way ``torchrun`` sets them up: the environment variables ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` (``amk.launch`` sets the same ones when
``--tp R`` spawns the processes itself). torch.distributed (``gloo`` for CPU objects; NCCL is
registered for CUDA tensors but used only by the HF baselines) carries only bootstrap
traffic and host-side gathers: the NVSHMEM unique id, arena sizes, tokens and
logits read back by the host. Every byte the decode step moves between GPUs goes through
NVSHMEM symmetric memory, by plain stores to peer pointers inside the megakernel.

NVSHMEM is initialised through nvshmem4py (``nvshmem.core``) by unique id: rank 0 creates
the id, the others receive it with ``broadcast_object_list``. Symmetric allocations must be
the same size on every PE, and the symmetric heap must be large enough for the arena (it
holds the weights too), so ``init_nvshmem`` sets ``NVSHMEM_SYMMETRIC_SIZE`` before
initialising. Multicast (NVLS) stays off: ``NVSHMEM_DISABLE_NVLS=1`` (the shared GPU
machines must not use it; docs/gpu-testing.md).

Shutdown: ``DistContext.close()`` frees symmetric tensors, finalises NVSHMEM and destroys the
process group; it is idempotent and is registered with ``atexit``, so success, an exception
and Ctrl-C (KeyboardInterrupt unwinds to atexit) all release the heap.
"""

from __future__ import annotations

import atexit
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from ground.errors import AmkError

ENV_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")

#: Environment every multi-GPU process runs with (no multicast / NVLS anywhere).
NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                    "NVSHMEM_DISABLE_NVLS": "1"}

#: Headroom added to the largest arena when sizing the symmetric heap (NVSHMEM's own
#: internal allocations, alignment).
HEAP_SLACK = 256 << 20


class DistError(AmkError):
    """A multi-GPU setup failure (exit code 1)."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message, exit_code)


def env_world() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) from torchrun-style variables, or None when not set."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    try:
        rank = int(os.environ["RANK"])
        world = int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", rank))
    except ValueError as e:
        raise DistError(f"bad distributed environment variable: {e}", exit_code=2) from None
    if not 0 <= rank < world:
        raise DistError(f"RANK={rank} is outside WORLD_SIZE={world}", exit_code=2)
    return rank, world, local


@dataclass
class DistContext:
    """This process's place in a multi-GPU run.

    ``rank`` / ``world``: the PE number and count (tensor-parallel rank and degree);
    ``device``: this rank's CUDA device; ``nvshmem``: whether NVSHMEM is initialised;
    ``owns_group``: whether ``close`` destroys the process group (False when the group is the
    caller's, as for ``amk.distribute``).
    """

    rank: int
    world: int
    local_rank: int
    device: torch.device
    nvshmem: bool = False
    owns_group: bool = True
    _tensors: list[torch.Tensor] = field(default_factory=list, repr=False)
    _closed: bool = False

    # ------------------------------------------------------------ host collectives
    def broadcast_object(self, obj: Any, src: int) -> Any:
        """``obj`` from rank ``src`` on every rank (gloo; picklable objects)."""
        import torch.distributed as dist
        box = [obj if self.rank == src else None]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""
        import torch.distributed as dist
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        """Host barrier over all ranks (gloo)."""
        import torch.distributed as dist
        dist.barrier()

    # ------------------------------------------------------------ symmetric memory
    def symmetric_bytes(self, nbytes: int) -> torch.Tensor:
        """A uint8 CUDA tensor of ``nbytes`` on the NVSHMEM symmetric heap (zero-filled).
        Collective: every rank must call it with the same ``nbytes``, in the same order."""
        if not self.nvshmem:
            raise DistError("symmetric memory needs init_nvshmem() first")
        import nvshmem.core.interop.torch as nvt
        sizes = self.all_gather_object(int(nbytes))
        if len(set(sizes)) != 1:
            raise DistError(f"symmetric allocation sizes differ across ranks: {sizes}")
        t = nvt.bytetensor((int(nbytes),))
        t.zero_()
        self._tensors.append(t)
        return t

    def free_symmetric(self, t: torch.Tensor) -> None:
        """Give a tensor from ``symmetric_bytes`` back to the symmetric heap, so a later
        allocation (another schedule's arena, e.g. in a sweep) finds the room. Collective,
        like the allocation; nothing may use ``t`` (or a view or CUDA graph of it) after."""
        k = next((i for i, u in enumerate(self._tensors) if u is t), None)
        if k is None:
            raise DistError("free_symmetric: the tensor was not allocated by symmetric_bytes")
        import nvshmem.core.interop.torch as nvt
        torch.cuda.synchronize(self.device)
        self.barrier()
        del self._tensors[k]
        nvt.free_tensor(t)

    def peer_deltas(self, t: torch.Tensor) -> dict[int, int]:
        """For a symmetric tensor ``t``: peer rank -> byte distance from this rank's copy to
        the peer's copy as mapped into this process (``nvshmem_ptr`` minus own pointer).
        Raises DistError when a peer is not reachable by load/store (no NVLink / P2P)."""
        import nvshmem.core.interop.torch as nvt
        out = {}
        for p in range(self.world):
            if p == self.rank:
                continue
            peer = nvt.get_peer_tensor(t, p)
            if peer is None or peer.data_ptr() == 0:
                raise DistError(f"rank {p}'s symmetric heap is not mapped into rank {self.rank} "
                                "(no peer-to-peer path); amk's megakernel needs NVLink/P2P peers")
            out[p] = int(peer.data_ptr()) - int(t.data_ptr())
        return out

    # ------------------------------------------------------------ shutdown
    def close(self) -> None:
        """Free symmetric tensors, finalise NVSHMEM and, when it owns it, destroy the process
        group (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.nvshmem:
                import nvshmem.core as nvshmem
                import nvshmem.core.interop.torch as nvt
                torch.cuda.synchronize(self.device)
                for t in self._tensors:
                    try:
                        nvt.free_tensor(t)
                    except Exception:
                        pass
                self._tensors.clear()
                nvshmem.finalize()
                self.nvshmem = False
        finally:
            import torch.distributed as dist
            if self.owns_group and dist.is_initialized():
                dist.destroy_process_group()


def init_distributed(world: int | None = None) -> DistContext:
    """Join the process group described by the torchrun environment (see module doc).

    ``world``: the expected WORLD_SIZE (``--tp R``); a mismatch is an error. Binds this
    process to GPU ``LOCAL_RANK``. Raises DistError if the variables are missing, the GPU
    does not exist, or the group cannot form.
    """
    got = env_world()
    if got is None:
        raise DistError("not started as a multi-process run (RANK / WORLD_SIZE unset); use "
                        "`amk ... --tp R` or torchrun", exit_code=2)
    rank, size, local = got
    if world is not None and size != world:
        raise DistError(f"--tp {world} but WORLD_SIZE={size}", exit_code=2)
    for k, v in NO_MULTICAST_ENV.items():
        os.environ.setdefault(k, v)
    if not torch.cuda.is_available():
        raise DistError("a multi-GPU run needs CUDA GPUs; none is visible")
    if local >= torch.cuda.device_count():
        raise DistError(f"LOCAL_RANK={local} but only {torch.cuda.device_count()} GPU(s) are visible")
    torch.cuda.set_device(local)
    import torch.distributed as dist
    if not dist.is_initialized():
        try:
            # gloo for CPU tensors (bootstrap, host gathers), NCCL for CUDA tensors (only the
            # HF tensor-parallel baselines use it; the communicator is created lazily).
            dist.init_process_group("cpu:gloo,cuda:nccl", rank=rank, world_size=size)
        except Exception as e:
            raise DistError(f"rank {rank}: torch.distributed bootstrap failed: {e}") from None
    ctx = DistContext(rank=rank, world=size, local_rank=local, device=torch.device("cuda", local))
    atexit.register(ctx.close)
    return ctx


def init_nvshmem(ctx: DistContext, heap_bytes: int) -> None:
    """Initialise NVSHMEM on every rank by unique id, with a symmetric heap of at least
    ``heap_bytes`` (+ ``HEAP_SLACK``). Collective. Raises DistError when nvshmem4py is
    missing or initialisation fails."""
    if ctx.nvshmem:
        return
    try:
        import nvshmem.core as nvshmem
        from cuda.core.experimental import Device
    except ImportError:
        try:
            import nvshmem.core as nvshmem
            from cuda.core import Device
        except ImportError as e:
            raise DistError(f"nvshmem4py is not installed ({e}); install the gpu extra "
                            "(pip install 'amk[gpu]')", exit_code=2) from None
    heap = int(max(ctx.all_gather_object(int(heap_bytes)))) + HEAP_SLACK
    os.environ["NVSHMEM_SYMMETRIC_SIZE"] = str(heap)
    for k, v in NO_MULTICAST_ENV.items():
        os.environ.setdefault(k, v)
    uid = nvshmem.get_unique_id(empty=ctx.rank != 0)
    uid = ctx.broadcast_object(uid if ctx.rank == 0 else None, src=0)
    dev = Device(ctx.local_rank)
    dev.set_current()
    try:
        nvshmem.init(device=dev, uid=uid, rank=ctx.rank, nranks=ctx.world, initializer_method="uid")
    except Exception as e:
        raise DistError(f"rank {ctx.rank}: NVSHMEM initialisation failed: {e}") from None
    ctx.nvshmem = True
