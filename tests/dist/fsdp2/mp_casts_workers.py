"""Scenarios of upstream test_fully_shard_mixed_precision.py (TestFullyShardMixedPrecision
Casts): which dtype each unit's inputs and outputs have, under per-unit policies, activation
checkpointing, norm layers, and a dtype change after sharding."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import shardwise as sw
from tests.dist.fsdp2.common import Expect, record_collectives

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32


class Recorder(nn.Module):
    """Records its input; optionally casts it to its weight's dtype itself."""

    def __init__(self, inputs: dict, cast: bool) -> None:
        super().__init__()
        self.l = nn.Linear(10, 10)
        self.inputs = inputs
        self.cast = cast

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.inputs[self] = x
        return self.l(x.to(self.l.weight.dtype) if self.cast else x)


class RecorderModel(nn.Module):
    def __init__(self, inputs: dict, cast: bool) -> None:
        super().__init__()
        self.inputs = inputs
        self.c1 = Recorder(inputs, cast)
        self.c2 = Recorder(inputs, cast)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.inputs[self] = x
        return self.c2(self.c1(x))


def float16_on_one_submodule(rank: int, world: int, ex: Expect, variant: str) -> None:
    """fp16 on one child only. c2_fp16: the unit casts c2's input. c2_casts_itself: the
    module casts (cast_forward_inputs=False). c1_output_fp32: c1's output_dtype=fp32 gives
    c2 an fp32 input."""
    inputs: dict = {}
    model = RecorderModel(inputs, cast=variant == "c2_casts_itself")
    if variant == "c2_fp16":
        sw.fully_shard(model.c2, mp_policy=sw.MixedPrecisionPolicy(param_dtype=F16))
        expected = (F32, F32, F16)
    elif variant == "c2_casts_itself":
        sw.fully_shard(model.c2, mp_policy=sw.MixedPrecisionPolicy(param_dtype=F16,
                                                                   cast_forward_inputs=False))
        expected = (F32, F32, F32)
    else:
        sw.fully_shard(model.c1, mp_policy=sw.MixedPrecisionPolicy(param_dtype=F16,
                                                                   output_dtype=F32))
        expected = (F32, F16, F32)
    sw.fully_shard(model)
    model(torch.zeros(2, 10)).sum().backward()
    got = tuple(inputs[m].dtype for m in (model, model.c1, model.c2))
    ex.true(got == expected, f"input dtypes (model, c1, c2) {got}, expected {expected}")


def submodules_with_external_inputs(rank: int, world: int, ex: Expect,
                                    enable_submodule_cast: bool) -> None:
    """A unit's forward takes a tensor made inside the parent's forward (not from the
    parent's inputs): the unit's own cast_forward_inputs decides its dtype."""
    inputs: dict[str, torch.Tensor] = {}

    class ToyModule(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l = nn.Linear(10, 10)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            inputs["l2_input_x"], inputs["l2_input_y"] = x, y
            return self.l(x)

    class ToyModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l1 = nn.Linear(10, 10)
            self.l2 = ToyModule()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            inputs["model_input_x"] = x
            return self.l2(self.l1(x), torch.ones(2, 10))

    model = ToyModel()
    sw.fully_shard(model.l2, mp_policy=sw.MixedPrecisionPolicy(
        param_dtype=F16, cast_forward_inputs=enable_submodule_cast))
    sw.fully_shard(model, mp_policy=sw.MixedPrecisionPolicy(param_dtype=F16))
    model(torch.zeros(2, 10)).sum().backward()
    got = {k: v.dtype for k, v in inputs.items()}
    expected = {"model_input_x": F16, "l2_input_x": F16,
                "l2_input_y": F16 if enable_submodule_cast else F32}
    ex.true(got == expected, f"input dtypes {got}, expected {expected}")


def checkpoint_recompute_casts(rank: int, world: int, ex: Expect, recompute_cast: str) -> None:
    """Activation checkpointing recomputes a unit's forward in backward with the same casts:
    of its inputs (recompute_cast='input') or of its output (output_dtype, 'output')."""

    class RecordingLinear(nn.Linear):
        def __init__(self) -> None:
            super().__init__(1, 1)
            self.input_dtypes: list[torch.dtype] = []

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.input_dtypes.append(x.dtype)
            return super().forward(x)

    class Model(nn.Module):
        def __init__(self, in_dtype: torch.dtype) -> None:
            super().__init__()
            self.linear1 = RecordingLinear()
            self.in_dtype = in_dtype
            self.output_dtypes: list[torch.dtype] = []

        def run_linear1(self, x: torch.Tensor) -> torch.Tensor:
            x = self.linear1(x)
            self.output_dtypes.append(x.dtype)
            return x

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = checkpoint(self.run_linear1, x.to(self.in_dtype), use_reentrant=False,
                           early_stop=False)
            return x.float().sum()

    if recompute_cast == "input":
        in_dtype, policy = F32, sw.MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=BF16)
    else:
        in_dtype, policy = BF16, sw.MixedPrecisionPolicy(
            param_dtype=BF16, reduce_dtype=BF16, output_dtype=F32, cast_forward_inputs=False)
    torch.manual_seed(42)
    model = Model(in_dtype)
    sw.fully_shard(model.linear1, mp_policy=policy)
    sw.fully_shard(model, mp_policy=policy)
    model(torch.randn(8, 1)).backward()
    if recompute_cast == "input":
        got = model.linear1.input_dtypes
        ex.true(got == [BF16, BF16], f"linear1 input dtypes (forward, recompute) {got}")
    else:
        got = model.output_dtypes
        ex.true(got == [F32, F32], f"linear1 output dtypes (forward, recompute) {got}")


