"""Issue 44: the HF Trainer on Accelerate's FSDP1 path (`fsdp_config["version"] = 1`) and
Lightning Fabric's `FSDPStrategy`, each on PyTorch's FSDP1 and through `sw.patched_fsdp1()`,
in the same ranks.

The Trainer runs as Accelerate runs it: `FullyShardedDataParallel(model, auto_wrap_policy=
transformer_auto_wrap_policy for LlamaDecoderLayer, FULL_SHARD, device_id=cpu, ...)`, its
`clip_grad_norm_`, and SHARDED_STATE_DICT checkpoints written with DCP (model and optimizer,
`FSDP.optim_state_dict` / `optim_state_dict_to_load`), then a second Trainer resumes from
the step-2 checkpoint. Accelerate picks FSDP on accelerators only; the workers lift that
gate for both engines alike as Accelerate's GPU branch sets its state
(`_accelerate_fsdp_on_cpu`: the FSDP type kept for every later `AcceleratorState()`), and
record how each model was wrapped (`_wrapping`), so that a run on DDP cannot pass.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed.fsdp

import shardwise as sw
from shardwise.fsdp1 import FullyShardedDataParallel as SW_FSDP1
from tests.dist.hf_trainer_workers import _data, _fsdp_on_cpu
from tests.hf_models import build

STEPS = 3
# Below the gradient norms (about 1.3 at every step): the Trainer clips at each step, with
# the total norm over the ranks on both engines (FSDP1's `clip_grad_norm_`).
MAX_NORM = 1.0
# torch's FSDP1 class, taken before any patch, in a tuple: patch_fsdp1 rebinds the module
# globals that hold the class itself.
TORCH_FSDP1 = (torch.distributed.fsdp.FullyShardedDataParallel,)


def _wrapping(model: torch.nn.Module, engine_cls: Any) -> dict[str, Any]:
    """How the trained model is wrapped: FSDP1 instances of torch's class and of shardwise's
    among its modules, DDP wrappers, the engine's `fsdp_modules` with their classes."""
    from torch.nn.parallel import DistributedDataParallel

    units = engine_cls.fsdp_modules(model)
    return {"torch_fsdp1": sum(isinstance(m, TORCH_FSDP1) for m in model.modules()),
            "shardwise": sum(isinstance(m, SW_FSDP1) for m in model.modules()),
            "ddp": sum(isinstance(m, DistributedDataParallel) for m in model.modules()),
            "units": len(units),
            "unit_engines": sorted({"shardwise" if isinstance(u, SW_FSDP1)
                                    else "torch" if isinstance(u, TORCH_FSDP1) else "other"
                                    for u in units})}


@contextlib.contextmanager
def _cpu_device_id() -> Any:
    """Accelerate passes `device_id=torch.device("cpu", 0)` on CPU, which FSDP1 refuses as
    inconsistent with its compute device `cpu`: hand either engine `cpu`. Accelerate (and
    FSDP1's own auto wrapping) read the class from this module when they run."""
    import torch.distributed.fsdp.fully_sharded_data_parallel as home

    engine_cls = home.FullyShardedDataParallel  # FSDP1's, or shardwise's if patched

    class OnCPU(engine_cls):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, device_id: Any = None, **kwargs: Any) -> None:
            if isinstance(device_id, torch.device) and device_id.type == "cpu":
                device_id = torch.device("cpu")
            super().__init__(*args, device_id=device_id, **kwargs)

    home.FullyShardedDataParallel = OnCPU
    try:
        yield
    finally:
        home.FullyShardedDataParallel = engine_cls


