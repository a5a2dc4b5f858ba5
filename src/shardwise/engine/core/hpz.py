"""hpZ: after forward, keep each parameter sharded over a block of k ranks, not all S.

[Note: hpZ] `fully_shard(m, reshard_after_forward=k)` with k a proper divisor of the
shard-group size S is FSDP2's int form (ZeRO++'s hierarchical partitioning). The shard
group is cut into S/k blocks of k consecutive ranks (FSDP2's `(S/k, k)` post-forward mesh;
this rank is number `shard_rank % k` of its block). After forward a unit keeps, of each
bucket's gathered rows, the S/k rows that belong to its block position (rows
`[j * S/k, (j + 1) * S/k)` of the rank-major `(S, numel)` layout, in the compute dtype)
and frees the rest. Backward's all-gather then runs within the block: each rank sends S/k
rows and receives k times that, so the block's all-gather output is the full rank-major
buffer again, copied out exactly as a shard-group gather is. The post-backward reshard
returns to the 1/S shard; the reduce-scatter is over the whole shard group as before.

Per rank, backward's all-gather moves (k-1)/k of a unit's gathered bytes over k ranks
(native: sends 1/k of them) instead of (S-1)/S over S ranks; between forward and backward
each rank holds 1/k of a unit's compute-dtype parameters instead of 1/S.

The kept rows are used only by the backward that follows: a gather outside backward (the
next forward, an explicit `unshard()`) drops them and gathers the shards, which an optimizer
step may have changed since. A forward without grad mode (evaluation) reshards fully, and
so does a unit holding all-gather extension parameters (their hooks gather per parameter;
FSDP2 gathers those within its post-forward mesh only when each has a single output).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.distributed import ProcessGroup

from ..comm.subgroups import block_group
from ..comm.transport import Transport, transport_for
from .mesh import MeshInfo

if TYPE_CHECKING:
    from .tp import TPContext
    from .unit import Unit


@dataclass(frozen=True)
class Hpz:
    """A unit's post-forward block: k consecutive ranks of its shard group."""

    k: int
    group: ProcessGroup
    transport: Transport  # how the block's all-gather moves bytes
    rows: int  # S / k: rows of the rank-major gather layout this rank keeps
    first_row: int  # (shard_rank % k) * rows


def check_hpz(k: int, mesh: MeshInfo, tp: TPContext | None, where: str) -> None:
    """Refuse what hpZ does not cover, before any group is made ([Note: hpZ])."""
    if mesh.replicate_size > 1:
        raise NotImplementedError(
            f"{where}: reshard_after_forward={k} (hpZ, groups of {k} of the "
            f"{mesh.shard_size} shard ranks) on a HYBRID_SHARD mesh ({mesh.replicate_size} "
            "replicas) is not supported: pass a 1-D mesh, or True/False")
    if tp is not None:
        # FSDP2 refuses it for DTensor (tensor-parallel) parameters too.
        raise NotImplementedError(
            f"{where}: reshard_after_forward={k} (hpZ) with tensor-parallel parameters is "
            "not supported (nor in FSDP2): use True or False")


def check_params(unit: Unit, k: int) -> None:
    """Tensor subclasses (NF4, float8) gather through their own hooks: refused with hpZ."""
    subs = [p.fqn for p in unit.params if p.subclass]
    if subs:
        raise NotImplementedError(
            f"reshard_after_forward={k} (hpZ) with tensor-subclass parameters {subs} is not "
            "supported: use True or False for this module")


def enable(unit: Unit, k: int) -> None:
    """Give a freshly sharded unit its post-forward block of `k` ranks."""
    check_params(unit, k)
    unit.hpz = make(unit.mesh, k)


def make(mesh: MeshInfo, k: int) -> Hpz:
    """This rank's block of `k` ranks (the group is made once per block, comm/subgroups.py)."""
    S = mesh.shard_size
    assert 1 < k < S and S % k == 0, f"hpZ block {k} of a shard group of {S}"
    group = block_group(mesh.shard_group, k)
    rows = S // k
    return Hpz(k, group, transport_for(group), rows, (mesh.shard_rank % k) * rows)


def keep(unit: Unit, hpz: Hpz) -> list[torch.Tensor | None]:
    """Per bucket, this rank's rows of the gathered layout, copied out of the unsharded
    parameters before they are freed: (rows * numel,) in the compute dtype."""
    lo, hi = hpz.first_row, hpz.first_row + hpz.rows
    kept: list[torch.Tensor | None] = []
    with torch.no_grad():
        for g in unit.buckets:
            if g.numel == 0:
                kept.append(None)
                continue
            out = torch.empty((hpz.rows, g.numel), dtype=g.dtype, device=unit.mesh.device)
            views = [p.unsharded_rows_view() for p in g.gathered]
            if all(v is not None for v in views):
                torch.cat([v[lo:hi] for v in views], dim=1, out=out)  # type: ignore[index]
            else:
                # A parameter on another dim holds its own layout, not rows: its rows are
                # copied out of it ([Note: layout] in sharded_param.py).
                for p, off in zip(g.gathered, g.offsets):
                    p.rows_into(out[:, off: off + p.chunk_numel], lo)
            kept.append(out.view(-1))
    return kept
