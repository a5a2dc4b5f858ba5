"""The per-model context: one per sharded root, made when the root is sharded.

It owns what the units under one root share: the step `Schedule` (prefetch order, pending
reductions, the in-flight limits), the event sinks and the step number events are labelled
with, and the buffer pool. `fully_shard(module)` makes a context for `module`'s unit and
takes in the contexts of the units already sharded below it, so the settings a user makes
before the first forward (sinks, prefetch, limits) live here from the start.

What needs every rank (the layout check) or a finished model (no meta parameters) waits for
the first forward (`ensure_ready`).
"""

from __future__ import annotations

import functools
import logging
import struct
import zlib
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

from ..comm import collectives as C
from ..comm.work import debug_enabled
from .dtensor import check_params_in_place
from .events import EventSink
from .policies import agreement_groups, model_ranks
from .schedule import Limits, Schedule, ShardedState, TrainingState
from .unit import Streams, Unit, streams_for

if TYPE_CHECKING:
    from .policies import MeshInfo
    from .sharded_param import ShardedParam


# --------------------------------------------------------------------------------------------------
# Looking inside a sharded model: its units, sharded parameters and per-model context.
#
# The one way the rest of the package (checkpoints, observers, the explorer, the CLI) finds
# what the engine built, instead of reading engine attributes off modules.


def unit_of(module: nn.Module) -> Unit | None:
    """The unit `fully_shard(module)` made (None: the module was not sharded itself)."""
    # The module's own attribute: a wrapper that forwards unknown attributes to the module
    # inside it (CheckpointWrapper) must not look sharded when only its layer is.
    return vars(module).get("_sw_unit")


def units_of(model: nn.Module) -> list[Unit]:
    """Every unit at or below `model`, in module order (the root, if sharded, first)."""
    return [u for m in model.modules() if (u := unit_of(m)) is not None]


def is_sharded(model: nn.Module) -> bool:
    return any(unit_of(m) is not None for m in model.modules())


def context_of(model: nn.Module) -> ModelContext | None:
    """The per-model context of the sharded root at or below `model` (None: not sharded)."""
    units = units_of(model)
    return units[0].ctx if units else None


def mesh_of(model: nn.Module) -> MeshInfo | None:
    """The process groups the first unit of `model` communicates over."""
    units = units_of(model)
    return units[0].mesh if units else None


def sharded_params(model: nn.Module) -> list[ShardedParam]:
    """Every ShardedParam under `model`, once each, in unit order."""
    out, seen = [], set()
    for u in units_of(model):
        for p in u.params:
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def named_sharded_params(model: nn.Module) -> list[tuple[str, ShardedParam]]:
    """(FQN relative to `model`, ShardedParam) for every sharded parameter, first name wins.

    Names follow `model.named_parameters()`, so tied parameters appear once.
    """
    out, seen = [], set()
    for mname, m in model.named_modules():
        for pname, t in m._parameters.items():
            sp = getattr(t, "_sw_param", None) if t is not None else None
            if sp is not None and id(sp) not in seen:
                seen.add(id(sp))
                out.append((f"{mname}.{pname}" if mname else pname, sp))
    return out


