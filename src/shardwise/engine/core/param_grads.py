"""One parameter's gradients: this rank's unsharded gradient before its reduction, and the
sharded gradient after it, as plain rows ([Note: layout] in sharded_param.py).

A mixin of `ShardedParam` (which sets the attributes declared below, and whose `to_rows` /
`from_rows` convert between rows and the face's layout).
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.distributed.tensor._dtensor_spec import DTensorSpec

from . import dtensor as DT
from .tp import TPParam


class ParamGrads:
    direct: bool
    sharded: nn.Parameter
    unsharded: nn.Parameter
    spec: DTensorSpec | None
    tp: TPParam | None
    acc_grad: torch.Tensor | None
    _handed: tuple[weakref.ref[torch.Tensor], int] | None

    # --- this rank's gradient before reduction -------------------------------------------

    def _direct_grad_is_new(self, g: torch.Tensor | None) -> bool:
        h = self._handed
        return g is not None and not (h is not None and h[0]() is g and g._version == h[1])

    def has_local_grad(self) -> bool:
        """Whether `local_grad()` would return a gradient, without folding or moving any."""
        if self.direct:
            return self._direct_grad_is_new(self.sharded.grad)
        return self.unsharded.grad is not None or self.acc_grad is not None

    def local_grad(self) -> torch.Tensor | None:
        """This rank's full-shape gradient not yet handed to a reduction (None if none);
        direct, the whole gradient it holds.

        Not a predicate: gradients accumulated under no_sync are folded into `acc_grad`
        here (see `has_local_grad` for the question alone).
        """
        if self.direct:
            # All of it, even unchanged since the last reduction: that reduction replaced
            # the gradient with the mean on every rank, so what a rank accumulated since is
            # on top of it (a rank that did not use the parameter again still holds its
            # share). Sending zeros instead lost it (NO_SHARD without zero_grad, or a unit
            # reduced twice in one backward).
            return self.sharded.grad
        g = self.unsharded_grad()
        if self.acc_grad is None:
            return g
        if g is not None:
            with torch.no_grad():
                self.acc_grad.add_(g)
            self.unsharded.grad = None
        return self.acc_grad

    def unsharded_grad(self) -> torch.Tensor | None:
        """The unsharded parameter's gradient as a plain tensor (TP: its local part)."""
        g = self.unsharded.grad
        if g is None or self.tp is None:
            return g
        return self.tp.grad_local(g)

    def drop_local_grad(self) -> None:
        """The local gradient was packed for reduction: free it (direct: remember it)."""
        if self.direct:
            self.mark_reduced()
        else:
            self.unsharded.grad = None
            self.acc_grad = None

    def mark_reduced(self) -> None:
        g = self.sharded.grad
        # A weak reference: the reduced gradient is the user's to free (zero_grad); holding it
        # here kept last step's gradient alive until the next reduction (NO_SHARD).
        self._handed = (weakref.ref(g), g._version) if g is not None else None

    # --- the sharded gradient, as plain local rows ----------------------------------

    @property
    def shard_grad(self) -> torch.Tensor | None:
        """This rank's rows of the sharded gradient (a plain tensor, a view), or None."""
        g = self.sharded.grad
        return None if g is None else self.to_rows(DT.local_of(g))

    def set_shard_grad(self, rows: torch.Tensor) -> None:
        """Make `rows` (plain, shaped like `local`) the sharded gradient."""
        face = self.from_rows(rows)
        self.sharded.grad = face if self.spec is None else DT.wrap(face, self.spec)
