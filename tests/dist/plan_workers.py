"""Workers that hold a plan against a real sharded run: bytes held, peak RSS, step time.

RSS is measured carefully: glibc is told to serve every allocation above 64 KiB with mmap
(so freed tensors leave the resident set at once, and RSS follows live bytes instead of
the allocator's arenas), the process warms up (autograd, gloo and attention kernels allocate
once on first use), then the kernel's high-water mark is reset (/proc/self/clear_refs) and
read again after the steps.
"""

from __future__ import annotations

import ctypes
import statistics
import time

import torch

import shardwise as sw
from shardwise.planner import plan
from shardwise.planner.calibrate import calibrate_in_group, clock_of
from shardwise.planner.profiles import cpu_device
from shardwise.train.model import GPT, GPTConfig

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3


def follow_live_bytes(on: bool = True) -> None:
    """on: serve allocations above 64 KiB with mmap, so freed tensors leave RSS at once.
    off: serve them from the heap again (up to glibc's 32 MiB dynamic maximum) and keep
    freed memory, so steps reuse warm pages instead of faulting fresh ones in (timing)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(M_MMAP_THRESHOLD, 64 * 1024 if on else 32 * 2**20)
    libc.mallopt(M_TRIM_THRESHOLD, 128 * 1024 if on else 2**30)


def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_high_water_mark() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def held_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes behind params, grads and optimizer state, each storage counted once."""
    from shardwise.engine.dtensor import local_of
    from shardwise.engine.inspect import sharded_params

    def storages(tensors: list[torch.Tensor]) -> int:
        seen: dict[int, int] = {}
        for t in tensors:
            s = local_of(t).untyped_storage()  # optimizer state of DTensor params: DTensors
            seen[s.data_ptr()] = s.nbytes()
        return sum(seen.values())

    sps = sharded_params(model)
    params = storages([sp.padded_shard for sp in sps])
    grads = storages([sp.shard_grad for sp in sps if sp.shard_grad is not None])
    state = storages([v for s in opt.state.values() for v in s.values()
                      if isinstance(v, torch.Tensor)])
    return {"params": params, "grads": grads, "optimizer": state}


def _build(cfg: GPTConfig, strategy: str, mp: str | None) -> torch.nn.Module:
    with torch.device("meta"):
        model = GPT(cfg)
    sw.shard_model(model, sharding_strategy=strategy, auto_wrap_policy="transformer",
                   mixed_precision=mp)
    sw.materialize(model, seed=0)
    return model


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, idx: torch.Tensor,
          zero: bool = True) -> None:
    loss = model(idx, idx)
    loss.backward()
    opt.step()
    if zero:
        opt.zero_grad()


def _batch(cfg: GPTConfig, rank: int, batch: int, seq: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank)
    return torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)


def states_case(rank: int, world: int, cfg_kw: dict, cases: list[tuple[str, str | None]],
                ranks_per_node: int) -> list[dict]:
    """For each (strategy, precision): bytes held after one optimizer step vs the plan."""
    cfg = GPTConfig(**cfg_kw)
    out = []
    for strategy, mp in cases:
        model = _build(cfg, strategy, mp)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        _step(model, opt, _batch(cfg, rank, 1, 16), zero=False)
        held = held_bytes(model, opt)
        with torch.device("meta"):
            meta = GPT(cfg)
        p = plan(meta, world_size=world, sharding_strategy=strategy, mixed_precision=mp,
                 ranks_per_node=ranks_per_node, rank=rank)
        r = p.per_rank
        out.append({"case": f"{strategy}/{mp}", "rank": rank, "held": held,
                    "planned": {"params": r.params_bytes, "grads": r.grads_bytes,
                                "optimizer": r.optimizer_bytes}})
        del model, opt
    return out


