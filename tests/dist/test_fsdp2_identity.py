"""Issue 22: shardwise's sharded modules are torch FSDPModules, with FSDP2's API, each
checked against torch's own FSDP2 running the same code and an unsharded reference.

PyTorch's own code on the FSDPModule path is covered here (torchtitan's division loop,
register_fsdp_forward_method) and by tests that now run on FSDPModules: DCP's
get/set_model_state_dict and torch.nn.utils.clip_grad_norm_ (test_dtensor.py, which asserts
the identity) and torch.compile (test_compile.py).
"""

from __future__ import annotations

import pytest
from torch.distributed.fsdp import FSDPModule

from shardwise.engine.api.sharded_module import ShardedModule
from shardwise.testing import run_distributed
from tests.dist import fsdp2_identity_workers as W


def test_every_fsdpmodule_method_is_overridden() -> None:
    """FSDPModule's own methods reach into FSDP2's state: none may be inherited."""
    names = [n for n, v in vars(FSDPModule).items()
             if callable(v) or isinstance(v, (staticmethod, classmethod))]
    assert len(names) > 20
    cls = type("ShardedProbe", (ShardedModule, __import__("torch").nn.Linear), {})
    inherited = [n for n in names
                 if next(c for c in cls.__mro__ if n in vars(c)) is FSDPModule
                 and n not in ("__init_subclass__",)]
    assert not inherited, f"FSDPModule methods not overridden: {inherited}"


@pytest.mark.parametrize("world,chunked", [(2, False), (3, True)])
def test_divide_factor_and_list_form(world: int, chunked: bool) -> None:
    run_distributed(W.divide_factor_and_list_form, world, chunked)


def test_state_dict_mid_step() -> None:
    # At 3 ranks too through the ported case fsdp2/test_state_dict.py::dp_state_dict_dtensors.
    run_distributed(W.state_dict_mid_step, 2)


def test_comm_methods() -> None:
    run_distributed(W.comm_methods, 3)


def test_forward_methods_and_reset() -> None:
    run_distributed(W.forward_methods_and_reset, 2)


def test_meta_init() -> None:
    from tests.dist import fsdp2_meta_workers as M

    run_distributed(M.meta_init, 3)  # uneven shards and an empty one (the 2-row head)


def test_one_rank_dtensor_and_dcp(tmp_path: object) -> None:
    from tests.dist import fsdp2_meta_workers as M

    run_distributed(M.one_rank, 1, str(tmp_path) + "/ckpt")
