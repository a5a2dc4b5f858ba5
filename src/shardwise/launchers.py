"""Launchers other than torchrun: Slurm's `srun`, and what a run says about its topology.

torch.distributed's `env://` start-up reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT,
and shardwise reads LOCAL_RANK and LOCAL_WORLD_SIZE too (the device, HYBRID_SHARD's node
groups, threads per rank). torchrun sets all of them; `srun` sets its own SLURM_* variables
instead. `torch_env_from_slurm(environ)` translates one into the other, and
`use_slurm_env()` applies it to this process, so that

    srun python -m shardwise.cli train ...          # one task per rank, no torchrun

joins one process group. `sw.init_distributed()` does the same by itself, without writing the
environment: it passes the translated rank, world size and address to the group's start
(engine/comm/process_group.py holds the translation).

Ray Train needs nothing here: its TorchTrainer starts the process group and sets the same
variables before `train_func` runs, and `sw.init_distributed()` joins the group that exists
(docs/launching.md).

"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from .engine.comm.process_group import (  # noqa: F401 - the public home of the Slurm helpers
    LAUNCHER_ENV,
    OPT_OUT_ENV,
    expand_nodelist,
    in_srun_step,
    launch_var,
    tasks_on_node,
    torch_env_from_slurm,
    use_slurm_env,
)


def launcher_name(environ: Mapping[str, str] | None = None) -> str:
    """Who started this process: slurm, ray, shardwise (--nproc), torchrun or none."""
    env = os.environ if environ is None else environ
    # (sw.init_distributed's Slurm start-up records it without writing the environment.)
    named = env.get(LAUNCHER_ENV) or (launch_var(LAUNCHER_ENV) if environ is None else None)
    if named:
        return named
    run_id = env.get("TORCHELASTIC_RUN_ID", "")
    if run_id:
        return "shardwise --nproc" if run_id.startswith("shardwise-") else "torchrun"
    return "none (one process)" if "RANK" not in env else "RANK/WORLD_SIZE variables"


def topology(world: int, strategy: str, tp: int = 1,
             environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Nodes, ranks per node and the device mesh of a run, for the header.

    Nodes are counted as the launchers count them: WORLD_SIZE / LOCAL_WORLD_SIZE (the ranks
    one torchrun agent or one Slurm node started), which is also how HYBRID_SHARD finds its
    node groups (engine/core/policies.py).
    """
    env = os.environ if environ is None else environ
    local = int(env.get("LOCAL_WORLD_SIZE") or world)
    nodes = world // local if local and world % local == 0 else 0
    if tp > 1:
        mesh = f"(dp={world // tp}, tp={tp}): FSDP over dp, tensor parallel over tp"
    elif strategy in ("HYBRID_SHARD", "HYBRID_SHARD_ZERO2") and nodes:
        mesh = (f"(replicate={nodes}, shard={local}): shard inside a node, replicate "
                "across nodes")
    elif strategy == "NO_SHARD":
        mesh = f"({world},): replicated, gradients all-reduced"
    else:
        mesh = f"({world},): {strategy} over {world} ranks"
    return {"nodes": nodes, "ranks_per_node": local, "world": world, "mesh": mesh,
            "launcher": launcher_name(env)}


def ray_train_loop(config: dict[str, Any]) -> dict[str, Any]:
    """`train_loop_per_worker` for Ray Train's `TorchTrainer`: a `shardwise train` run with
    the command-line options `config["argv"]`, on every worker.

    Ray has started the process group and set RANK, WORLD_SIZE, LOCAL_RANK and
    LOCAL_WORLD_SIZE before this runs; `sw.init_distributed()` joins that group (it never
    starts a second one), and nothing here destroys it: Ray does at shutdown. Each worker
    reports the run's summary numbers to Ray (`ray.train.report`) and returns the summary.
    """
    import ray.train

    import shardwise as sw

    from .commands.train import config_on_every_rank, worker

    os.environ[LAUNCHER_ENV] = "ray"
    rank, _, _ = sw.init_distributed()
    summary = worker(config_on_every_rank([str(a) for a in config.get("argv", [])], rank))
    ray.train.report({k: v for k, v in summary.items()
                      if isinstance(v, (int, float)) and not isinstance(v, bool)})
    return summary
