"""Every knob of the public API given a bad value: the call, the value, the message it must give.

These rows are the single source of docs/errors.md: `python -m tests.unit.bad_inputs
--markdown` prints the table, and tests/unit/test_bad_input.py checks that the doc matches
and that every row raises `ValueError` with its message (CLI rows: bad_inputs_cli.py).
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

import shardwise as sw

nan, inf = math.nan, math.inf
# Never created: the path a load must refuse, and the only place a refused save could write.
NO_SUCH = os.path.join(tempfile.gettempdir(), "shardwise-bad-input-no-such-dir", "ckpt")
A_FILE = os.path.join(tempfile.gettempdir(), "shardwise-bad-input-a-file")
EMPTY_DIR = os.path.join(tempfile.gettempdir(), "shardwise-bad-input-empty-dir")


def a_file() -> str:
    """A plain file where a folder is expected (made on first use)."""
    with open(A_FILE, "a"):
        pass
    return A_FILE


def empty_dir() -> str:
    """An empty folder where a weights folder is expected (made on first use)."""
    os.makedirs(EMPTY_DIR, exist_ok=True)
    return EMPTY_DIR


@dataclass(frozen=True)
class Case:
    knob: str  # `function(parameter)` or `shardwise cmd --option`
    bad: str  # the bad value as the docs show it
    expect: str  # a fragment the error message must contain
    call: Callable[[], Any] | None = None  # API rows
    argv: tuple[str, ...] = ()  # CLI rows: the arguments after `shardwise`

    @property
    def id(self) -> str:
        return f"{self.knob} {self.bad}".replace(" ", "_")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


_LIN = nn.Linear(2, 2)


def sharded() -> nn.Module:
    return sw.shard_model(Net())


def _opt() -> torch.optim.Optimizer:
    return torch.optim.SGD(sharded().parameters(), lr=0.1)


def api(knob: str, bad: str, expect: str, call: Callable[[], Any]) -> Case:
    return Case(knob, bad, expect, call=call)


def _sm(**kw: Any) -> Callable[[], Any]:
    return lambda: sw.shard_model(Net(), **kw)


def _shard_dim(dim: int) -> Any:
    from torch.distributed.tensor import Shard

    return Shard(dim)


def _dp_dims() -> object:
    from torch.distributed.fsdp import DataParallelMeshDims

    return DataParallelMeshDims(shard="dp")


def _replicate() -> Any:
    from torch.distributed.tensor import Replicate

    return Replicate()


def _fs(**kw: Any) -> Callable[[], Any]:
    return lambda: sw.fully_shard(Net(), **kw)


def _clip(*args: Any, **kw: Any) -> Callable[[], Any]:
    return lambda: sw.clip_grad_norm_(sharded(), *args, **kw)


def _scaler(**kw: Any) -> Callable[[], Any]:
    return lambda: sw.ShardedGradScaler(**kw)


P = "is not allowed"
CASES: list[Case] = [
    # shard_model: the four knobs, the mesh, the model
    api("shard_model(model)", "'net'", "model='net' is not allowed", lambda: sw.shard_model("net")),
    api("shard_model(sharding_strategy)", "'ZERO3'",
        "sharding_strategy='ZERO3' is not one of: FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, "
        "HYBRID_SHARD", _sm(sharding_strategy="ZERO3")),
    api("shard_model(sharding_strategy)", "3", "sharding_strategy=3 is not one of",
        _sm(sharding_strategy=3)),
    api("shard_model(auto_wrap_policy)", "'blocks'",
        "auto_wrap_policy='blocks' is not allowed; use 'transformer', 'size', None",
        _sm(auto_wrap_policy="blocks")),
    api("shard_model(auto_wrap_policy)", "5", "auto_wrap_policy=5 must be a string, a callable",
        _sm(auto_wrap_policy=5)),
    api("shard_model(auto_wrap_policy)", "'transformer' (no repeated blocks)",
        "auto_wrap_policy='transformer' found no block classes",
        lambda: sw.shard_model(nn.Sequential(nn.Linear(2, 2)))),
    api("shard_model(mixed_precision)", "'int8'",
        "mixed_precision='int8' is not allowed; use None, 'bf16', 'fp16'",
        _sm(mixed_precision="int8")),
    api("shard_model(mixed_precision)", "torch.bfloat16", "mixed_precision=torch.bfloat16",
        _sm(mixed_precision=torch.bfloat16)),
    api("shard_model(cpu_offload)", "'yes'",
        "cpu_offload='yes' is not allowed; use True, False, sw.CPUOffloadPolicy(...) or FSDP1's "
        "CPUOffload",
        _sm(cpu_offload="yes")),
    api("shard_model(cpu_offload)", "1", "cpu_offload=1 is not allowed", _sm(cpu_offload=1)),
    api("shard_model(mesh)", "'cuda'", "mesh='cuda' must be None or a 1-D or 2-D torch DeviceMesh",
        _sm(mesh="cuda")),
    api("shard_model(mesh)", "a 2-D mesh with FULL_SHARD", "FULL_SHARD takes a 1-D mesh; a 2-D "
        "mesh means HYBRID_SHARD", _sm(mesh=SimpleNamespace(ndim=2))),
    api("shard_model(mesh)", "a 1-D mesh with HYBRID_SHARD", "HYBRID_SHARD needs a 2-D "
        "DeviceMesh (replicate, shard)",
        _sm(sharding_strategy="HYBRID_SHARD", mesh=SimpleNamespace(ndim=1))),
    api("shard_model(mesh)", "a 2-D mesh with NO_SHARD", "NO_SHARD takes mesh=None (every "
        "rank) or a 1-D DeviceMesh of the ranks that replicate the model",
        _sm(sharding_strategy="NO_SHARD", mesh=SimpleNamespace(ndim=2))),
    api("shard_model(ignored_params)", "5", "ignored_params=5 is not allowed: must be None or an "
        "iterable of torch.nn.Parameter", _sm(ignored_params=5)),
    api("shard_model(ignored_params)", "['w']", "ignored_params holds 'w'",
        _sm(ignored_params=["w"])),
    # fully_shard
    api("fully_shard(module)", "None", "fully_shard needs an nn.Module, got NoneType",
        lambda: sw.fully_shard(None)),  # type: ignore[arg-type]
    api("fully_shard(module)", "nn.ModuleList", "has no forward of its own",
        lambda: sw.fully_shard(nn.ModuleList([nn.Linear(2, 2)]))),
    api("fully_shard(module)", "(already sharded)", "is already sharded",
        lambda: sw.fully_shard(sharded())),
    api("fully_shard(mesh)", "3", "mesh=3 must be None or a 1-D or 2-D torch DeviceMesh",
        _fs(mesh=3)),
    api("fully_shard(mesh)", "object with ndim=1, no get_group", "must be None or a 1-D or 2-D "
        "torch DeviceMesh", _fs(mesh=SimpleNamespace(ndim=1))),
    api("fully_shard(module)", "[]", "fully_shard got an empty list of modules",
        lambda: sw.fully_shard([])),
    api("fully_shard(module)", "[m, m]", "fully_shard got a list with the same module twice",
        lambda: sw.fully_shard([_LIN, _LIN])),
    api("fully_shard(reshard_after_forward)", "'yes'", "reshard_after_forward='yes' must be "
        "None, a bool or an int group size", _fs(reshard_after_forward="yes")),
    api("fully_shard(reshard_after_forward)", "3 (shard group of 1)", "reshard_after_forward=3 "
        "as an int must be a divisor of the shard group size 1", _fs(reshard_after_forward=3)),
    api("fully_shard(coalesce_bytes)", "-1", "coalesce_bytes=-1 must be None (the default, "
        "4194304 bytes) or an int >= 0", _fs(coalesce_bytes=-1)),
    api("shard_model(coalesce_bytes)", "True", "coalesce_bytes=True must be None",
        _sm(coalesce_bytes=True)),
    api("fully_shard(dp_mesh_dims)", "'dp'", "dp_mesh_dims='dp' must be a "
        "torch.distributed.fsdp.DataParallelMeshDims", _fs(dp_mesh_dims="dp")),
    api("fully_shard(dp_mesh_dims)", "shard=('dp',) without a mesh", "mesh must have "
        "mesh_dim_names when dp_mesh_dims is provided", _fs(dp_mesh_dims=_dp_dims())),
    # FSDP2's module methods and module-level functions
    api("FSDPModule.set_reshard_after_forward", "1", "reshard_after_forward should be a bool",
        lambda: sharded().set_reshard_after_forward(1)),  # type: ignore[arg-type]
    api("FSDPModule.set_all_reduce_hook", "3", "hook=3 must be a callable",
        lambda: sharded().set_all_reduce_hook(3)),  # type: ignore[arg-type]
    api("FSDPModule.set_custom_all_gather", "3", "must implement FSDP2's Comm protocol",
        lambda: sharded().set_custom_all_gather(3)),
    api("FSDPModule.set_post_optim_event", "3", "event=3 must be a torch.Event",
        lambda: sharded().set_post_optim_event(3)),
    api("register_fsdp_forward_method(method_name)", "'nope'", "does not have a method 'nope'",
        lambda: sw.register_fsdp_forward_method(sharded(), "nope")),
    api("share_comm_ctx(modules)", "[nn.Linear]", "share_comm_ctx expects sharded modules",
        lambda: sw.share_comm_ctx([nn.Linear(2, 2)])),
    api("fully_shard(shard_placement_fn)", "lambda p: Shard(1) (a 1-D bias has no dim 1)",
        "returned Shard(1) for parameter 'blocks.0.fc.bias' of shape (4,): dim out of range",
        _fs(shard_placement_fn=lambda p: _shard_dim(1))),
    api("fully_shard(shard_placement_fn)", "lambda p: Replicate()", "must return torch's "
        "Shard(dim) or None", _fs(shard_placement_fn=lambda p: _replicate())),
    api("fully_shard(shard_placement_fn)", "3", "shard_placement_fn=3 is not allowed",
        _fs(shard_placement_fn=3)),
    api("fully_shard(mp_policy)", "'bf16'", "mp_policy='bf16' must be sw.MixedPrecisionPolicy",
        _fs(mp_policy="bf16")),
    api("fully_shard(offload_policy)", "True", "offload_policy=True must be sw.CPUOffloadPolicy",
        _fs(offload_policy=True)),
    api("fully_shard(ignored_params)", "3", "ignored_params=3 is not allowed",
        _fs(ignored_params=3)),
    api("fully_shard(ignored_params)", "[torch.ones(2)]", "ignored_params holds tensor",
        _fs(ignored_params=[torch.ones(2)])),
    # policies
    api("MixedPrecisionPolicy(param_dtype)", "'int8'", "param_dtype='int8' is not a dtype; use "
        "one of", lambda: sw.MixedPrecisionPolicy(param_dtype="int8")),
    api("MixedPrecisionPolicy(param_dtype)", "torch.int32",
        "param_dtype=torch.int32 must be a floating-point dtype",
        lambda: sw.MixedPrecisionPolicy(param_dtype=torch.int32)),
    api("MixedPrecisionPolicy(reduce_dtype)", "5", "reduce_dtype=5 is not a dtype",
        lambda: sw.MixedPrecisionPolicy(reduce_dtype=5)),  # type: ignore[arg-type]
    api("MixedPrecisionPolicy(output_dtype)", "'half-ish'", "output_dtype='half-ish' is not a "
        "dtype", lambda: sw.MixedPrecisionPolicy(output_dtype="half-ish")),  # type: ignore
    api("MixedPrecisionPolicy(cast_forward_inputs)", "'yes'",
        f"cast_forward_inputs='yes' {P}: must be True or False",
        lambda: sw.MixedPrecisionPolicy(cast_forward_inputs="yes")),  # type: ignore
    *[api(f"CPUOffloadPolicy({f})", "'no'", f"CPUOffloadPolicy.{f}='no' {P}: must be True or "
          "False", lambda f=f: sw.CPUOffloadPolicy(**{f: "no"}))
      for f in ("params", "pin_memory")],
    api("size_policy(min_num_params)", "0", f"min_num_params=0 {P}: must be an int >= 1",
        lambda: sw.size_policy(0)),
    api("size_policy(min_num_params)", "1.5", "min_num_params=1.5", lambda: sw.size_policy(1.5)),
    api("size_policy(min_num_params)", "True", "min_num_params=True", lambda: sw.size_policy(True)),
    api("transformer_policy(block_classes)", "[]", "transformer_policy needs nn.Module classes",
        lambda: sw.transformer_policy([])),
    api("transformer_policy(block_classes)", "'Block'", f"block_classes='Block' {P}",
        lambda: sw.transformer_policy("Block")),  # type: ignore[arg-type]
    api("transformer_policy(block_classes)", "5", f"block_classes=5 {P}",
        lambda: sw.transformer_policy(5)),  # type: ignore[arg-type]
    api("transformer_policy(block_classes)", "[Block()]", "transformer_policy needs nn.Module "
        "classes", lambda: sw.transformer_policy([Block()])),  # type: ignore[list-item]
    # init_distributed (all fail before the environment or a process group is touched)
    api("init_distributed(backend)", "'mpi'", "backend='mpi' must be 'gloo', 'nccl' or None",
        lambda: sw.init_distributed(backend="mpi")),
    api("init_distributed(timeout_s)", "0", f"timeout_s=0 {P}: must be a finite number > 0",
        lambda: sw.init_distributed(timeout_s=0)),
    api("init_distributed(timeout_s)", "nan", "timeout_s=nan",
        lambda: sw.init_distributed(timeout_s=nan)),
    api("init_distributed(timeout_s)", "'10'", "timeout_s='10'",
        lambda: sw.init_distributed(timeout_s="10")),  # type: ignore[arg-type]
    # clip_grad_norm_
    api("clip_grad_norm_(model)", "'m'", f"model='m' {P}: must be a torch.nn.Module",
        lambda: sw.clip_grad_norm_("m", 1.0)),  # type: ignore[arg-type]
    api("clip_grad_norm_(max_norm)", "0", f"max_norm=0 {P}: must be a number > 0", _clip(0)),
    api("clip_grad_norm_(max_norm)", "nan", "max_norm=nan", _clip(nan)),
    api("clip_grad_norm_(max_norm)", "'1'", "max_norm='1'", _clip("1")),
    api("clip_grad_norm_(max_norm)", "True", "max_norm=True", _clip(True)),
    api("clip_grad_norm_(norm_type)", "0", f"norm_type=0 {P}: must be a number > 0",
        _clip(1.0, 0)),
    api("clip_grad_norm_(norm_type)", "'l2'", "norm_type='l2'", _clip(1.0, "l2")),
    api("clip_grad_norm_(norm_type)", "-inf", "norm_type=-inf", _clip(1.0, -inf)),
    api("clip_grad_norm_(error_if_nonfinite)", "'y'", f"error_if_nonfinite='y' {P}",
        _clip(1.0, error_if_nonfinite="y")),
    # state dicts
    api("full_state_dict(model)", "3", f"model=3 {P}", lambda: sw.full_state_dict(3)),
    api("full_state_dict(rank0_only)", "'yes'", f"rank0_only='yes' {P}: must be True or False",
        lambda: sw.full_state_dict(sharded(), rank0_only="yes")),  # type: ignore[arg-type]
    api("load_full_state_dict(model)", "None", f"model=None {P}",
        lambda: sw.load_full_state_dict(None, {})),  # type: ignore[arg-type]
    api("load_full_state_dict(sd)", "[1, 2]", f"sd=list {P}: must be a mapping",
        lambda: sw.load_full_state_dict(sharded(), [1, 2])),  # type: ignore[arg-type]
    api("load_full_state_dict(sd)", "{key: 3}", "sd['blocks.0.fc.weight']=int",
        lambda: sw.load_full_state_dict(sharded(), {"blocks.0.fc.weight": 3})),  # type: ignore
    api("load_full_state_dict(sd)", "{} (keys missing)", "state dict does not match the model: "
        "missing keys", lambda: sw.load_full_state_dict(sharded(), {})),
    api("load_full_state_dict(from_rank0)", "'yes'", f"from_rank0='yes' {P}",
        lambda: sw.load_full_state_dict(sharded(), {}, from_rank0="yes")),  # type: ignore
    api("load_full_state_dict(strict)", "'no'", f"strict='no' {P}",
        lambda: sw.load_full_state_dict(sharded(), {}, strict="no")),  # type: ignore
    # checkpoints
    api("save_checkpoint(path)", "5", f"path=5 {P}: must be a non-empty str or os.PathLike",
        lambda: sw.save_checkpoint(5, sharded())),  # type: ignore[arg-type]
    api("save_checkpoint(path)", "''", f"path='' {P}", lambda: sw.save_checkpoint("", sharded())),
    api("save_checkpoint(path)", "(a file)", "exists and is not a directory",
        lambda: sw.save_checkpoint(a_file(), sharded())),
    api("save_checkpoint(model)", "'m'", f"model='m' {P}",
        lambda: sw.save_checkpoint(NO_SUCH, "m")),  # type: ignore[arg-type]
    api("save_checkpoint(optimizer)", "'adam'", f"optimizer='adam' {P}: must be a "
        "torch.optim.Optimizer or None", lambda: sw.save_checkpoint(NO_SUCH, sharded(), "adam")),
    api("save_checkpoint(step)", "'3'", "step='3' must be an int >= 0 or None",
        lambda: sw.save_checkpoint(NO_SUCH, sharded(), step="3")),  # type: ignore[arg-type]
    api("save_checkpoint(step)", "-1", "step=-1", lambda: sw.save_checkpoint(
        NO_SUCH, sharded(), step=-1)),
    api("save_checkpoint(step)", "True", "step=True", lambda: sw.save_checkpoint(
        NO_SUCH, sharded(), step=True)),
    api("save_checkpoint(extra)", "{1, 2}", "extra must be JSON-serializable",
        lambda: sw.save_checkpoint(NO_SUCH, sharded(), extra={1, 2})),
    api("save_checkpoint(allow_nonfinite)", "'no'", f"allow_nonfinite='no' {P}",
        lambda: sw.save_checkpoint(NO_SUCH, sharded(), allow_nonfinite="no")),  # type: ignore
    api("load_checkpoint(path)", "(no such folder)", f"{P}: no checkpoint directory there",
        lambda: sw.load_checkpoint(NO_SUCH, sharded())),
    api("load_checkpoint(path)", "None", f"path=None {P}",
        lambda: sw.load_checkpoint(None, sharded())),  # type: ignore[arg-type]
    api("load_checkpoint(model)", "'m'", f"model='m' {P}",
        lambda: sw.load_checkpoint(NO_SUCH, "m")),  # type: ignore[arg-type]
    api("load_checkpoint(optimizer)", "3", f"optimizer=3 {P}",
        lambda: sw.load_checkpoint(NO_SUCH, sharded(), 3)),  # type: ignore[arg-type]
    api("load_checkpoint(verify)", "'yes'", f"verify='yes' {P}",
        lambda: sw.load_checkpoint(NO_SUCH, sharded(), verify="yes")),  # type: ignore
    api("load_checkpoint(trainable_only)", "'yes'", f"trainable_only='yes' {P}",
        lambda: sw.load_checkpoint(NO_SUCH, sharded(), trainable_only="yes")),  # type: ignore
    api("save_checkpoint(trainable_only)", "'yes'", f"trainable_only='yes' {P}",
        lambda: sw.save_checkpoint(NO_SUCH, sharded(), trainable_only="yes")),  # type: ignore
    api("save_adapter(model)", "(not peft)", "is not a peft model",
        lambda: sw.save_adapter(NO_SUCH, sharded())),
    api("save_adapter(path)", "(a file)", "already exists; give a new folder",
        lambda: sw.save_adapter(__file__, sharded())),
    api("export_safetensors(path)", "''", f"path='' {P}",
        lambda: sw.export_safetensors("", sharded())),
    api("export_safetensors(path)", "(a file)", f"{P}: it is a file; give a folder",
        lambda: sw.export_safetensors(a_file(), sharded())),
    api("export_safetensors(path)", "5", f"path=5 {P}",
        lambda: sw.export_safetensors(5, sharded())),  # type: ignore[arg-type]
    api("export_safetensors(model)", "'m'", f"model='m' {P}",
        lambda: sw.export_safetensors(NO_SUCH, "m")),  # type: ignore[arg-type]
    api("export_safetensors(max_shard_bytes)", "0", "max_shard_bytes=0 must be a positive int",
        lambda: sw.export_safetensors(NO_SUCH, sharded(), max_shard_bytes=0)),
    api("export_safetensors(max_shard_bytes)", "1.5", "max_shard_bytes=1.5",
        lambda: sw.export_safetensors(NO_SUCH, sharded(), max_shard_bytes=1.5)),  # type: ignore
    api("load_pretrained(model)", "'m'", f"model='m' {P}",
        lambda: sw.load_pretrained("m", NO_SUCH)),  # type: ignore[arg-type]
    api("load_pretrained(path)", "None", f"path=None {P}",
        lambda: sw.load_pretrained(sharded(), None)),  # type: ignore[arg-type]
    api("load_pretrained(path)", "(no such folder)", f"{P}: no such file or folder",
        lambda: sw.load_pretrained(sharded(), NO_SUCH)),
    api("load_pretrained(path)", "(a file not .safetensors)", f"{P}: a file must be "
        ".safetensors", lambda: sw.load_pretrained(sharded(), a_file())),
    api("load_pretrained(path)", "(a folder without weights)", f"{P}: the folder has no "
        "model.safetensors", lambda: sw.load_pretrained(sharded(), empty_dir())),
    api("load_pretrained(strict)", "'yes'", f"strict='yes' {P}",
        lambda: sw.load_pretrained(sharded(), NO_SUCH, strict="yes")),  # type: ignore
    api("load_pretrained(allow_nonfinite)", "'no'", f"allow_nonfinite='no' {P}",
        lambda: sw.load_pretrained(sharded(), NO_SUCH, allow_nonfinite="no")),  # type: ignore
    api("load_pretrained(quantize)", "'int4'", "quantize='int4' is not allowed: None, 'nf4' "
        "or sw.NF4(...)", lambda: sw.load_pretrained(sharded(), NO_SUCH, quantize="int4")),
    api("NF4(block_size)", "3", "NF4.block_size=3 is not allowed: an even int >= 2",
        lambda: sw.NF4(block_size=3)),
    # no_sync, materialize, precision_plan
    api("no_sync(model)", "'m'", f"model='m' {P}", lambda: sw.no_sync("m").__enter__()),
    api("no_sync(model)", "(not sharded)", "no_sync needs a sharded model",
        lambda: sw.no_sync(Net()).__enter__()),
    api("materialize(model)", "(not sharded)", "materialize needs a sharded model",
        lambda: sw.materialize(Net())),
    api("materialize(init_fn)", "3", f"init_fn=3 {P}: must be a callable",
        lambda: sw.materialize(sharded(), 3)),  # type: ignore[arg-type]
    api("materialize(seed)", "1.5", f"seed=1.5 {P}: must be an int",
        lambda: sw.materialize(sharded(), seed=1.5)),  # type: ignore[arg-type]
    api("precision_plan(model)", "(not sharded)", "is not sharded",
        lambda: sw.precision_plan(Net())),
    # ShardedGradScaler
    api("ShardedGradScaler(init_scale)", "0", f"init_scale=0 {P}: must be a finite number > 0",
        _scaler(init_scale=0)),
    api("ShardedGradScaler(init_scale)", "inf", "init_scale=inf", _scaler(init_scale=inf)),
    api("ShardedGradScaler(init_scale)", "'1'", "init_scale='1'", _scaler(init_scale="1")),
    api("ShardedGradScaler(growth_factor)", "1", f"growth_factor=1 {P}: must be a finite number "
        "> 1.0", _scaler(growth_factor=1)),
    api("ShardedGradScaler(growth_factor)", "nan", "growth_factor=nan", _scaler(growth_factor=nan)),
    api("ShardedGradScaler(backoff_factor)", "1", f"backoff_factor=1 {P}: must be a finite number "
        "> 0 and < 1.0", _scaler(backoff_factor=1)),
    api("ShardedGradScaler(growth_interval)", "0", f"growth_interval=0 {P}: must be an int >= 1",
        _scaler(growth_interval=0)),
    api("ShardedGradScaler(growth_interval)", "1.5", "growth_interval=1.5",
        _scaler(growth_interval=1.5)),
    api("ShardedGradScaler(enabled)", "'no'", f"enabled='no' {P}", _scaler(enabled="no")),
]

def markdown(cases: list[Case]) -> str:
    rows = ["| knob / option | bad value | error (key part) |", "|---|---|---|"]
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for c in cases:
        # Paths differ from machine to machine; the doc must not.
        bad, expect = (t.replace(NO_SUCH, "/no/such/dir").replace(repo, "<repo>")
                       .replace("|", "\\|") for t in (c.bad, c.expect))
        rows.append(f"| `{c.knob}` | `{bad}` | {expect} |")
    return "\n".join(rows) + "\n"


def api_cases() -> list[Case]:
    """The library's rows: the engine's (here), then the planner's."""
    from .bad_inputs_plan import PLAN_CASES

    return CASES + PLAN_CASES


def all_cases() -> list[Case]:
    from .bad_inputs_cli import CLI_CASES

    return api_cases() + CLI_CASES


if __name__ == "__main__":
    if sys.argv[1:] != ["--markdown"]:
        sys.exit("usage: python -m tests.unit.bad_inputs --markdown")
    print(markdown(all_cases()), end="")
