"""Run a model's initializers at full shape, one module at a time, keeping this rank's rows.

[Note: full-shape init] An initializer that runs on a rank's rows is not the unsharded
model's initializer: xavier's fan_out is dim 0, the sharded one; orthogonal_ makes only
the rows orthogonal; a draw per shard rank matches no unsharded run. So `materialize`
calls each module's initializer (`init_fn(m)` or `m.reset_parameters()`, in
`model.modules()` order, every rank seeded alike) while that module holds full tensors
of its own parameters, then copies this rank's rows into the shard and frees them. Every
rank draws the same full values, so the shards are the unsharded model's initialization,
bit for bit where the random stream is the same (the CPU; on an accelerator, init_fn's
DTensor ops draw through DTensor's generator). At most one initializer's parameters are
full at once.

An initializer may also write parameters of its submodules (nn.MultiheadAttention's
`_reset_parameters` zeroes `out_proj.bias`). Those hold shard views meanwhile; a write to
one is seen by its version counter, and the initializer runs again from the same random
state with those parameters full too. A write through `.data` bumps no counter: it lands
in the views as it is. The views are the same shape on every rank (padded shards for
`reset_parameters`; DTensors, whose shape is the full one, for `init_fn`), so every rank
runs the same code and the random streams stay together whatever an initializer does.
"""

from __future__ import annotations

import contextlib
import functools
import math
import mmap
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from ..core import dtensor as DT
from ..core.inspect import sharded_params
from ..core.sharded_param import ShardedParam


class FullShapeInit:
    """Runs initializers at full shape on one sharded model ([Note: full-shape init]).

    A full tensor starts as the unfilled sentinel: one that no initializer wrote is not
    copied over the shard, which keeps its values (or its own sentinel).
    """

    def __init__(self, model: nn.Module, device: torch.device, as_dtensor: bool) -> None:
        self.sps = sharded_params(model)
        # Where each sharded parameter is held: (id(module), name) -> its ShardedParam.
        self.owner = {(id(ref.module), ref.name): sp for sp in self.sps for ref in sp.refs}
        self.device = device
        # init_fn sees DTensors (FSDP2's convention); reset_parameters plain tensors.
        self.as_dtensor = as_dtensor

    def views(self) -> contextlib.AbstractContextManager[None]:
        """What modules hold for the whole pass: padded shard views for reset_parameters,
        the sharded DTensors (as they are) for init_fn."""
        return contextlib.nullcontext() if self.as_dtensor else _padded_views(self.sps)

    def run(self, m: nn.Module, call: Callable[[], object]) -> None:
        """`call()` (an initializer of `m`) with `m`'s own parameters full."""
        _init_module(m, call, self.owner, self.device, self.as_dtensor)


def initializer(m: nn.Module, init_fn: Callable[[nn.Module], None] | None
                ) -> Callable[[], object] | None:
    """What materialize runs for `m`: init_fn(m), else m.reset_parameters(), else nothing."""
    if init_fn is not None:
        return functools.partial(init_fn, m)
    reset = getattr(m, "reset_parameters", None)
    return reset if callable(reset) else None


def _init_module(m: nn.Module, call: Callable[[], object],
                 owner: dict[tuple[int, str], ShardedParam], device: torch.device,
                 as_dtensor: bool) -> None:
    own = {sp for name in m._parameters
           if (sp := owner.get((id(m), name))) is not None}
    below = [(sub, name) for sub in m.modules() if sub is not m
             for name in sub._parameters if (id(sub), name) in owner]
    rng = _rng_state(device)
    while True:
        fulls = {sp: unfilled(sp.orig_shape, sp.orig_dtype, device) for sp in own}
        # Every slot of these parameters under `m` (tied ones too) holds the full tensor.
        slots = [(sub, name) for sub in m.modules() for name in sub._parameters
                 if owner.get((id(sub), name)) in fulls]
        held = {slot: slot[0]._parameters[slot[1]] for slot in slots}
        for (sub, name) in slots:
            sp = owner[(id(sub), name)]
            sub._parameters[name] = nn.Parameter(_face(fulls[sp], sp, as_dtensor),
                                                 requires_grad=sp.requires_grad)
        watched = {slot: (t, t._version) for slot in below if slot not in held
                   and (t := slot[0]._parameters[slot[1]]) is not None}
        try:
            call()
        finally:
            for (sub, name), t in held.items():
                sub._parameters[name] = t
        touched = {owner[(id(s[0]), s[1])] for s, (t, v) in watched.items()
                   if t._version != v}
        if not touched:
            break
        # Written through a view: again from the same random state, those full as well.
        own |= touched
        _set_rng_state(device, rng)
    with torch.no_grad():
        for sp, full in fulls.items():
            if not still_unfilled(full):
                sp.local.copy_(sp.local_slice(full).to(sp.local.device))


