"""Checkpoint workers: train, save, resume at another world size, compare with one long run.

The reference is an unsharded TinyLM trained in-process on the same global batches (GLOBAL
samples per step, split evenly over the ranks), so a sharded run that saves after STEPS
steps and resumes anywhere must match it step for step, optimizer state included.
"""

from __future__ import annotations

import os
import shutil

import torch
import torch.distributed as dist

import shardwise as sw
from shardwise.engine.comm import collectives as C
from shardwise.engine.core.context import named_sharded_params
from shardwise.engine.core.dtensor import local_of
from tests.models import loss_fn, make_batch, make_model

GLOBAL = 12  # divisible by 1, 2, 3 and 4
STEPS = 3
LR = 1e-2
TOL = 1e-5


def make_opt(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range, rank: int,
          world: int) -> None:
    per = GLOBAL // world
    for step in steps:
        x, y = make_batch("lm", step, GLOBAL)
        loss_fn("lm", model(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per]
                ).backward()
        opt.step()
        opt.zero_grad()


def reference(steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    ref = make_model("lm", 0)
    opt = make_opt(ref)
    train(ref, opt, range(steps), 0, 1)
    return ref, opt


def _gather_rows(sp: object, rows: torch.Tensor | None) -> torch.Tensor:
    """Full tensor from this rank's rows of something shaped like sp (test-only)."""
    padded = torch.zeros(sp.chunk_rows, *sp.rest)
    if rows is not None:
        # Optimizer state of a DTensor parameter is a DTensor: its local rows.
        padded[: sp.local_rows] = local_of(rows).reshape(sp.local_rows, *sp.rest)
    if sp.shard_size > 1:
        full = torch.empty(sp.shard_size * sp.chunk_rows, *sp.rest)
        C.all_gather(full.view(-1), padded.reshape(-1), sp.owner.mesh.shard_group, False)
    else:
        full = padded
    return full[: sp.dim0].reshape(sp.orig_shape)


def worst_diff(model: torch.nn.Module, opt: torch.optim.Optimizer, ref: torch.nn.Module,
               ref_opt: torch.optim.Optimizer) -> float:
    """Largest |difference| over parameters and AdamW state; steps must be equal."""
    worst = 0.0
    full = sw.full_state_dict(model)
    ref_params = dict(ref.named_parameters())
    for name, p in ref_params.items():
        worst = max(worst, (full[name] - p.detach()).abs().max().item())
    for fqn, sp in named_sharded_params(model):
        st = opt.state.get(sp.sharded, {})
        rst = ref_opt.state.get(ref_params[fqn], {})
        assert set(st) == set(rst), (fqn, set(st), set(rst))
        if not rst:
            continue
        assert float(st["step"]) == float(rst["step"]), (fqn, st["step"], rst["step"])
        for k in ("exp_avg", "exp_avg_sq"):
            worst = max(worst, (_gather_rows(sp, st[k]) - rst[k]).abs().max().item())
    return worst


def save_at_2(rank: int, world: int, root: str) -> dict:
    """Train STEPS steps on 2 ranks, save; export GPT and TinyLM; check errors on all ranks."""
    model = make_model("lm", 0)
    sw.shard_model(model, sharding_strategy="FULL_SHARD", auto_wrap_policy="transformer")
    opt = make_opt(model)
    train(model, opt, range(STEPS), rank, world)
    ckpt = os.path.join(root, "c2")
    sw.save_checkpoint(ckpt, model, opt, step=STEPS, extra={"data_pos": 36, "tag": "c2"})
    files = sorted(os.listdir(ckpt))
    x, _ = make_batch("lm", 99, 4)
    with torch.no_grad():
        lm_out = model(x)
    lm_files = sw.export_safetensors(os.path.join(root, "lm_export"), model)

    from shardwise.train.model import GPT, GPTConfig

    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=37, block_size=8, n_layer=2, n_head=2, d_model=16))
    sw.shard_model(gpt, auto_wrap_policy="transformer")
    idx = torch.randint(0, 37, (2, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        gpt_out = gpt(idx)
    gpt_files = sw.export_safetensors(os.path.join(root, "gpt_export"), gpt,
                                      max_shard_bytes=8000)
    # Errors found on one rank raise on every rank, naming the file.
    bad = os.path.join(root, "c2_bad")
    if rank == 0:
        shutil.copytree(ckpt, bad)
        with open(os.path.join(bad, "rank00001.safetensors"), "r+b") as f:
            f.seek(-3, os.SEEK_END)  # a byte in the data: only rank 1 verifies this file
            f.write(b"\x7f")
    dist.barrier()
    errors = {}
    try:
        sw.load_checkpoint(bad, model, opt)
    except sw.CheckpointError as e:
        errors["corrupt"] = str(e)
    try:
        sw.load_checkpoint(ckpt, make_mlp_sharded())
    except sw.CheckpointError as e:
        errors["arch"] = str(e)
    # numpy, not tensors: torch would pass tensors through shared memory of a dead process.
    return {"files": files, "lm_out": lm_out.numpy(), "lm_files": lm_files,
            "gpt_out": gpt_out.numpy(), "gpt_idx": idx.numpy(), "gpt_files": gpt_files,
            "errors": errors}


def make_mlp_sharded() -> torch.nn.Module:
    m = make_model("mlp", 0)
    sw.shard_model(m, auto_wrap_policy=None)
    return m


def resume(rank: int, world: int, root: str, strategy: str, policy: object,
           save_as: str | None = None, no_shard_as: str | None = None) -> dict:
    """Load c2 into a model sharded at this world size/strategy, take one step, compare.

    `save_as`: save the stepped model there. `no_shard_as`: also load c2 (model only) into
    a NO_SHARD model and save that (every rank holds everything; rank 0 alone writes).
    """
    model = make_model("lm", 7)  # different init: everything must come from the checkpoint
    sw.shard_model(model, sharding_strategy=strategy, auto_wrap_policy=policy)
    opt = make_opt(model)
    extra = sw.load_checkpoint(os.path.join(root, "c2"), model, opt)
    ref, ref_opt = reference(STEPS)
    at_load = worst_diff(model, opt, ref, ref_opt)
    train(model, opt, range(STEPS, STEPS + 1), rank, world)
    train(ref, ref_opt, range(STEPS, STEPS + 1), 0, 1)
    after = worst_diff(model, opt, ref, ref_opt)
    files = no_shard_files = None
    if save_as is not None:
        path = os.path.join(root, save_as)
        sw.save_checkpoint(path, model, opt, step=STEPS + 1)
        files = sorted(os.listdir(path))
    if no_shard_as is not None:
        replicated = make_model("lm", 8)
        sw.shard_model(replicated, sharding_strategy="NO_SHARD", auto_wrap_policy=None)
        sw.load_checkpoint(os.path.join(root, "c2"), replicated)
        path = os.path.join(root, no_shard_as)
        sw.save_checkpoint(path, replicated, step=STEPS)
        no_shard_files = sorted(os.listdir(path))
    return {"extra": extra, "at_load": at_load, "after_step": after, "files": files,
            "no_shard_files": no_shard_files}
