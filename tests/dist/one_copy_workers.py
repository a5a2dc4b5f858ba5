"""Workers for the one-copy exchange at two ranks ([Note: one-copy exchange])."""

from __future__ import annotations

import copy
import datetime
import os
import socket
import time

import torch

import shardwise as sw
from shardwise.engine.comm import cma, one_copy, one_copy_setup
from shardwise.engine.comm.transport import PairTransport
from tests.dist.parity import grad_diffs, param_diffs
from tests.models import loss_fn, make_batch, make_model


def _exchanges_waited() -> list[int]:
    waited = [0]
    orig = one_copy.Exchange.wait

    def wait(self: one_copy.Exchange) -> None:
        waited[0] += 1
        orig(self)

    one_copy.Exchange.wait = wait  # type: ignore[method-assign]
    return waited


def train(rank: int, world: int, strategy: str, refuse_on: int = -1) -> dict[str, object]:
    """Three AdamW steps of the LM sharded with `strategy`, against the unsharded reference.

    `refuse_on`: this rank cannot read its peer's memory (the probe must fail on both).
    Returns the differences, every full parameter after the steps (to compare the paths bit
    for bit), whether the group has a one-copy channel and how many exchanges used it."""
    if rank == refuse_on:
        def refused(pid: int, dst: list[torch.Tensor], src: list[tuple[int, int]]) -> None:
            raise PermissionError(1, "Operation not permitted")
        cma.read = refused  # type: ignore[assignment]
    waited = _exchanges_waited()
    torch.manual_seed(0)
    model = make_model("lm", 3)
    ref = copy.deepcopy(model)
    ref.head.weight = ref.embed.weight
    sw.shard_model(model, sharding_strategy=strategy, auto_wrap_policy="transformer")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    out = steps_against_reference(model, ref, opt, ref_opt, rank, world, per_rank=3, seed=50)
    return {**out, "exchanges": waited[0]}


def steps_against_reference(model: torch.nn.Module, ref: torch.nn.Module,
                            opt: torch.optim.Optimizer, ref_opt: torch.optim.Optimizer,
                            rank: int, world: int, per_rank: int,
                            seed: int) -> dict[str, object]:
    """Three steps of the LM, each rank on its slice of a global batch the reference sees
    whole: every step's gradient and parameter differences, the full parameters after the
    steps (to compare paths bit for bit), and whether the group has a one-copy channel."""
    diffs: dict[str, float] = {}
    for step in range(3):
        x, y = make_batch("lm", seed + step, per_rank * world)
        mine = slice(rank * per_rank, rank * per_rank + per_rank)
        loss_fn("lm", model(x[mine]), y[mine]).backward()
        diffs.update(grad_diffs(model, ref_step(ref, x, y), f"step {step}"))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        diffs.update(param_diffs(model, ref, f"step {step}"))
    full = {k: v.tolist() for k, v in sw.full_state_dict(model).items()}
    channel = one_copy_setup._channels.get(torch.distributed.group.WORLD)
    return {"diffs": diffs, "full": full, "channel": channel is not None}


