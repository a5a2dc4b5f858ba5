"""One unit's gather half: unshard (issue the all-gather), wait_unshard (the full parameters
onto the modules), reshard (the shards back), with the extension parameters' packed gather
beside the plain buckets' ([Note: all-gather extensions] in extension.py).

A mixin of `Unit` (unit.py), which holds the state these methods move between.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch

from .bucket import FlatBucket, PendingGather
from .buffers import BufferPool
from .events import Span, now
from .extension import ExtGather, pack, unpack
from .hpz import Hpz, keep
from .mesh import MeshInfo
from .schedule import ShardedState, TrainingState
from .sharded_param import ShardedParam
from .streams import ExposedWait, record

if TYPE_CHECKING:
    from ..comm.transport import Transport
    from .context import ModelContext


class UnitGather:
    mesh: MeshInfo
    pool: BufferPool
    transport: Transport
    ctx: ModelContext | None
    state: ShardedState
    training_state: TrainingState
    params: list[ShardedParam]
    ext_params: list[ShardedParam]
    buckets: list[FlatBucket]
    hpz: Hpz | None
    post_forward: list[torch.Tensor | None] | None
    copied: dict[str, int]
    _gathers: list[PendingGather]
    _ext_gather: ExtGather | None
    _gather_size: int

    # --- unshard / reshard -------------------------------------------------------------

    def unshard(self, async_op: bool = True) -> None:
        """Issue the all-gather (idempotent: no-op unless SHARDED)."""
        if self.state is not ShardedState.SHARDED:
            return
        S, transport = self.mesh.shard_size, self.transport
        # [Note: hpZ] The rows kept after forward serve the backward that follows only.
        kept, self.post_forward = self.post_forward, None
        if kept is not None and not (self.ctx is not None and self.ctx.schedule.in_backward):
            kept = None
        if kept is not None:
            assert self.hpz is not None
            transport = self.hpz.transport
        self._gather_size = transport.size if S > 1 else 1
        streams = self.ctx.streams if self.ctx is not None else None
        if streams is not None and self.ctx.schedule.state is TrainingState.IDLE:  # type: ignore[union-attr]
            # An explicit unshard() between steps: the shards may have just been written.
            streams.copy_in.wait_stream(torch.cuda.current_stream(self.mesh.device))
        for i, g in enumerate(self.buckets):
            if S == 1 or g.numel == 0:
                continue  # nothing to gather; wait_unshard() casts/copies locally
            start = now()
            # What this rank sends: its shard, or under hpZ its block rows (S/k shards).
            n = g.numel if kept is None else g.numel * (S // transport.size)
            with _on(streams and streams.copy_in):  # [Note: streams]
                out = self.pool.get(g.numel * S, g.dtype, self.mesh.device)
                send = transport.gather_buffer(n, g.dtype, self.mesh.device, self.pool)
                shard = send[:n]
                with torch.no_grad():
                    if kept is not None:
                        shard.copy_(kept[i], non_blocking=True)  # type: ignore[arg-type]
                    else:
                        # Casts to the compute dtype and, under offload, copies host -> device.
                        torch._foreach_copy_([shard[off : off + p.chunk_numel] for p, off
                                              in zip(g.gathered, g.offsets)],
                                             [p.padded_shard.reshape(-1) for p in g.gathered],
                                             non_blocking=True)
            # all-to-all also replicates the shard into every peer's row.
            self.copied["gather_in"] += (n * shard.element_size()
                                         * (transport.size if transport.name == "all_to_all"
                                            else 1))
            if streams is not None:
                streams.all_gather.wait_stream(streams.copy_in)
                with _on(streams.all_gather):
                    # Synchronous on NCCL means: the all-gather stream waits, not the host.
                    work = transport.all_gather(out, send, n, False, label=self.label)
                    done = record(streams.all_gather)
                self._gathers.append(PendingGather(g, send, out, work, start, 0.0, done))
                continue
            with Span() as call:
                work = transport.all_gather(out, send, n, async_op, label=self.label)
            # A synchronous gather blocks inside the call: all of it is exposed.
            self._gathers.append(PendingGather(g, send, out, work, start,
                                               0.0 if async_op else call.seconds))
        if self.ext_params:
            self._ext_gather = self._gather_extensions(async_op, streams)
        self.state = ShardedState.GATHERING

    def _gather_extensions(self, async_op: bool, streams: Any) -> ExtGather:
        """The extension parameters' pre hooks and their one packed all-gather
        ([Note: all-gather extensions] in extension.py)."""
        start = now()
        with _on(streams and streams.copy_in):  # the hooks run where the copy-in does
            send, pg = pack(self, self.ext_params)
        pg.start = start
        numel, S = sum(pg.split), self.mesh.shard_size
        self.copied["gather_in"] += (numel * send.element_size()
                                     * (S if self.transport.name == "all_to_all" else 1))
        if S == 1:
            return pg  # the send row is the output: nothing to gather
        if streams is not None:
            streams.all_gather.wait_stream(streams.copy_in)
            with _on(streams.all_gather):
                pg.work = self.transport.all_gather(pg.out, send, numel, False,
                                                    label=self.label)
                pg.done = record(streams.all_gather)
            return pg
        with Span() as call:
            pg.work = self.transport.all_gather(pg.out, send, numel, async_op, label=self.label)
        pg.blocked = 0.0 if async_op else call.seconds
        return pg

    def _wait(self, pg: PendingGather | ExtGather) -> float:
        """Wait for a gather (CUDA: the compute stream waits); the exposed seconds."""
        if pg.done is not None:  # [Note: streams]
            return ExposedWait(pg.done, bool(self.ctx and self.ctx.sinks)).seconds
        with Span() as wait:
            pg.work.wait()
        return wait.seconds

    def wait_unshard(self) -> None:
        """Make the full parameters available on the modules (gathering first if needed)."""
        if self.state is ShardedState.UNSHARDED:
            return
        if self.state is ShardedState.SHARDED:
            self.unshard(async_op=False)
        S = self.mesh.shard_size
        with torch.no_grad():
            for pg in self._gathers:
                waited = self._wait(pg)
                self.pool.release(pg.send)
                rows = pg.out.view(S, pg.bucket.numel)
                for p in pg.bucket.gathered:
                    p.alloc_unsharded()
                # One fused copy (FSDP2's split_with_sizes_copy). The destinations are `.data`
                # views so the copy does not bump the autograd version counter that tensors
                # saved in forward check in backward (they alias this storage).
                dsts = [p.unsharded_rows_view() for p in pg.bucket.gathered]
                if all(d is not None for d in dsts):
                    torch.split_with_sizes_copy(rows, pg.bucket.sizes, dim=1, out=dsts)
                else:
                    # A parameter on another dim is copied into its own layout
                    # ([Note: layout] in sharded_param.py), on this (compute) stream too.
                    for p, part in zip(pg.bucket.gathered,
                                       rows.split(pg.bucket.sizes, dim=1)):
                        p.copy_out(part)
                self.copied["gather_out"] += pg.out.numel() * pg.out.element_size()
                self.pool.release(pg.out)
                self.emit("all_gather", "all_gather", pg.out.numel() * pg.out.element_size(),
                           pg.start, waited + pg.blocked)
            if self._ext_gather is not None:
                self._finish_extensions(self._ext_gather)
            if S == 1:
                for p in self.params:
                    if not p.direct and p.ext is None:
                        p.alloc_unsharded()
                        p.copy_out(p.padded_shard.view(1, -1), non_blocking=True)
        self._gathers.clear()
        for p in self.params:
            for ref in p.refs:
                ref.module._parameters[ref.name] = p.unsharded
        self.state = ShardedState.UNSHARDED

    def _finish_extensions(self, pg: ExtGather) -> None:
        self._ext_gather = None
        waited = self._wait(pg) if self.mesh.shard_size > 1 else 0.0
        if pg.pooled:
            self.pool.release(pg.send)
        unpack(self, pg)
        nbytes = pg.out.numel() * pg.out.element_size()
        self.copied["gather_out"] += nbytes
        if pg.pooled:
            self.pool.release(pg.out)
            self.emit("all_gather", "all_gather", nbytes, pg.start, waited + pg.blocked)

    def shards_changed_since_gather(self) -> bool:
        """Unsharded, and some shard was written since it was gathered: this rank's rows of
        a gathered parameter are no longer its shard, cast as the gather cast it.

        Compared by value, not by version counters: torch's fused optimizers and writes
        through `.data` bump none. Only units still gathered at a forward's start pay it (a
        forward that no backward followed, reshard_after_backward=False).
        """
        if self.state is not ShardedState.UNSHARDED:
            return False
        for p in self.params:
            if p.ext is not None:
                return True  # what its hooks gathered cannot be compared to the shard
            if p.direct:
                continue
            mine = p.gathered_local_rows()
            if not torch.equal(mine, p.local.to(device=mine.device, dtype=mine.dtype)):
                return True
        return False

    def reshard(self) -> None:
        """Free the full parameters; the modules see the shards again. In forward under
        hpZ, this rank's block rows are kept for backward first ([Note: hpZ])."""
        if self.state is ShardedState.SHARDED:
            if self.training_state is not TrainingState.FORWARD:
                self.post_forward = None  # backward is over (or never came)
            return
        if self.state is ShardedState.GATHERING:
            # Collectives must complete on every rank before their buffers go back.
            self.wait_unshard()
        start = now()
        if (self.hpz is not None and self.training_state is TrainingState.FORWARD
                and torch.is_grad_enabled() and not self.ext_params):
            self.post_forward = keep(self, self.hpz)
        for p in self.params:
            for ref in p.refs:
                ref.module._parameters[ref.name] = p.sharded
            p.free_unsharded()
        self.state = ShardedState.SHARDED
        self.emit("reshard", "", 0, start)


def _on(stream: Any) -> Any:
    """Run the block on `stream` (CUDA), or where it runs now (None: CPU)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
