"""Process groups of a few consecutive ranks inside a shard group (hpZ's post-forward groups).

`fully_shard(m, reshard_after_forward=k)` keeps, between forward and backward, a shard of
each parameter over the k consecutive ranks of the shard group that this rank belongs to
(FSDP2's `(S/k, k)` post-forward mesh, engine/core/hpz.py); backward's all-gather runs in
that group. Only the group's own members create it (`use_local_synchronization`): the
fully_shard call that asks for it may run on a sub-mesh whose other world ranks never call
anything. One group per set of ranks is made and kept: every unit of a model asks for the
same one, and a second group with the same ranks would take the same (hashed) name.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed import ProcessGroup

from . import process_group as PG

# (default group, global ranks) -> the group; cleared when the default group changes (a
# new init_process_group), whose groups are gone with it.
_groups: dict[tuple[int, ...], ProcessGroup] = {}
_made_under: list[object] = []


def block_ranks(shard_group: ProcessGroup | None, k: int) -> list[int]:
    """The global ranks of this rank's block of `k` consecutive shard-group ranks."""
    ranks = PG.group_ranks(shard_group)
    me = PG.rank(shard_group)
    first = (me // k) * k
    return ranks[first : first + k]


def block_group(shard_group: ProcessGroup | None, k: int) -> ProcessGroup:
    """This rank's process group of `k` consecutive ranks of `shard_group` (k divides its
    size; made once per set of ranks, by those ranks only)."""
    default = dist.distributed_c10d._get_default_group()
    if not _made_under or _made_under[0] is not default:
        _groups.clear()
        _made_under[:] = [default]
    ranks = tuple(block_ranks(shard_group, k))
    group = _groups.get(ranks)
    if group is None:
        group = dist.new_group(list(ranks), use_local_synchronization=True)
        assert group is not None, f"rank {dist.get_rank()} is not in its own block {ranks}"
        _groups[ranks] = group
    return group
