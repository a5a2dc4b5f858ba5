"""One parameter's unsharded storage: the buffer the unsharded parameter lives in, allocated
between unshard and reshard, and filled from the all-gather's output ([Note: layout] in
sharded_param.py).

A mixin of `ShardedParam` (which sets the attributes declared below and calls
`_build_unsharded` each time it builds its Parameter objects).
"""

from __future__ import annotations

import torch
from torch import nn

from .extension import Extension
from .layout import full_into_rows, rows_into_full
from .tp import TPParam


class UnshardedStorage:
    direct: bool
    subclass: bool
    sharded: nn.Parameter
    unsharded: nn.Parameter
    tp: TPParam | None
    ext: Extension | None
    device: torch.device
    compute_dtype: torch.dtype
    requires_grad: bool
    orig_shape: torch.Size
    shard_dim: int
    shard_size: int
    chunk_rows: int
    chunk_numel: int
    dim0: int
    rest: tuple[int, ...]
    row_start: int
    row_end: int

    def _build_unsharded(self, padded: torch.Tensor, meta: bool) -> None:
        """Create the unsharded Parameter and the storage behind it (freed by the caller)."""
        if self.subclass:
            # The unsharded parameter comes from the first gather's post hook; until then
            # an empty stand-in keeps the flags (requires_grad, .grad = None) meaningful.
            self._full_padded = None
            self.unsharded = nn.Parameter(torch.empty(0, dtype=self.compute_dtype,
                                                      device="meta" if meta else self.device),
                                          requires_grad=self.requires_grad)
        elif self.direct:
            self._full_padded = padded
            self.unsharded = self.sharded
        else:
            # Dim 0: the padded rows the gather writes into; another dim: the parameter's
            # own contiguous shape, copied into from the gather output ([Note: layout]).
            shape = ((self.shard_size * self.chunk_rows, *self.rest) if self.shard_dim == 0
                     else self.orig_shape)
            full = torch.empty(shape, dtype=self.compute_dtype,
                               device="meta" if meta else self.device)
            self._full_padded = full
            view = full[: self.dim0].view(self.orig_shape) if self.shard_dim == 0 else full
            self.unsharded = nn.Parameter(
                view if self.tp is None else self.tp.compute_face(view),
                requires_grad=self.requires_grad,
            )
            self.unsharded._sw_param = self  # type: ignore[attr-defined]
        # Kept, not remade per gather: views of a tensor follow its storage through
        # `resize_`, and the storage object is the same one each time.
        full = self._full_padded
        self._storage = None if meta or full is None else full.untyped_storage()
        self._nbytes = 0 if full is None else full.numel() * full.element_size()
        # (S, C * row_numel) rank-major rows of the unsharded buffer: dim 0 only.
        self._rows = (None if full is None or self.shard_dim != 0
                      else full.data.view(self.shard_size, self.chunk_numel))

    @property
    def full_padded(self) -> torch.Tensor:
        """The buffer behind the unsharded parameter: (S*C, *rest) padded rows on dim 0,
        the original shape (contiguous, no padding) on another dim ([Note: layout])."""
        return self._full_padded

    # --- unsharded storage: exists only between unshard and reshard -----------------

    def alloc_unsharded(self) -> None:
        """Plain parameters' unsharded storage back (extensions: extension.py does it)."""
        storage = self._storage
        if self.direct or storage is None:
            return
        if storage.size() != self._nbytes:
            storage.resize_(self._nbytes)

    def free_unsharded(self) -> None:
        if self.ext is not None:
            self.ext.free()
        storage = self._storage
        if self.direct or storage is None:
            return
        if storage.size() != 0:
            storage.resize_(0)

    # --- the all-gather's output into the unsharded parameter, and back -------------

    def unsharded_rows_view(self) -> torch.Tensor | None:
        """(S, C * row_numel) view of the unsharded buffer (row r is rank r's chunk) for a
        dim-0 parameter; None on another dim (`copy_out` / `rows_into` copy instead)."""
        assert self._full_padded is not None, "a subclass parameter has no unsharded buffer"
        return self._rows

    def copy_out(self, rows: torch.Tensor, non_blocking: bool = False) -> None:
        """Write gathered rank-major `rows` ((S, C * row_numel)) into the unsharded
        parameter (`.data`: no autograd version bump, see Unit.wait_unshard)."""
        if self._rows is not None:
            self._rows.copy_(rows, non_blocking=non_blocking)
        else:
            rows_into_full(rows, self._full_padded.data, self.shard_dim, self.chunk_rows,
                           non_blocking)

    def rows_into(self, dst: torch.Tensor, first_rank: int) -> None:
        """Copy ranks `first_rank ..`'s rows of the unsharded parameter into `dst`
        ((R, C * row_numel), padding rows zero as the gather had them): what hpZ keeps."""
        if self._rows is not None:
            dst.copy_(self._rows[first_rank: first_rank + dst.shape[0]])
        else:
            full_into_rows(self._full_padded.data, dst, self.shard_dim, self.chunk_rows,
                           first_rank)

    def gathered_local_rows(self) -> torch.Tensor:
        """This rank's rows of the unsharded parameter, shaped like `local` (a view)."""
        return self.to_rows(self._full_padded.data)[self.row_start: self.row_end]
