"""torchtitan's own llama3 code, driven as a user's script would, on FSDP2 and on shardwise.

Used unmodified from the installed torchtitan: the llama3 model and its config builder
(`Llama3Model`, `_build_llama3_layers`), its parallelize function `parallelize_llama` (TP via
the model's own plan, activation checkpointing via `FullAC`, FSDP via `apply_fsdp_to_decoder`,
which calls `fully_shard([norm, lm_head])` and turns FSDP's gradient division off on every
`FSDPModule`), `ParallelDims` and its meshes, the meta init (`to_empty` + `init_weights`), its
`CrossEntropyLoss` (sum over tokens / global valid tokens, as `Trainer.train_step`), its
`clip_grad_norm_`, its `OptimizersContainer` / `LRSchedulersContainer` and its DCP
`CheckpointManager`. Not driven: `Trainer` itself (it needs a Hugging Face dataset and a
tokenizer download) - this file does the steps of its `train_step`. Two config choices, both
torchtitan's own options: attention is its `ScaledDotProductAttention` (its flex attention
compiles with inductor, too slow for a CPU test) and `spmd_backend="partial_dtensor"` (the
classic path: DTensor on the model-parallel axes, FSDP on the data-parallel mesh).

The switch to shardwise is the one documented line, `sw.patched_fsdp2()` (or
`sw.patch_fsdp2()`), around torchtitan's parallelize function. Both engines run in the same process,
on the same ranks, from the same weights and batches.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

import shardwise as sw

VOCAB = 101  # odd: the vocab rows do not divide by 2 or 3 ranks
DIM, HEADS, SEQ = 32, 4, 12
TOL_FP32, TOL_BF16 = 1e-5, 1e-3


def _config(n_layers: int = 2) -> Any:
    from torchtitan.models.common import (
        ComplexRoPE,
        Embedding,
        Linear,
        RMSNorm,
        compute_ffn_hidden_dim,
    )
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import (
        _EMBEDDING_INIT,
        _NORM_INIT,
        Llama3Model,
        _build_llama3_layers,
        _output_linear_init,
    )

    layers = _build_llama3_layers(
        n_layers=n_layers, dim=DIM, n_heads=HEADS, n_kv_heads=2,
        hidden_dim=compute_ffn_hidden_dim(DIM, multiple_of=16),
        rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=64, theta=500000.0,
                                scaling="llama"),
        attn_backend="flex", fuse_qkv=True)
    for block in layers:
        block.attention.inner_attention = ScaledDotProductAttention.Config()
    return Llama3Model.Config(
        dim=DIM, vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM,
                                        param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB,
                              param_init=_output_linear_init(DIM)),
        layers=layers)


def _on_cpu() -> None:
    """torchtitan takes "cuda" as its device type when no accelerator is found (its
    tools/utils.py); on a CPU-only machine its meshes must be built for "cpu"."""
    import sys

    import torchtitan.distributed.parallel_dims  # noqa: F401

    for name, mod in list(sys.modules.items()):
        if name.startswith("torchtitan") and getattr(mod, "device_type", None) == "cuda":
            mod.device_type = "cpu"  # type: ignore[attr-defined]


def _dims(world: int, dp: int, tp: int) -> Any:
    from torchtitan.distributed import ParallelDims

    _on_cpu()
    dims = ParallelDims(dp_replicate=1, dp_shard=dp, cp=1, tp=tp, pp=1, ep=1,
                        world_size=world, spmd_backend="partial_dtensor")
    dims.build_mesh()
    return dims


def build(engine: str, dims: Any, *, bf16: bool = False, ac: bool = False,
          seed: int = 0) -> torch.nn.Module:
    """torchtitan's recipe: build on meta, parallelize, to_empty, init_weights."""
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed.activation_checkpoint import FullAC
    from torchtitan.models.llama3 import parallelize_llama

    with torch.device("meta"):
        model = _config().build()
    kwargs: dict[str, Any] = dict(
        parallel_dims=dims,
        training=TrainingConfig(mixed_precision_param="bfloat16" if bf16 else "float32",
                                mixed_precision_reduce="float32"),
        parallelism=ParallelismConfig(spmd_backend="partial_dtensor"),
        compile_config=CompileConfig(), ac_config=FullAC.Config() if ac else None,
        dump_folder="")
    if engine == "shardwise":
        with sw.patched_fsdp2():
            model = parallelize_llama(model, **kwargs)
    else:
        model = parallelize_llama(model, **kwargs)
        # FSDP2 asks gloo for PREMUL_SUM once the divide factor is 1.0 (torchtitan's
        # setting), which gloo lacks: plain SUM instead, the same arithmetic.
        from torch.distributed.fsdp import FSDPModule

        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    return model