# --------------------------------------------------------------------------------------------------
# Containers of units: each member gathers and reduces once per call of the module holding them.
#
# [Note: data-dependent units] Each rank's collectives follow from the module structure alone
# ([Note: structure decides] in schedule.py): a unit gathers when its forward reaches it. A
# model whose data decides which units run breaks that. The usual case is a mixture-of-experts
# layer whose experts are sharded one unit each, in an `nn.ModuleList` (FSDP2 users do this
# with Mixtral and Qwen2-MoE): a rank that routes no token to expert 3 never calls it, so it
# would never join the all-gather the other ranks issue for it, and their collectives would
# pair with other ones (same-sized experts exchanging rows silently, others aborting or hanging).
#
# So a `ModuleList`/`ModuleDict` of units (nested containers flattened, in their order) held by
# a module (the *holder*: the MoE block, the model's layer stack) is one group: in each call of
# the holder, every rank gathers each member once and, in backward, reduces each once, in
# container order, whether or not its data ran the member. One at a time: when member j is
# called, the members before j that this call has not run yet get a stand-in first ([Note:
# stand-ins] in schedule.py: the schedule calls their hooks would have made, units nested in
# them included, in module order); when the holder returns, so do the members after the last
# one run. A stand-in gathers and releases at once, and owes backward a gather and a reduction
# of no gradient, settled where its backward would have run. The recorded forward order is then
# the container's on every rank, and so are prefetch and the final callback's order. A member
# called again after a later one (or twice) in one holder call starts a new round over the
# container: a layer stack run twice per call costs two rounds on every rank. Every rank must
# run the same number of rounds, which holds when the code, not the data, decides the order
# (as in Mixtral's and Qwen2-MoE's ascending loop over the experts hit).
#
# Memory: a stand-in holds one member's gathered parameters, as a run of it would; measured in
# docs/moe.md against gathering the whole group at the holder's call. Time: a layer stack
# called in order, or any holder whose every member runs, gets no stand-in: its collectives
# are what they were (tests/dist/test_collective_counts.py), and no step pays a collective or
# a host-device sync to follow the routing. Refused on every rank at the first forward (the
# structure shows it): a unit that is a member twice (listed twice, or in two containers).
# Not followed: members called outside their holder's forward (the holder must be the module
# that calls them), and a holder's inputs that reach the loss on some ranks only.

_CONTAINERS = (nn.ModuleList, nn.ModuleDict)

_log = logging.getLogger(__name__)


class _Pass:
    """One call of a holder: the next member (container position) it reaches."""

    __slots__ = ("next", "needs_grad")

    def __init__(self, needs_grad: bool) -> None:
        self.next = 0
        # Its inputs needed a gradient (a stand-in's reduction then runs within backward).
        self.needs_grad = needs_grad


class Containers:
    """One model's holders, their members, and where each running holder call is."""

    def __init__(self, holders: list[tuple[nn.Module, str, list[tuple[nn.Module, str]]]],
                 schedule: Schedule[Unit], top: list[nn.Module], inputs: Any = ()) -> None:
        # (holder module, its name in the model, its members: (a unit's module, its name)).
        self.holders = holders
        self.schedule = schedule
        # id(member module) -> (holder index, position in the container).
        self.where: dict[int, tuple[int, int]] = {}
        for i, (_, _, members) in enumerate(holders):
            for j, (m, name) in enumerate(members):
                if id(m) in self.where:
                    k, at = self.where[id(m)]
                    raise RuntimeError(
                        f"unit {holders[k][2][at][1]!r} is a member of two containers of units "
                        f"(also {name!r}), so its gathers would follow two holders' calls: "
                        "hold each unit in one ModuleList/ModuleDict, or shard the module "
                        "that holds both containers as one unit; see docs/moe.md")
                self.where[id(m)] = (i, j)
        # Per holder, per member: the hook calls a call of the member makes, units nested
        # in it included (module order): (unit, True) at its pre-forward, (unit, False) after.
        self.calls = [[_hook_calls(m) for m, _ in members] for _, _, members in holders]
        self.passes: list[_Pass | None] = [None] * len(holders)
        self.warned: set[int] = set()
        self.handles: list[Any] = []
        for i, (holder, _, _) in enumerate(holders):
            self.handles.append(holder.register_forward_pre_hook(
                functools.partial(self._holder_starts, i), with_kwargs=True))
            # Before the holder's own unit post-hook (which reshards it, or ends the step).
            self.handles.append(holder.register_forward_hook(
                functools.partial(self._holder_ends, i), prepend=True))
            if any(holder is t for t in top):
                # The root holds it and is running now: its pre-hook was taken already.
                self.passes[i] = _Pass(_needs_grad(inputs))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def reset(self) -> None:
        self.passes = [None] * len(self.holders)

    def _holder_starts(self, i: int, module: nn.Module, args: Any, kwargs: Any) -> None:
        self.passes[i] = _Pass(_needs_grad((args, kwargs)))

    def called(self, module: nn.Module) -> None:
        """A member's pre-forward (or its recomputation), before its gather: the members
        before it that this holder call has not reached stand in first."""
        at = self.where.get(id(module))
        if at is None:
            return
        i, j = at
        p = self.passes[i]
        if p is None:
            return  # called outside its holder's forward: not followed
        if j < p.next:
            # A new round over the container: the rest of this one first.
            self._stand_in(i, p, len(self.calls[i]))
            p.next = 0
            if j > 0 and i not in self.warned:
                self.warned.add(i)
                _log.warning(
                    "%r calls the units of its container out of container order (%r after a "
                    "later one): each such call starts a new round, which gathers and reduces "
                    "every member again", self.holders[i][1] or "<root>",
                    self.holders[i][2][j][1])
        self._stand_in(i, p, j)
        p.next = j + 1

    def _holder_ends(self, i: int, module: nn.Module, args: Any, output: Any) -> None:
        p, self.passes[i] = self.passes[i], None
        if p is not None:
            self._stand_in(i, p, len(self.calls[i]))

    def _stand_in(self, i: int, p: _Pass, upto: int) -> None:
        """Stand-ins for members [p.next, upto) of holder i ([Note: stand-ins])."""
        grad = torch.is_grad_enabled()
        for j in range(p.next, upto):
            self.schedule.stand_in([
                (u, pre, grad and (p.needs_grad or any(x.requires_grad for x in u.params)))
                for u, pre in self.calls[i][j]], late=not p.needs_grad)
        p.next = max(p.next, upto)