def _face(full: torch.Tensor, sp: ShardedParam, as_dtensor: bool) -> torch.Tensor:
    """What the module holds while its initializer runs: the full tensor, as a DTensor
    replicated on the parameter's mesh for init_fn (FSDP2's convention: `device_mesh`,
    `placements` and `distribute_tensor(full, ...)` work), else plain."""
    if not as_dtensor or sp.spec is None or full.dim() == 0:
        return full
    spec = sp.spec
    meta = TensorMeta(full.shape, DT.contiguous_stride(full.shape), full.dtype)
    rep = DTensorSpec(spec.mesh, (Replicate(),) * spec.mesh.ndim, tensor_meta=meta)
    return DT.wrap(full, rep)


@contextlib.contextmanager
def _padded_views(sps: list[ShardedParam]) -> Iterator[None]:
    """Modules hold plain views of their padded shards while `reset_parameters` runs:
    the same shape on every rank (an empty shard would skip an initializer's draw on one
    rank only); padding rows are zeroed after."""
    for sp in sps:
        view = nn.Parameter(sp.from_rows(sp.padded_shard), requires_grad=sp.requires_grad)
        for ref in sp.refs:
            ref.module._parameters[ref.name] = view
    try:
        yield
    finally:
        for sp in sps:
            for ref in sp.refs:
                ref.module._parameters[ref.name] = sp.sharded
            with torch.no_grad():
                sp.padded_shard[sp.local_rows:].zero_()


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    acc = torch.get_device_module(device.type) if device.type != "cpu" else None
    return torch.get_rng_state(), (acc.get_rng_state(device) if acc is not None else None)


def _set_rng_state(device: torch.device, state: tuple[torch.Tensor, torch.Tensor | None]
                   ) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.get_device_module(device.type).set_rng_state(state[1], device)


# Full tensors at least this large are mapped anonymously on the host, so that freeing one
# gives its pages back at once: from the C heap, glibc keeps them (its mmap threshold grows
# after the first large free), and a model's initializers added up in the resident set one
# module after another (a 4 x 16 MB model grew by 55 MB on a 16.8 MB shard).
_MAP_BYTES = 1 << 20


def unfilled(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A new tensor holding the sentinel that initializers overwrite."""
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    if device.type == "cpu" and nbytes >= _MAP_BYTES:
        pages = mmap.mmap(-1, nbytes)  # unmapped when the last tensor on it is freed
        t = torch.frombuffer(pages, dtype=dtype, count=numel).view(shape)
        return fill_sentinel(t)
    return fill_sentinel(torch.empty(shape, dtype=dtype, device=device))


def fill_sentinel(t: torch.Tensor) -> torch.Tensor:
    """`t`, filled in place with the unfilled sentinel: NaN, or the lowest integer (a bool
    has no value to spare: False)."""
    if t.is_floating_point() or t.is_complex():
        return t.fill_(float("nan"))
    if t.dtype == torch.bool:
        return t.fill_(False)
    return t.fill_(torch.iinfo(t.dtype).min)


def still_unfilled(t: torch.Tensor) -> bool:
    """Whether `t` holds only the sentinel (never for an empty or bool tensor: nothing to
    fill, or no value left to mark "unfilled")."""
    if t.numel() == 0 or t.dtype == torch.bool:
        return False
    flat = t.reshape(-1)
    step = 1 << 20  # in pieces: a full-size boolean mask would be one more large buffer
    for i in range(0, flat.numel(), step):
        piece = flat[i : i + step]
        if t.is_floating_point() or t.is_complex():
            if not bool(torch.isnan(piece).all()):
                return False
        elif not bool((piece == torch.iinfo(t.dtype).min).all()):
            return False
    return True
