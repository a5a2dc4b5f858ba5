"""Workers for issue 36: the Hugging Face `Trainer` through Accelerate's FSDP2 path with FSDP
activation checkpointing (`fsdp_config["activation_checkpointing"]`), on FSDP2 and on
shardwise (`sw.patched_fsdp2()` around the Trainer), in the same ranks.

Accelerate wraps each decoder layer in torch's `CheckpointWrapper` (`fsdp2_apply_ac`) and then
calls `torch.distributed.fsdp.fully_shard` on the wrappers, the embedding, the tail and the
root (`fsdp2_prepare_model`). Accelerate enables FSDP only on accelerator devices; on this CPU
the worker lifts that one gate (`_fsdp_on_cpu`) for both engines alike, so the rest of its
FSDP2 path runs as written, with gloo.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch

import shardwise as sw
from tests.hf_models import VOCAB, build

STEPS = 3
SEQ = 9
OFFLOAD_ENV = "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD"


@contextlib.contextmanager
def _fsdp_on_cpu() -> Iterator[None]:
    """Accelerate's state picks FSDP for an `fsdp_plugin` on GPU-like devices only; on a
    multi-process CPU run it would pick DDP. Take the FSDP branch there too."""
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    original = AcceleratorState.__init__

    def init(self: Any, *args: Any, fsdp_plugin: Any = None, **kwargs: Any) -> None:
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type is DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin

    AcceleratorState.__init__ = init  # type: ignore[method-assign]
    try:
        yield
    finally:
        AcceleratorState.__init__ = original  # type: ignore[method-assign]
        AcceleratorState._reset_state(reset_partial_state=True)


def _data() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(16):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=g)
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows


def _run(engine: str, folder: str, offload: bool) -> dict[str, Any]:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper
    from torch.distributed.fsdp import FSDPModule
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=f"{folder}/{engine}", per_device_train_batch_size=2, max_steps=STEPS,
        learning_rate=1e-2, max_grad_norm=1.0, seed=0, logging_steps=1, report_to=[],
        save_strategy="no", dataloader_num_workers=0, use_cpu=True, fsdp=True,
        fsdp_config={"version": 2, "activation_checkpointing": True,
                     "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})
    switch = sw.patched_fsdp2() if engine == "shardwise" else contextlib.nullcontext()
    # Accelerate reads the offload switch from the environment only (the Trainer has no
    # field for it): each layer is then OffloadWrapper(CheckpointWrapper(layer)).
    os.environ[OFFLOAD_ENV] = "true" if offload else "false"
    try:
        with _fsdp_on_cpu(), switch:
            trainer = Trainer(model=build("llama"), args=args, train_dataset=_data())
            trainer.train()
    finally:
        os.environ.pop(OFFLOAD_ENV)
    model = trainer.model
    engine_fs = sw.fully_shard if engine == "shardwise" else _torch_fully_shard()
    return {
        "logs": [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h],
        "params": {n: p.detach().full_tensor().clone() for n, p in model.named_parameters()},
        # For each wrapper: its class, whether it was sharded (Accelerate shards the
        # CheckpointWrapper, not an OffloadWrapper around it) and has a state, and which
        # engine's class it became.
        "wrappers": [(_torch_class(w), isinstance(w, FSDPModule),
                      engine_fs.state(w) is not None,
                      type(w).__mro__[1].__module__.split(".")[0])
                     for w in model.modules() if isinstance(w, ActivationWrapper)],
    }


def _torch_class(w: Any) -> str:
    """CheckpointWrapper / OffloadWrapper, under the engine's sharded subclass if any."""
    return next(c.__name__ for c in type(w).__mro__
                if c.__module__.startswith("torch.distributed.algorithms"))


def _torch_fully_shard() -> Any:
    from torch.distributed.fsdp import fully_shard

    return fully_shard


def trainer_ac(rank: int, world: int, folder: str) -> dict[str, Any]:
    """Without and with activation offloading, FSDP2 then shardwise: per-step losses and
    grad norms, the largest parameter difference after training, and what each engine made
    of the activation-checkpointing wrappers."""
    out = {}
    for offload in (False, True):
        fsdp2 = _run("fsdp2", folder, offload)
        ours = _run("shardwise", folder, offload)
        assert fsdp2["params"].keys() == ours["params"].keys()
        worst = max((fsdp2["params"][k] - ours["params"][k]).abs().max().item()
                    for k in fsdp2["params"])
        out[f"offload={offload}"] = {
            "fsdp2": {k: v for k, v in fsdp2.items() if k != "params"},
            "shardwise": {k: v for k, v in ours.items() if k != "params"},
            "params": worst}
    return out
