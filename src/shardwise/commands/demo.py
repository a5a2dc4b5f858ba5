"""`shardwise demo`: the FSDP hello-world, a 16-32-4 MLP (676 parameters) on 2 processes."""

from __future__ import annotations

import torch
from torch import nn

from ._args import Parser, at_least

STEPS = 5


def make_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def worker(steps: int) -> dict:
    import shardwise as sw
    from shardwise.engine.comm import collectives
    from shardwise.engine.core.context import named_sharded_params

    torch.set_num_threads(1)
    rank, world, _ = sw.init_distributed()
    model = make_mlp()
    total = sum(p.numel() for p in model.parameters())
    sw.shard_model(model, sharding_strategy="FULL_SHARD", auto_wrap_policy=None)
    held = [
        {"param": name, "shape": list(sp.orig_shape), "rows": [sp.row_start, sp.row_end],
         "dim": sp.shard_dim, "numel": sp.local.numel()}
        for name, sp in named_sharded_params(model)
    ]
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(64 * world, 16, generator=g)
    y = (x[:, :4].argmax(dim=1))  # a learnable 4-class rule
    mine = slice(rank * 64, (rank + 1) * 64)
    losses = []
    for _ in range(steps):
        loss = nn.functional.cross_entropy(model(x[mine]), y[mine])
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        collectives.all_reduce(mean, None, label="demo loss")
        losses.append(mean.item() / world)
    return {"rank": rank, "world": world, "total": total, "held": held, "losses": losses}


def main(argv: list[str]) -> int:
    ap = Parser(prog="shardwise demo", description=__doc__)
    ap.add_argument("--nproc", type=int, default=2, help="local processes (default 2)")
    ap.add_argument("--steps", type=int, default=STEPS, help="training steps (default 5)")
    args = ap.parse_args(argv)
    at_least(ap, "nproc", args.nproc, 1)
    at_least(ap, "steps", args.steps, 1)
    from shardwise.launch import launch

    results = launch(worker, args.nproc, args.steps)
    total = results[0]["total"]
    print(f"MLP 16 -> 32 -> 4: {total} parameters, FULL_SHARD over {args.nproc} ranks (gloo)")
    for r in results:
        held = sum(h["numel"] for h in r["held"])
        print(f"\nrank {r['rank']} holds {held} of {total} parameters "
              f"({100 * held / total:.1f}%):")
        for h in r["held"]:
            a, b = h["rows"]
            print(f"  {h['param']:<10} {str(tuple(h['shape'])):<9} rows {a:>2}..{b:<2} "
                  f"({h['numel']} values)")
    print("\ntraining (mean loss over ranks):")
    for i, loss in enumerate(results[0]["losses"], 1):
        print(f"  step {i}: loss {loss:.4f}")
    return 0
