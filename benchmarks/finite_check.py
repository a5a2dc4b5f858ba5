"""Cost of save_checkpoint's NaN/inf refusal on a ~100 MB model (fp32, one process, CPU).

Prints the check alone (the fast path: every tensor is finite), a whole save with the check,
and a whole save with `allow_nonfinite=True`, side by side in one run.

    .venv/bin/python benchmarks/finite_check.py
"""

from __future__ import annotations

import statistics
import tempfile
import time

import torch
from torch import nn

import shardwise as sw
from shardwise.checkpoint import optim_state
from shardwise.checkpoint.finite import first_nonfinite
from shardwise.checkpoint.slots import model_view


def best(fn: object, n: int = 5) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    torch.manual_seed(0)
    # 24 x 1024 x 1024 fp32 = 96 MiB of parameters (~25M), plus 2x that of AdamW state.
    model = nn.Sequential(*[nn.Linear(1024, 1024, bias=False) for _ in range(24)])
    sw.shard_model(model, auto_wrap_policy=None)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 1024)).sum().backward()
    opt.step()
    view = model_view(model)
    slots = [e.slot() for e in view.entries] + optim_state.collect(opt, view)[1]
    mb = sum(s.local.numel() * s.local.element_size() for s in slots) / 2**20
    check = best(lambda: first_nonfinite(slots))
    with tempfile.TemporaryDirectory() as d:
        checked = best(lambda: sw.save_checkpoint(f"{d}/a", model, opt))
        unchecked = best(lambda: sw.save_checkpoint(f"{d}/b", model, opt, allow_nonfinite=True))
    print(f"{mb:.0f} MB of parameters + optimizer state, {torch.get_num_threads()} threads")
    print(f"  finite check            {check * 1e3:8.1f} ms")
    print(f"  save_checkpoint          {checked * 1e3:8.1f} ms")
    print(f"  save (allow_nonfinite)   {unchecked * 1e3:8.1f} ms")
    print(f"  check / save             {check / checked:8.1%}")


if __name__ == "__main__":
    main()
