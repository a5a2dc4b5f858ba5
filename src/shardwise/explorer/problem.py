"""The explorer's learning problem: 4-class data that lives on a 2-D plane inside 16-D space.

Every rank rebuilds the same data and the same initial MLP from the seed, so no tensor has
to be shipped between processes to start a run. The data are drawn in 2-D (four Gaussian
blobs around a circle, at a seed-dependent angle) and embedded into 16-D by an orthonormal
map P (16, 2) plus a little off-plane noise. The model sees only the 16-D points; the page
shows the 2-D coordinates, and decision regions are the model's predictions on the plane
P @ [u, v], so what is drawn is exactly what was learned.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

N_CLASSES = 4
IN_DIM, HIDDEN = 16, 32
# 240 divides evenly over 1, 2, 3 and 4 ranks, so every world size sees the same batch.
N_POINTS = 240
# Decision regions are sampled on a GRID x GRID lattice over the plot's extent.
GRID = 48
EXTENT = 3.5  # the plot spans [-EXTENT, EXTENT] on both axes
# Optimiser settings chosen so 12 full-batch steps go from chance to well above it.
LR = 0.02


@dataclass(frozen=True)
class Problem:
    x: torch.Tensor  # (N, 16) model inputs
    y: torch.Tensor  # (N,) class labels
    xy: torch.Tensor  # (N, 2) coordinates on the plane, for drawing
    proj: torch.Tensor  # (16, 2) orthonormal embedding of the plane


def make_problem(seed: int) -> Problem:
    """Four overlapping blobs on a circle, embedded in 16-D; identical for a given seed."""
    g = torch.Generator().manual_seed(seed)
    angle0 = float(torch.rand((), generator=g)) * 2 * math.pi
    radius = 1.6 + 0.6 * float(torch.rand((), generator=g))
    per = N_POINTS // N_CLASSES
    y = torch.arange(N_CLASSES).repeat_interleave(per)  # (N,)
    angles = angle0 + y.to(torch.float32) * (2 * math.pi / N_CLASSES)
    centres = torch.stack([torch.cos(angles), torch.sin(angles)], dim=1) * radius  # (N, 2)
    xy = centres + 0.85 * torch.randn(N_POINTS, 2, generator=g)
    q, _ = torch.linalg.qr(torch.randn(IN_DIM, 2, generator=g))  # (16, 2), orthonormal
    x = xy @ q.T + 0.05 * torch.randn(N_POINTS, IN_DIM, generator=g)  # (N, 16)
    # Shuffle once so each rank's contiguous slice holds all four classes.
    order = torch.randperm(N_POINTS, generator=g)
    return Problem(x[order].contiguous(), y[order].contiguous(), xy[order].contiguous(), q)


def make_model(seed: int) -> nn.Module:
    """The classic FSDP example: Linear(16, 32) -> ReLU -> Linear(32, 4), 676 parameters."""
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed + 1)  # a different stream from the data's
    model = nn.Sequential(nn.Linear(IN_DIM, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, N_CLASSES))
    torch.random.set_rng_state(gen_state)
    return model


def rank_slice(rank: int, world: int) -> slice:
    """The contiguous rows of the global batch that `rank` trains on."""
    per = N_POINTS // world
    return slice(rank * per, (rank + 1) * per)


def grid_inputs(proj: torch.Tensor) -> torch.Tensor:
    """(GRID*GRID, 16): the plane's lattice points, row-major from the top-left corner."""
    ticks = torch.linspace(-EXTENT, EXTENT, GRID)
    v, u = torch.meshgrid(ticks.flip(0), ticks, indexing="ij")  # top row = largest v
    plane = torch.stack([u.reshape(-1), v.reshape(-1)], dim=1)  # (G*G, 2)
    return plane @ proj.T


@torch.no_grad()
def evaluate(model: nn.Module, problem: Problem) -> dict:
    """Loss and accuracy on all points, and the decision regions on the plane."""
    logits = model(problem.x)
    loss = nn.functional.cross_entropy(logits, problem.y).item()
    acc = (logits.argmax(dim=1) == problem.y).float().mean().item()
    probs = model(grid_inputs(problem.proj)).softmax(dim=1)  # (G*G, 4)
    conf, cls = probs.max(dim=1)
    return {
        "loss": loss,
        "accuracy": acc,
        # One digit per lattice point and a confidence byte: compact for the live feed.
        "regions": "".join(str(int(c)) for c in cls.tolist()),
        "confidence": [round(float(c), 2) for c in conf.tolist()],
    }


def points_payload(problem: Problem) -> list[list[float]]:
    """[[u, v, class], ...] for drawing the data."""
    return [[round(float(a), 3), round(float(b), 3), int(c)]
            for (a, b), c in zip(problem.xy.tolist(), problem.y.tolist())]
