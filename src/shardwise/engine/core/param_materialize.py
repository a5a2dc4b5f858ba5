"""One parameter's shard made real: allocated for a parameter sharded on the meta device,
or written from a full tensor (meta-device init, loading; ext/materialize.py, checkpoint/).

A mixin of `ShardedParam` (which sets the attributes declared below, and whose `_build`
makes new Parameter objects around the new shard).
"""

from __future__ import annotations

import torch

from .tp import TPParam


class Materialize:
    fqn: str
    tp: TPParam | None
    orig_dtype: torch.dtype
    host_device: torch.device
    pin_memory: bool
    chunk_rows: int
    rest: tuple[int, ...]
    local: torch.Tensor
    local_rows: int
    is_meta: bool
    global_shape: tuple[int, ...]

    def new_padded_shard(self, *, zero_valid_rows: bool = True) -> torch.Tensor:
        """A (C, *rest) chunk for this rank, where the real shard will live: padding rows
        zero, the valid rows too unless the caller writes all of them (`zero_valid_rows=
        False`: zeroing first would touch every page twice, most of a large load's time)."""
        shape = (self.chunk_rows, *self.rest)
        if zero_valid_rows:
            return torch.zeros(shape, dtype=self.orig_dtype, device=self.host_device)
        padded = torch.empty(shape, dtype=self.orig_dtype, device=self.host_device)
        padded[self.local_rows :].zero_()
        return padded

    def materialize(self, padded: torch.Tensor | None = None) -> None:
        """Allocate this rank's shard for a meta parameter: zeros, or `padded` (made by
        `new_padded_shard` and filled, its padding rows zero) when given.

        New Parameter objects replace the meta ones on every module that refers to this
        parameter (a meta tensor's storage cannot be swapped in place), so build the
        optimizer after materializing.
        """
        if not self.is_meta:
            return
        if padded is None:
            padded = self.new_padded_shard()
        if self.pin_memory:
            padded = padded.pin_memory()
        self._build(padded, meta=False)

    def set_full(self, full: torch.Tensor) -> None:
        """Copy this rank's rows of the full tensor `full` into the shard."""
        if tuple(full.shape) != self.global_shape:
            raise ValueError(
                f"{self.fqn}: got shape {tuple(full.shape)}, expected {self.global_shape}"
            )
        if self.tp is not None:
            full = self.tp.local_piece(full)
        self.materialize()
        with torch.no_grad():
            self.local.copy_(self.local_slice(full))