def _needs_grad(inputs: Any) -> bool:
    return any(isinstance(t, torch.Tensor) and t.requires_grad
               for t in torch.utils._pytree.tree_leaves(inputs))


def _hook_calls(module: nn.Module) -> list[tuple[Unit, bool]]:
    out: list[tuple[Unit, bool]] = []
    u = vars(module).get("_sw_unit")
    if u is not None:
        out.append((u, True))
    for child in module.children():
        out += _hook_calls(child)
    if u is not None:
        out.append((u, False))
    return out


def find_holders(named: list[tuple[str, nn.Module]], is_unit: Callable[[nn.Module], bool]
                 ) -> list[tuple[nn.Module, str, list[tuple[nn.Module, str]]]]:
    """The holders among the model's `named` modules (those whose child is a container of
    units; nested containers belong to the outermost one) with their members."""
    by_name = dict(named)
    out = []
    for name, c in named:
        if not name or not isinstance(c, _CONTAINERS):
            continue
        holder_name = name.rpartition(".")[0]
        holder = by_name.get(holder_name)
        if holder is None or isinstance(holder, _CONTAINERS):
            continue  # part of the outer container's members
        members: list[tuple[nn.Module, str]] = []
        _collect(c, name, is_unit, members)
        if members:
            out.append((holder, holder_name, members))
    return out


def _collect(c: nn.Module, prefix: str, is_unit: Callable[[nn.Module], bool],
             members: list[tuple[nn.Module, str]]) -> None:
    for n, m in c.named_children():
        if is_unit(m):
            members.append((m, f"{prefix}.{n}"))
        elif isinstance(m, _CONTAINERS):
            _collect(m, f"{prefix}.{n}", is_unit, members)


