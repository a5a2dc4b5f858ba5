"""Optimizer state in a checkpoint, keyed by parameter FQN so it survives resharding.

The optimizer only ever sees sharded parameters, so state shaped like its parameter (AdamW's
`exp_avg`, `exp_avg_sq`; SGD's `momentum_buffer`) holds exactly the parameter's rows and is
stored like it: `optim/<fqn>/<name>`, rows by owner (a 0-d parameter's too: `_shaped_like`).
Other 0-d tensors and numbers (AdamW's `step`) are the same on every rank and go into
the manifest's JSON, as do the param groups' hyperparameters. Loading builds a regular
`optimizer.state_dict()` for the optimizer at hand, so torch's own `load_state_dict` places
and casts every value exactly as it would.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch

from ..engine.core.dtensor import is_dtensor, wrap
from ..engine.core.sharded_param import ShardedParam
from .manifest import CheckpointError, Manifest, optim_name
from .safetensors_io import dtype_from_name, dtype_name
from .slots import ModelView, Slot, full_slot, read_rows, sharded_slot

_SKIP_HYPER = ("params", "param_names")  # the membership, stored by FQN instead


def _param_fqn(view: ModelView, p: torch.Tensor, group: int) -> str:
    if id(p) not in view.params:
        raise ValueError(f"optimizer param group {group} holds a parameter of shape "
                         f"{tuple(p.shape)} that is not a parameter of the model; build the "
                         f"optimizer from the sharded model's parameters()")
    return view.params[id(p)][0]


def _hyper_json(key: str, value: Any, group: int) -> Any:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"optimizer param group {group}: {key} is a tensor of shape "
                             f"{tuple(value.shape)}; only numbers and 0-d tensors are stored")
        return {"tensor": value.item(), "dtype": dtype_name(value.dtype)}
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        raise ValueError(f"optimizer param group {group}: {key}={value!r} is not "
                         f"JSON-serializable") from None
    return value


def _shaped_like(name: str, v: Any, p: torch.Tensor, sp: ShardedParam | None) -> bool:
    """Whether optimizer state `v` is shaped like its parameter `p` (stored as rows).

    A 0-d parameter's state shaped like it is 0-d too, as is a step counter: on a DTensor
    face, what is a DTensor like it (exp_avg; torch's `step` stays plain); on a plain one
    (NO_SHARD), all but `step` ([Note: 0-d parameters] in engine/core/sharded_param.py).
    """
    if not isinstance(v, torch.Tensor) or v.shape != p.shape:
        return False
    if v.dim() > 0:
        return True
    if is_dtensor(p):
        return is_dtensor(v)
    return sp is not None and name != "step"


def collect(optimizer: torch.optim.Optimizer, view: ModelView
            ) -> tuple[dict[str, Any], list[Slot], dict[str, dict[str, Any]]]:
    """(JSON of the param groups, this rank's state slots, per-FQN state description).

    The description maps fqn -> {"tensors": [names], "scalars": {name: value spec}}.
    """
    groups, slots, state = [], [], {}
    for gi, group in enumerate(optimizer.param_groups):
        fqns = []
        for p in group["params"]:
            fqn = _param_fqn(view, p, gi)
            fqns.append(fqn)
            sp = view.params[id(p)][1]
            desc: dict[str, Any] = {"tensors": [], "scalars": {}}
            for name, v in optimizer.state.get(p, {}).items():
                if _shaped_like(name, v, p, sp):
                    sname = optim_name(fqn, name)
                    slots.append(sharded_slot(sname, sp, v) if sp is not None
                                 else full_slot(sname, v, view.writes_full))
                    desc["tensors"].append(name)
                elif isinstance(v, torch.Tensor) and v.dim() == 0:
                    desc["scalars"][name] = {"value": v.item(), "dtype": dtype_name(v.dtype)}
                elif isinstance(v, (bool, int, float)):
                    desc["scalars"][name] = {"value": v}
                else:
                    what = f"shape {tuple(v.shape)}" if isinstance(v, torch.Tensor) else type(v)
                    raise ValueError(
                        f"optimizer state {name!r} of {fqn} ({what}) cannot be checkpointed: "
                        f"only tensors shaped like the parameter {tuple(p.shape)}, 0-d "
                        f"tensors and numbers are supported")
            if desc["tensors"] or desc["scalars"]:
                state[fqn] = desc
        hyper = {k: _hyper_json(k, v, gi) for k, v in group.items() if k not in _SKIP_HYPER}
        groups.append({"hyper": hyper, "params": fqns})
    return {"class": type(optimizer).__name__, "param_groups": groups}, slots, state


def check(optimizer: torch.optim.Optimizer, view: ModelView, m: Manifest,
          where: str) -> None:
    """Raise CheckpointError when the checkpoint's optimizer does not fit this one."""
    saved = m.optimizer
    if saved is None:
        raise CheckpointError(f"{where} holds no optimizer state, but an optimizer was given "
                              f"to load_checkpoint; pass optimizer=None to load the model only")
    groups = saved["param_groups"]
    if len(groups) != len(optimizer.param_groups):
        raise CheckpointError(f"{where}: the checkpoint's optimizer has {len(groups)} param "
                              f"groups, this one has {len(optimizer.param_groups)}")
    for gi, (g, group) in enumerate(zip(groups, optimizer.param_groups)):
        mine = [_param_fqn(view, p, gi) for p in group["params"]]
        theirs = list(g["params"])
        if set(mine) != set(theirs):
            extra = sorted(set(mine) - set(theirs))
            missing = sorted(set(theirs) - set(mine))
            raise CheckpointError(
                f"{where}: optimizer param group {gi} differs: in this optimizer only "
                f"{extra[:3]}, in the checkpoint only {missing[:3]}")
    for fqn, desc in saved.get("state", {}).items():
        for name in desc["tensors"]:
            sname = optim_name(fqn, name)
            info = m.tensors.get(sname)
            pinfo = m.model_tensor(fqn)
            if info is None or pinfo is None or info.shape != pinfo.shape:
                raise CheckpointError(f"{where}: optimizer state {sname} is missing or not "
                                      f"shaped like its parameter")


def _restore_hyper(saved: Any, current: Any) -> Any:
    if isinstance(saved, dict) and "tensor" in saved and "dtype" in saved:
        device = current.device if isinstance(current, torch.Tensor) else "cpu"
        return torch.tensor(saved["tensor"], dtype=dtype_from_name(saved["dtype"]),
                            device=device)
    if isinstance(current, tuple) and isinstance(saved, list):
        return tuple(saved)
    return saved


def _scalar(spec: dict[str, Any]) -> Any:
    if "dtype" in spec:
        return torch.tensor(spec["value"], dtype=dtype_from_name(spec["dtype"]))
    return spec["value"]


def _like_param(rows: torch.Tensor, sp: ShardedParam | None, p: torch.Tensor) -> torch.Tensor:
    """Optimizer state for parameter `p` from its stored rows, in the parameter's form.

    A DTensor parameter gets DTensor state of the same placement (torch's
    `load_state_dict` casts dtype and device, but would leave a plain tensor plain).
    """
    if sp is None:
        return rows.reshape(p.shape)
    face = sp.from_rows(rows.reshape(sp.local.shape))  # the parameter's strides, as torch's
    if sp.spec is None:
        return face
    return wrap(face.to(sp.host_device), sp.spec)


def read_state(optimizer: torch.optim.Optimizer, view: ModelView, m: Manifest,
               read: Callable[[str, int, int], torch.Tensor]) -> dict[str, Any]:
    """This optimizer's `state_dict()`, built from the checkpoint; tensors on the CPU.

    `read(name, start, end)` returns rows [start, end) of a stored tensor.
    """
    saved = m.optimizer or {}
    state_desc = saved.get("state", {})
    state: dict[int, dict[str, Any]] = {}
    groups = []
    index = 0
    for group, g in zip(optimizer.param_groups, saved["param_groups"]):
        ids = []
        for p in group["params"]:
            fqn, sp = view.params[id(p)]
            desc = state_desc.get(fqn)
            if desc is not None:
                st = {name: _scalar(spec) for name, spec in desc["scalars"].items()}
                for name in desc["tensors"]:
                    sname = optim_name(fqn, name)
                    rows = read_rows(read, sname, m.tensors[sname], sp)
                    st[name] = _like_param(rows, sp, p)
                state[index] = st
            ids.append(index)
            index += 1
        hyper = {k: v for k, v in group.items() if k not in _SKIP_HYPER}
        for k, v in g["hyper"].items():
            hyper[k] = _restore_hyper(v, group.get(k))
        hyper["params"] = ids
        if "param_names" in group:
            hyper["param_names"] = group["param_names"]
        groups.append(hyper)
    return {"state": state, "param_groups": groups}
