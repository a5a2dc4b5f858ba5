"""The training loop of `shardwise train`: one function, `run(cfg, reporter)`, on every rank.

It builds the GPT on the meta device, shards it with the config's four knobs, materializes
only the local shards, and trains with AdamW on the sharded parameters. Rank 0 writes
metrics.jsonl and hands each step to the `reporter` (the console lives on the CLI side:
library code never prints); every rank writes its own engine event log for the first
`log.event_steps` steps.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Protocol

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import shardwise as sw

from ..engine import collectives as Cm
from ..engine.dtensor import local_of
from ..observe.sinks import JsonlSink, attach_sink, detach_sink, set_step
from ..observe.trace import Trace
from . import data as D
from . import guard as G
from . import rundir
from .config import Config, TrainSection
from .metrics import (
    MB,
    STATE_BYTES_PER_PARAM,
    ByteCounter,
    MetricsFile,
    memory_mb,
    peak_memory_mb,
)
from .model import GPT
from .tensor_parallel import check_world, parallelize_gpt

log = logging.getLogger(__name__)


class Reporter(Protocol):
    """Receives progress on rank 0 (the CLI's console implements it)."""

    def start(self, info: dict[str, Any]) -> None: ...
    def step(self, record: dict[str, Any]) -> None: ...
    def eval(self, step: int, val_loss: float) -> None: ...
    def checkpoint(self, step: int, path: str) -> None: ...
    def end(self, summary: dict[str, Any]) -> None: ...


class NullReporter:
    def start(self, info: dict[str, Any]) -> None: ...
    def step(self, record: dict[str, Any]) -> None: ...
    def eval(self, step: int, val_loss: float) -> None: ...
    def checkpoint(self, step: int, path: str) -> None: ...
    def end(self, summary: dict[str, Any]) -> None: ...


def lr_at(step: int, t: TrainSection) -> float:
    """Learning rate of optimizer step `step` (1-based): linear warm-up, then decay to
    lr * min_lr_ratio at `t.steps`."""
    min_lr = t.lr * t.min_lr_ratio
    if t.warmup_steps and step <= t.warmup_steps:
        return t.lr * step / t.warmup_steps
    if t.schedule == "constant" or t.steps <= t.warmup_steps:
        return t.lr
    frac = (step - t.warmup_steps) / (t.steps - t.warmup_steps)  # 0 -> 1 over the decay
    if t.schedule == "linear":
        return t.lr + (min_lr - t.lr) * frac
    return min_lr + 0.5 * (t.lr - min_lr) * (1.0 + math.cos(math.pi * frac))


def threads_per_rank(cfg: Config) -> int:
    if cfg.threads:
        return cfg.threads
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, cores // max(1, local))


def _shared_run_dir(cfg: Config, rank: int, device: torch.device) -> tuple[Path, bool]:
    """Rank 0 prepares the run folder; everyone gets its path and whether to resume from it
    (a torchelastic restart resumes: rundir.for_restart), or rank 0's error."""
    answer: dict[str, Any] = {}
    if rank == 0:
        try:
            ready = rundir.prepare(cfg)
            answer = {"dir": str(Path(ready.out_dir).expanduser() / ready.name),
                      "resume": ready.resume}
        except (ValueError, OSError) as e:
            answer = {"error": str(e), "type": type(e).__name__}
    answer = Cm.broadcast_json(answer, src=0)
    if "error" in answer:
        raise (OSError if answer["type"] == "OSError" else ValueError)(answer["error"])
    return Path(answer["dir"]), bool(answer["resume"])


def build_model(cfg: Config, mesh: DeviceMesh | None = None) -> GPT:
    """The GPT built on the meta device, sharded with the config's knobs, then materialized:
    each rank allocates and initializes only its own shards.

    With a (dp, tp) `mesh` the model is built whole on every rank (same seed, same
    weights), split by the TP plan, then sharded over dp: materialize's per-shard streams
    would give the TP ranks' different heads identical initial values.
    """
    torch.manual_seed(cfg.train.seed)
    with torch.device("meta" if mesh is None else "cpu"):
        model = GPT(cfg.model.gpt())
    if mesh is not None:
        parallelize_gpt(model.to(mesh.device_type), mesh["tp"])
    s = cfg.shard
    sw.shard_model(
        model,
        sharding_strategy=s.sharding_strategy,
        auto_wrap_policy=None if s.auto_wrap_policy == "none" else s.auto_wrap_policy,
        mixed_precision=None if s.mixed_precision == "fp32" else s.mixed_precision,
        cpu_offload=s.cpu_offload,
        mesh=None if mesh is None else mesh["dp"],
    )
    if mesh is None:
        sw.materialize(model, seed=cfg.train.seed)
    return model


def tp_mesh(cfg: Config, world: int, device: torch.device) -> DeviceMesh | None:
    """The (dp, tp) mesh for --parallel.tp > 1 (None: FSDP alone); checked before creating it."""
    tp = cfg.parallel.tp
    if tp == 1:
        return None
    check_world(tp, world)
    return init_device_mesh(device.type, (world // tp, tp), mesh_dim_names=("dp", "tp"))


def _optimizer(model: torch.nn.Module, t: TrainSection) -> torch.optim.Optimizer:
    # Decay matrices only (norm gains are 1-D). Sharded parameters keep their dimensionality
    # (a row slice of the original), so this split is the same as unsharded.
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": t.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2))


def _gather(values: list[float], device: torch.device) -> list[list[float]]:
    """Each rank's `values` -> a list per rank (one small all-gather)."""
    return Cm.all_gather_floats(values)


@torch.no_grad()
def evaluate(model: GPT, val: torch.Tensor, cfg: Config, rank: int, world: int,
             device: torch.device) -> float:
    """Mean loss over the fixed validation batches of every rank."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    seq = model.cfg.block_size
    tp = cfg.parallel.tp  # a TP group shares its batches; the sum counts each tp times
    for x, y in D.val_batches(val, seq, cfg.train.batch_size, rank // tp, world // tp,
                              cfg.train.eval_batches, device):
        total += model(x, y).double()
    Cm.all_reduce(total, None, label="validation loss")
    return total.item() / (world * cfg.train.eval_batches)


class _EventLog:
    """The engine's events for a bounded number of steps: counted, and written per rank."""

    def __init__(self, model: GPT, path: Path, write: bool) -> None:
        self.model = model
        self.counter = ByteCounter()
        self.file = path.open("a") if write else None
        self.sinks: list[Any] = [self.counter]
        if self.file is not None:
            self.sinks.append(JsonlSink(self.file))
        for sink in self.sinks:
            attach_sink(model, sink)

    def stop(self) -> None:
        """Detach (the engine pays nothing from here on) and close; idempotent."""
        for sink in self.sinks:
            detach_sink(self.model, sink)
        self.sinks = []
        if self.file is not None:
            self.file.close()
            self.file = None


class _TraceWindow:
    """`--trace`: a `Trace` over log.trace_steps steps after log.trace_after warm-up steps."""

    def __init__(self, cfg: Config, run_dir: Path, model: GPT, start: int) -> None:
        self.first = self.last = -1  # no step matches: nothing is traced
        if cfg.trace:
            self.first = min(start + 1 + cfg.log.trace_after, cfg.train.steps)
            self.last = min(self.first + cfg.log.trace_steps - 1, cfg.train.steps)
        # A resumed run keeps its earlier trace: the new one goes beside it.
        d = run_dir / "trace"
        if d.exists() and any(d.iterdir()):
            d = run_dir / f"trace-step{self.first}"
        self.trace = Trace(d, model)
        self.summary: dict[str, Any] = {}

    @property
    def paused(self) -> bool:
        return self.trace.paused

    @paused.setter
    def paused(self, value: bool) -> None:
        self.trace.paused = value  # evaluation's forwards are not training steps

    def before(self, step: int) -> None:
        if step == self.first:
            self.trace.start()
        if self.first <= step <= self.last:
            self.trace.step(step)

    def after(self, step: int) -> None:
        if step == self.last:
            report = self.trace.stop()
            self.summary = {"dir": str(self.trace.dir), "merged": str(self.trace.merged_path),
                            "report": report.to_dict()}


def _rng_state() -> str:
    return base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()


def _set_rng_state(s: str) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8))


def save(run_dir: Path, step: int, model: GPT, opt: torch.optim.Optimizer,
         stream: D.BatchStream, scaler: sw.ShardedGradScaler, keep: int, rank: int) -> Path:
    """A sharded checkpoint with the data position and RNG state in `extra`; prune old ones."""
    path = rundir.checkpoint_path(run_dir, step)
    extra = {"step": step, "data": stream.state_dict(), "rng": _rng_state(),
             "scaler": scaler.state_dict()}
    sw.save_checkpoint(str(path), model, opt, step=step, extra=extra)
    Cm.barrier(label="checkpoint saved")
    if rank == 0:
        pruned = rundir.prune_checkpoints(run_dir, keep)
        log.info("checkpoint %s (pruned %d older)", path, len(pruned))
    return path


def resume(run_dir: Path, model: GPT, opt: torch.optim.Optimizer,
           stream: D.BatchStream, scaler: sw.ShardedGradScaler) -> int:
    """Load the latest checkpoint; return the step it was taken after."""
    step, path = rundir.checkpoints(run_dir)[-1]
    extra = sw.load_checkpoint(str(path), model, opt) or {}
    if "data" not in extra or "step" not in extra:
        raise RuntimeError(f"checkpoint {str(path)!r} lacks the training position in `extra`")
    stream.load_state_dict(extra["data"])
    if "rng" in extra:
        _set_rng_state(extra["rng"])
    if scaler.enabled and "scaler" in extra:
        scaler.load_state_dict(extra["scaler"])
    return int(extra["step"])


def run(cfg: Config, reporter: Reporter | None = None) -> dict[str, Any]:
    """Train on every rank of the current process group (or torchrun's); return the summary."""
    rank, world, device = sw.init_distributed()
    torch.set_num_threads(threads_per_rank(cfg))
    t = cfg.train
    gcfg = cfg.model.gpt()
    seq = gcfg.block_size
    # The data first: text that is too short fails alike on every rank, before a run folder
    # exists that would block running the same --name again.
    text = D.read_corpus(cfg.data.path or None, cfg.data.max_bytes, cfg.data.seed)
    parts = D.split(text, cfg.data.val_fraction, seq)
    # Ranks of one TP group (consecutive ranks: the mesh is (dp, tp)) read the same batch.
    tp = cfg.parallel.tp
    if tp > 1:
        check_world(tp, world)
    dp_rank, dp_world = rank // tp, world // tp
    stream = D.BatchStream(parts.train, seq, t.batch_size, dp_rank, dp_world, cfg.data.seed,
                           device)

    run_dir, resuming = _shared_run_dir(cfg, rank, device)
    cfg = dataclasses.replace(cfg, name=run_dir.name, resume=resuming)
    rep: Reporter = reporter if (reporter is not None and rank == 0) else NullReporter()

    model = build_model(cfg, tp_mesh(cfg, world, device))
    opt = _optimizer(model, t)
    # fp16's narrow range needs loss scaling; bf16 and fp32 do not (the scaler is a no-op).
    scaler = sw.ShardedGradScaler(enabled=cfg.shard.mixed_precision == "fp16")
    guard = G.NonFiniteGuard(t.on_nonfinite, t.max_skipped_steps,
                             scaler_handles_grads=scaler.enabled)
    start = resume(run_dir, model, opt, stream, scaler) if cfg.resume else 0
    # A restart after the last step (a crash at teardown) has nothing left to do: not an error.
    if start >= t.steps and not rundir.is_restart():
        raise ValueError(f"the checkpoint is at step {start}; train.steps={t.steps} leaves "
                         "nothing to do (raise --train.steps to train further)")

    n_params = gcfg.num_params()
    local_params = sum(local_of(p).numel() for p in model.parameters())
    tokens_per_step = t.batch_size * seq * t.grad_accum * dp_world
    rep.start({"run_dir": str(run_dir), "world": world, "device": str(device),
               "params": n_params, "local_params": local_params, "start_step": start,
               "steps": t.steps, "tokens_per_step": tokens_per_step, "config": cfg,
               "train_bytes": len(parts.train), "val_bytes": len(parts.val),
               "threads": torch.get_num_threads(),
               "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
               "precision_plan": sw.precision_plan(model)})

    # Count bytes over a few steps even when no event file is written, then stop paying.
    events = _EventLog(model, run_dir / f"events-rank{rank}.jsonl", cfg.log.event_steps != 0)
    count_until = start + max(cfg.log.event_steps, 3) if cfg.log.event_steps >= 0 else t.steps
    tracing = _TraceWindow(cfg, run_dir, model, start)
    metrics = MetricsFile(run_dir / "metrics.jsonl") if rank == 0 else None

    val_loss = math.nan
    losses: list[float] = []
    timed_tokens, timed_s = 0, 0.0
    t_begin = time.perf_counter()
    for step in range(start + 1, t.steps + 1):
        lr = lr_at(step, t)
        for g in opt.param_groups:
            g["lr"] = lr
        set_step(model, step)
        G.kill_hook_for_tests(step, rank)
        tracing.before(step)
        t0 = time.perf_counter()
        loss_sum = torch.zeros((), device=device)
        for micro in range(t.grad_accum):
            x, y = stream.next()
            # Accumulate locally; only the last micro-batch's backward communicates.
            sync = micro == t.grad_accum - 1
            with contextlib.nullcontext() if sync else sw.no_sync(model):
                loss = G.nan_hook_for_tests(model(x, y), step, rank)
                scaler.scale(loss / t.grad_accum).backward()
            loss_sum += loss.detach()
        scaler.unscale_(opt)  # clip the true gradients, not the scaled ones
        norm = sw.clip_grad_norm_(model, t.grad_clip if t.grad_clip > 0 else math.inf)
        # Every rank's loss (and memory) in one small all-gather, so the mean loss, NaN if
        # any rank's is, is the same on every rank before anything is applied.
        per_rank = _gather([loss_sum.item() / t.grad_accum, memory_mb(device)], device)
        loss_mean = sum(r[0] for r in per_rank) / world
        # Decided alike on every rank: a stop raises here, so no checkpoint is ever saved
        # after a non-finite step.
        applied = guard.check(step, loss_mean, norm.item())
        # False when skipped, or when fp16 gradients overflowed on any rank.
        stepped = scaler.step(opt) if applied else False
        scaler.update()
        opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        if step > start + 1:  # the first step pays for lazy initialization: not timed
            timed_tokens, timed_s = timed_tokens + tokens_per_step, timed_s + dt
        if applied:  # a skipped step's NaN would make the summary's losses NaN
            losses.append(loss_mean)
        record = {"step": step, "loss": loss_mean, "lr": lr, "grad_norm": norm.item(),
                  "tokens_per_s": tokens_per_step / dt,
                  "memory_mb": [round(r[1], 1) for r in per_rank],
                  "time_s": round(time.perf_counter() - t_begin, 3)}
        if step <= count_until and step in events.counter.by_step:
            # This rank's bytes sent (and received alike): [Note: communication bytes].
            record["comm_bytes"] = sum(events.counter.by_step[step].values())
        if scaler.enabled:
            record.update(loss_scale=scaler.get_scale(), skipped=not stepped)
        if not applied:
            record.update(nonfinite=True, skipped=True, nonfinite_skipped=guard.skipped)
        if step == count_until:
            events.stop()
        tracing.after(step)
        if (t.eval_interval and step % t.eval_interval == 0) or step == t.steps:
            events.counter.paused = tracing.paused = True
            val_loss = evaluate(model, parts.val, cfg, rank, world, device)
            events.counter.paused = tracing.paused = False
            record["val_loss"] = val_loss
            rep.eval(step, val_loss)
        if metrics is not None:
            metrics.write(record)
        rep.step(record)
        if (cfg.checkpoint.interval and step % cfg.checkpoint.interval == 0) or step == t.steps:
            path = save(run_dir, step, model, opt, stream, scaler, cfg.checkpoint.keep, rank)
            rep.checkpoint(step, str(path))
    if metrics is not None:
        metrics.close()

    events.counter.paused = True
    sample = _sample(model, cfg, device)
    events.stop()
    if rank == 0 and sample:
        (run_dir / "sample.txt").write_text(sample)
    state_mb = local_params * STATE_BYTES_PER_PARAM / MB
    comm = events.counter.last_step()
    rows = _gather([peak_memory_mb(device), state_mb, float(sum(comm.values()))], device)
    tail = losses[-10:] or [math.nan]  # every step of this invocation may have been skipped
    summary = {
        "run_dir": str(run_dir), "steps": t.steps, "start_step": start, "world": world,
        "params": n_params,
        "final_loss": tail[-1], "final_loss_avg10": sum(tail) / len(tail),
        "final_val_loss": val_loss,
        "tokens_per_s": timed_tokens / timed_s if timed_s else math.nan,
        "peak_memory_mb": [r[0] for r in rows],
        "state_mb": [r[1] for r in rows],
        "unsharded_state_mb": n_params * STATE_BYTES_PER_PARAM / MB,
        "bytes_per_step": [int(r[2]) for r in rows],
        "bytes_per_step_rank0": comm if rank == 0 else {},
        "sample": sample, "device": device.type, "nonfinite_skipped": guard.skipped,
        "wall_s": time.perf_counter() - t_begin,
    }
    if tracing.summary:
        summary["trace"] = tracing.summary
    rep.end(summary)
    return summary


def _sample(model: GPT, cfg: Config, device: torch.device) -> str:
    """Text from the trained model; every rank samples in lockstep (each forward is collective)."""
    if cfg.log.sample_tokens <= 0:
        return ""
    prompt = torch.tensor([list(cfg.log.sample_prompt.encode())], dtype=torch.long, device=device)
    gen = torch.Generator(device=device).manual_seed(cfg.train.seed)
    out = model.generate(prompt, cfg.log.sample_tokens, generator=gen)
    # Escaped, not U+FFFD: a byte-level model can emit bytes that are not UTF-8.
    return bytes(out[0].tolist()).decode("utf-8", errors="backslashreplace")