# --------------------------------------------------------------------------------------------------
# The freeze check (SHARDWISE_DEBUG=1): every rank must agree on which parameters require grad.
#
# [Note: freeze check] A unit's gradient reduction packs only the parameters that require
# grad (`FlatBucket.grad_params`), and the layout follows `requires_grad` changes the user
# makes between steps (`Unit.follow_requires_grad`, at the root's forward). A change made on
# one rank only (`blocks[0].attn.weight.requires_grad_(False)` on rank 1) gives the ranks
# reductions of different sizes: gloo aborts the process ("Received data size doesn't match
# expected size"), NCCL hangs or reads garbage.
#
# A rank that changed nothing cannot know it should check, so the check is a collective every
# rank joins at every backward. That is a collective FSDP2 does not issue, so it runs only in
# debug mode, with the other misuse checks (engine/comm/work.py): at the first backward hook of a
# grad-enabled forward, before any reduction, one all-reduce of a CRC of every parameter's
# flag over the model's ranks. Every rank reads the same result, so either all go on or all
# raise; on a mismatch one more exchange (on the error path only) names the units, counts and
# parameters that differ. Without debug mode the layout check at the first forward
# (context.py) still runs once; docs/debugging.md says to turn the debug mode on when a run
# that freezes parameters dies in a reduce-scatter.

LABEL = "freeze check"


def check_same_trainable(units: Sequence[Unit], groups: Sequence[Any]) -> None:
    """Raise on every rank if the ranks' `requires_grad` flags differ ([Note: freeze check]).
    `groups`: the model's agreement groups (mesh.agreement_groups)."""
    if not (C.is_initialized() and groups and any(u.mesh.dp_size > 1 for u in units)):
        return
    flags = bytes(p.requires_grad for u in units for p in u.params)
    fp = zlib.crc32(flags) & 0x7FFFFFFF
    hi, neg_lo = C.max_over([fp, -fp], groups, label=LABEL)
    if (hi, -neg_lo) != (fp, fp):
        raise RuntimeError(_describe(units, groups[0], flags))


def _describe(units: Sequence[Unit], group: Any, flags: bytes) -> str:
    every = C.all_gather_bytes(flags, group)
    names = C.group_ranks(group)
    me, fp = C.rank(), zlib.crc32(flags)
    others = sorted({zlib.crc32(b) for b in every} - {fp})
    parts = []
    at = 0
    for u in units:
        n = len(u.params)
        rows = [b[at: at + n] for b in every]
        at += n
        if len(set(rows)) > 1:
            parts.append(_unit_difference(u, rows, names))
    where = "; ".join(parts[:3]) + (f"; and {len(parts) - 3} more units"
                                     if len(parts) > 3 else "")
    return (f"rank {me}: ranks disagree on which parameters require grad (fingerprint "
            f"{fp} here, {', '.join(map(str, others))} elsewhere); {where}. Freeze "
            "or unfreeze parameters on every rank alike, between steps: a unit reduces "
            "the gradients of the parameters that require grad, so ranks that disagree "
            "would exchange buffers of different sizes")


def _unit_difference(u: Unit, rows: list[bytes], names: list[int]) -> str:
    """"unit 'blocks.1' (7 parameters): rank 1 trains 6, rank 0 trains 7; blocks.1.up.weight
    requires grad on rank 0, not on rank 1" (`rows`: each rank's flags for `u`, from the
    global ranks `names`)."""
    by_count: dict[int, list[int]] = {}
    for r, row in zip(names, rows):
        by_count.setdefault(sum(row), []).append(r)
    # The fewest ranks first: usually the one rank that changed something.
    counts = sorted(by_count.items(), key=lambda kv: (len(kv[1]), kv[0]))
    trains = ", ".join(f"{_ranks(rs)} {'trains' if len(rs) == 1 else 'train'} {c}"
                       for c, rs in counts)
    params = []
    for i, p in enumerate(u.params):
        yes = [r for r, row in zip(names, rows) if row[i]]
        if 0 < len(yes) < len(rows):
            no = [r for r in names if r not in yes]
            name = f"{u.name}.{p.fqn}" if u.name else p.fqn
            params.append(f"{name} requires grad on {_ranks(yes)}, not on {_ranks(no)}")
    more = f" (and {len(params) - 5} more)" if len(params) > 5 else ""
    return (f"unit {u.label!r} ({len(u.params)} parameters): {trains}; "
            + ", ".join(params[:5]) + more)


def _ranks(rs: list[int]) -> str:
    return f"rank {rs[0]}" if len(rs) == 1 else f"ranks {rs}"