@contextlib.contextmanager
def _accelerate_fsdp_on_cpu() -> Any:
    """`_fsdp_on_cpu`, plus the two things Accelerate's GPU branch does when it picks FSDP,
    which mixed precision depends on: `fsdp_plugin.set_mixed_precision(...)` (FSDP1's
    MixedPrecision(param_dtype, reduce_dtype, buffer_dtype) from `mixed_precision`), and the
    type written into PartialState's shared state (a later `AcceleratorState()`, as the
    autocast wrapper in prepare_model and `AcceleratedOptimizer` make, copies it back:
    MULTI_CPU, so `clip_grad_norm_` would use torch's own on each rank's shards, not the
    wrapper's)."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    with _fsdp_on_cpu():
        lifted = AcceleratorState.__init__

        def init(self: Any, *args: Any, fsdp_plugin: Any = None, **kwargs: Any) -> None:
            fresh = not AcceleratorState._shared_state
            lifted(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
            if fresh and self.distributed_type is DistributedType.FSDP:
                PartialState._shared_state["distributed_type"] = DistributedType.FSDP
                if self._mixed_precision != "no":
                    fsdp_plugin.set_mixed_precision(self._mixed_precision)

        AcceleratorState.__init__ = init  # type: ignore[method-assign]
        try:
            yield
        finally:
            AcceleratorState.__init__ = lifted  # type: ignore[method-assign]


@contextlib.contextmanager
def _loaded_optimizer_state(seen: dict[str, int]) -> Any:
    """Record how many parameters have optimizer state right after the Trainer's
    `load_fsdp_optimizer` (Accelerate's) on resume."""
    import transformers.trainer as home

    load = home.load_fsdp_optimizer

    def counted(fsdp_plugin: Any, accelerator: Any, optimizer: Any, *args: Any,
                **kwargs: Any) -> Any:
        out = load(fsdp_plugin, accelerator, optimizer, *args, **kwargs)
        seen["params"] = sum(len(g["params"]) for g in optimizer.param_groups)
        seen["with_state"] = sum(1 for s in optimizer.state.values() if s)
        return out

    home.load_fsdp_optimizer = counted
    try:
        yield
    finally:
        home.load_fsdp_optimizer = load


def _trainer(engine: str, folder: str, resume: str | None) -> dict[str, Any]:
    from accelerate.utils import DistributedType
    from transformers import Trainer, TrainingArguments

    switch = sw.patched_fsdp1() if engine == "shardwise" else contextlib.nullcontext()
    loaded: dict[str, int] = {}
    with _accelerate_fsdp_on_cpu(), switch, _cpu_device_id(), _loaded_optimizer_state(loaded):
        args = TrainingArguments(
            output_dir=f"{folder}/{engine}", per_device_train_batch_size=2, max_steps=STEPS,
            learning_rate=1e-2, max_grad_norm=MAX_NORM, seed=0, logging_steps=1,
            report_to=[], save_strategy="steps", save_steps=2, dataloader_num_workers=0,
            use_cpu=True, fsdp="full_shard",
            fsdp_config={"version": 1, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                         "state_dict_type": "SHARDED_STATE_DICT", "use_orig_params": True,
                         "sync_module_states": False, "cpu_ram_efficient_loading": False})
        torch.manual_seed(0)
        trainer = Trainer(model=build("llama"), args=args, train_dataset=_data())
        trainer.train(resume_from_checkpoint=resume)
        model = trainer.model_wrapped
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP  # the engine's
        from torch.distributed.fsdp import StateDictType

        wrapping = _wrapping(model, FSDP)
        # Still FSDP after training: what Accelerate clipped and checkpointed with.
        wrapping["distributed_type"] = str(trainer.accelerator.distributed_type)
        wrapping["is_fsdp"] = trainer.accelerator.distributed_type is DistributedType.FSDP
        FSDP.set_state_dict_type(model, StateDictType.FULL_STATE_DICT)
        params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"logs": [(h["step"], h["loss"], h["grad_norm"])
                     for h in trainer.state.log_history if "loss" in h],
            "params": params, "wrapping": wrapping, "loaded": loaded}


