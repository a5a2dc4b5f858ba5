"""The one-copy read itself (engine/comm/cma.py), within one process."""

from __future__ import annotations

import os

import pytest
import torch

from shardwise.engine.comm import cma

pytestmark = pytest.mark.skipif(not cma.enabled(), reason="no process_vm_readv here")


def test_reads_regions_into_tensors_region_for_region() -> None:
    a, b = torch.arange(10, dtype=torch.float32), torch.arange(7, dtype=torch.int64) * 3
    empty = torch.empty(0)
    out_a, out_b, out_empty = torch.zeros(10), torch.zeros(7, dtype=torch.int64), torch.empty(0)
    cma.read(os.getpid(), [out_a, out_empty, out_b],
             [(a.data_ptr(), 40), (empty.data_ptr(), 0), (b.data_ptr(), 56)])
    assert torch.equal(out_a, a) and torch.equal(out_b, b)


def test_more_regions_than_one_system_call_takes() -> None:
    src = [torch.full((3,), float(i)) for i in range(2500)]  # past IOV_MAX (1024)
    dst = [torch.zeros(3) for _ in src]
    cma.read(os.getpid(), dst, [(t.data_ptr(), 12) for t in src])
    assert all(torch.equal(d, s) for d, s in zip(dst, src))


def test_a_size_mismatch_is_an_error_not_a_partial_copy() -> None:
    src, dst = torch.ones(4), torch.zeros(5)
    with pytest.raises(ValueError, match="peer sent 16 bytes where 20 were expected"):
        cma.read(os.getpid(), [dst], [(src.data_ptr(), 16)])
    assert torch.equal(dst, torch.zeros(5))
    with pytest.raises(ValueError, match="2 destinations for 1 peer regions"):
        cma.read(os.getpid(), [dst, dst], [(src.data_ptr(), 20)])


def test_an_unmapped_address_fails_by_name() -> None:
    with pytest.raises(OSError, match="process_vm_readv from pid"):
        cma.read(os.getpid(), [torch.zeros(4)], [(8, 16)])  # page 0 is never mapped


def test_a_short_read_continues_where_it_stopped() -> None:
    assert cma._advance([(100, 8), (200, 8), (300, 4)], 10) == [(202, 6), (300, 4)]
    assert cma._advance([(100, 8)], 8) == []


def test_off_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDWISE_CMA", "0")
    assert not cma.enabled()