class ModelContext:
    def __init__(self, top: Unit) -> None:
        self.top = top
        self.units: list[Unit] = [top]
        self.schedule: Schedule[Unit] = Schedule(self.units)
        self.sinks: list[EventSink] = []
        # Training step that events are labelled with (observe.sinks.set_step).
        self.step = 0
        self.ready = False
        self._final_queued = False
        # set_post_optim_event: waited for at the start of the next root forward.
        self.post_optim_event: object | None = None
        # CUDA: the side streams of [Note: streams] (None on CPU); made at the first forward.
        self.streams: Streams | None = None
        # Holders of containers of units and their running calls ([Note: data-dependent
        # units]); None: the model has none.
        self.containers: Containers | None = None
        # Under SHARDWISE_DEBUG: the freeze check is due at this backward's first hook.
        self._check_trainable = False
        # The groups the checks above agree over: the model's ranks ([Note: model group]
        # in policies.py), set at the first forward.
        self.groups: list[Any] = [None]

    @classmethod
    def create(cls, top: Unit) -> ModelContext:
        """A context for `top`, taking in every unit already sharded beneath its module."""
        ctx = cls(top)
        units: list[Unit] = []
        seen: set[int] = set()
        for name, m in _named_modules(top.modules):
            u = unit_of(m)
            if u is None or id(u) in seen:
                continue  # a list-form unit is reached through each of its modules
            seen.add(id(u))
            old = u.ctx
            if old is not None and old is not ctx:
                if old.ready:
                    raise RuntimeError(
                        f"unit {name!r} already ran forward as its own root; call "
                        "fully_shard on the blocks first and on the root last, then run "
                        "forward on the root")
                ctx.sinks.extend(s for s in old.sinks if s not in ctx.sinks)
                ctx.schedule.prefetch = ctx.schedule.prefetch and old.schedule.prefetch
                ctx.schedule.limits = old.schedule.limits
                ctx.step = max(ctx.step, old.step)
            ctx._adopt(u, name)
            units.append(u)
        ctx.units[:] = units
        return ctx

    def _adopt(self, u: Unit, name: str) -> None:
        u.ctx = self
        u.name = name
        u.is_root = u is self.top
        # One pool for the whole model: only a few unit-sized buffers are alive at once.
        u.pool = self.top.pool

    @property
    def limits(self) -> Limits:
        return self.schedule.limits

    @property
    def in_backward(self) -> bool:
        return self.schedule.state is TrainingState.PRE_BACKWARD

    # --- first forward ------------------------------------------------------------------

    def ensure_ready(self, unit: Unit, inputs: Any = ()) -> ModelContext:
        """At the first forward through `unit` (`inputs`: that call's); returns the context
        that runs it."""
        if self.ready:
            return self
        if unit is not self.top:
            # Forward started below the sharded root: that unit's subtree runs on its own
            # (the root's own first forward then reports the conflict).
            return ModelContext.create(unit).ensure_ready(unit, inputs)
        taken = [u.label for u in self.units if u.ctx is not self]
        if taken:
            raise RuntimeError(
                f"units {taken[:5]} already belong to another root (they ran forward as their "
                "own root first); call fully_shard on the blocks first and on the root last, "
                "and run forward on the root")
        meta = [p.fqn for u in self.units for p in u.params if p.is_meta]
        if meta:
            raise RuntimeError(
                f"parameters {meta[:5]}{' ...' if len(meta) > 5 else ''} are still on the "
                "meta device: call sw.materialize(model) or sw.load_full_state_dict(model, "
                "sd) before the first forward")
        for u in self.units:
            # FSDP2's monkey-patch recipe: hooks patched onto the shards after sharding
            # gather through them from the first forward on ([Note: all-gather extensions]).
            if any([p.refresh_extension() for p in u.params]):
                u.set_params(u.params)
        check_params_in_place(self.units)
        self.groups = agreement_groups(self.units)
        _check_same_layout(self.units, self.groups)
        self.streams = streams_for(self.top.mesh.device)
        # A module's own attribute: a CheckpointWrapper forwards lookups to the unit inside.
        holders = find_holders(_named_modules(self.top.modules),
                               lambda m: vars(m).get("_sw_unit") is not None)
        if holders:
            self.containers = Containers(holders, self.schedule, self.top.modules, inputs)
        self.ready = True
        return self

    # --- step boundaries ----------------------------------------------------------------

    def begin_forward(self) -> None:
        event, self.post_optim_event = self.post_optim_event, None
        if self.streams is not None:
            self.streams.step_starts(event)  # [Note: streams]
        elif event is not None:
            event.wait()  # type: ignore[attr-defined]  # the current stream waits for it
        if self.schedule.state is TrainingState.PRE_BACKWARD:
            # A backward that never reached its final callback (it raised): its results are
            # dropped, as reset_iter_state drops them. Finishing it instead would write its
            # gradients after the user's zero_grad, into the next step's (wrong numbers,
            # silently), and issue reductions this rank's peers may not issue.
            _log.warning("the last backward did not finish (it raised?): its gradients "
                         "are dropped; call model.reset_iter_state() after such an error")
            self.reset_iter_state()
        # The user may have frozen or unfrozen parameters since the last step.
        for u in self.units:
            u.follow_requires_grad()
        # Still gathered from a forward that no backward followed (grad enabled, the root
        # and reshard_after_forward=False units keep their parameters), or kept by
        # reshard_after_backward=False, and the shards changed since (an optimizer step, a
        # write through `.data`): the full parameters are stale. Decided alike on every
        # rank: a rank whose shard is empty sees no change where the others do, and a
        # reshard on some ranks only would gather on those alone.
        kept = [u for u in self.units
                if u.state is ShardedState.UNSHARDED and u.kept_needs_value_check()]
        if kept:
            stale = C.max_over([int(u.shards_changed_since_gather()) for u in kept],
                               self.groups, label="stale gathered parameters")
            for u, s in zip(kept, stale):
                if s:
                    u.reshard()
        self._check_trainable = torch.is_grad_enabled() and debug_enabled()
        self.schedule.begin_forward()

    def ensure_backward(self) -> None:
        """Every backward hook calls this: the first one queues the final callback (and,
        under SHARDWISE_DEBUG, checks that every rank trains the same parameters before
        any reduction, [Note: freeze check])."""
        if self._check_trainable:
            self._check_trainable = False
            try:
                check_same_trainable(self.units, self.groups)
            except RuntimeError:
                self.reset_iter_state()
                raise
        self.schedule.state = TrainingState.PRE_BACKWARD
        if not self._final_queued:
            self._final_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)

    def finish_backward(self) -> None:
        """Root final callback: every gradient reduced, every unit sharded."""
        self.schedule.end_backward()
        for u in self.units:
            u.settle()
        self._final_queued = False

    def reset_iter_state(self) -> None:
        """After a forward or backward raised: wait for the collectives in flight (every
        rank issued them), drop their results and every unreduced gradient, reshard."""
        sched = self.schedule
        self._check_trainable = False
        while sched.pending:
            pr: Any = sched.pending.popleft()
            pr.work.wait()
            if pr.done is not None:  # [Note: streams]: before its buffers are reused
                torch.cuda.current_stream().wait_event(pr.done)
            if pr.send is not None:
                pr.unit.pool.release(pr.send)
        for u in self.units:
            u.reshard()
            u.post_forward = None
            u.partial_reduce.clear()  # deferred reductions of the failed step (FSDP2 too)
            for p in u.params:
                if not p.direct:
                    p.unsharded.grad = None
                    p.acc_grad = None
            u.training_state = TrainingState.IDLE
        sched.state = TrainingState.IDLE
        sched.order_now = []
        sched.reduced = set()
        sched.owed = []
        if self.containers is not None:
            self.containers.reset()
        self._final_queued = False


