"""Review: `sw.plan`'s bytes per rank against what a real run holds after a step, exactly,
where tests/dist/test_plan.py does not look (and where its 2% tolerance would not see it):

- NO_SHARD on 2 ranks, and FULL_SHARD or bf16 on 1 rank: the gradients are views of the
  packed reduction buffer, one 4-byte "has a gradient" flag per parameter included; the plan
  left the flags out whenever the shard group had one rank (only a 1-rank NO_SHARD fp32 run,
  which reduces nothing, has none);
- frozen parameters (attention and the tied embedding, or everything but the norms, as in
  LoRA-style fine-tuning): no gradient and no optimizer state for them.
"""

from __future__ import annotations

from shardwise.testing import run_distributed
from tests.dist.review_numbers_workers import frozen_states_case

# Odd sizes: d_model 90 over 2 ranks, a tied embedding.
SMALL = dict(vocab_size=256, block_size=64, n_layer=3, n_head=3, d_model=90)


def _check(results: list[list[dict]]) -> None:
    for per_rank in results:
        for case in per_rank:
            assert case["held"] == case["planned"], case


def test_plan_equals_held_bytes_on_one_rank() -> None:
    cases = [("FULL_SHARD", None, ""), ("FULL_SHARD", "bf16", ""), ("NO_SHARD", None, ""),
             ("NO_SHARD", "bf16", "")]
    _check(run_distributed(frozen_states_case, 1, SMALL, cases))


def test_plan_equals_held_bytes_with_frozen_params_at_2_ranks() -> None:
    cases = [(s, mp, frozen) for frozen in ("", "attn", "norms-only")
             for s, mp in (("FULL_SHARD", None), ("FULL_SHARD", "bf16"),
                           ("SHARD_GRAD_OP", None), ("NO_SHARD", None), ("NO_SHARD", "bf16"))]
    _check(run_distributed(frozen_states_case, 2, SMALL, cases))
