"""One explorer rank: a real shardwise run of the 676-parameter MLP, driven by commands.

Each rank process joins a gloo (or NCCL) group, then answers commands from the server's
`WorkerGroup` (see workers.py) one at a time: `setup` builds data, model, sharding and
optimizer from a config and a seed; `step` runs one training step; `close` leaves. Replies
carry what the page shows: this rank's shard map, its bytes of sharded state, the engine's
events for the step (with the unsharded working set measured at each event) and, on rank 0,
loss, accuracy and decision regions of the full model.
"""

from __future__ import annotations

import os
import queue
import signal
import traceback
from typing import Any

import torch
from torch import nn

from ..engine.comm import collectives as C
from ..engine.core.dtensor import local_of
from ..engine.core.events import Event, now
from .problem import LR, Problem, evaluate, make_model, make_problem, points_payload, rank_slice


def _nbytes(t: torch.Tensor | None) -> int:
    """Bytes this rank holds (a DTensor's local rows, not its global size)."""
    return 0 if t is None else local_of(t).numel() * t.element_size()


class MemoryProbe:
    """An event sink that also records how many unsharded bytes are alive at each event.

    "Working set" = storage behind full (unsharded) parameters plus their full gradients,
    the memory that exists only while a unit computes. Measured, not modelled: it reads
    the storage sizes the engine actually holds when the event is emitted.
    """

    def __init__(self, params: list[Any]) -> None:
        # Only params that are neither direct nor whole have separate unsharded storage.
        self.params = [p for p in params if not (getattr(p, "direct", False)
                                                 or getattr(p, "whole", False))]
        self.rows: list[tuple[Event, int]] = []

    def live_bytes(self) -> int:
        total = 0
        for p in self.params:
            full = getattr(p, "full_padded", None)
            if full is not None and not full.is_meta:
                total += full.untyped_storage().nbytes()
            unsharded = getattr(p, "unsharded", None)
            if unsharded is not None:
                total += _nbytes(unsharded.grad)
        return total

    def __call__(self, ev: Event) -> None:
        self.rows.append((ev, self.live_bytes()))

    def drain(self) -> list[tuple[Event, int]]:
        out, self.rows = self.rows, []
        return out


def wrap_policy(name: str):
    """'layer': one unit per Linear (plus the root); 'model': the whole model is one unit."""
    if name == "layer":
        return lambda m: isinstance(m, nn.Linear)
    return None


