"""Activation bytes of one step, from the transformer's shape, and the largest batch that fits."""

from __future__ import annotations

from collections.abc import Callable

from .shape import TransformerShape
from .simulate import StepActivations


def step_activations(shape: TransformerShape | None, tokens: int | None, act_bytes: int,
                     checkpointing: bool) -> StepActivations | None:
    """What one rank's step keeps for backward (None: shape or tokens unknown)."""
    if shape is None or tokens is None:
        return None
    full = shape.block_activation_bytes(act_bytes) * tokens
    grads = shape.block_backward_transient_bytes(act_bytes) * tokens
    if checkpointing:
        # Only each block's input survives forward; backward recomputes one block at a time.
        layer, layer_backward = shape.block_input_bytes(act_bytes) * tokens, full + grads
    else:
        layer, layer_backward = full, grads
    return StepActivations(layer, layer_backward, shape.root_activation_bytes(act_bytes) * tokens,
                           shape.root_transient_bytes(act_bytes) * tokens)


def largest_batch(fits: Callable[[int], bool], limit: int = 1 << 20) -> int:
    """Largest b in [0, limit] with fits(b) (fits is monotone in b)."""
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
