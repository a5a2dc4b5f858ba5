"""The process groups a unit communicates over, from what the user passed.

`mesh=None` is the whole world; a 1-D DeviceMesh one shard group; a 2-D one (replicate,
shard) is HYBRID_SHARD. Each mesh chooses its transport once (transport.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from ..comm import collectives as C
from ..comm.transport import Transport, transport_for
from . import dtensor as DT
from .policies import ShardingStrategy


@dataclass
class MeshInfo:
    """The process groups a unit communicates over."""

    shard_group: ProcessGroup | None
    shard_rank: int
    shard_size: int
    replicate_group: ProcessGroup | None
    replicate_size: int
    device: torch.device
    global_rank: int = 0
    # The DeviceMesh the sharded parameters' DTensors live on (None: they stay plain).
    device_mesh: DeviceMesh | None = None
    # How the shard group moves flat buffers: decided once, when the mesh is made.
    transport: Transport = field(init=False)

    def __post_init__(self) -> None:
        self.transport = (transport_for(self.shard_group) if self.shard_size > 1
                          else Transport(None))

    @property
    def dp_size(self) -> int:
        """Ranks that see different data: gradients are averaged over all of them."""
        return self.shard_size * self.replicate_size


def default_device() -> torch.device:
    if C.is_initialized() and C.backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def mesh_info_for(mesh: object | None) -> MeshInfo:
    """MeshInfo from None (the whole world), a 1-D DeviceMesh, or a 2-D one (replicate, shard)."""
    device = default_device()
    grank = C.rank()
    if isinstance(mesh, MeshInfo):
        return mesh
    if mesh is None:
        # A one-rank world has a mesh too (FSDP2's parameters are DTensors there as well:
        # Lightning's ModelParallelStrategy finds a distributed model by them).
        dmesh = DT.world_mesh(device.type) if C.is_initialized() else None
        return MeshInfo(None, C.rank(), C.world_size(), None, 1, device, grank, dmesh)
    ndim = getattr(mesh, "ndim", None)
    if not isinstance(mesh, DeviceMesh):
        ndim = None  # not a DeviceMesh, whatever its ndim says
    else:
        device = _device_of(mesh)
    if ndim == 1:
        g = mesh.get_group()  # type: ignore[attr-defined]
        return MeshInfo(g, C.rank(g), C.world_size(g), None, 1, device, grank, mesh)  # type: ignore[arg-type]
    if ndim == 2:
        rep, shard = mesh.get_group(0), mesh.get_group(1)  # type: ignore[attr-defined]
        return MeshInfo(shard, C.rank(shard), C.world_size(shard), rep, C.world_size(rep),
                        device, grank, mesh)  # type: ignore[arg-type]
    raise ValueError(f"mesh={mesh!r} must be None or a 1-D or 2-D torch DeviceMesh")


def _device_of(mesh: DeviceMesh) -> torch.device:
    """The units' device for `mesh`: a CUDA mesh over gloo (two ranks sharing one GPU, where
    NCCL refuses duplicate devices) puts them on the GPU, as FSDP2 does; else the backend's."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return default_device()


def mesh_for_strategy(strategy: ShardingStrategy, mesh: object | None) -> object | None:
    """What shard_model's `sharding_strategy` makes of `mesh`: a MeshInfo, or the mesh."""
    world = C.world_size()
    if strategy is ShardingStrategy.NO_SHARD:
        if mesh is None:
            return MeshInfo(None, 0, 1, None, world, default_device(), C.rank())
        # The replicas are the mesh's ranks: ignoring it all-reduced over the world, which
        # hung a model on a subgroup ([Note: model ranks] in model_group.py).
        if not isinstance(mesh, DeviceMesh) or mesh.ndim != 1:
            raise ValueError(f"NO_SHARD takes mesh=None (every rank) or a 1-D DeviceMesh of "
                             f"the ranks that replicate the model, got {mesh!r}")
        g = mesh.get_group()
        return MeshInfo(None, 0, 1, g, C.world_size(g), _device_of(mesh), C.rank())
    if strategy is ShardingStrategy.HYBRID_SHARD:
        if mesh is not None:
            if getattr(mesh, "ndim", None) != 2:
                raise ValueError(f"HYBRID_SHARD needs a 2-D DeviceMesh (replicate, shard), "
                                 f"got {mesh!r}")
            return mesh
        local = C.env_int("LOCAL_WORLD_SIZE", world)
        if local < 1 or world % local:
            raise ValueError(f"HYBRID_SHARD: LOCAL_WORLD_SIZE={local} does not divide the "
                             f"world size {world}")
        shard_g, rep_g = C.new_groups_2d(world // local, local)
        dev = default_device()
        dmesh = DT.hybrid_mesh(rep_g, shard_g, world // local, local, dev.type)
        return MeshInfo(shard_g, C.rank(shard_g), local, rep_g, world // local, dev,
                        C.rank(), dmesh)
    if mesh is not None and getattr(mesh, "ndim", None) == 2:
        raise ValueError(f"{strategy.value} takes a 1-D mesh; a 2-D mesh means HYBRID_SHARD")
    return mesh


def agreement_groups(units: Iterable[Any]) -> list[ProcessGroup | None]:
    """The groups a model's engine-internal agreements run over ([Note: model group]).

    [Note: model group] The checks that keep a model's ranks in step (the layout check, the
    freeze check, the stale-gathered-parameter decision) must run over the ranks that run
    the model and no others: over the world, a model sharded on a subgroup (a pipeline
    stage's dp mesh, ranks {0, 1} of 3) waited for ranks that never run it, or met another
    model's check there. The ranks are the union of the units' meshes (under TP the (dp, tp)
    mesh; a group of None is the world). When they are the whole world this is [None], one
    all-reduce as before; when one of the units' groups holds exactly them, that group; else
    the groups of the mesh's dims in a fixed order (`collectives.max_over` reduces over each
    in turn, which reaches every rank of a product mesh). [] when no other rank runs it.
    """
    ranks, groups = _span(units)
    if ranks >= set(range(C.world_size())):
        return [None]
    exact = [g for g in groups if set(C.group_ranks(g)) == ranks]
    return exact[:1] or list(groups)


def model_ranks(units: Iterable[Any]) -> list[int]:
    """The global ranks that run the model of `units`, ascending (its first rank first):
    where model-level operations (checkpoints, full state dicts) send from or write on."""
    ranks, _ = _span(units)
    return sorted(ranks | {C.rank()})


def _span(units: Iterable[Any]) -> tuple[set[int], list[ProcessGroup | None]]:
    """(the global ranks of the units' meshes, the distinct groups of their dims); the
    whole world and [None] as soon as one dim's group is the world."""
    ranks: set[int] = set()
    groups: list[ProcessGroup | None] = []
    for u in units:
        m: MeshInfo = u.mesh
        tp = next((p.tp.ctx for p in u.params if p.tp is not None), None)
        dmesh = tp.spmd_mesh if tp is not None else m.device_mesh
        if dmesh is not None:
            ranks.update(int(r) for r in dmesh.mesh.flatten().tolist())
        dims = [(m.replicate_group, m.replicate_size), (m.shard_group, m.shard_size)]
        if tp is not None and tp.tp_mesh is not None:
            dims.append((tp.tp_mesh.get_group(), tp.tp_size))
        for g, n in dims:
            if n <= 1:
                continue
            if g is None:
                return set(range(C.world_size())), [None]  # a group of the whole world
            if dmesh is None:
                ranks.update(C.group_ranks(g))
            if all(g is not h for h in groups):
                groups.append(g)
    return ranks, groups