def ref_step(ref: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.nn.Module:
    loss_fn("lm", ref(x), y).backward()
    return ref


def _pair() -> PairTransport:
    return PairTransport(torch.distributed.group.WORLD)


def any_wait_order(rank: int, world: int) -> list[list[float]]:
    """Two exchanges issued in the same order, waited in opposite orders on the two ranks:
    each must finish, with the peer's values (the waits do not deadlock)."""
    t = _pair()
    out_a, out_b = torch.zeros(5), torch.zeros(7)
    a = t.exchange_parts([torch.full((5,), 10.0 + rank)], [out_a], "all_gather", "a",
                         out_a)
    b = t.exchange_parts([torch.full((7,), 20.0 + rank)], [out_b], "reduce_scatter", "b",
                         out_b)
    for w in ((a, b) if rank == 0 else (b, a)):
        w.wait()
    return [out_a.tolist(), out_b.tolist()]


def out_of_step(rank: int, world: int) -> str:
    """Rank 1 sends three parts where rank 0 expects two: rank 0 names the mismatch; rank 1,
    left waiting for rank 0's acknowledgement, fails when rank 0 closes the channel."""
    t = _pair()
    recvs = [torch.zeros(3), torch.zeros(4)]
    sends = [torch.ones(3), torch.ones(4)] + ([torch.ones(2)] if rank == 1 else [])
    work = t.exchange_parts(sends, recvs, "all_gather", "blocks.0", recvs[0])
    try:
        work.wait()
    except Exception as e:  # noqa: BLE001 - the message is the result
        if rank == 0:
            assert t.channel is not None
            t.channel.close()
        return f"{type(e).__name__}: {e}"
    return "no error"


def dead_peer(rank: int, world: int) -> None:
    """Rank 1 dies before issuing its side of an exchange; rank 0, waiting on it, raises a
    named error at once (the channel closes) instead of waiting out the timeout."""
    t = _pair()
    warm = torch.zeros(1)  # the channel is set up by a first exchange both ranks make
    t.exchange_parts([torch.ones(1)], [warm], "all_gather", "warm-up", warm).wait()
    if rank == 1:
        time.sleep(0.5)
        os._exit(0)
    recv = torch.zeros(4)
    t.exchange_parts([torch.ones(4)], [recv], "all_gather", "blocks.3", recv).wait()


def late_issue(rank: int, world: int) -> list[float]:
    """Rank 1 issues and waits before rank 0 has issued at all (its wait blocks on rank 0's
    doorbell); rank 0 then waits on a later exchange first, so rank 1's nudge is answered
    by rank 0's reader thread."""
    t = _pair()
    first, second = torch.zeros(3), torch.zeros(2)
    if rank == 0:
        time.sleep(0.3)
    a = t.exchange_parts([torch.full((3,), 1.0 + rank)], [first], "all_gather", "a", first)
    if rank == 1:
        a.wait()
    b = t.exchange_parts([torch.full((2,), 5.0 + rank)], [second], "all_gather", "b", second)
    b.wait()
    if rank == 0:
        a.wait()
    return first.tolist() + second.tolist()


def set_up_fails(rank: int, world: int, how: str) -> dict[str, object]:
    """The channel's set-up fails on one side ("bind0": rank 0 cannot listen) or both
    ("nounix": AF_UNIX refused, as under a seccomp filter): both ranks go over gloo, at once,
    with the peer's values."""
    if how == "bind0" and rank == 0:
        def bind(self: socket.socket, addr: object) -> None:
            raise OSError(98, "Address already in use")
        socket.socket.bind = bind  # type: ignore[method-assign]
    if how == "nounix":
        real = socket.socket.__init__

        def init(self: socket.socket, family: int = -1, *a: object, **k: object) -> None:
            if family == socket.AF_UNIX:
                raise PermissionError(1, "Operation not permitted")
            real(self, family, *a, **k)  # type: ignore[arg-type]
        socket.socket.__init__ = init  # type: ignore[method-assign]
    t = _pair()
    start = time.monotonic()
    out = torch.zeros(4)
    t.exchange_parts([torch.full((4,), 1.0 + rank)], [out], "all_gather", "x", out).wait()
    return {"out": out.tolist(), "seconds": time.monotonic() - start,
            "channel": t.channel is not None}


def group_timeout(rank: int, world: int) -> str:
    """A group made with its own 3 s timeout (as a script calling dist.new_group or
    dist.init_process_group directly does): a stalled peer fails the wait at 3 s."""
    g = torch.distributed.new_group([0, 1], timeout=datetime.timedelta(seconds=3))
    assert one_copy_setup.group_timeout_s(g, 300.0) == 3.0
    t = PairTransport(g)
    warm = torch.zeros(1)
    t.exchange_parts([torch.ones(1)], [warm], "all_gather", "warm-up", warm).wait()
    if rank == 1:
        time.sleep(6)
        return "slept"
    recv = torch.zeros(2)
    start = time.monotonic()
    try:
        t.exchange_parts([torch.ones(2)], [recv], "all_gather", "blocks.1", recv).wait()
    except Exception as e:  # noqa: BLE001 - the message is the result
        return f"{time.monotonic() - start:.1f} {type(e).__name__}: {e}"
    return "no error"


def dropped_unwaited(rank: int, world: int) -> int:
    """Exchanges issued and dropped without a wait (an exception mid-forward, then training
    goes on): the channel keeps a bounded number, not all of them with their tensors."""
    t = _pair()
    for i in range(one_copy._KEEP + 100):
        out = torch.zeros(8)
        t.exchange_parts([torch.ones(8)], [out], "all_gather", f"u{i}", out)
    out = torch.zeros(3)
    t.exchange_parts([torch.full((3,), 7.0 + rank)], [out], "reduce_scatter", "z", out).wait()
    assert out.tolist() == [8.0 - rank] * 3
    assert t.channel is not None
    return len(t.channel.exchanges)