def unsharded(seed: int = 0) -> torch.nn.Module:
    with torch.device("meta"):
        model = _config().build()
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model


def load_full(model: torch.nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Each rank copies its own slice of every full tensor (no communication)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            src = full[_canonical(name)]
            if isinstance(p, DTensor):
                local = distribute_tensor(src, p.device_mesh, p.placements,
                                          src_data_rank=None).to_local()
                p.to_local().copy_(local)
            else:
                p.copy_(src)


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {_canonical(n): (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in model.named_parameters()}


def _canonical(name: str) -> str:
    return name.replace("_checkpoint_wrapped_module.", "")


def batches(step: int, global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (global_batch, SEQ + 1), generator=g)
    labels = tokens[:, 1:].clone()
    labels[0, :3] = -100  # some ignored tokens: the global count is not batch * seq
    return tokens[:, :-1], labels


def train_step(model: torch.nn.Module, opt: Any, dims: Any, step: int, per_rank: int,
               loss_fn: Any) -> tuple[float, float]:
    """The steps of torchtitan's Trainer.train_step (one microbatch, no PP)."""
    from torchtitan.distributed import utils as dist_utils

    dp_rank = dims.get_mesh("batch").get_local_rank() if dims.dp_enabled else 0
    inputs, labels = batches(step, per_rank * dims.dp_shard)
    inputs = inputs[dp_rank * per_rank:(dp_rank + 1) * per_rank]
    labels = labels[dp_rank * per_rank:(dp_rank + 1) * per_rank]
    local_valid = (labels != -100).sum()
    global_valid = dist_utils.dist_sum_tensor(local_valid, dims.get_mesh("batch"))
    opt.zero_grad()
    loss, _ = loss_fn(model(inputs), labels, global_valid)
    loss.backward()
    norm = dist_utils.clip_grad_norm_(list(model.parameters()), 1.0, foreach=True)
    opt.step()
    global_loss = dist_utils.dist_sum(loss.detach(), dims.get_mesh("loss"))
    return float(global_loss), float(norm.full_tensor() if isinstance(norm, DTensor) else norm)


def _optimizer(model: torch.nn.Module) -> Any:
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig

    cfg = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW",
                                       optimizer_kwargs={"lr": 1e-2, "weight_decay": 0.1,
                                                         "eps": 1e-4})],
        implementation="for-loop")
    return cfg.build(model_parts=[model])


def _loss() -> Any:
    from torchtitan.components.loss import CrossEntropyLoss

    return CrossEntropyLoss.Config().build()


def parity(rank: int, world: int, dp: int, tp: int, bf16: bool, ac: bool,
           folder: str | None = None, steps: int = 3) -> dict[str, Any]:
    """FSDP2 and shardwise through torchtitan's parallelize_llama: losses and grad norms
    every step, full parameters after the last; returns the worst differences. Also checks
    shardwise's meta init against the unsharded init, and with `folder` saves shardwise's
    run there with torchtitan's CheckpointManager (then "saved" holds its parameters)."""
    dims = _dims(world, dp, tp)
    start = full_params(unsharded(seed=1))
    runs = {}
    for engine in ("fsdp2", "shardwise"):
        model = build(engine, dims, bf16=bf16, ac=ac, seed=1)
        if engine == "shardwise":
            check_meta_init(model, dims, seed=1)
        load_full(model, start)
        opt, loss_fn = _optimizer(model), _loss()
        curve = [train_step(model, opt, dims, s, 2, loss_fn) for s in range(steps)]
        runs[engine] = (curve, full_params(model), model, opt)
    tol = TOL_BF16 if bf16 else TOL_FP32
    (ref_curve, ref_params, ref_model, _), (curve, params, model, opt) = (
        runs["fsdp2"], runs["shardwise"])
    _check_identity(ref_model, model)
    worst: dict[str, Any] = {"loss": 0.0, "norm": 0.0, "params": 0.0}
    for s, ((rl, rn), (gl, gn)) in enumerate(zip(ref_curve, curve)):
        worst["loss"] = max(worst["loss"], abs(rl - gl) / max(1.0, abs(rl)))
        worst["norm"] = max(worst["norm"], abs(rn - gn) / max(1.0, abs(rn)))
        assert abs(rl - gl) <= tol * max(1.0, abs(rl)), f"step {s}: loss {gl} vs FSDP2 {rl}"
        assert abs(rn - gn) <= tol * max(1.0, abs(rn)), f"step {s}: norm {gn} vs FSDP2 {rn}"
    for name, ref in ref_params.items():
        d = (params[name].float() - ref.float()).abs().max().item()
        worst["params"] = max(worst["params"], d)
        assert d <= tol, f"{name}: differs from FSDP2 by {d:.3g} (tol {tol})"
    # The run moved the parameters: a comparison of two untouched models proves nothing.
    moved = max((ref_params[n] - start[n]).abs().max().item() for n in start)
    assert moved > 1e-3, moved
    if folder is not None:
        assert _manager(folder, model, opt).save(curr_step=steps)
        worst["saved"] = {n: t.flatten().tolist() for n, t in params.items()}
    return worst