class RankTrainer:
    """The model, optimizer and data of one rank for one run (one config, one seed)."""

    def __init__(self, rank: int, world: int, cfg: dict, seed: int, device: torch.device) -> None:
        import shardwise as sw
        from shardwise.engine.core.context import sharded_params
        from shardwise.observe.sinks import attach_sink

        self.rank, self.world, self.device = rank, world, device
        # HYBRID_SHARD reads the node size from the environment, as under torchrun.
        os.environ["LOCAL_WORLD_SIZE"] = str(cfg["local_world_size"])
        self.problem: Problem = make_problem(seed)
        self.seed = seed
        model = make_model(seed).to(device)
        sw.shard_model(
            model,
            sharding_strategy=cfg["strategy"],
            auto_wrap_policy=wrap_policy(cfg["wrap"]),
            mixed_precision=None if cfg["mixed_precision"] == "none" else cfg["mixed_precision"],
            cpu_offload=bool(cfg["cpu_offload"]),
        )
        self.model = model
        self.probe = MemoryProbe(sharded_params(model))
        attach_sink(model, self.probe)
        self.opt = torch.optim.AdamW(model.parameters(), lr=LR)
        mine = rank_slice(rank, world)
        self.x = self.problem.x[mine].to(device)
        self.y = self.problem.y[mine].to(device)
        self.grad_bytes = 0

    # --- what the page shows ---------------------------------------------------------

    def shard_map(self) -> dict:
        """Units in module order; per parameter the rows of dim 0 this rank holds."""
        from shardwise.engine.core.context import mesh_of, units_of

        units = []
        for unit in units_of(self.model):
            name = unit.name
            params = []
            for sp in unit.params:
                shape = list(sp.orig_shape)
                params.append({
                    "name": sp.fqn if not name else f"{name}.{sp.fqn}",
                    "shape": shape, "rows": [sp.row_start, sp.row_end],
                    "dim0": shape[sp.shard_dim] if shape else 1, "dim": sp.shard_dim,
                    "numel": sp.local.numel(),
                })
            units.append({"name": name, "params": params})
        mesh = mesh_of(self.model)
        assert mesh is not None
        return {"units": units, "mesh": {"shard_rank": mesh.shard_rank,
                                         "shard_size": mesh.shard_size,
                                         "replicate_size": mesh.replicate_size}}

    def memory(self) -> dict:
        params = sum(_nbytes(p) for p in self.model.parameters())
        optim = sum(_nbytes(t) for state in self.opt.state.values()
                    for t in state.values() if isinstance(t, torch.Tensor))
        return {"params": params, "grads": self.grad_bytes, "optimizer": optim}

    def evaluate_full(self) -> dict | None:
        """Every rank joins the gather; rank 0 evaluates an unsharded copy of the model."""
        import shardwise as sw

        full = sw.full_state_dict(self.model, rank0_only=True)
        if self.rank != 0:
            return None
        ref = make_model(self.seed)
        ref.load_state_dict({k: v.float() for k, v in full.items()})
        return evaluate(ref, self.problem)

    # --- commands --------------------------------------------------------------------

    def setup_reply(self) -> dict:
        reply = {**self.shard_map(), "memory": {**self.memory(), "working_peak": 0},
                 "events": [], "eval": self.evaluate_full()}
        if self.rank == 0:
            reply["points"] = points_payload(self.problem)
        return reply

    def step(self, k: int) -> dict:
        from shardwise.observe.sinks import set_step

        set_step(self.model, k)
        self.probe.drain()
        t0 = now()
        loss = nn.functional.cross_entropy(self.model(self.x).float(), self.y)
        loss.backward()
        self.grad_bytes = sum(_nbytes(p.grad) for p in self.model.parameters())
        t_opt = now()
        self.opt.step()
        # The engine does not time the optimizer (it only sees shards); the trainer does,
        # in the same Event schema, so the page plays the whole step from one stream.
        self.probe(Event(self.rank, "", "optimizer", "", 0, t_opt, now(), k))
        self.opt.zero_grad(set_to_none=True)
        rows = self.probe.drain()
        mean = loss.detach().reshape(1).clone()
        C.all_reduce(mean, None)
        events = [{**ev.to_dict(), "live": live} for ev, live in rows]
        peak = max((live for _, live in rows), default=0)
        return {"events": events, "t0": t0, "train_loss": float(mean.item()) / self.world,
                "memory": {**self.memory(), "working_peak": peak},
                "eval": self.evaluate_full()}


def rank_main(rank: int, world: int, port: int, cmd_q: Any, out_q: Any, backend: str,
              timeout_s: float) -> None:
    """Process entry: join the group, then serve commands until `close` (or the parent dies).

    SIGINT is ignored (the server handles Ctrl-C and sends `close`); SIGTERM ends the
    process silently.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)  # a few ranks share a few cores: no oversubscription
    try:
        import shardwise as sw

        _, _, device = sw.init_distributed(backend, timeout_s=timeout_s)
    except BaseException:  # noqa: BLE001 - the parent must hear why a rank could not start
        out_q.put((rank, -1, "error", traceback.format_exc()))
        return
    out_q.put((rank, -1, "ok", {"device": str(device)}))
    trainer: RankTrainer | None = None
    parent = os.getppid()
    while True:
        try:
            msg = cmd_q.get(timeout=1.0)
        except queue.Empty:
            # A server killed outright never sends `close`: leave when orphaned (the OS
            # hands orphans to another parent) instead of lingering on a shared machine.
            if os.getppid() != parent:
                break
            continue
        op, mid = msg["op"], msg["id"]
        if op == "close":
            break
        try:
            if op == "setup":
                trainer = None  # drop the previous run's model before building the next
                trainer = RankTrainer(rank, world, msg["config"], msg["seed"], device)
                reply = trainer.setup_reply()
            elif op == "step":
                if trainer is None:
                    raise RuntimeError("step before setup")
                reply = trainer.step(msg["step"])
            else:
                raise ValueError(f"unknown command {op!r}")
            out_q.put((rank, mid, "ok", reply))
        except BaseException:  # noqa: BLE001 - report, then keep serving (or be closed)
            out_q.put((rank, mid, "error", traceback.format_exc()))
    C.destroy_process_group()