def _named_modules(modules: list[nn.Module]) -> list[tuple[str, nn.Module]]:
    if len(modules) == 1:
        return list(modules[0].named_modules())
    # The list form: names are relative to each module, prefixed by its position.
    return [(f"{i}.{n}" if n else str(i), m) for i, top in enumerate(modules)
            for n, m in top.named_modules()]


def _check_same_layout(units: list[Unit], groups: list[Any]) -> None:
    """Every rank must shard the same model the same way, or collectives would mismatch.

    One small all-reduce at the first forward turns a diverging rank (another model, other
    shapes, another wrap policy, an all-gather extension subclass on one rank only, which
    gathers other bytes) into an error on every rank instead of a hang or garbage.
    """
    desc = ";".join(
        f"{u.name}:" + ",".join(f"{p.global_shape}{p.orig_dtype}{p.compute_dtype}{p.subclass}"
                                f"d{p.shard_dim}"
                                for p in u.params)
        for u in units
    )
    fingerprint = zlib.crc32(desc.encode()) & 0x7FFFFFFF
    hi, neg_lo = C.max_over([fingerprint, -fingerprint], groups, label="layout check")
    if (hi, -neg_lo) != (fingerprint, fingerprint):
        raise RuntimeError(
            f"rank {C.rank()}: ranks disagree on the sharded model ({len(units)} units here, "
            f"layout fingerprint {fingerprint}); every rank must build the same model and call "
            "shard_model/fully_shard with the same arguments"
        )


