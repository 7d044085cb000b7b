"""The spec compiled to a torch ``DeviceMesh`` (torchtitan's ``ParallelDims`` pattern): one
mesh dimension per axis of :data:`AXES` (size-1 axes included, so every rank sees the same
layout), plus the two flattened groups the runtime uses — ``sp`` (ring x ulysses: the
tokens of one forward) and ``rows`` (dp x cfg: the forwards of one step).

Hot paths use the raw process groups (``ParallelMesh.group``); the ``DeviceMesh`` itself is
there for consumers that want DTensor (a trainer's FSDP2).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from omniloop.parallel.spec import AXES, ROW_AXES, SP_AXES, ParallelSpec


def rendezvous_store(timeout_s: float) -> Any:
    """The pool's rendezvous: a TCPStore on 127.0.0.1 at a port the OS picks (no race for a
    free port); its ``port`` goes to the ranks. The process holding it must outlive them."""
    return dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def init_process_group(rank: int, world: int, port: int, device: torch.device, timeout_s: float,
                       store: Any = None) -> None:
    """Join the pool's default process group (gloo on CPU, NCCL + gloo for CPU tensors on CUDA)
    through the rendezvous store at ``port`` (or ``store``, in the process that holds it)."""
    if dist.is_initialized():
        raise RuntimeError("a torch.distributed process group is already initialized in this process; an omniloop "
                           "pool makes its own (do not start it under torchrun)")
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore("127.0.0.1", port, None, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)


@dataclass(frozen=True)
class ParallelMesh:
    """This rank's view of the pool: the mesh, its coordinates and its groups."""

    spec: ParallelSpec
    rank: int
    device_mesh: Any  # torch.distributed.device_mesh.DeviceMesh
    _groups: dict[str, Any]  # axis or flattened-axis name -> ProcessGroup

    @classmethod
    def build(cls, spec: ParallelSpec, device: torch.device) -> ParallelMesh:
        """Every rank calls this (it creates the groups collectively)."""
        from torch.distributed.device_mesh import DeviceMesh

        assert dist.get_world_size() == spec.world, f"world {dist.get_world_size()} != spec {spec.compact()}"
        layout = torch.arange(spec.world).view(*spec.degrees)
        mesh = DeviceMesh(device.type, layout, mesh_dim_names=AXES)
        groups = {a: mesh.get_group(a) for a in AXES}
        groups["sp"] = mesh[SP_AXES]._flatten("sp").get_group()
        groups["rows"] = mesh[ROW_AXES]._flatten("rows").get_group()
        return cls(spec, dist.get_rank(), mesh, groups)

    def group(self, axis: str) -> Any | None:
        """The process group of ``axis`` (an axis of AXES, ``"sp"`` or ``"rows"``); None when
        its degree is 1, so single-rank axes cost nothing."""
        return self._groups[axis] if self.size(axis) > 1 else None

    def size(self, axis: str) -> int:
        if axis == "sp":
            return self.spec.sp
        if axis == "rows":
            return self.spec.rows
        return getattr(self.spec, axis)

    def coordinate(self, axis: str) -> int:
        """This rank's index along ``axis`` (its rank inside that axis's group)."""
        if self.size(axis) == 1:
            return 0
        return dist.get_rank(self._groups[axis])

    def global_ranks(self, axis: str) -> list[int]:
        """The global ranks of this rank's ``axis`` group, in group order."""
        if self.size(axis) == 1:
            return [self.rank]
        return dist.get_process_group_ranks(self._groups[axis])
