"""`shardwise train`: a real sharded training run from one command.

`--nproc N` starts PyTorch's own elastic launcher in-process (torchrun --standalone); under
an existing torchrun (single- or multi-node) the command just runs on its rank. The console
(progress bar, validation lines, summary) is printed by rank 0 only (train_console.py).

How it ends: 0; 2 with one `error:` line for a mistake in the config, the data, a
checkpoint or a resume, whichever process found it (checked before any worker starts where
possible); 3 on a non-finite step; 1 with the failing rank's traceback for a crash; 130
(Ctrl-C) with one line saying where the run stopped and how to continue; 143 (SIGTERM, or
128 + checkpoint.stop_signal) after every rank finished its step and a checkpoint was
written (train/preempt.py). A run that ends before its first step leaves no run folder
behind.

Ranks started without this command's launcher (torchrun, Slurm's srun, Ray) stop together
([Note: stopping together] in engine/comm/process_group.py): the rank that stops first says
why in the group's store and leaves without waiting; every other rank's next collective fails
at once, and each rank prints one line naming the first rank and its cause.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shlex
import shutil
import sys
from pathlib import Path
from typing import Any

from ..train import config as C
from ..train import options as O
from ..train import rundir
from ..train.finetune import check_given, resumed_values
from ._args import report
from .train_console import ConsoleReporter

PROG = "shardwise train"


def load_config(argv: list[str]) -> C.Config:
    """Defaults < (on --resume: the run's saved config.toml) < --config FILE < the command line."""
    values, config_path = O.parse_argv(argv)
    file_values = O.read_toml(config_path) if config_path else {}
    merged = {**file_values, **values}
    cfg = rundir.resolve_name(O.build(merged))
    if cfg.resume:
        saved_path = Path(cfg.out_dir).expanduser() / cfg.name / "config.toml"
        saved = O.read_toml(saved_path) if saved_path.exists() else {}
        # Actions and placement belong to this invocation, not to the saved run.
        for k in ("name", "out_dir", "resume", "resume_from", "overwrite", "nproc", "threads",
                  "trace", "max_restarts", "data.reset"):
            saved.pop(k, None)
        if "train.min_lr" in saved:  # written before min_lr became a fraction of lr
            lr = float(saved.get("train.lr", C.TrainSection.lr))
            saved["train.min_lr_ratio"] = float(saved.pop("train.min_lr")) / lr
        cfg = O.build({**resumed_values(saved, merged), **merged, "name": cfg.name})
        rundir.check_resume(cfg)
    check_given(cfg.model.hf, merged)
    return cfg


def offload_note(cfg: C.Config, cuda: bool) -> str | None:
    """shard.cpu_offload on a machine without a GPU: everything is in host memory already."""
    if cfg.shard.cpu_offload and not cuda:
        return ("shard.cpu_offload=true has no effect without a GPU: parameters, gradients "
                "and optimizer state are in host memory already")
    return None


def schedule_note(cfg: C.Config) -> str | None:
    """On --resume with another train.steps: what happens to the learning-rate schedule."""
    if not cfg.resume:
        return None
    saved = Path(cfg.out_dir).expanduser() / cfg.name / "config.toml"
    old_steps = O.read_toml(saved).get("train.steps") if saved.exists() else None
    t = cfg.train
    if old_steps is None or int(old_steps) == t.steps or t.schedule == "constant" \
            or not t.steps or not int(old_steps):  # a length in epochs: decided by the data
        return None
    import dataclasses

    from ..train.trainer import lr_at

    if cfg.data.reset:
        return None
    start = rundir.chosen(Path(cfg.out_dir).expanduser() / cfg.name, cfg.resume_from)[0]
    from ..train.finetune import warmup

    t = dataclasses.replace(t, warmup_ratio=0.0,
                            warmup_steps=warmup(t.warmup_steps, t.warmup_ratio, t.steps))
    old = dataclasses.replace(t, steps=int(old_steps))
    return (f"train.steps {old_steps} -> {t.steps} on resume: the {t.schedule} decay is "
            f"stretched over {t.steps} steps, so the lr of step {start + 1} goes from "
            f"{lr_at(start + 1, old):.2e} (the old schedule) to {lr_at(start + 1, t):.2e}, "
            f"reaching {t.lr * t.min_lr_ratio:.2e} at step {t.steps}")


def precheck(cfg: C.Config, nproc: int) -> None:
    """What can fail on every rank alike, checked before any process starts."""
    from ..train import data as D
    from ..train.tensor_parallel import check_world

    d, t = cfg.data, cfg.train
    if cfg.model.hf:
        check_world(cfg.parallel.tp, nproc)
        from ..train.hf_folder import has_tokenizer

        if not has_tokenizer(cfg.model.hf):
            raise ValueError(f"model.hf={cfg.model.hf!r} has no tokenizer (tokenizer.json, or "
                             "vocab.json and merges.txt): save the tokenizer into the folder "
                             "with tokenizer.save_pretrained")
        # The weight files' headers and the data files, here in the launcher: a mistake is
        # one line in about a second, not after every worker has started.
        from ..checkpoint.manifest import CheckpointError
        from ..checkpoint.pretrained_files import find_files
        from ..train.hf_inputs import check_files

        try:
            find_files(cfg.model.hf)
        except (ValueError, CheckpointError) as e:
            raise ValueError(f"model.hf={cfg.model.hf!r}: " + str(e).replace(
                f"path={cfg.model.hf!r} ", "")) from None
        check_files(cfg)
        return  # token counts need the tokenizer: the workers check them
    gpt = cfg.model.gpt()
    check_world(cfg.parallel.tp, nproc,
                {"n_head": gpt.n_head, "d_model": gpt.d_model, "ffn_dim": gpt.ffn_dim})
    D.check_size(d.path or None, d.max_bytes, d.seed, d.val_fraction,
                 gpt.block_size, t.batch_size, nproc // cfg.parallel.tp)


def worker(cfg: C.Config) -> dict[str, Any]:
    """One rank's whole job (module-level: the launcher pickles it)."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from ..train.faults import FaultInjector
    from ..train.guard import EXIT_NONFINITE, NonFiniteError
    from ..train.preempt import StopRequest, unhandled_by_torchrun
    from ..train.trainer import run

    lost = unhandled_by_torchrun(cfg.checkpoint.stop_signal)
    if lost and os.environ.get("RANK", "0") == "0":
        print(f"{PROG}: warning: {lost}", file=sys.stderr, flush=True)
    try:
        # SIGTERM (and checkpoint.stop_signal) now ask for a checkpoint and a stop after the
        # step; the e2e fault tests ask through SHARDWISE_TEST_* (None otherwise).
        with StopRequest(cfg.checkpoint.stop_signal) as stop:
            return run(cfg, ConsoleReporter(), faults=FaultInjector.from_env(), stop=stop)
    except NonFiniteError as e:
        # Raised on every rank alike: a clean end with an exit status, not a traceback per
        # rank (and, with --nproc, not a restart that would only diverge again).
        from ..engine.comm import collectives

        if collectives.rank() == 0:
            print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
        return {"error": str(e), "exit_code": EXIT_NONFINITE}


def expected_errors() -> dict[type[BaseException], int]:
    """Errors raised on purpose -> exit status: one line, no traceback."""
    # From their modules, not `shardwise.X`: the launcher process needs none of the rest of
    # the public API ([Note: lazy package] in shardwise/__init__.py).
    from ..checkpoint.manifest import CheckpointError
    from ..engine.comm.work import CollectiveError

    return {ValueError: 2, CheckpointError: 2, CollectiveError: 1}


def default_nproc() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def _program() -> str:
    """How the user can run this command again: under `make run` (which takes no options)
    that is the virtual environment's own `shardwise`, not `make run`."""
    exe = sys.argv[0] if sys.argv else ""
    if os.path.basename(exe) == "shardwise" and (os.environ.get("MAKELEVEL")
                                                 or not shutil.which("shardwise")):
        rel = os.path.relpath(exe)
        return rel if not rel.startswith("..") else exe
    return "shardwise"


def _launch_prefix(environ: dict[str, str] | None = None) -> tuple[str, str]:
    """How to start `shardwise` again under the launcher this process runs under, and a note
    for after the command: `srun ...` under Slurm (never a local run there), `torchrun ...`
    under torchrun, else the program itself."""
    from ..launchers import launcher_name

    env = dict(os.environ if environ is None else environ)
    launcher = launcher_name(env)
    # `python -m shardwise.cli` runs cli.py as __main__; an installed `shardwise` is a script.
    module = bool(sys.argv) and os.path.basename(sys.argv[0]) == "cli.py"
    prog = "python -m shardwise.cli" if module else _program()
    world = env.get("WORLD_SIZE", "1")
    if launcher == "slurm":
        job = env.get("SLURM_JOB_ID", "")
        requeue = (f", or requeue the job (`scontrol requeue {job}`): a requeued job resumes "
                   "by itself") if job else ""
        return f"srun --ntasks {world} {prog}", f" (inside a Slurm allocation{requeue})"
    if launcher == "torchrun":
        local = env.get("LOCAL_WORLD_SIZE", world)
        nodes = int(world) // max(int(local), 1)
        head = f"torchrun --nnodes {nodes} " if nodes > 1 else "torchrun "
        return f"{head}--nproc-per-node {local} -m shardwise.cli", ""
    return prog, ""


def stopped_line(cfg: C.Config, run: Path, argv: list[str] | tuple[str, ...] = (),
                 under_launcher: bool = False) -> str:
    """Where an interrupted run stands, and the command that continues it (`under_launcher`:
    the one for the launcher that started this rank, e.g. `srun ...` under Slurm)."""
    step, found = rundir.last_step(run), rundir.checkpoints(run)
    if step == 0 and not found:
        return "interrupted before the first step; nothing was saved"
    head = (f"interrupted after step {step} of {cfg.train.steps}" if cfg.train.steps else
            f"interrupted after step {step} ({cfg.train.epochs:g} epochs)")
    prog, after = _launch_prefix() if under_launcher else (_program(), "")
    if found:
        return (f"{head}; latest checkpoint {found[-1][1].name}; continue with "
                f"`{prog} train --name {cfg.name} --resume{_steps_flag(cfg, run)}`{after}")
    again = shlex.join([*prog.split(), "train", *[a for a in argv if a != "--overwrite"],
                        "--overwrite"])
    return (f"{head}, before the first checkpoint (checkpoint.interval="
            f"{cfg.checkpoint.interval}); start again with `{again}`{after}")


def _steps_flag(cfg: C.Config, run: Path) -> str:
    # The saved config.toml may still hold the old train.steps (a resume interrupted before
    # its first step): then --resume alone would leave nothing to do.
    saved = run / "config.toml"
    old = O.read_toml(saved).get("train.steps") if saved.exists() else None
    return f" --train.steps {cfg.train.steps}" if old is not None and \
        int(old) != cfg.train.steps else ""


def preempted_line(cfg: C.Config, run: Path, stopped: dict[str, Any], rank: int,
                   under_launcher: bool = True) -> str:
    """What a rank says after a signal stopped the run with a checkpoint (train/preempt.py):
    rank 0 the whole story and the command that continues, the others one short line."""
    import signal

    sig = signal.Signals(int(stopped["signal"])).name
    who = f"{sig} (rank {stopped['rank']} got it first)"
    ckpt = Path(str(stopped["checkpoint"])).name
    if rank != 0:
        return f"rank {rank} stopped after step {stopped['step']}: {who}; checkpoint {ckpt}"
    of = f" of {cfg.train.steps}" if cfg.train.steps else ""
    prog, after = _launch_prefix() if under_launcher else (_program(), "")
    return (f"stopped by {who} after step {stopped['step']}{of}; checkpoint {ckpt} saved; "
            f"continue with `{prog} train --name {cfg.name} --resume{_steps_flag(cfg, run)}`"
            f"{after}")


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(O.help_text())
        return 0
    from ..launch import Interrupted, WorkerFailure, launch, under_torchrun
    from ..launchers import use_slurm_env

    try:
        use_slurm_env()  # a task of `srun` (no torchrun): its SLURM_* give the ranks
    except ValueError as e:
        return report(PROG, e)
    if under_torchrun():
        return _under_torchrun(argv)
    try:
        cfg = load_config(argv)
        nproc = cfg.nproc or default_nproc()
        precheck(cfg, nproc)
        import torch

        notes = [(kind, n) for kind, n in (("warning", schedule_note(cfg)),
                                           ("note", offload_note(cfg, torch.cuda.is_available())))
                 if n]
    except ValueError as e:
        return report(PROG, e)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted before the workers started", file=sys.stderr)
        return 130
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    for kind, note in notes:
        print(f"{PROG}: {kind}: {note}", file=sys.stderr)
    run = Path(cfg.out_dir).expanduser() / cfg.name
    fresh = creates_run_folder(cfg, run)
    print(f"{PROG}: launching {nproc} workers (torch.distributed elastic, "
          f"run folder {run})...", flush=True)
    try:
        # Slurm's KillWait: 30 s from SIGTERM to SIGKILL; the workers finish their step and
        # write a checkpoint within most of it (train/preempt.py).
        stop = (cfg.checkpoint.stop_signal,) if cfg.checkpoint.stop_signal else ()
        results = launch(worker, nproc, cfg, max_restarts=cfg.max_restarts,
                         expected=expected_errors(), stop_signals=stop, grace_s=25)
    except Interrupted as e:
        if fresh:
            rundir.discard_unstarted(run)
        print(f"{PROG}: {stopped_line(cfg, run, argv)}", file=sys.stderr)
        return e.exit_code
    except WorkerFailure as e:
        if fresh:
            rundir.discard_unstarted(run)
        if e.traceback:
            print(f"{PROG}: rank {e.rank} crashed:\n{e.traceback.rstrip()}", file=sys.stderr)
            print(f"{PROG}: error: rank {e.rank}: {e.message}", file=sys.stderr)
            return e.exit_code
        # A worker's own error (a damaged checkpoint, a failed collective): --help is no help.
        return report(PROG, e.message, hint=False)
    stopped = next((r["stopped"] for r in results if isinstance(r, dict) and "stopped" in r),
                   None)
    if stopped:  # a worker, not this launcher, got the signal
        print(f"{PROG}: {preempted_line(cfg, run, stopped, 0, under_launcher=False)}",
              file=sys.stderr)
    return max(r.get("exit_code", 0) if isinstance(r, dict) else 0 for r in results)


def _config_from_dict(d: dict[str, Any]) -> C.Config:
    """Rebuild the Config that rank 0 resolved (sent as JSON: nothing pickles between ranks)."""
    sections = {f.name: f.type for f in dataclasses.fields(C.Config) if f.name in C.SECTIONS}
    classes = {name: getattr(C, f"{name.capitalize()}Section") for name in sections}
    return C.Config(**{k: (classes[k](**v) if k in classes else v) for k, v in d.items()})


def config_on_every_rank(argv: list[str], rank: int) -> C.Config:
    """Rank 0 resolves the config from `argv`; every rank of the existing process group
    gets it, or rank 0's ValueError."""
    from shardwise.engine.comm import collectives

    answer: dict[str, Any] = {}
    if rank == 0:
        try:
            answer = {"config": dataclasses.asdict(load_config(argv))}
        except ValueError as e:
            answer = {"error": str(e)}
    answer = collectives.broadcast_json(answer, src=0)
    if "error" in answer:
        raise ValueError(answer["error"])
    return _config_from_dict(answer["config"])


def creates_run_folder(cfg: C.Config, run: Path) -> bool:
    """Whether this invocation creates the run folder `run` (asked before it exists): such a
    folder is removed again if the run ends before its first step (rundir.discard_unstarted),
    so the same command can run again once the cause is fixed."""
    return not cfg.resume and (cfg.overwrite or not run.exists() or not any(run.iterdir()))


def _under_torchrun(argv: list[str]) -> int:
    """Rank 0 resolves the config (and the run folder's name); every rank gets its answer.

    Resolving on every rank would race: rank 0 creates the folder that another rank's
    "never overwrite" check then finds. An expected error is one line from rank 0 and exit
    status 2 on every rank (torchrun itself then reports the failed workers). Whatever else
    stops a rank stops them all ([Note: stopping together]; `_stop_rank`).
    """
    import shardwise as sw
    from shardwise.engine.comm import collectives

    rank, _, _ = sw.init_distributed()
    cfg: C.Config | None = None
    run, fresh = Path(), False
    try:
        try:
            cfg = config_on_every_rank(argv, rank)
        except ValueError as e:
            if rank == 0:
                report(PROG, e)
            collectives.finish()
            return 2
        run = Path(cfg.out_dir).expanduser() / cfg.name
        fresh = rank == 0 and creates_run_folder(cfg, run)  # before rank 0 creates it
        result = worker(cfg)
    except BaseException as e:  # noqa: BLE001 - every way a rank stops: say so, leave
        if isinstance(e, SystemExit) and not e.code:
            raise
        return _stop_rank(e, rank, cfg, run, fresh, argv)
    stopped = result.get("stopped")
    if stopped:  # a signal: every rank finished the same step and saved (train/preempt.py)
        print(f"{PROG}: {preempted_line(cfg, run, stopped, rank)}", file=sys.stderr,
              flush=True)
    collectives.finish()
    return int(result.get("exit_code", 0))


def _cause(e: BaseException) -> tuple[str, int, bool]:
    """(cause, exit status, whether it is a crash worth its traceback) of a rank's stop."""
    from ..train.preempt import SignalStop

    text = " ".join(str(e).split())
    if isinstance(e, KeyboardInterrupt):
        return "interrupted (SIGINT)", 130, False
    if isinstance(e, SignalStop):
        return f"stopped by {text}", 128 + e.signum, False
    if isinstance(e, SystemExit):
        code = e.code if isinstance(e.code, int) else 1
        return f"exit status {code}", code, False
    status = next((c for t, c in expected_errors().items() if isinstance(e, t)), None)
    if status is not None:
        return f"error: {text}", status, False
    return f"crashed: {type(e).__name__}: {text}", 1, True


def _stop_rank(e: BaseException, rank: int, cfg: C.Config | None, run: Path, fresh: bool,
               argv: list[str]) -> int:
    """This rank stops: say why in the group's store (unless a rank did first), print one
    line naming the first rank and its cause, and end at once, waiting on no peer: its
    connections close with the process, which is how the others learn ([Note: stopping
    together] in engine/comm/process_group.py). Returns only without a process group."""
    import traceback

    from ..engine.comm import process_group as PG
    from ..engine.comm.work import CollectiveError

    cause, status, crash = _cause(e)
    lost = isinstance(e, CollectiveError) and PG.first_stop() is None
    timed_out = lost and any(w in str(e.__cause__ or e).lower() for w in ("timed out", "timeout"))
    if lost and not timed_out:
        # A peer's connection closed and no rank said why: this rank is not the cause.
        reason = PG.stop_note() or "no rank said why (a rank died without a word: killed?)"
        line = f"rank {rank} stopped: a collective failed; {reason}"
        first = None
    else:
        if timed_out:  # this rank waited out the timeout: the stall is the cause it names
            cause = "a collective timed out: " + str(e).split(" Backend said:")[0]
        first = PG.announce_stop(cause, status)
        line = ""
    if first is not None and first["rank"] == rank:
        if crash:
            tb = "".join(traceback.format_exception(e)).rstrip()
            print(f"{PROG}: rank {rank} crashed:\n{tb}", file=sys.stderr)
        if rank == 0 and status == 2:
            report(PROG, e)  # a refusal found by rank 0 (or by every rank alike): as before
        else:
            line = f"rank {rank} stopped first: {cause}"
    elif first is not None and not (status == 2 and first["cause"] == cause and rank != 0):
        # (A refusal every rank raised alike is said once, by rank 0.)
        line = f"rank {rank} stopped: rank {first['rank']} stopped first ({first['cause']})"
    if line and rank == 0 and cfg is not None:
        line += f"; {stopped_line(cfg, run, argv, under_launcher=True)}"
    if line:
        print(f"{PROG}: {line}", file=sys.stderr, flush=True)
    if rank == 0 and fresh:
        rundir.discard_unstarted(run)  # nothing was trained in it
    if (first is None or first["rank"] != rank) and os.environ.get("TORCHELASTIC_RUN_ID"):
        # A consequence, under torchrun's agent: it polls every 0.1 s and names the first
        # failed worker it finds in a poll, which could be this one if it ended in the same
        # poll as the cause (a SIGKILLed rank's exitcode -9 then goes unreported).
        import time

        time.sleep(0.3)
    PG.leave(status, then_exit=PG.is_initialized())
    return status