def _check_identity(ref: torch.nn.Module, model: torch.nn.Module) -> None:
    """The units torchtitan made are FSDPModules on both engines, in the same places,
    and every one of them has FSDP's gradient division turned off."""
    from torch.distributed.fsdp import FSDPModule

    def units(m: torch.nn.Module) -> list[str]:
        return [n for n, x in m.named_modules() if isinstance(x, FSDPModule)]

    assert units(model) == units(ref), (units(model), units(ref))
    assert units(model), "no FSDPModule found on the shardwise model"
    # ...and the switch took: shardwise made the units of one, FSDP2 those of the other
    # (two FSDP2 runs would agree trivially).
    assert all(getattr(m, "_sw_unit", None) is not None
               for m in model.modules() if isinstance(m, FSDPModule))
    assert not any(getattr(m, "_sw_unit", None) is not None for m in ref.modules())


def check_meta_init(model: torch.nn.Module, dims: Any, seed: int) -> None:
    """torchtitan's meta init (build on meta, parallelize, to_empty, init_weights on the
    DTensor parameters) gives FSDP2's weights exactly, and the unsharded model's wherever
    the init is not random. Random inits draw through DTensor's random ops, which on a CPU
    mesh use each rank's local generator (torch warns so) on FSDP2 as on shardwise, so there
    neither reproduces the unsharded draw; the scale must still be the unsharded one (an
    init that saw shard shapes instead of full ones would get its fan wrong)."""
    got, fsdp2 = full_params(model), full_params(build("fsdp2", dims, seed=seed))
    ref = full_params(unsharded(seed=seed))
    for name, t in got.items():
        d = (t - fsdp2[name]).abs().max().item()
        assert d == 0.0, f"{name}: meta init differs from FSDP2's by {d:.3g}"
        if ref[name].std() == 0:
            assert torch.equal(t, ref[name]), f"{name}: deterministic init differs"
        else:
            ratio = (t.std() / ref[name].std()).item()
            assert 0.8 < ratio < 1.25, f"{name}: init std {ratio:.3f} x the unsharded one"


def _manager(folder: str, model: torch.nn.Module, opt: Any) -> Any:
    from torchtitan.components.checkpointer import CheckpointManager
    from torchtitan.components.optimizer import LRSchedulersContainer

    lr = LRSchedulersContainer.Config(warmup_steps=1).build(optimizers=opt, training_steps=10)
    return CheckpointManager.Config(enable=True, folder=folder, interval=1,
                                    last_save_model_only=False).build(
        dataloader=None, model_parts=[model], optimizers=opt, lr_schedulers=lr,
        states={}, sd_adapter=None, base_folder="")


def dp2_runs(rank: int, world: int, folder: str) -> dict[str, Any]:
    """Both dp-only cases in one launch: fp32 with activation checkpointing (saved to
    `folder`), then bf16 parameters with fp32 reduction."""
    return {"fp32-ac": parity(rank, world, world, 1, False, True, folder),
            "bf16": parity(rank, world, world, 1, True, False)}


def ckpt_load(rank: int, world: int, folder: str,
              saved: dict[str, list[float]]) -> float:
    """torchtitan's CheckpointManager.load at dp `world` into a fresh shardwise model
    (meta-initialized: checked too): the parameters are the saved ones and the optimizer
    state came back (its step)."""
    dims = _dims(world, world, 1)
    model = build("shardwise", dims, seed=3)
    check_meta_init(model, dims, seed=3)
    opt = _optimizer(model)
    # An optimizer step before loading gives the optimizer state the checkpoint replaces.
    model(batches(0, 1)[0]).sum().backward()
    opt.step()
    opt.zero_grad()
    assert _manager(folder, model, opt).load(step=3)
    worst = 0.0
    for name, t in full_params(model).items():
        want = torch.tensor(saved[name]).reshape(t.shape)
        worst = max(worst, (t - want).abs().max().item())
    assert worst == 0.0, worst
    steps = {float(s["step"]) for o in opt.optimizers for s in o.state.values()}
    assert steps == {3.0}, steps
    return worst
