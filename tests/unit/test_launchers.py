"""Slurm's variables -> torchrun's (shardwise.launchers), and the topology the header prints."""

from __future__ import annotations

import os

import pytest

from shardwise import launchers as L

# Task 5 of an `srun -N 2 -n 8` step: node 1, its second task.
STEP = {"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8", "SLURM_NODEID": "1",
        "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "123456", "SLURM_STEP_ID": "0",
        "SLURM_JOB_NUM_NODES": "2", "SLURM_TASKS_PER_NODE": "4(x2)"}


@pytest.mark.parametrize("nodelist, hosts", [
    ("node01", ["node01"]),
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("node[08-10],gpu5", ["node08", "node09", "node10", "gpu5"]),
    ("a[1-2]-b[1-2]", ["a1-b1", "a1-b2", "a2-b1", "a2-b2"]),
    ("login,node[9-10]x", ["login", "node9x", "node10x"]),
])
def test_expand_nodelist(nodelist: str, hosts: list[str]) -> None:
    assert L.expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("nodelist, why", [
    ("", "empty"), ("node[01-04", "unbalanced"), ("node01]", "unbalanced"),
    ("node[a-b]", "'a-b' is not a number"), ("node[4-1]", "runs backwards"),
    ("a,,b", "empty host"),
])
def test_expand_nodelist_refuses(nodelist: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        L.expand_nodelist(nodelist)


def test_tasks_per_node() -> None:
    assert [L.tasks_on_node("2(x3),1", n) for n in range(4)] == [2, 2, 2, 1]
    with pytest.raises(ValueError, match="lists 4 nodes; this is node 4"):
        L.tasks_on_node("2(x3),1", 4)
    with pytest.raises(ValueError, match=r"'x2' is not N or N\(xK\)"):
        L.tasks_on_node("x2", 0)


def test_srun_task_gets_torchrun_variables() -> None:
    assert L.torch_env_from_slurm(STEP) == {
        "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "gpu07",
        "MASTER_PORT": str(20000 + 123456 % 10000), "SHARDWISE_LAUNCHER": "slurm"}
    # Chosen address and port are kept; without a tasks-per-node list an even split is used.
    env = {**STEP, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400"}
    del env["SLURM_TASKS_PER_NODE"]
    got = L.torch_env_from_slurm(env)
    assert (got["MASTER_ADDR"], got["MASTER_PORT"], got["LOCAL_WORLD_SIZE"]) == (
        "10.0.0.1", "29400", "4")


def test_not_an_srun_task() -> None:
    # The batch script itself, an salloc shell, an opt-out, no Slurm at all: nothing to do.
    batch = {k: v for k, v in STEP.items() if k != "SLURM_STEP_ID"}
    assert L.torch_env_from_slurm(batch) == {}
    assert L.torch_env_from_slurm({**STEP, "SLURM_STEP_ID": "batch"}) == {}
    assert L.torch_env_from_slurm({**STEP, "SHARDWISE_SLURM": "0"}) == {}
    assert L.torch_env_from_slurm({}) == {}


@pytest.mark.parametrize("change, why", [
    ({"SLURM_PROCID": "8"}, "SLURM_PROCID=8 is not allowed with SLURM_NTASKS=8"),
    ({"SLURM_NTASKS": "eight"}, "SLURM_NTASKS='eight' is not allowed: must be an integer"),
    ({"SLURM_LOCALID": "4"}, "SLURM_LOCALID='4' is not allowed with 4 tasks on this node"),
    ({"SLURM_JOB_NODELIST": None}, "address of task 0 is unknown: set MASTER_ADDR"),
    ({"SLURM_JOB_ID": None}, "no port can be derived: set MASTER_PORT"),
    ({"SLURM_TASKS_PER_NODE": None, "SLURM_NTASKS": "7", "SLURM_PROCID": "1"},
     "uneven and SLURM_TASKS_PER_NODE is not set"),
])
def test_bad_slurm_variables_are_named(change: dict[str, str | None], why: str) -> None:
    env = {**STEP, **{k: v for k, v in change.items() if v is not None}}
    for k, v in change.items():
        if v is None:
            env.pop(k)
    with pytest.raises(ValueError, match=why):
        L.torch_env_from_slurm(env)


def test_use_slurm_env_leaves_torchrun_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in STEP.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("RANK", "3")  # `srun torchrun ...`: torchrun's variables win
    assert not L.use_slurm_env()
    monkeypatch.delenv("RANK")
    for k in ("WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "GROUP_RANK", "GROUP_WORLD_SIZE", "SHARDWISE_LAUNCHER"):
        monkeypatch.delenv(k, raising=False)
    assert L.use_slurm_env()
    import os

    assert os.environ["RANK"] == "5" and os.environ["MASTER_ADDR"] == "gpu07"
    monkeypatch.delenv("RANK")  # monkeypatch restores only what it set


def test_topology() -> None:
    env = {"LOCAL_WORLD_SIZE": "4", "TORCHELASTIC_RUN_ID": "job"}
    t = L.topology(8, "HYBRID_SHARD", environ=env)
    assert (t["nodes"], t["ranks_per_node"], t["launcher"]) == (2, 4, "torchrun")
    assert t["mesh"].startswith("(replicate=2, shard=4)")
    assert L.topology(8, "FULL_SHARD", tp=2, environ=env)["mesh"].startswith("(dp=4, tp=2)")
    t = L.topology(2, "FULL_SHARD", environ={"LOCAL_WORLD_SIZE": "2",
                                             "TORCHELASTIC_RUN_ID": "shardwise-1a2b"})
    assert (t["nodes"], t["launcher"], t["mesh"]) == (1, "shardwise --nproc",
                                                      "(2,): FULL_SHARD over 2 ranks")
    assert L.topology(2, "FULL_SHARD", environ={"SHARDWISE_LAUNCHER": "slurm"})["launcher"] \
        == "slurm"


def test_init_distributed_reads_slurm_without_torchrun(tmp_path) -> None:
    """`srun python script.py` calling only sw.init_distributed(): one task of one, on
    127.0.0.1; it used to start a lone group that ignored Slurm (eight tasks, eight models).
    The variables are passed to the group's start, never written into os.environ."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_"))
           # a test before this one in the same process may have named a launcher
           and k != "SHARDWISE_LAUNCHER"}
    env.update({"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "1",
                "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "127.0.0.1",
                "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_JOB_NUM_NODES": "1",
                "SLURM_TASKS_PER_NODE": "1"})
    code = ("import os, shardwise as sw; from shardwise.launchers import launcher_name; "
            "from shardwise.engine.comm.process_group import launch_var; "
            "r, w, _ = sw.init_distributed(); "
            "print(r, w, launch_var('MASTER_PORT'), launcher_name(), "
            "any(k in os.environ for k in ('RANK', 'MASTER_PORT', 'SHARDWISE_LAUNCHER')))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0", "1", str(20000 + 4242 % 10000), "slurm", "False"]