def _diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def trainer_fsdp1(rank: int, world: int, folder: str) -> dict[str, Any]:
    """FSDP1 then shardwise: a 3-step run (saving at step 2), then a run resumed from each
    engine's step-2 checkpoint. Per-step losses and grad norms, how each model was wrapped,
    and the largest parameter differences between the engines and between each engine's
    resumed and uninterrupted runs."""
    out: dict[str, Any] = {}
    runs = {}
    for engine in ("fsdp1", "shardwise"):
        first = _trainer(engine, folder, None)
        resumed = _trainer(engine, folder, f"{folder}/{engine}/checkpoint-2")
        runs[engine] = (first, resumed)
    for i, what in enumerate(("train", "resume")):
        a, b = runs["fsdp1"][i], runs["shardwise"][i]
        out[what] = {"fsdp1": a["logs"], "shardwise": b["logs"],
                     "wrapping": {"fsdp1": a["wrapping"], "shardwise": b["wrapping"]},
                     "params": _diff(a["params"], b["params"]),
                     "loaded": {"fsdp1": a["loaded"], "shardwise": b["loaded"]}}
    for engine, (first, resumed) in runs.items():
        out[f"{engine}: resume vs train"] = _diff(first["params"], resumed["params"])
    return out


# --------------------------------------------------------------------------------------------------
# Lightning Fabric's FSDPStrategy (FSDP1): setup, backward with no_backward_sync, its
# clip_gradients (the wrapper's clip_grad_norm_), save/load with sharded and full state dicts.


def _fabric_run(engine: str, folder: str, world: int) -> dict[str, Any]:
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import FSDPStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from tests.dist.fsdp1_workers import D_IN, Block, Net, _batch

    class CPUFSDPStrategy(FSDPStrategy):
        """Two gates for a CPU run, lifted for both engines alike: Fabric refuses
        `FSDPStrategy` itself off GPUs (an exact-type check, which a subclass passes), and it
        passes `device_id=None` on CPU, where FSDP1 needs `torch.device("cpu")`."""

        def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
            import torch.distributed.fsdp as fsdp

            engine_cls = fsdp.FullyShardedDataParallel  # FSDP1's, or shardwise's if patched

            class OnCPU(engine_cls):  # type: ignore[misc, valid-type]
                def __init__(self, *args: Any, device_id: Any = None, **kwargs: Any) -> None:
                    super().__init__(*args, device_id=device_id or torch.device("cpu"),
                                     **kwargs)

            fsdp.FullyShardedDataParallel = OnCPU
            try:
                return super().setup_module(module)
            finally:
                fsdp.FullyShardedDataParallel = engine_cls

    switch = sw.patched_fsdp1() if engine == "shardwise" else contextlib.nullcontext()
    out: dict[str, Any] = {"loss": [], "norm": []}
    with switch:
        fabric = Fabric(accelerator="cpu", devices=world, strategy=CPUFSDPStrategy(
            auto_wrap_policy=ModuleWrapPolicy({Block}), state_dict_type="sharded"))
        fabric.launch()  # ranks exist already (LOCAL_RANK is set): Fabric joins them
        torch.manual_seed(0)
        model = fabric.setup_module(Net())
        opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
        rank = fabric.global_rank
        for step in range(3):
            for micro in range(2):
                with fabric.no_backward_sync(model, enabled=micro == 0):
                    loss = model(_batch(rank, step, micro)).pow(2).mean() / 2
                    fabric.backward(loss)
                out["loss"].append(loss.item())
            out["norm"].append(fabric.clip_gradients(model, opt, max_norm=0.5).item())
            opt.step()
            opt.zero_grad()
        fabric.save(f"{folder}/{engine}-sharded", {"model": model, "optimizer": opt})
        # Load into a fresh model and optimizer and take one more step.
        torch.manual_seed(1)
        model2 = fabric.setup_module(Net())
        opt2 = fabric.setup_optimizers(torch.optim.AdamW(model2.parameters(), lr=1e-2))
        fabric.load(f"{folder}/{engine}-sharded", {"model": model2, "optimizer": opt2})
        x = torch.randn(4, D_IN, generator=torch.Generator().manual_seed(7 + rank))
        loss = model2(x).pow(2).mean()
        fabric.backward(loss)
        opt2.step()
        out["loss"].append(loss.item())
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import StateDictType

        with FSDP.state_dict_type(model2._forward_module, StateDictType.FULL_STATE_DICT):
            out["params"] = {k: v.detach().clone()
                             for k, v in model2._forward_module.state_dict().items()}
        out["wrapper"] = type(model2._forward_module).__mro__[1].__module__
        out["wrapping"] = [_wrapping(m._forward_module, FSDP) for m in (model, model2)]
    return out


