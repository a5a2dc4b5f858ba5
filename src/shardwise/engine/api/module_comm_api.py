"""FSDP2's communication methods on a sharded module: gradient division, hooks on the
reduced gradients, custom collectives, and the knobs that have nothing to change here.

Part of [Note: FSDPModule identity] (module_api.py): each overrides FSDPModule's method of
the same name, whose body would reach into FSDP2's internal state.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..comm.transport import CustomTransport
from ..core.checks import check_bool, check_int, check_number

# At run time, not under TYPE_CHECKING: Hugging Face resolves the annotations of a model's
# class (typing.get_type_hints), and a sharded module's class inherits these.
from ..core.unit import Unit


class CommMethods:
    _sw_unit: Unit

    def _sw_units(self, recurse: bool) -> Iterator[Unit]:
        raise NotImplementedError  # module_api.FSDP2Methods

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide this unit's reduced gradients by `factor` instead of the data-parallel
        size (the default, a mean over ranks); 1.0 gives the sum over ranks (torchtitan
        sets it on every module when its loss is divided by the global token count).
        Not recursive, as in FSDP2."""
        factor = check_number("factor", factor, positive=True)
        self._sw_unit.grad_divide_factor = float(factor)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated in FSDP2 (a DeprecationWarning there too): `set_gradient_divide_factor`."""
        warnings.warn("set_reduce_scatter_divide_factor is deprecated: use "
                      "set_gradient_divide_factor", DeprecationWarning, stacklevel=2)
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """shardwise always reduces with SUM and divides afterwards, so the collectives
        are unchanged. As in FSDP2, it decides what an all-reduce hook sees: True, the sum
        (the division follows the hook); False (default), the divided gradient."""
        check_bool("enable", enable)
        self._sw_unit.force_sum_reduction = enable

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *,
                            stream: Any = None) -> None:
        """`hook(reduced)` runs on this unit's flat reduced gradient shard (one call per
        communication dtype), after the reduce-scatter (and the all-reduce across replicas
        under HYBRID_SHARD), before it is written to the parameters' `.grad`; in-place
        changes are kept. Not recursive, as in FSDP2."""
        if not callable(hook):
            raise ValueError(f"hook={hook!r} must be a callable (tensor) -> None")
        if stream is not None:
            if self._sw_unit.mesh.replicate_size > 1:
                raise ValueError("stream cannot be set when using HYBRID_SHARD (FSDP2 "
                                 "refuses it with native HSDP too)")
            if not isinstance(stream, torch.Stream):
                raise ValueError(f"stream={stream!r} must be a torch stream or None")
        self._sw_unit.all_reduce_hook = hook
        self._sw_unit.all_reduce_hook_stream = stream

    def set_custom_all_gather(self, comm: Any) -> None:
        """Gather this unit's parameters with `comm` (FSDP2's `AllGather`: `allocate(size,
        dtype=, device=)` gives the output buffer, `comm(output_tensor=, input_tensor=,
        group=, async_op=)` fills it rank-major)."""
        _check_comm("set_custom_all_gather", comm)
        u = self._sw_unit
        u.transport = CustomTransport(u.transport, all_gather=comm)

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        """Reduce this unit's gradients with `comm` (FSDP2's `ReduceScatter`: `allocate`
        gives the output buffer, `comm(output_tensor=, input_tensor=, group=, op=,
        async_op=)` reduces; shardwise passes `op=ReduceOp.SUM` and divides afterwards)."""
        _check_comm("set_custom_reduce_scatter", comm)
        u = self._sw_unit
        u.transport = CustomTransport(u.transport, reduce_scatter=comm)

    def set_post_optim_event(self, event: Any) -> None:
        """The root's next forward makes the current stream wait for `event` (recorded
        after the optimizer step) before gathering, then drops it. shardwise gathers on the
        current stream, which already follows the optimizer step; the event is waited on
        so that work the user ordered behind it is respected too. None clears it, as in
        FSDP2: a CPU stream's `record_event()` returns None, so FSDP2's recipe runs there."""
        if event is not None and (not hasattr(event, "wait") or not hasattr(event, "record")):
            raise ValueError(f"event={event!r} must be a torch.Event (or torch.cuda.Event)")
        ctx = self._sw_unit.ctx
        assert ctx is not None
        ctx.post_optim_event = event

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *,
                                         recurse: bool = True) -> None:
        """Accepted: shardwise always reduces a unit's whole gradient buffer, a parameter
        without a gradient on this rank contributing zeros, so ranks that used different
        parameters still issue the same collectives."""
        check_bool("reduce_scatter_unused_params", reduce_scatter_unused_params)

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *,
                                             recurse: bool = True) -> None:
        """Accepted, checked (a positive int): reductions in flight are bounded per model by
        `Limits.reduces` (sw.set_limits), not per module."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(f"max_input_buffers must be an int, got "
                            f"{type(max_input_buffers).__name__}")
        check_int("max_input_buffers", max_input_buffers, minimum=1)

    def set_separate_reduce_scatter_group(self, enable: bool = True, *,
                                          recurse: bool = True) -> None:
        """Accepted, checked: a communicator per collective kind is an NCCL overlap knob;
        shardwise's numbers and its gloo transport are the same either way."""
        check_bool("enable", enable)

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Accepted, checked: shardwise's buffers come from its own pool (an NCCL-only
        zero-copy knob in FSDP2)."""
        check_bool("enable", enable)

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """Refused: symmetric-memory all-gathers need FSDP2's NCCL staging buffers."""
        raise NotImplementedError(
            f"set_symm_mem_for_comm(backend={backend!r}) is not supported: shardwise does "
            "not allocate its all-gather buffers from NCCL symmetric memory")


def _check_comm(what: str, comm: Any) -> None:
    if not callable(comm) or not callable(getattr(comm, "allocate", None)):
        raise ValueError(f"{what}: comm={comm!r} must implement FSDP2's Comm protocol "
                         "(an allocate(size, *, dtype, device) method and __call__)")
