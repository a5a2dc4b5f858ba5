"""The run folder `runs/<name>/`: naming, never clobbering, checkpoints and their pruning.

Layout:
    config.toml            the resolved config (readable back with --config)
    metrics.jsonl          one line per optimizer step (written by rank 0)
    events-rank{r}.jsonl   the engine's events, one file per rank
    checkpoints/step-NNNNNNN/   sharded checkpoints (the latest `checkpoint.keep`)
    sample.txt             text sampled from the trained model
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
from pathlib import Path

from ..checkpoint.atomic import is_complete
from ..checkpoint.atomic import remove as remove_checkpoint
from .config import Config
from .options import dumps_toml

CKPT_DIR = "checkpoints"
_CKPT_RE = re.compile(r"^step-(\d+)$")
# config.toml's first lines name the torchelastic job and the Slurm job that last wrote the
# folder (each only when there is one).
_JOB_LINE = "# written by torchelastic job "
_SLURM_LINE = "# written by slurm job "


def checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, path) of the checkpoints in a run folder, oldest first."""
    root = run_dir / CKPT_DIR
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _CKPT_RE.match(p.name)
        # Only published checkpoints: a save that crashed leaves `step-N.partial` (ignored by
        # the pattern) or a folder without its manifest.
        if m and p.is_dir() and is_complete(str(p)):
            found.append((int(m.group(1)), p))
    return sorted(found)


def step_of(name: str) -> int | None:
    """step-0000020 -> 20; "" -> None."""
    m = _CKPT_RE.match(name)
    return int(m.group(1)) if m else None


def chosen(run_dir: Path, resume_from: str = "") -> tuple[int, Path]:
    """The checkpoint a resume loads: `resume_from`'s, else the latest complete one."""
    found = checkpoints(run_dir)
    if resume_from:
        for step, p in found:
            if p.name == resume_from:
                return step, p
        have = ", ".join(p.name for _, p in found) or "none"
        raise ValueError(f"resume_from={resume_from!r}: {str(run_dir)!r} has no complete "
                         f"checkpoint of that name (complete checkpoints: {have})")
    return found[-1]


def set_aside(run_dir: Path, resume_from: str = "") -> list[str]:
    """Before a resume trains: move out of the way what a later save would trip over.

    A step folder without manifest.json (a save that died, or a removed manifest) would make
    that step's save refuse to replace it, after the steps before it were trained; with
    `resume_from`, complete checkpoints after it would be taken for the latest by the next
    --resume. Both are renamed (nothing is deleted): `step-N.incomplete`,
    `step-N.superseded`, which no resume reads. Returns "old -> new" lines.
    """
    root = run_dir / CKPT_DIR
    if not root.is_dir():
        return []
    start = chosen(run_dir, resume_from)[0] if checkpoints(run_dir) else 0
    moved = []
    for p in sorted(root.iterdir()):
        step = step_of(p.name)
        if step is None or not p.is_dir():
            continue
        if not is_complete(str(p)) and any(p.iterdir()):
            suffix = ".incomplete"
        elif resume_from and step > start and is_complete(str(p)):
            suffix = ".superseded"
        else:
            continue
        dst = p.with_name(p.name + suffix)
        n = 1
        while dst.exists():
            n += 1
            dst = p.with_name(f"{p.name}{suffix}{n}")
        p.rename(dst)
        moved.append(f"{p.name} -> {dst.name}")
    return moved


def checkpoint_path(run_dir: Path, step: int) -> Path:
    return run_dir / CKPT_DIR / f"step-{step:07d}"


