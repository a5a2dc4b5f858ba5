"""A `Plan` as text: what `print(plan)` and `shardwise plan` show (one table, two callers).

Sizes are binary (GiB, MiB, KiB) everywhere; bandwidths GiB/s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .result import Plan


def size(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f} B"


def count(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.3g}{unit}"
    return f"{n:.0f}"


def flop(n: float) -> str:
    for unit, div in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9)):
        if n >= div:
            return f"{n / div:.3g} {unit}"
    return f"{n / 1e6:.3g} MFLOP"


def secs(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def headline(p: Plan, label: str | None = None) -> str:
    batch = (f", batch {p.batch_size} x {p.seq_len} tokens per rank"
             if p.batch_size and p.seq_len else "")
    what = f"{label} ({count(p.params)} params" if label else f"{count(p.params)} params ("
    sep = ", " if label else ""
    return (f"{what}{sep}{p.units} units) on {p.world_size} x {p.device or 'any device'}"
            + (f" ({p.interconnect})" if p.interconnect else "")
            + f", {p.mixed_precision}, {p.optimizer}{batch}")


def table(p: Plan) -> list[str]:
    """The chosen strategy, term by term, with the verdict and what would fit instead."""
    r = p.per_rank
    if r.frozen_bytes:  # a fine-tune: the frozen base apart from what trains
        base = "NF4 linears" if r.dequant_bytes else "as stored"
        params = [(f"frozen base (sharded, {base})", r.frozen_bytes),
                  ("trained parameters (sharded)", r.params_bytes - r.frozen_bytes)]
    else:
        params = [("parameters (sharded, fp32 masters)", r.params_bytes)]
    rows = [
        *params,
        ("gradients (sharded)", r.grads_bytes),
        (f"optimizer state ({p.optimizer})", r.optimizer_bytes),
        ("= model states", r.model_states_bytes),
        ("gathered units, peak (prefetch incl.)", r.unsharded_bytes),
        ("communication buffers, peak", r.comm_buffers_bytes),
        ("activations, peak", r.activations_bytes),
        *([("NF4 dequantization, peak (largest weight)", r.dequant_bytes)]
          if r.dequant_bytes else []),
        ("module buffers", r.buffers_bytes),
        ("optimizer step temporaries", r.optimizer_temp_bytes),
    ]
    out = [f"{p.sharding_strategy} per rank (rank 0 holds the most; shard {p.shard_size} x "
           f"replicate {p.replicate_size}):"]
    if p.least_even:
        out.append(f"  {p.least_even}")
    if p.tensor_parallel > 1 and p.tp_embeddings is not None:
        from .tp import describe_tables

        dp = p.shard_size * p.replicate_size
        tables = describe_tables(p.tp_embeddings, p.tensor_parallel)
        out.append(f"  tensor parallel {p.tensor_parallel} x FSDP {dp}: {tables}")
    out += [f"  {name:<40} {size(v) if v is not None else 'unknown':>11}" for name, v in rows]
    out.append(f"  {'peak forward / backward / step':<40} "
               f"{size(r.peak_forward_bytes)} / {size(r.peak_backward_bytes)} / "
               f"{size(r.peak_step_bytes)}")
    what = "total (the step peak)" if r.activations_bytes is not None else \
        "total without activations"
    line = f"  {what:<40} {size(r.total_bytes):>11}"
    if p.usable_bytes is not None:
        line += f"  of {size(p.usable_bytes)} usable: {p.verdict}"
        if p.max_batch_size is not None:
            line += f"; largest batch {p.max_batch_size}"
    out.append(line)
    if r.host_bytes:
        out.append(f"  {'host memory (CPU offload)':<40} {size(r.host_bytes):>11}")
    if p.alternatives:
        out.append("  what would fit instead (cheapest change first; total per rank, step):")
        for a in p.alternatives:
            step = secs(a.step_s) if a.step_s is not None else "-"
            out.append(f"    {a.change:<58} {size(a.total_bytes):>11} {step:>9}")
    c = p.comm
    out.append(f"  sent per rank per step: {size(c.sent_bytes)} (all-gather "
               f"{size(c.all_gather_bytes)}, reduce-scatter {size(c.reduce_scatter_bytes)}, "
               f"all-reduce {size(c.all_reduce_bytes)}; intra-node {size(c.intra_node_bytes)}, "
               f"inter-node {size(c.inter_node_bytes)}), received the same")
    t = p.time
    if t is not None:
        out.append(f"  {flop(t.model_flops)} per rank per step; step "
                   f"{secs(t.step_s)} (overlapped {secs(t.step_s_overlap)}, serial "
                   f"{secs(t.step_s_serial)}: compute {secs(t.compute_s)}, communication "
                   f"{secs(t.comm_s)}, local copies {secs(t.copy_s)}, optimizer "
                   f"{secs(t.optimizer_s)})")
        out.append(f"  MFU {100 * t.mfu:.0f}%, {t.tokens_per_s:,.0f} tokens/s for the job")
        out.append(f"  time verdict: {t.verdict}")
    out += [f"  note: {note}" for note in p.notes]
    return out


def describe(p: Plan, label: str | None = None) -> str:
    """`print(plan)`: the headline and the table."""
    return "\n".join([headline(p, label), "", *table(p)])