# --------------------------------------------------------------------------------------------------
# The ranks that run one model, and the model-level collectives over them.
#
# [Note: model ranks] The engine's own checks run over a model's agreement groups ([Note:
# model group] in policies.py). So must the operations a user calls on the whole model: seeding
# and replicated buffers in `materialize`, the agreements and the writer of checkpoints,
# exports and pretrained loads, `full_state_dict(rank0_only=True)`,
# `load_full_state_dict(from_rank0=True)`, the grad scaler's found-inf flag. On a model
# sharded on a subgroup (ranks {1, 2} of 3, a pipeline stage, a 2 x 2 HYBRID_SHARD mesh on 4
# of 5 ranks) the world's collectives waited for ranks that never run the model, or met
# another model's collective there, and "rank 0" may not run the model at all.
#
# `ModelGroup` is the model's ranks (ascending; the *first rank* is where a model-level
# operation sends from or writes: global rank 0 when the model runs on every rank) and its
# agreement groups. A model on every rank has groups [None]: each operation below is then
# the one world collective it was before, at the same cost. On a subgroup that one of the
# units' groups spans, it is that group's collective. On a product mesh no group spans the
# model: the operation runs over each dim's group in turn (an agreement is a MAX, a broadcast
# is relayed from the ranks that already hold the value, bytes gathered so far are gathered
# again), which reaches every rank of the mesh. A model on one rank alone communicates not
# at all.