def prune_checkpoints(run_dir: Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` checkpoints; return what was deleted."""
    old = [p for _, p in checkpoints(run_dir)[:-keep]] if keep > 0 else []
    for p in old:
        # Manifest first: a crash midway must not leave a folder that looks complete.
        remove_checkpoint(str(p))
    return old


def _next_free(out: Path, stem: str) -> str:
    n = 1
    while (out / f"{stem}-{n}").exists():
        n += 1
    return f"{stem}-{n}"


def latest_run(out: Path) -> Path | None:
    """The most recently written run folder under `out` that holds a checkpoint."""
    runs = [p for p in out.iterdir() if p.is_dir() and checkpoints(p)] if out.is_dir() else []
    if not runs:
        return None
    return max(runs, key=lambda p: checkpoints(p)[-1][1].stat().st_mtime)


def job_id() -> str:
    """This torchelastic job's run id: the same in each restart of a job, new for each job
    (torchrun --standalone and `launch` draw one; multi-node jobs pass --rdzv-id)."""
    return os.environ.get("TORCHELASTIC_RUN_ID", "")


def slurm_job() -> str:
    """This Slurm job's id ("" outside Slurm); a requeued job keeps it."""
    return os.environ.get("SLURM_JOB_ID", os.environ.get("SLURM_JOBID", ""))


def requeued() -> bool:
    """Whether this is a Slurm job that was requeued (`sbatch --requeue`, a preemption, or
    `scontrol requeue`): SLURM_RESTART_COUNT counts the requeues."""
    try:
        return bool(slurm_job()) and int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0) > 0
    except ValueError:
        return False


def _torchelastic_restart() -> bool:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0


def is_restart() -> bool:
    """A torchelastic restart of the workers, or a requeued Slurm job: the same job again."""
    return _torchelastic_restart() or requeued()


def _marker(run: Path, prefix: str) -> str:
    try:
        with (run / "config.toml").open() as f:
            head = [f.readline().rstrip("\n") for _ in range(2)]
    except OSError:
        return ""
    return next((line[len(prefix):] for line in head if line.startswith(prefix)), "")


def written_by(run: Path) -> str:
    """The torchelastic job id in the folder's config.toml ("" if none)."""
    return _marker(run, _JOB_LINE)


def written_by_slurm_job(run: Path) -> str:
    """The Slurm job id in the folder's config.toml ("" if none)."""
    return _marker(run, _SLURM_LINE)


def _same_job(run: Path) -> bool:
    """Whether this same job last wrote `run`: the torchelastic job whose workers restarted,
    or the Slurm job that was requeued."""
    job = job_id()
    if _torchelastic_restart() and job and written_by(run) == job:
        return True
    return requeued() and written_by_slurm_job(run) == slurm_job()


def for_restart(cfg: Config) -> Config:
    """After a torchelastic restart or a Slurm requeue, continue the folder this same job was
    writing.

    With a checkpoint there: resume from its newest complete one. Without (the first attempt
    died before its first checkpoint): start over in it, the only case where a restart
    deletes anything, and then only files this job itself wrote. A folder written by any
    other job (or by no job) gets the usual rules, so user data is never touched.
    """
    if not is_restart() or cfg.resume:
        return cfg
    out = Path(cfg.out_dir).expanduser()
    if cfg.name:
        mine = [out / cfg.name] if _same_job(out / cfg.name) else []
    else:
        mine = [p for p in out.iterdir() if _same_job(p)] if out.is_dir() else []
    if not mine:
        return cfg
    run = max(mine, key=lambda p: (p / "config.toml").stat().st_mtime)
    if checkpoints(run):
        return dataclasses.replace(cfg, name=run.name, resume=True, overwrite=False)
    return dataclasses.replace(cfg, name=run.name, overwrite=True)


def resolve_name(cfg: Config) -> Config:
    """Fix the run's name and check the folder, before any process starts or any file is written.

    A new run never reuses an existing, non-empty folder unless `overwrite` is set; an
    unnamed run takes `<preset>-<n>`; `resume` needs a folder with a checkpoint (unnamed:
    the latest such run). A torchelastic restart continues its own folder (`for_restart`).
    """
    cfg = for_restart(cfg)
    out = Path(cfg.out_dir).expanduser()
    if cfg.resume:
        if cfg.name:
            run = out / cfg.name
            if not run.is_dir():
                raise ValueError(f"--resume: there is no run folder {str(run)!r}")
        else:
            found = latest_run(out)
            if found is None:
                raise ValueError(f"--resume: no run folder with a checkpoint under {str(out)!r}")
            run = found
        if not checkpoints(run):
            raise ValueError(f"--resume: {str(run)!r} holds no checkpoint to resume from")
        chosen(run, cfg.resume_from)  # raises if resume_from names no complete checkpoint
        return dataclasses.replace(cfg, name=run.name)
    if not cfg.name:
        stem = Path(cfg.model.hf).name if cfg.model.hf else cfg.model.preset
        return dataclasses.replace(cfg, name=_next_free(out, stem or "hf"))
    run = out / cfg.name
    if run.exists() and any(run.iterdir()) and not cfg.overwrite:
        raise ValueError(
            f"run folder {str(run)!r} already exists; pass --resume to continue it, "
            "--overwrite to replace it, or another --name")
    return cfg


def prepare(cfg: Config, moved: list[str] | None = None) -> Config:
    """Create (or, for --overwrite, recreate) the run folder and write config.toml; return
    the resolved config (its `name`, and `resume` as a torchelastic restart decided it).
    On a resume, what `set_aside` moved is appended to `moved`.

    On --resume the folder is kept, except that metrics after the resumed checkpoint are
    dropped: they belong to steps that are about to be run again.
    """
    cfg = resolve_name(cfg)
    run = Path(cfg.out_dir).expanduser() / cfg.name
    if cfg.overwrite and run.exists():
        shutil.rmtree(run)
    run.mkdir(parents=True, exist_ok=True)
    if cfg.resume:
        aside = set_aside(run, cfg.resume_from)
        if moved is not None:
            moved.extend(aside)
        step = chosen(run, cfg.resume_from)[0]
        truncate_metrics(run / "metrics.jsonl", step)
        # Events too: a step run again (perhaps at another world size) must not show up
        # twice, nor with ranks it no longer has, in a replay.
        for events in run.glob("events-rank*.jsonl"):
            truncate_metrics(events, step)
    # The saved config describes the run, not this invocation's actions.
    saved = dataclasses.replace(cfg, resume=False, resume_from="", overwrite=False,
                                data=dataclasses.replace(cfg.data, reset=False))
    job, slurm = job_id(), slurm_job()
    (run / "config.toml").write_text((f"{_JOB_LINE}{job}\n" if job else "")
                                     + (f"{_SLURM_LINE}{slurm}\n" if slurm else "")
                                     + dumps_toml(saved))
    return cfg


def truncate_metrics(path: Path, last_step: int) -> None:
    """Drop the JSON lines of `path` (metrics or events) after step `last_step`, and any
    line a killed run left half-written."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if line.strip() and json.loads(line).get("step", 0) <= last_step:
                keep.append(line)
        except json.JSONDecodeError:
            pass
    path.write_text("".join(line + "\n" for line in keep))


def last_step(run: Path) -> int:
    """The last step metrics.jsonl records (0: none)."""
    steps = [0]
    with contextlib.suppress(OSError):
        for line in (run / "metrics.jsonl").read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError, AttributeError):
                steps.append(int(json.loads(line).get("step", 0)))
    return max(steps)


def saved_extra(ckpt: Path) -> dict:
    """A checkpoint's `extra` (the training position, keys, phase) from its manifest."""
    from ..checkpoint.manifest import read_manifest

    extra = read_manifest(str(ckpt)).extra
    return extra if isinstance(extra, dict) else {}


def check_resume(cfg: Config) -> None:
    """On --resume, before anything starts: refuse when no step is left to train, and when
    the data, tokenizer or model differ from what the checkpoint trained on (unless
    --data.reset starts a fresh phase from its weights: [Note: phases] in trainer.py)."""
    if not cfg.resume:
        return
    from .identity import differences, run_keys

    run = Path(cfg.out_dir).expanduser() / cfg.name
    if not checkpoints(run):
        return
    step, ckpt = chosen(run, cfg.resume_from)
    extra = saved_extra(ckpt)
    if not cfg.data.reset:
        changed = differences(extra.get("keys") or {}, run_keys(cfg))
        if changed:
            what = " and ".join(changed)
            raise ValueError(
                f"--resume: the {what} differ{'s' if len(changed) == 1 else ''} from what "
                f"{ckpt.name} of run {cfg.name!r} trained on; continuing would apply its data "
                "position, schedule and optimizer state to something else. Pass --data.reset "
                "to keep its weights and start a fresh data position, schedule and optimizer, "
                "or resume with the run's own data, tokenizer and model")
    # train.steps is the run's total ([Note: run length] in finetune.py); a length in
    # epochs depends on the data, so the trainer checks it once the data is read.
    end = cfg.train.steps
    if end and step >= end:
        raise ValueError(f"the checkpoint is at step {step}; train.steps={cfg.train.steps} "
                         "leaves nothing to do (raise --train.steps to train further)")


def discard_unstarted(run: Path) -> bool:
    """Remove a run folder that a failed or interrupted start left before its first step
    (no checkpoint, no metrics), so the same --name can be run again; True if removed.

    Only for a folder this invocation created (the caller knows): a folder holding anything
    else than what a start writes is kept.
    """
    if not run.is_dir() or checkpoints(run) or last_step(run):
        return False
    start_files = re.compile(r"^(config\.toml|metrics\.jsonl|events-rank\d+\.jsonl|checkpoints)$")
    if any(not start_files.match(p.name) for p in run.iterdir()):
        return False
    shutil.rmtree(run, ignore_errors=True)
    return True