def _norm_model(variant: str) -> nn.Sequential:
    if variant == "layer_norm":
        return nn.Sequential(nn.Linear(12, 12), nn.LayerNorm(12), nn.Linear(12, 12))
    if variant == "batch_norm_1d":
        return nn.Sequential(nn.Linear(12, 12), nn.BatchNorm1d(12), nn.Linear(12, 12))
    return nn.Sequential(nn.Conv2d(1, 5, 3), nn.BatchNorm2d(5), nn.Conv2d(5, 4, 3))


def _plain_outcome(variant: str, pd: torch.dtype, x: torch.Tensor) -> str | None:
    """What PyTorch itself does with these dtypes, unsharded: None or the error message."""
    model = _norm_model(variant).to(pd)
    if variant in ("batch_norm_1d", "batch_norm_2d"):  # a unit's buffers stay fp32
        model[1].running_mean = model[1].running_mean.float()
        model[1].running_var = model[1].running_var.float()
    try:
        model(x.to(pd)).sum().backward()
    except RuntimeError as e:
        return str(e)
    return None


def norm_modules(rank: int, world: int, ex: Expect, param_dtype: str, variant: str) -> None:
    """Norm layers as units under a low-precision policy: forward and backward run, the
    output has the compute dtype. Batch norm 2d also with its buffers cast down, and with
    its own policy (output_dtype only). Where upstream expects a dtype error from the
    accelerator's batch norm (fp32 running stats, low-precision weights), the port expects
    exactly what PyTorch does unsharded on this device."""
    pd = {"bf16": BF16, "fp16": F16}[param_dtype]
    policy = sw.MixedPrecisionPolicy(param_dtype=pd)
    model = _norm_model(variant)
    if variant == "batch_norm_2d_bn_policy":
        sw.fully_shard(model[1], mp_policy=sw.MixedPrecisionPolicy(output_dtype=pd))
        units = [model[0], model[2], model]
    else:
        units = [model[0], model[1], model[2], model]
    for m in units:
        sw.fully_shard(m, mp_policy=policy)
    if variant == "batch_norm_2d_low_buffers":
        model[1].running_mean = model[1].running_mean.to(pd)
        model[1].running_var = model[1].running_var.to(pd)
    x = torch.randn((4, 12)) if variant in ("layer_norm", "batch_norm_1d") \
        else torch.randn((3, 1, 9, 9))
    plain_error = _plain_outcome(variant, pd, x)
    try:
        z = model(x)
        ex.true(z.dtype == pd, f"output dtype {z.dtype}, expected {pd}")
        z.sum().backward()
    except RuntimeError as e:
        ex.true(plain_error is not None, f"raised where unsharded PyTorch does not: {e}")
        return
    ex.true(plain_error is None, f"no error where unsharded PyTorch raises: {plain_error}")


def clamp_reduce_dtype(rank: int, world: int, ex: Expect) -> None:
    """A model built in bf16 with a bf16/bf16 policy, moved to fp32 after sharding: the
    reduce dtype stays bf16 (or the move is refused at the call, issue 12 defect 14)."""
    model = nn.Sequential(nn.Linear(32, 32, dtype=BF16), nn.Linear(32, 32, dtype=BF16))
    policy = sw.MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=BF16)
    ex.true(policy.reduce_dtype == BF16, "the policy changed its reduce dtype")
    for m in [*model, model]:
        sw.fully_shard(m, mp_policy=policy)
    try:
        model.to(torch.float32)
    except (ValueError, RuntimeError, TypeError):
        return
    with record_collectives() as log:
        model(torch.randn(4, 32)).sum().backward()
    dtypes = {rec[3] for rec in log if rec[0] == "reduce_scatter"}
    ex.true(dtypes == {BF16}, f"reduce-scatter dtypes {dtypes}")
