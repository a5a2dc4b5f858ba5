"""The one-copy release ([Note: one-copy release] in engine/comm/one_copy.py): a rank waits
only for its own receives and lets go of what it sent once its peer has read it, so a late
peer never reads a freed or reused buffer."""

from __future__ import annotations

import pytest

from shardwise.engine.comm import cma
from shardwise.testing import run_distributed
from tests.dist import one_copy_release_workers as W

TOL = 1e-4  # d=256: fp32 sums of 256-wide rows in another order

pytestmark = pytest.mark.skipif(not cma.enabled(), reason="no process_vm_readv here")


@pytest.mark.parametrize("strategy,late", [("FULL_SHARD", 1), ("FULL_SHARD", 0),
                                           ("SHARD_GRAD_OP", 1)])
def test_a_late_peer_reads_what_was_sent_not_what_came_after(strategy: str, late: int) -> None:
    one = run_distributed(W.lagging_peer, 2, strategy, late, 0.02)
    gloo = run_distributed(W.lagging_peer, 2, strategy, late, 0.0, env={"SHARDWISE_CMA": "0"})
    for r in range(2):
        assert one[r]["channel"] and not gloo[r]["channel"]
        off = {k: v for k, v in one[r]["diffs"].items() if not v < TOL}
        assert not off, off
        assert one[r]["full"] == gloo[r]["full"]  # the same bits as gloo's
        # Every exchange of the steps was released by their end (the state dict's too).
        assert one[r]["held"] == 0, one[r]["held"]
