"""`shardwise train` started by launchers other than torchrun, against the same run started by
`--nproc 2`: two `srun`-style processes (SLURM_* variables, no torchrun) and a Ray Train
`TorchTrainer` with 2 CPU workers. The same config at the same world size trains the same
numbers whoever starts the processes."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from shardwise.train.metrics import read_metrics

STEPS = 3
TINY = ["--model.preset", "tiny", "--data.max_bytes", "200000", "--train.batch_size", "4",
        "--train.steps", str(STEPS), "--train.eval_interval", "0", "--train.eval_batches", "2",
        "--log.sample_tokens", "0", "--log.event_steps", "0"]
TIMEOUT_S = 240
# What a parent torchrun (or an earlier test) could leave in the environment.
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
               "MASTER_PORT", "GROUP_RANK", "GROUP_WORLD_SIZE", "TORCHELASTIC_RUN_ID",
               "SHARDWISE_LAUNCHER")


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCH_VARS and not k.startswith("SLURM_")}
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir / "metrics.jsonl")]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    cwd = tmp_path_factory.mktemp("nproc")
    proc = subprocess.run([sys.executable, "-m", "shardwise.cli", "train", "--name", "ref",
                           "--nproc", "2", *TINY], cwd=cwd, text=True, capture_output=True,
                          timeout=TIMEOUT_S, env=clean_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return losses(cwd / "runs" / "ref")


_HANDED_OUT: set[int] = set()


def _job_id_with_free_port() -> int:
    """A job id whose derived port (20000 + id mod 10000) is free on this machine now, and
    never one handed out before in this process: a stopped case's rank 0 may still hold its
    store's port for a moment, and a probe that found it free just before would collide."""
    start = random.randrange(10000)
    for job in range(start, start + 10000):
        if job % 10000 in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", 20000 + job % 10000))
            except OSError:
                continue
            _HANDED_OUT.add(job % 10000)
            return 4_000_000 + job % 10000
    raise RuntimeError("no free port in 20000-29999")


def test_srun_tasks_without_torchrun(tmp_path: Path, reference: list[float]) -> None:
    """What `srun -N 1 -n 2 python -m shardwise.cli train ...` gives each task."""
    job = _job_id_with_free_port()
    procs = []
    for rank in range(2):
        env = clean_env(SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_NTASKS="2",
                        SLURM_NODEID="0", SLURM_JOB_NODELIST="localhost", SLURM_STEP_ID="0",
                        SLURM_JOB_ID=str(job), SLURM_JOB_NUM_NODES="1",
                        SLURM_TASKS_PER_NODE="2")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "shardwise.cli", "train", "--name", "slurm", *TINY],
            cwd=tmp_path, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True))
    outs = []
    try:
        outs = [p.communicate(timeout=TIMEOUT_S)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    log = "\n".join(outs)
    assert all(p.returncode == 0 for p in procs), log
    assert "on 2 ranks" in log and "topology: 1 node x 2 ranks (launched by slurm)" in log
    assert log.count("final train loss") == 1  # rank 0 alone prints
    run = tmp_path / "runs" / "slurm"
    assert all(len(r["memory_mb"]) == 2 for r in read_metrics(run / "metrics.jsonl"))
    assert losses(run) == reference


def ray_probe_loop(config: dict) -> None:
    """ray_train_loop, watched: the process group Ray started is the one shardwise trained
    on (no init_process_group call, the same group object, still up afterwards)."""
    import json

    import torch.distributed as dist

    from shardwise.launchers import ray_train_loop

    calls: list[object] = []
    real = dist.init_process_group

    def counting(*args: object, **kwargs: object) -> None:
        calls.append(args)
        real(*args, **kwargs)  # type: ignore[arg-type]

    dist.init_process_group = counting  # type: ignore[assignment]
    before = dist.group.WORLD
    try:
        ray_train_loop(config)
    finally:
        dist.init_process_group = real
    # Ray Train keeps reported metrics only beside a checkpoint: the answer goes to a file.
    seen = {"inits": len(calls), "same_group": dist.group.WORLD is before,
            "still_up": dist.is_initialized(), "world": dist.get_world_size()}
    Path(config["probe_dir"], f"rank{dist.get_rank()}.json").write_text(json.dumps(seen))


def test_ray_train_torchtrainer(tmp_path: Path, reference: list[float]) -> None:
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    out = tmp_path / "runs"
    ray.init(num_cpus=4, include_dashboard=False, object_store_memory=100 * 2**20,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(sys.path)}},
             log_to_driver=False)
    try:
        trainer = TorchTrainer(
            ray_probe_loop,
            train_loop_config={"argv": ["--name", "ray", "--out_dir", str(out), *TINY],
                               "probe_dir": str(tmp_path)},
            scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
            run_config=RunConfig(storage_path=str(tmp_path / "ray"), name="shardwise"))
        result = trainer.fit()
    finally:
        ray.shutdown()
    assert result.error is None, result.error
    for rank in range(2):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen == {"inits": 0, "same_group": True, "still_up": True, "world": 2}, seen
    assert losses(out / "ray") == reference
