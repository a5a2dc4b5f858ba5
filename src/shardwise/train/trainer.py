"""The training loop of `shardwise train`: `run(cfg, reporter)` on every rank.

It builds the GPT on the meta device, shards it with the config's four knobs, materializes
only the local shards, and trains with AdamW on the sharded parameters. Rank 0 writes
metrics.jsonl and hands each step to the `reporter` (the console lives on the CLI side:
library code never prints); every rank writes its own engine event log for the first
`log.event_steps` steps. A `Trainer` is the run in four parts: build (its constructor),
`train_step`, `log_step` and `finish`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from pathlib import Path
from typing import Any, Protocol

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import shardwise as sw

from .. import launchers
from ..engine.comm import collectives as Cm
from ..engine.core.dtensor import local_of
from ..observe.sinks import set_step
from . import data as D
from . import finetune as FT
from . import rundir
from .best import BestKeeper
from .build import Built, build, build_gpt
from .checkpointing import resume, save, saved_tokens_per_step
from .config import Config, TrainSection
from .eval_metrics import evaluate, scope
from .faults import FaultInjector
from .flops import Utilization
from .guard import NonFiniteGuard
from .identity import run_keys
from .losses import counted_targets
from .metrics import (
    MB,
    memory_mb,
    open_metric_log,
    peak_memory_mb,
    reserved_peak_mb,
    training_state_bytes,
)
from .model import GPT
from .preempt import StopRequest, first_request
from .sampling import ByteCodec, HFCodec, sample_text
from .tensor_parallel import check_world
from .windows import EventLog, TraceWindow


class Reporter(Protocol):
    """Receives progress on rank 0 (the CLI's console implements it)."""

    def start(self, info: dict[str, Any]) -> None: ...
    def step(self, record: dict[str, Any]) -> None: ...
    # metrics: the evaluation's record (val_loss, val_perplexity, val_accuracy).
    def eval(self, step: int, val_loss: float,
             metrics: dict[str, float] | None = None) -> None: ...
    def checkpoint(self, step: int, path: str) -> None: ...
    def end(self, summary: dict[str, Any]) -> None: ...


class NullReporter:
    def start(self, info: dict[str, Any]) -> None: ...
    def step(self, record: dict[str, Any]) -> None: ...
    def eval(self, step: int, val_loss: float,
             metrics: dict[str, float] | None = None) -> None: ...
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
    """--threads, or this rank's share of the free cores ([Note: threads per rank])."""
    from .threads import threads_per_rank as choose

    return choose(cfg.threads)


def _shared_run_dir(cfg: Config, rank: int) -> tuple[Path, bool, list[str]]:
    """Rank 0 prepares the run folder; everyone gets its path and whether to resume from it
    (a torchelastic restart resumes: rundir.for_restart), or rank 0's error. Resolving it on
    every rank would race: rank 0 creates the folder another rank's "never overwrite" check
    then finds."""
    answer: dict[str, Any] = {}
    if rank == 0:
        try:
            moved: list[str] = []
            ready = rundir.prepare(cfg, moved)
            answer = {"dir": str(Path(ready.out_dir).expanduser() / ready.name),
                      "resume": ready.resume, "moved": moved}
        except (ValueError, OSError) as e:
            answer = {"error": str(e), "type": type(e).__name__}
    answer = Cm.broadcast_json(answer, src=0)
    if "error" in answer:
        raise (OSError if answer["type"] == "OSError" else ValueError)(answer["error"])
    return Path(answer["dir"]), bool(answer["resume"]), list(answer["moved"])


def build_model(cfg: Config, mesh: DeviceMesh | None = None) -> GPT:
    """The built-in GPT, sharded and materialized (see build.build_gpt)."""
    return build_gpt(cfg, mesh)


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
    # The fastest correct implementation: fused where torch accepts it ([Note: optimizer
    # implementation] in optim.py).
    from .optim import adamw

    return adamw(groups, lr=t.lr, betas=(t.beta1, t.beta2))[0]


@dataclasses.dataclass(frozen=True)
class StepResult:
    """One optimizer step, decided alike on every rank."""

    step: int
    lr: float
    loss: float  # the mean over ranks: NaN if any rank's is
    grad_norm: float
    memory_mb: list[float]  # per rank
    applied: bool  # the non-finite guard let the step through
    stepped: bool  # and the optimizer stepped (False too when fp16 gradients overflowed)
    seconds: float
    # (rank, signal number) of the first rank asked to stop (preempt.py), seen alike by
    # every rank in this step's all-gather: the run stops after this step. None: go on.
    stop: tuple[int, int] | None = None


class Trainer:
    """One training run, on this rank: built here, then `train_step` and `log_step` for each
    step from `start + 1` to `cfg.train.steps`, then `finish`."""

    def __init__(self, cfg: Config, reporter: Reporter | None = None,
                 faults: FaultInjector | None = None, stop: StopRequest | None = None) -> None:
        self.rank, self.world, self.device = sw.init_distributed()
        torch.set_num_threads(threads_per_rank(cfg))
        t = cfg.train
        seq = cfg.model.seq_len()
        # The data first: text that is too short fails alike on every rank, before a run
        # folder exists that would block running the same --name again.
        if cfg.model.hf:
            # Tokenized once into the cache (the first rank of each node), memory-mapped;
            # every source, and the evaluation set or each source's held-out documents.
            from . import hf_inputs

            self.parts: Any = hf_inputs.load(cfg, seq)
            self.n_train, self.n_val = self.parts.n_train, self.parts.n_val
        else:
            text = D.read_corpus(cfg.data.path or None, cfg.data.max_bytes, cfg.data.seed)
            self.parts = D.split(text, cfg.data.val_fraction, seq)
            self.n_train, self.n_val = len(self.parts.train), len(self.parts.val)
        # Ranks of one TP group (consecutive ranks: the mesh is (dp, tp)) read the same batch.
        tp = cfg.parallel.tp
        if tp > 1:
            check_world(tp, self.world)
        self.dp_world = self.world // tp
        stream_cls: Any = D.BatchStream
        if cfg.model.hf:
            from .token_parts import TokenBatchStream as stream_cls
        self.stream = stream_cls(self.parts.train, seq, t.batch_size, self.rank // tp,
                                 self.dp_world, cfg.data.seed, self.device)

        self.keys = run_keys(cfg)
        self.run_dir, resuming, self.moved = _shared_run_dir(cfg, self.rank)
        self.cfg = cfg = dataclasses.replace(cfg, name=self.run_dir.name, resume=resuming)
        self.rep: Reporter = (reporter if (reporter is not None and self.rank == 0)
                              else NullReporter())
        self.faults = faults  # None outside the fault tests: no checks in the step loop
        self.stop = stop  # SIGTERM's note (commands/train.py installs it); None: no requests

        self.built = build(cfg, tp_mesh(cfg, self.world, self.device))
        self.model = self.built.model
        self.opt = _optimizer(self.model, t)
        # [Note: optimizer in backward] in optim.py: self.opt keeps the state and the lr.
        self.in_backward = None
        if t.optim_in_backward:
            from .optim import InBackward

            self.in_backward = InBackward(self.opt, self.model)
        # fp16's narrow range needs loss scaling; bf16 and fp32 do not (a no-op scaler).
        self.scaler = sw.ShardedGradScaler(enabled=cfg.shard.mixed_precision == "fp16")
        self.guard = NonFiniteGuard(t.on_nonfinite, t.max_skipped_steps,
                                    scaler_handles_grads=self.scaler.enabled)
        # [Note: phases] --data.reset starts a phase at the resumed step: a fresh data
        # position, optimizer and schedule, train.steps steps after it.
        self.phase = 0
        self.start = 0
        if cfg.resume:
            self.start, self.phase = resume(
                self.run_dir, self.model, self.opt, self.stream, self.scaler,
                step=rundir.step_of(cfg.resume_from), reset=cfg.data.reset,
                trainable_only=bool(cfg.lora.rank), keys=self.keys, name=cfg.name)
        # [Note: run length] in finetune.py: train.steps is the run's total; train.epochs
        # counts passes over this phase's data. The schedule spans the phase.
        self.windows = len(self.stream.windows)
        self.end = FT.run_end(t.steps, t.epochs, self.phase,
                              FT.steps_per_epoch(self.windows, self.stream.global_batch))
        span = self.end - self.phase
        self.schedule = dataclasses.replace(  # what lr_at reads, resolved in steps
            t, steps=span, epochs=0.0, warmup_ratio=0.0,
            warmup_steps=FT.warmup(t.warmup_steps, t.warmup_ratio, span))
        # A restart after the last step (a crash at teardown) has nothing left to do.
        if self.start >= self.end and not rundir.is_restart():
            length = f"train.steps={t.steps}" if t.steps else f"train.epochs={t.epochs:g}"
            raise ValueError(f"the checkpoint is at step {self.start}; {length} (step "
                             f"{self.end}) leaves nothing to do (raise it to train further)")
        self.n_params, self.n_trainable = self.built.n_params, self.built.n_trainable
        self.local_params = sum(local_of(p).numel() for p in self.model.parameters())
        self.tokens_per_step = t.batch_size * seq * t.grad_accum * self.dp_world
        # A resume at another data-parallel size changes the global batch; said once, here.
        saved_tps = saved_tokens_per_step(self.run_dir) if cfg.resume else None
        # Every rank at once: a CPU's peak is measured under the load training will put on it.
        self.mfu = Utilization.for_run(cfg, self.n_trainable, self.device, self.world)
        self.rep.start({
            "topology": launchers.topology(self.world, cfg.shard.sharding_strategy,
                                           cfg.parallel.tp), **self.mfu.info(),
            "run_dir": str(self.run_dir), "world": self.world, "device": str(self.device),
            "params": self.n_params, "local_params": self.local_params,
            "start_step": self.start, "steps": self.end, "tokens_per_step": self.tokens_per_step,
            "saved_tokens_per_step": saved_tps,
            "trainable": self.n_trainable, "moved_aside": self.moved,
            "config": cfg, "train_bytes": self.n_train,
            "val_bytes": self.n_val, "threads": torch.get_num_threads(),
            # What each validation pass covers ([Note: evaluation set]); rank 0 only.
            "eval": scope(self.parts.val, cfg, self.world).line() if self.rank == 0 else "",
            "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
            "precision_plan": sw.precision_plan(self.model)})

        # Count bytes over a few steps even when no event file is written, then stop paying.
        self.events = EventLog(self.model, self.run_dir / f"events-rank{self.rank}.jsonl",
                               cfg.log.event_steps != 0)
        self.count_until = (self.start + max(cfg.log.event_steps, 3)
                            if cfg.log.event_steps >= 0 else self.end)
        self.tracing = TraceWindow(cfg, self.run_dir, self.model, self.start)
        self.metrics = (open_metric_log(cfg, self.run_dir, self.world, self.start)
                        if self.rank == 0 else None)
        self.best = BestKeeper(self.run_dir, cfg.checkpoint.best, bool(cfg.lora.rank))
        self.val_loss = math.nan
        self.saved: Path | None = None  # the latest checkpoint this invocation wrote
        self.losses: list[float] = []  # applied steps only
        self.timed_tokens, self.timed_s = 0, 0.0
        self.t_begin = time.perf_counter()

    def train_step(self, step: int) -> StepResult:
        """Forward and backward over grad_accum micro-batches, clip, and apply the step unless
        the non-finite guard says otherwise."""
        t, model, opt, scaler = self.cfg.train, self.model, self.opt, self.scaler
        lr = lr_at(step - self.phase, self.schedule)
        for g in opt.param_groups:
            g["lr"] = lr
        set_step(model, step)
        if self.faults is not None:
            self.faults.before_step(step, self.rank)
        self.tracing.before(step)
        t0 = time.perf_counter()
        loss_sum = torch.zeros((), device=self.device)
        batches = [self.stream.next() for _ in range(t.grad_accum)]
        # Masked targets (--model.hf): the step's loss is the mean over every counted target
        # of every rank's micro-batches, so each is weighed by its count. A plain mean per
        # micro-batch, averaged, made the loss and the gradient depend on the split.
        weigh = self.built.loss_sum is not None
        counted = counted_targets(batches, self.device) if weigh else 0.0
        # A batch is (x, y), or (x, y, positions) for packed --model.hf data.
        for micro, batch in enumerate(batches):
            # Accumulate locally; only the last micro-batch's backward communicates.
            sync = micro == t.grad_accum - 1
            if self.in_backward is not None:
                self.in_backward.armed = sync  # step in the backward that reduces
            with contextlib.nullcontext() if sync else sw.no_sync(model):
                if weigh:
                    loss = self.built.loss_sum(*batch)[0]  # type: ignore[misc]
                    # The reduction averages the dp ranks (TP ranks count the same targets).
                    scale = self.world / max(counted, 1.0)
                else:
                    loss, scale = self.built.loss(*batch), 1.0 / t.grad_accum
                if self.faults is not None:
                    loss = self.faults.loss(loss, step, self.rank)
                scaler.scale(loss * scale).backward()
            loss_sum += loss.detach()
        if self.in_backward is not None:
            norm = self.in_backward.finish()  # stepped already; no clipping (config.py)
        else:
            scaler.unscale_(opt)  # clip the true gradients, not the scaled ones
            norm = sw.clip_grad_norm_(model, t.grad_clip if t.grad_clip > 0
                                      else math.inf).item()
        # Every rank's loss (and memory) in one small all-gather, so the mean loss, NaN if
        # any rank's is, is the same on every rank before anything is applied. A stop request
        # (a signal's number and time, preempt.py) rides along: every rank sees every rank's.
        mine = loss_sum.item() if weigh else loss_sum.item() / t.grad_accum
        asked = (float(self.stop.signum), self.stop.when) if self.stop else (0.0, 0.0)
        per_rank = Cm.all_gather_floats([mine, memory_mb(self.device), *asked])
        loss_mean = sum(r[0] for r in per_rank) / (max(counted, 1.0) if weigh
                                                   else self.world)
        # Decided alike on every rank: a stop raises here, so no checkpoint is ever saved
        # after a non-finite step.
        applied = self.guard.check(step, loss_mean, norm)
        if self.in_backward is not None:
            stepped = applied  # in backward; a non-finite step stopped the run above
        else:
            stepped = scaler.step(opt) if applied else False
        scaler.update()
        opt.zero_grad(set_to_none=True)
        return StepResult(step, lr, loss_mean, norm, [r[1] for r in per_rank], applied, stepped,
                          time.perf_counter() - t0,
                          first_request([(r[2], r[3]) for r in per_rank]))

    def log_step(self, r: StepResult) -> None:
        """The step's record to metrics.jsonl and the reporter; evaluation and a checkpoint
        when due."""
        t, step = self.cfg.train, r.step
        if step > self.start + 1:  # the first step pays for lazy initialization: not timed
            self.timed_tokens += self.tokens_per_step
            self.timed_s += r.seconds
        if r.applied:  # a skipped step's NaN would make the summary's losses NaN
            self.losses.append(r.loss)
        record = {"step": step, "loss": r.loss, "lr": r.lr, "grad_norm": r.grad_norm,
                  "tokens_per_s": self.tokens_per_step / r.seconds,
                  **self.mfu.figures(self.tokens_per_step / r.seconds),
                  "max_memory_mb": round(reserved_peak_mb(self.device), 1),
                  "memory_mb": [round(m, 1) for m in r.memory_mb],
                  "time_s": round(time.perf_counter() - self.t_begin, 3)}
        counted = self.events.counter.by_step
        if step <= self.count_until and step in counted:
            # This rank's bytes sent (and received alike): [Note: communication bytes].
            record["comm_bytes"] = sum(counted[step].values())
        if self.scaler.enabled:
            record.update(loss_scale=self.scaler.get_scale(), skipped=not r.stepped)
        if not r.applied:
            record.update(nonfinite=True, skipped=True, nonfinite_skipped=self.guard.skipped)
        if step == self.count_until:
            self.events.stop()
        self.tracing.after(step)
        # A stop skips the evaluation (the grace period before SIGKILL is short) and saves.
        if ((t.eval_interval and step % t.eval_interval == 0) or step == self.end) \
                and (r.stop is None or step == self.end):
            self.events.counter.paused = self.tracing.paused = True
            ev = evaluate(self.built, self.parts.val, self.cfg, self.rank, self.world,
                          self.device)
            self.val_loss = ev.loss
            record.update(ev.record())
            if self.best.offer(self.model, step, ev.loss):
                record["best"] = True
            self.events.counter.paused = self.tracing.paused = False
            self.rep.eval(step, self.val_loss, ev.record())
        if self.metrics is not None:
            self.metrics.write(record)
        self.rep.step(record)
        ck = self.cfg.checkpoint
        if (ck.interval and step % ck.interval == 0) or step == self.end or r.stop:
            path = save(self.run_dir, step, self.model, self.opt, self.stream, self.scaler,
                        ck.keep, self.rank, keys=self.keys, phase=self.phase,
                        trainable_only=bool(self.cfg.lora.rank),
                        tokens_per_step=self.tokens_per_step)
            self.rep.checkpoint(step, str(path))
            self.saved = path

    def stopped(self, r: StepResult) -> dict[str, Any]:
        """The summary of a run stopped by a signal after step `r.step`, its checkpoint saved."""
        if self.metrics is not None:
            self.metrics.close()
        self.events.stop()
        assert r.stop is not None
        rank, signum = r.stop
        return {"run_dir": str(self.run_dir), "steps": self.end, "start_step": self.start,
                "world": self.world, "stopped": {"step": r.step, "rank": rank,
                                                  "signal": signum, "checkpoint": str(self.saved)},
                "exit_code": 128 + signum}

    def finish(self) -> dict[str, Any]:
        """Close the logs, sample some text, and return the run's summary (every rank)."""
        if self.metrics is not None:
            self.metrics.close()
        self.events.counter.paused = True
        # Training's peak, read before sampling: generating text can take more memory than a
        # training step did (measured under bf16: 846 MiB sampling vs 460 MiB training), and
        # the peak resident set size only ever grows.
        train_peak = peak_memory_mb(self.device)
        sample = _sample(self.built, self.cfg, self.device,
                         getattr(self.parts.val, "tokens", None))
        self.events.stop()
        if self.rank == 0 and sample:
            (self.run_dir / "sample.txt").write_text(sample)
        state_bytes, unsharded_state_bytes = training_state_bytes(self.model)
        state_mb = state_bytes / MB
        comm = self.events.counter.last_step()
        rows = Cm.all_gather_floats([train_peak, state_mb, float(sum(comm.values())),
                                     peak_memory_mb(self.device)])
        tail = self.losses[-10:] or [math.nan]  # every step of this invocation may be skipped
        summary = {
            "run_dir": str(self.run_dir), "steps": self.end,
            "epochs": FT.epochs_seen(self.stream.epoch, self.stream.index, self.windows,
                                     self.stream.global_batch),
            "start_step": self.start, "world": self.world, "params": self.n_params,
            "final_loss": tail[-1], "final_loss_avg10": sum(tail) / len(tail),
            "final_val_loss": self.val_loss,
            # The best evaluation of this invocation that beat the run's earlier best, if any.
            "best": ({"step": self.best.step, "val_loss": self.best.loss}
                     if self.best.step else {}),
            "tokens_per_s": self.timed_tokens / self.timed_s if self.timed_s else math.nan,
            "peak_memory_mb": [r[0] for r in rows],
            "sample_peak_memory_mb": [r[3] for r in rows],
            "state_mb": [r[1] for r in rows],
            "unsharded_state_mb": unsharded_state_bytes / MB,
            "bytes_per_step": [int(r[2]) for r in rows],
            "bytes_per_step_rank0": comm if self.rank == 0 else {},
            "sample": sample, "device": self.device.type,
            "nonfinite_skipped": self.guard.skipped,
            "wall_s": time.perf_counter() - self.t_begin,
        }
        if self.tracing.summary:
            summary["trace"] = self.tracing.summary
        self.rep.end(summary)
        return summary


def run(cfg: Config, reporter: Reporter | None = None,
        faults: FaultInjector | None = None, stop: StopRequest | None = None) -> dict[str, Any]:
    """Train on every rank of the current process group (or torchrun's); return the summary.
    `faults`: the tests' fault injector (train/faults.py), None in a normal run. `stop`: the
    signal note (preempt.py); once any rank has one, every rank ends after the same step with
    a checkpoint, and the summary's `stopped` says where."""
    trainer = Trainer(cfg, reporter, faults, stop)
    for step in range(trainer.start + 1, trainer.end + 1):
        r = trainer.train_step(step)
        trainer.log_step(r)
        if r.stop is not None and step < trainer.end:
            return trainer.stopped(r)
    return trainer.finish()


def _sample(built: Built, cfg: Config, device: torch.device, val_tokens: Any = None) -> str:
    """Text from the trained model; every rank samples in lockstep (each forward is collective).
    An empty log.sample_prompt (model.hf) starts from the validation split's first tokens."""
    if cfg.log.sample_tokens <= 0:
        return ""
    codec = HFCodec(cfg.model.hf) if cfg.model.hf else ByteCodec()
    prompt = cfg.log.sample_prompt
    if not prompt and val_tokens is not None:
        prompt = codec.decode([int(i) for i in val_tokens[:8]])
    built.model.eval()
    try:
        return sample_text(built.logits, codec, prompt, cfg.log.sample_tokens,
                           cfg.model.seq_len(), cfg.train.seed, device)
    finally:
        built.model.train()
