"""Non-finite steps: the trainer stops, or skips the step, on a NaN/inf loss or gradient norm.

Every rank must take the same decision, or the ranks that step and the ranks that do not
would wait for each other in different collectives. The gradient norm from
`sw.clip_grad_norm_` is already the same on every rank; the trainer passes the mean loss over
ranks from the all-gather it already makes for its step log.

Fault injection for the tests (a NaN loss on one rank, a killed rank) is train/faults.py.
"""

from __future__ import annotations

import logging
import math

log = logging.getLogger(__name__)

EXIT_NONFINITE = 3  # the CLI's exit status when the run stops on a non-finite step


class NonFiniteError(RuntimeError):
    """The run stops on a non-finite loss or gradient norm (raised on every rank alike)."""


class NonFiniteGuard:
    """Decides, on every rank alike, whether an optimizer step may be applied.

    mode: "stop" raises NonFiniteError; "skip" returns False (the caller drops the step)
    until more than `max_skipped` steps in a row were skipped, then raises.
    scaler_handles_grads: fp16 loss scaling is on, so a non-finite gradient norm with a
    finite loss is an overflow the ShardedGradScaler skips (and backs off from) by itself;
    it is neither counted nor stopped on here. A non-finite loss still is: the scale does
    not reach the forward pass, so lowering it would not help.
    """

    def __init__(self, mode: str, max_skipped: int, *, scaler_handles_grads: bool) -> None:
        if mode not in ("stop", "skip"):
            raise ValueError(f"train.on_nonfinite={mode!r} is not one of: stop, skip")
        if max_skipped < 0:
            raise ValueError(f"train.max_skipped_steps={max_skipped!r} must be >= 0")
        self.mode = mode
        self.max_skipped = max_skipped
        self.scaler_handles_grads = scaler_handles_grads
        self.skipped = 0  # steps skipped in the whole run (this process)
        self.in_a_row = 0

    def check(self, step: int, loss: float, grad_norm: float) -> bool:
        """True: apply the step. False: skip it. Raises NonFiniteError to stop the run."""
        loss_ok = math.isfinite(loss)
        norm_ok = math.isfinite(grad_norm) or self.scaler_handles_grads
        if loss_ok and norm_ok:
            self.in_a_row = 0
            return True
        what = (f"non-finite loss {loss} at step {step} (grad norm {grad_norm})" if not loss_ok
                else f"non-finite grad norm {grad_norm} at step {step} (loss {loss:.4f})")
        if self.mode == "stop":
            raise NonFiniteError(f"{what}; stopping (set train.on_nonfinite=skip to skip "
                                 "such steps)")
        self.skipped += 1
        self.in_a_row += 1
        if self.in_a_row > self.max_skipped:
            raise NonFiniteError(
                f"{what}; {self.in_a_row} steps in a row were non-finite, more than "
                f"train.max_skipped_steps={self.max_skipped}; stopping")
        log.warning("%s; step skipped (%d so far)", what, self.skipped)
        return False