def fabric_fsdp1(rank: int, world: int, folder: str) -> dict[str, Any]:
    a = _fabric_run("fsdp1", folder, world)
    b = _fabric_run("shardwise", folder, world)
    return {"loss": max(abs(x - y) for x, y in zip(a["loss"], b["loss"], strict=True)),
            "norm": max(abs(x - y) for x, y in zip(a["norm"], b["norm"], strict=True)),
            "params": max((a["params"][k] - b["params"][k]).abs().max().item()
                          for k in a["params"]),
            "wrappers": (a["wrapper"], b["wrapper"]),
            "wrapping": {"fsdp1": a["wrapping"], "shardwise": b["wrapping"]}}


# --------------------------------------------------------------------------------------------------
# Accelerate's mixed precision on FSDP1 with a model loaded in bf16: after wrapping, Accelerate
# upcasts each FSDP1 instance's flat parameter to fp32 (`FSDP.fsdp_modules`, `_has_params`,
# `_flat_param`), so the optimizer steps fp32 master weights while compute runs in bf16.


def _trainer_bf16(engine: str, folder: str) -> dict[str, Any]:
    from transformers import Trainer, TrainingArguments

    switch = sw.patched_fsdp1() if engine == "shardwise" else contextlib.nullcontext()
    with _accelerate_fsdp_on_cpu(), switch, _cpu_device_id():
        args = TrainingArguments(
            output_dir=f"{folder}/bf16-{engine}", per_device_train_batch_size=2,
            max_steps=STEPS, learning_rate=1e-2, max_grad_norm=MAX_NORM, seed=0,
            logging_steps=1, report_to=[], save_strategy="no", dataloader_num_workers=0,
            use_cpu=True, bf16=True, fsdp="full_shard",
            fsdp_config={"version": 1, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                         "state_dict_type": "FULL_STATE_DICT", "use_orig_params": True,
                         "sync_module_states": False, "cpu_ram_efficient_loading": False})
        torch.manual_seed(0)
        trainer = Trainer(model=build("llama").to(torch.bfloat16), args=args,
                          train_dataset=_data())
        trainer.train()
        model = trainer.model_wrapped
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP  # the engine's
        from torch.distributed.fsdp import StateDictType

        units = len(FSDP.fsdp_modules(model))
        wrapping = _wrapping(model, FSDP)
        wrapping["distributed_type"] = str(trainer.accelerator.distributed_type)
        masters = sorted({str(p.dtype) for g in trainer.optimizer.param_groups
                          for p in g["params"]})
        # Set, not the context manager: FSDP1's restores the previous type, None here.
        FSDP.set_state_dict_type(model, StateDictType.FULL_STATE_DICT)
        params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"logs": [(h["step"], h["loss"], h["grad_norm"])
                     for h in trainer.state.log_history if "loss" in h],
            "params": params, "masters": masters, "units": units, "wrapping": wrapping,
            "policy": repr(getattr(model, "mixed_precision", None))}


def trainer_bf16_fsdp1(rank: int, world: int, folder: str) -> dict[str, Any]:
    """The HF Trainer (bf16=True, fsdp_config version 1) on a model loaded in bf16: FSDP1
    then shardwise. Master dtypes, FSDP instance counts, losses and final parameters."""
    a = _trainer_bf16("fsdp1", folder)
    b = _trainer_bf16("shardwise", folder)
    assert a["params"].keys() == b["params"].keys()
    return {"fsdp1": {k: a[k] for k in ("logs", "masters", "units", "policy", "wrapping")},
            "shardwise": {k: b[k] for k in ("logs", "masters", "units", "policy", "wrapping")},
            "param_dtypes": sorted({(str(a["params"][k].dtype), str(b["params"][k].dtype))
                                    for k in a["params"]}),
            "params": max((a["params"][k].double() - b["params"][k].double()).abs().max().item()
                          for k in a["params"])}
