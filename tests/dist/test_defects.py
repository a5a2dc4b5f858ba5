"""Issue 12's defects, each against an unsharded reference or a clear error (2 and 3 ranks)."""

from __future__ import annotations

import pytest

from shardwise.testing import run_distributed
from tests.dist import defects as D
from tests.dist import defects_api as A


@pytest.mark.parametrize("world", [2, 3])
def test_frozen_weights_inside_units(world: int) -> None:
    run_distributed(D.frozen_in_units, world)


@pytest.mark.parametrize("world", [2, 3])
def test_requires_grad_changed_after_sharding(world: int) -> None:
    run_distributed(D.requires_grad_after_sharding, world)


@pytest.mark.parametrize("world", [2, 3])
def test_unused_parameters_keep_none_gradients(world: int) -> None:
    run_distributed(D.unused_params, world)


def test_load_full_state_dict_after_forward_without_backward() -> None:
    run_distributed(D.load_after_forward, 2)


@pytest.mark.parametrize("world", [2, 3])
def test_no_sync_accumulates_in_reduce_dtype(world: int) -> None:
    run_distributed(D.no_sync_accumulates_in_reduce_dtype, world)


@pytest.mark.parametrize("world", [2, 3])
def test_dataclass_activations(world: int) -> None:
    run_distributed(D.dataclass_activations, world)


def test_activation_checkpointing_under_mixed_precision() -> None:
    run_distributed(D.checkpointed_mixed_precision, 2)


def test_output_dtype_per_unit() -> None:
    run_distributed(D.per_unit_output_dtype, 3)


def test_slicing_and_deepcopy() -> None:
    run_distributed(A.slicing_and_deepcopy, 2)


def test_materialize_seed_agreement_and_meta_buffers() -> None:
    run_distributed(A.materialize_seed_and_buffers, 2)


def test_optimizer_built_before_sharding_fails_loudly() -> None:
    run_distributed(A.optimizer_before_sharding, 2)


def test_to_dtype_after_sharding_is_refused() -> None:
    run_distributed(A.to_dtype_after_sharding, 2)
