"""[Note: lockstep]: the schedule's collectives do not depend on which units the data used.

One process, units that record what they would communicate: a rank that skips experts, or
whose backward gives some unit no gradient, must produce the same sequence of all-gathers and
reductions as a rank that uses everything.
"""

from __future__ import annotations

import pytest

from shardwise.engine.lockstep import Groups
from shardwise.engine.schedule import Schedule, ShardedState, TrainingState


class FakeUnit:
    def __init__(self, name: str, log: list[str], root: bool = False) -> None:
        self.name, self.log = name, log
        self.state = ShardedState.SHARDED
        self.training_state = TrainingState.IDLE
        self.reshard_after_forward = True
        self.reshard_after_backward = True
        self.is_root = root
        self.reshards_after_forward = not root

    def unshard(self, async_op: bool = True) -> None:
        if self.state is ShardedState.SHARDED:
            self.log.append(f"gather {self.name}")
            self.state = ShardedState.GATHERING

    def wait_unshard(self) -> None:
        self.unshard(False)
        self.state = ShardedState.UNSHARDED

    def reshard(self) -> None:
        self.state = ShardedState.SHARDED

    def reduce_grads(self) -> tuple:
        self.log.append(f"reduce {self.name}")
        return ()

    def has_unreduced_grads(self) -> bool:
        return False


def _moe_steps(used: list[int], steps: int = 2) -> list[str]:
    """A root holding one layer unit whose MoE block holds three expert units; the rank
    calls only the experts in `used` (container order), and backward reaches only them."""
    log: list[str] = []
    root, layer = FakeUnit("root", log, root=True), FakeUnit("layer", log)
    experts = [FakeUnit(f"e{i}", log) for i in range(3)]
    s: Schedule[FakeUnit] = Schedule([root, layer, *experts])
    s.groups = Groups(members=[experts], member_of={id(e): (0, i) for i, e in enumerate(experts)},
                      inside={id(e): frozenset({0}) for e in experts},
                      closes={id(layer): (0,), id(root): (0,)})
    # [Note: hooked agreement]: a skipped expert is not hooked here; the ranks' agreement
    # says some rank (the one that uses every expert) hooked each.
    s.settle = lambda: s.agree([True] * len(s.units))
    for _ in range(steps):
        s.begin_forward()
        s.pre_forward(root, True)  # ids need no gradient: no post-backward token
        layer_post = s.pre_forward(layer, True)
        tokens = []
        for i in used:
            post = s.pre_forward(experts[i], True)
            tokens.append((experts[i], s.post_forward(experts[i], hooked=True), post))
        layer_pre = s.post_forward(layer, hooked=True)
        root_pre = s.post_forward(root, hooked=True)
        s.end_forward(backward_follows=True)
        s.pre_backward(root, root_pre)
        s.pre_backward(layer, layer_pre)
        for e, pre, post in reversed(tokens):
            s.pre_backward(e, pre)
            s.post_backward(e, post)
        s.post_backward(layer, layer_post)
        s.end_backward()
        log.append("step")
    return log


@pytest.mark.parametrize("used", [[0, 2], [1], [0, 1], [1, 2], [2]])
def test_skipped_experts_gather_and_reduce_in_lockstep(used: list[int]) -> None:
    everything = _moe_steps([0, 1, 2])
    assert _moe_steps(used) == everything
    # Every expert is gathered in forward and again in backward, and reduced, every step.
    assert everything.count("reduce e1") == 2 and everything.count("gather e1") == 4


def _branch(used_aux: bool) -> list[str]:
    """Units a -> aux (side output) -> b, all run; only some ranks' loss uses aux."""
    log: list[str] = []
    root = FakeUnit("root", log, root=True)
    a, aux, b = (FakeUnit(n, log) for n in ("a", "aux", "b"))
    s: Schedule[FakeUnit] = Schedule([root, a, aux, b])
    for _ in range(2):
        s.begin_forward()
        s.pre_forward(root, True)
        t = {}
        for u in (a, aux, b):
            post = s.pre_forward(u, True)
            t[u.name] = (s.post_forward(u, hooked=True), post)
        root_pre = s.post_forward(root, hooked=True)
        s.end_forward(backward_follows=True)
        s.pre_backward(root, root_pre)
        for u in (b, aux, a):
            if u is aux and not used_aux:
                continue  # no gradient reaches aux on this rank
            s.pre_backward(u, t[u.name][0])
            s.post_backward(u, t[u.name][1])
        s.end_backward()
        log.append("step")
    return log


def test_unit_without_gradient_here_reduces_where_the_others_do() -> None:
    assert _branch(False) == _branch(True)