class ModelGroup:
    """One model's ranks and agreement groups ([Note: model ranks])."""

    def __init__(self, ranks: Iterable[int], groups: Iterable[ProcessGroup | None]) -> None:
        self.ranks = tuple(sorted(ranks))
        self.groups = list(groups)
        # Per group, the global rank a broadcast from the first rank comes from there
        # (None: no rank of that group holds it yet); made at the first multi-dim broadcast.
        self._sources: list[int | None] | None = None

    @classmethod
    def world(cls) -> ModelGroup:
        """Every rank (an unsharded model, or a call made before any model exists)."""
        return cls(range(C.world_size()), [None])

    @classmethod
    def of_units(cls, units: Iterable[Any]) -> ModelGroup:
        units = list(units)
        if not units or not C.is_initialized():
            return cls.world()
        ranks = model_ranks(units)
        groups = agreement_groups(units)
        return cls(ranks, groups if len(ranks) > 1 else [])

    @property
    def first(self) -> int:
        """The global rank model-level operations send from and write on."""
        return self.ranks[0]

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def is_first(self) -> bool:
        return C.rank() == self.first

    @property
    def index(self) -> int:
        """This rank's position among the model's ranks (0 on the first rank)."""
        return self.ranks.index(C.rank())

    def describe(self) -> str:
        """"rank 0" on every rank, "rank 1 (the first of ranks [1, 2])" on a subgroup."""
        if self.ranks == tuple(range(C.world_size())):
            return f"rank {self.first}"
        return f"rank {self.first} (the first of the model's ranks {list(self.ranks)})"

    # --- collectives over the model's ranks ----------------------------------------------

    def agree(self, flag: bool, label: str = "") -> bool:
        """True on every rank of the model iff `flag` is True on all of them."""
        if len(self.groups) == 1:
            return C.agree(flag, self.groups[0], label=label)
        return C.max_over([0 if flag else 1], self.groups, label=label)[0] == 0

    def max_(self, tensor: torch.Tensor, label: str = "") -> torch.Tensor:
        """The elementwise MAX of `tensor` over the model's ranks, in place (over each group
        in turn on a product mesh: a repeated rank changes nothing under MAX)."""
        for g in self.groups:
            C.all_reduce(tensor, g, op="max", label=label)
        return tensor

    def broadcast(self, tensor: torch.Tensor, label: str = "") -> torch.Tensor:
        """The first rank's `tensor`, in place on every rank of the model."""
        if len(self.groups) == 1:
            return C.broadcast(tensor, self.first, self.groups[0], label=label)
        for g, src in zip(self.groups, self._relay()):
            if src is not None:
                C.broadcast(tensor, src, g, label=label)
        return tensor

    def _relay(self) -> list[int | None]:
        """Each group's source for a broadcast from the first rank through the groups in
        turn: its lowest rank holding the value by then (one tiny all-reduce per group,
        once per ModelGroup: every broadcast of this model follows the same path)."""
        if self._sources is None:
            holds = C.rank() == self.first
            sources: list[int | None] = []
            for g in self.groups:
                n = C.world_size(g)
                lowest = -C.max_over([-C.rank(g) if holds else -n], [g],
                                     label="model broadcast path")[0]
                sources.append(C.global_rank_of(g, lowest) if lowest < n else None)
                holds = holds or lowest < n
            self._sources = sources
        return self._sources

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Every model rank's `data`, in the order of `ranks`, on every rank of the model."""
        if not self.groups:
            return [data]
        if len(self.groups) == 1:
            g = self.groups[0]
            got = dict(zip(C.group_ranks(g), C.all_gather_bytes(data, g)))
            return [got[r] for r in self.ranks]
        have = {C.rank(): data}
        for g in self.groups:  # what each rank holds so far, gathered over the next dim
            for blob in C.all_gather_bytes(_pack(have), g):
                have.update(_unpack(blob))
        return [have[r] for r in self.ranks]

    def gather_bytes(self, data: bytes) -> list[bytes]:
        """Every model rank's `data` (order of `ranks`) on the first rank; [] elsewhere."""
        if len(self.groups) == 1:
            g = self.groups[0]
            dst = C.group_ranks(g).index(self.first)
            got = C.gather_bytes(data, dst=dst, group=g)
            if not got:
                return []
            by_rank = dict(zip(C.group_ranks(g), got))
            return [by_rank[r] for r in self.ranks]
        every = self.all_gather_bytes(data)
        return every if self.is_first else []


def model_group(model: object) -> ModelGroup:
    """The ModelGroup of a sharded `model`; the world for anything else (a plain module, a
    wrong argument that a check will refuse next: every rank reaches that check)."""
    if not isinstance(model, nn.Module):
        return ModelGroup.world()
    return ModelGroup.of_units(units_of(model))


def _pack(items: dict[int, bytes]) -> bytes:
    """{global rank: bytes} as (rank, length, bytes) records: never pickle."""
    return b"".join(struct.pack("<qq", r, len(b)) + b for r, b in sorted(items.items()))


def _unpack(blob: bytes) -> dict[int, bytes]:
    out: dict[int, bytes] = {}
    at = 0
    while at < len(blob):
        r, n = struct.unpack_from("<qq", blob, at)
        at += 16
        out[r] = blob[at: at + n]
        at += n
    return out