def rss_and_time_case(rank: int, world: int, cfg_kw: dict, batch: int, seq: int,
                      steps: int, rounds: int = 5, clock: str = "cpu") -> dict:
    """Peak RSS growth over `steps` steps vs the planned total, then (rounds > 0) step time
    vs a calibrated plan, on the same model. Timing is for benchmarks/plan_vs_measured.py
    only: a test sets rounds=0."""
    follow_live_bytes(True)  # before anything large is allocated
    cfg = GPTConfig(**cfg_kw)
    with torch.device("meta"):
        meta = GPT(cfg)
    idx = _batch(cfg, rank, batch, seq)
    # Warm-up on a tiny model: first-use allocations (autograd threads, gloo, kernels).
    tiny = GPTConfig(vocab_size=cfg.vocab_size, block_size=16, n_layer=2, n_head=2,
                     d_model=32)
    w = _build(tiny, "FULL_SHARD", None)
    wopt = torch.optim.AdamW(w.parameters())
    for _ in range(2):
        _step(w, wopt, _batch(tiny, rank, 2, 16))
    del w, wopt
    exact = reset_high_water_mark()
    rss0 = status_kib("VmRSS") * 1024
    model = _build(cfg, "FULL_SHARD", None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        _step(model, opt, idx)
    hwm = status_kib("VmHWM") * 1024
    mem_plan = plan(meta, world_size=world, batch_size=batch, seq_len=seq,
                    device=cpu_device(ranks_per_node=world), rank=rank)
    memory = {"rank": rank, "rss_growth": hwm - rss0, "exact_hwm": exact,
              "planned_total": mem_plan.per_rank.total_bytes, "per_rank": mem_plan.per_rank}
    if rounds == 0:
        return memory

    # Calibrate, predict and time one step, back to back, several rounds: on a shared
    # machine the load changes from second to second, so each step is judged against the
    # calibration taken right before it; the median ratio is the verdict. The "cpu" clock
    # counts the process's own CPU time, so other tenants' load does not count as ours.
    follow_live_bytes(False)
    _step(model, opt, idx)  # warm the heap for the timed steps
    d = cfg.d_model
    now = clock_of(clock)
    ratios, rows = [], []
    for _ in range(rounds):
        cal = calibrate_in_group(matmul=(batch * seq, d, 4 * d), repeats=3, clock=clock,
                                 attention=(batch, cfg.n_head, seq, d // cfg.n_head))
        predicted = plan(meta, world_size=world, batch_size=batch, seq_len=seq,
                         device=cal.device(), interconnect=cal.interconnect(), rank=rank).time
        torch.distributed.barrier()
        t0, w0 = now(), time.perf_counter()
        _step(model, opt, idx)
        t = torch.tensor([now() - t0, time.perf_counter() - w0], dtype=torch.float64)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)  # the step's pace
        ratios.append(t[0].item() / predicted.step_s)
        rows.append({"measured_s": t[0].item(), "wall_s": t[1].item(),
                     "predicted_s": predicted.step_s, "compute_s": predicted.compute_s,
                     "comm_s": predicted.comm_s, "gflops": cal.flops["fp32"] / 1e9,
                     "attention": cal.attention_efficiency,
                     "elementwise_gbs": cal.elementwise_bandwidth / 1e9})
    return {**memory, "time_ratio": statistics.median(ratios), "rounds": rows}


# A Llama with grouped-query attention (4 heads, 2 kv heads), a SwiGLU MLP and an untied
# head; sizes that dp 2 splits unevenly after tp 2 (vocab 37, MLP 2 x 3 rows per TP rank...).
LLAMA = {"model_type": "llama", "hidden_size": 24, "intermediate_size": 30,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "vocab_size": 37, "max_position_embeddings": 16, "tie_word_embeddings": False}
LLAMA_TP = {"self_attn.q_proj": "col", "self_attn.k_proj": "col", "self_attn.v_proj": "col",
            "self_attn.o_proj": "row", "mlp.gate_proj": "col", "mlp.up_proj": "col",
            "mlp.down_proj": "row"}


def _tp_gpt(cfg_kw: dict, mesh: object) -> tuple[torch.nn.Module, object]:
    from shardwise.train.tensor_parallel import parallelize_gpt

    cfg = GPTConfig(**cfg_kw)
    torch.manual_seed(0)
    model = GPT(cfg)
    parallelize_gpt(model, mesh["tp"])  # type: ignore[index]
    with torch.device("meta"):
        meta = GPT(cfg)
    return model, meta


def _tp_llama(mesh: object) -> tuple[torch.nn.Module, object]:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in LLAMA.items()
                                            if k != "model_type"}))
    tp_plan = {k: ColwiseParallel() if v == "col" else RowwiseParallel()
               for k, v in LLAMA_TP.items()}
    for layer in model.model.layers:
        parallelize_module(layer, mesh["tp"], tp_plan)  # type: ignore[index]
    return model, dict(LLAMA)  # planned from the config alone


def tp_states_case(rank: int, world: int, tp: int, gpt_kw: dict) -> list[dict]:
    """dp x tp: bytes held after an optimizer step vs `sw.plan(..., tensor_parallel=tp)`,
    for our GPT (the trainer's TP plan) and a Hugging Face Llama (GQA, SwiGLU, untied
    head; PyTorch's Colwise/RowwiseParallel) planned from its config.json alone."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
    out = []
    for name, build in (("gpt", lambda: _tp_gpt(gpt_kw, mesh)),
                        ("llama", lambda: _tp_llama(mesh))):
        model, what = build()
        blocks = model.blocks if name == "gpt" else model.model.layers  # type: ignore[union-attr]
        for b in blocks:
            sw.fully_shard(b, mesh=mesh["dp"])
        sw.fully_shard(model, mesh=mesh["dp"])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        idx = torch.randint(0, 37, (1, 8), generator=torch.Generator().manual_seed(0))
        if name == "gpt":
            loss = model(idx, idx)
        else:
            loss = model(input_ids=idx, labels=idx).loss
        loss.backward()
        opt.step()
        held = held_bytes(model, opt)
        r = plan(what, world_size=world, tensor_parallel=tp, rank=rank).per_rank
        out.append({"case": f"{name} dp{world // tp} x tp{tp}", "rank": rank, "held": held,
                    "planned": {"params": r.params_bytes, "grads": r.grads_bytes,
                                "optimizer": r.optimizer_bytes}})
        del model, opt
    return out
