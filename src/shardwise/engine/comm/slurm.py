"""Slurm's `srun` without torchrun: SLURM_* variables into torchrun's.

torch.distributed's `env://` start-up reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT,
and shardwise reads LOCAL_RANK and LOCAL_WORLD_SIZE too (the device, HYBRID_SHARD's node
groups, threads per rank). torchrun sets all of them; `srun` sets its own SLURM_* variables
instead. `torch_env_from_slurm(environ)` translates one into the other, and
`use_slurm_env()` applies it to this process; `init_distributed` calls it when no group and
no RANK exist, so `srun python train.py` joins one process group (docs/launching.md).

Only the standard library is imported: this runs before torch does anything distributed.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

# Set by use_slurm_env (and by shardwise's Ray helper) so the header can name the launcher.
LAUNCHER_ENV = "SHARDWISE_LAUNCHER"
# SHARDWISE_SLURM=0 leaves the SLURM_* variables alone (e.g. to run one process inside an
# allocation); "1" (or unset) translates them when a task of an srun step is found.
OPT_OUT_ENV = "SHARDWISE_SLURM"
# Ports below Linux's ephemeral range (32768-60999), so one the OS handed out for an
# outgoing connection cannot already hold it.
PORT_BASE, PORT_SPAN = 20000, 10000


def expand_nodelist(nodelist: str) -> list[str]:
    """Slurm's compressed host list -> host names, in order.

    `node[01-03,07],gpu5` -> node01 node02 node03 node07 gpu5 (zero padding kept). Several
    bracket groups in one name (`rack[1-2]-n[1-2]`) expand as a product, like scontrol.
    """
    text = nodelist.strip()
    if not text:
        raise ValueError("SLURM node list is empty")
    hosts: list[str] = []
    for name in _split_top_level(text, nodelist):
        hosts += _expand_one(name, nodelist)
    return hosts


def _split_top_level(text: str, whole: str) -> list[str]:
    """Split at the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if depth not in (0, 1):
            why = "nested brackets" if depth > 1 else "unbalanced brackets"
            raise ValueError(f"SLURM node list {whole!r} is not allowed: {why}")
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"SLURM node list {whole!r} is not allowed: unbalanced brackets")
    parts.append(text[start:])
    if any(not p.strip() for p in parts):
        raise ValueError(f"SLURM node list {whole!r} is not allowed: an empty host name")
    return [p.strip() for p in parts]


def _expand_one(name: str, whole: str) -> list[str]:
    m = re.search(r"\[([^\]]*)\]", name)
    if m is None:
        if "]" in name:
            raise ValueError(f"SLURM node list {whole!r} is not allowed: unbalanced brackets")
        return [name]
    head, tail = name[:m.start()], name[m.end():]
    out = []
    for item in m.group(1).split(","):
        lo, sep, hi = item.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"SLURM node list {whole!r} is not allowed: {item!r} is not a "
                             "number or a range such as 01-04")
        if not sep:
            numbers = [lo]
        else:
            if int(hi) < int(lo):
                raise ValueError(f"SLURM node list {whole!r} is not allowed: the range "
                                 f"{item!r} runs backwards")
            width = len(lo)  # node[08-10]: node08 node09 node10
            numbers = [str(n).zfill(width) for n in range(int(lo), int(hi) + 1)]
        for n in numbers:
            out += _expand_one(f"{head}{n}{tail}", whole)
    return out


def tasks_on_node(tasks_per_node: str, node: int) -> int:
    """The task count of node `node` from Slurm's `2(x3),1` form (3 nodes with 2, then 1)."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if m is None:
            raise ValueError(f"SLURM tasks per node {tasks_per_node!r} is not allowed: "
                             f"{part!r} is not N or N(xK)")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    if node >= len(counts):
        raise ValueError(f"SLURM tasks per node {tasks_per_node!r} lists {len(counts)} nodes; "
                         f"this is node {node}")
    return counts[node]


def in_srun_step(environ: Mapping[str, str]) -> bool:
    """Whether this process is a task of an `srun` step (not the batch script itself, which
    runs once however many tasks the job asked for), and the user did not opt out."""
    if environ.get(OPT_OUT_ENV, "1") == "0":
        return False
    step = environ.get("SLURM_STEP_ID", environ.get("SLURM_STEPID"))
    return "SLURM_PROCID" in environ and "SLURM_NTASKS" in environ and step is not None \
        and step != "batch"


def _int(environ: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        raw = environ.get(name)
        if raw is None:
            continue
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"{name}={raw!r} is not allowed: must be an integer") from None
    return None


def torch_env_from_slurm(environ: Mapping[str, str]) -> dict[str, str]:
    """torchrun's variables for this task of an srun step ({} outside one).

    RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK (the node) and
    GROUP_WORLD_SIZE (the nodes) come from SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, the
    tasks on this node, SLURM_NODEID and the node count. MASTER_ADDR is the first host of
    the step's node list (where task 0 runs, under Slurm's default block distribution);
    MASTER_PORT is 20000 + job id mod 10000, so every task of the job agrees on it without
    talking. A MASTER_ADDR or MASTER_PORT already set is kept: the way to choose them.
    """
    if not in_srun_step(environ):
        return {}
    rank = _int(environ, "SLURM_PROCID")
    world = _int(environ, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    local = _int(environ, "SLURM_LOCALID")
    node = _int(environ, "SLURM_NODEID") or 0
    assert rank is not None and world is not None  # in_srun_step checked them
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"SLURM_PROCID={rank} is not allowed with SLURM_NTASKS={world}: "
                         "need 0 <= rank < tasks")
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST") \
        or environ.get("SLURM_NODELIST")
    if not nodelist and "MASTER_ADDR" not in environ:
        raise ValueError("SLURM_JOB_NODELIST is not set, so the address of task 0 is "
                         "unknown: set MASTER_ADDR")
    hosts = expand_nodelist(nodelist) if nodelist else []
    nodes = _int(environ, "SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES") \
        or len(hosts) or 1
    per_node = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
    if per_node:
        local_world = tasks_on_node(per_node, node)
    elif world % nodes == 0:
        local_world = world // nodes
    else:
        raise ValueError(f"SLURM_NTASKS={world} over {nodes} nodes is uneven and "
                         "SLURM_TASKS_PER_NODE is not set: set it (or --ntasks-per-node)")
    if local is None or not 0 <= local < local_world:
        raise ValueError(f"SLURM_LOCALID={environ.get('SLURM_LOCALID')!r} is not allowed "
                         f"with {local_world} tasks on this node")
    port = environ.get("MASTER_PORT")
    if port is None:
        job = _int(environ, "SLURM_JOB_ID", "SLURM_JOBID")
        if job is None:
            raise ValueError("SLURM_JOB_ID is not set, so no port can be derived: set "
                             "MASTER_PORT")
        port = str(PORT_BASE + job % PORT_SPAN)
    return {
        "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local),
        "LOCAL_WORLD_SIZE": str(local_world), "GROUP_RANK": str(node),
        "GROUP_WORLD_SIZE": str(nodes),
        "MASTER_ADDR": environ.get("MASTER_ADDR") or hosts[0], "MASTER_PORT": port,
        LAUNCHER_ENV: "slurm",
    }


def use_slurm_env() -> bool:
    """Inside an srun task without torchrun's variables, set them from Slurm's (see
    `torch_env_from_slurm`); True when it did. A process torchrun started (RANK set) is
    left alone: `srun torchrun ...` works as before. Call before `sw.init_distributed()`."""
    if "RANK" in os.environ:
        return False
    env = torch_env_from_slurm(os.environ)
    os.environ.update(env)
    return bool(env)
