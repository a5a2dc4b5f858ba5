"""Workers that hold a plan against a real sharded run: bytes held, peak RSS, step time.

RSS is measured carefully: glibc is told to serve every allocation above 64 KiB with mmap
(so freed tensors leave the resident set at once, and RSS follows live bytes instead of
the allocator's arenas), the process warms up (autograd, gloo and attention kernels allocate
once on first use), then the kernel's high-water mark is reset (/proc/self/clear_refs) and
read again after the steps.
"""

from __future__ import annotations

import ctypes
import os
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


def storages(tensors: list[torch.Tensor]) -> int:
    """Bytes of the storages behind `tensors`, each counted once."""
    from shardwise.engine.core.dtensor import local_of

    seen: dict[int, int] = {}
    for t in tensors:
        s = local_of(t).untyped_storage()  # optimizer state of DTensor params: DTensors
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def held_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes behind params, grads and optimizer state, each storage counted once."""
    from shardwise.engine.core.context import sharded_params

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


def copies_case(rank: int, world: int, cfg_kw: dict,
                cases: list[tuple[str, str | None]]) -> list[dict]:
    """For each (strategy, precision): bytes the engine copied locally in one training step
    (`Unit.copied`, summed over units) beside the planner's rule ([Note: local copies])."""
    from shardwise.engine.core.context import context_of
    from shardwise.engine.core.policies import MixedPrecisionPolicy
    from shardwise.planner.copies import step_copies, transport_of
    from shardwise.planner.memory import unit_cost
    from shardwise.planner.units import units_of_model

    cfg = GPTConfig(**cfg_kw)
    with torch.device("meta"):
        meta = GPT(cfg)
    out = []
    for strategy, mp in cases:
        model = _build(cfg, strategy, mp)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ctx = context_of(model)
        assert ctx is not None

        def copied() -> dict[str, int]:
            total: dict[str, int] = {}
            for u in ctx.units:  # noqa: B023 - called within this iteration
                for k, v in u.copied.items():
                    total[k] = total.get(k, 0) + v
            return total

        _step(model, opt, _batch(cfg, rank, 2, 16))  # the first step records the order
        before = copied()
        _step(model, opt, _batch(cfg, rank, 2, 16))
        engine = {k: v - before[k] for k, v in copied().items()}
        mu = units_of_model(meta, "transformer", None)
        costs = [unit_cost(u, world, rank, MixedPrecisionPolicy.parse(mp), False, False)
                 for u in mu.units]
        planned = step_copies(costs, shard_size=world, replicate_size=1,
                              transport=transport_of(world, True),
                              reshard_after_forward=strategy == "FULL_SHARD")
        out.append({"case": f"{strategy}/{mp}", "rank": rank, "engine": engine,
                    "planned": planned})
        del model, opt
    return out


def rss_case(rank: int, world: int, cfg_kw: dict, batch: int, seq: int,
             steps: int) -> dict:
    """Peak RSS growth over `steps` steps vs the planned total."""
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
    return {"rank": rank, "rss_growth": hwm - rss0, "exact_hwm": exact,
            "planned_total": mem_plan.per_rank.total_bytes, "per_rank": mem_plan.per_rank}


def _host_busy_s() -> float:
    """CPU-seconds every tenant of the machine has run since boot (/proc/stat)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:9]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # less idle, iowait


def step_time_case(rank: int, world: int, cfg_kw: dict, batch: int, seq: int,
                   steps: int = 5, threads: int = 1, clock: str = "cpu") -> dict:
    """One round of benchmarks/plan_vs_measured.py: calibrate this machine (every rank at
    once, `clock`), plan the step, then time `steps` steps of the FULL_SHARD fp32 GPT.

    `threads`: torch intra-op threads per rank (0: as `shardwise train` sets them, cores //
    ranks). Each step's figures are the slowest rank's: wall seconds, and CPU seconds of
    the process (all threads).
    `others_cores`: cores the machine's other tenants used meanwhile (every tenant's CPU
    time from /proc/stat, less ours): a round they took cores from is polluted in wall
    time."""
    from shardwise.planner.calibrate import _cores
    from shardwise.planner.shape import shape_of_model
    from shardwise.planner.units import units_of_model

    threads = threads or max(1, _cores() // world)
    torch.set_num_threads(threads)
    follow_live_bytes(False)  # steps reuse warm pages, as training does
    cfg = GPTConfig(**cfg_kw)
    with torch.device("meta"):
        meta = GPT(cfg)
    model = _build(cfg, "FULL_SHARD", None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx = _batch(cfg, rank, batch, seq)
    for _ in range(2):  # the first step records the order, the second warms the heap
        _step(model, opt, idx)
    d, heads = cfg.d_model, cfg.n_head
    params = list(meta.parameters())
    mu = units_of_model(meta, "transformer", None).units
    units = [4 * u.numel for u in mu]
    load = os.getloadavg()[0]
    cal = calibrate_in_group(matmul=(batch * seq, d, 4 * d), repeats=3, clock=clock,
                             attention=(batch, heads, seq, d // heads),
                             block=shape_of_model(meta),
                             optimizer=(sum(p.numel() for p in params) // world, len(params)),
                             collective_sizes=(min(units), max(units)),
                             units=(len(mu), round(len(params) / len(mu))))
    dev = cal.device()
    t = plan(meta, world_size=world, batch_size=batch, seq_len=seq, device=dev,
             interconnect=cal.interconnect(), rank=rank).time
    assert t is not None
    now = clock_of(clock)
    rows = []
    torch.distributed.barrier()
    busy0, mine0, wall0 = _host_busy_s(), time.process_time(), time.perf_counter()
    for _ in range(steps):
        w0, c0 = time.perf_counter(), now()
        _step(model, opt, idx)
        x = torch.tensor([time.perf_counter() - w0, now() - c0], dtype=torch.float64)
        torch.distributed.all_reduce(x, op=torch.distributed.ReduceOp.MAX)  # the step's pace
        rows.append(x.tolist())
    span = time.perf_counter() - wall0
    mine = torch.tensor([time.process_time() - mine0], dtype=torch.float64)
    torch.distributed.all_reduce(mine)
    others = (_host_busy_s() - busy0 - mine.item()) / span
    k = dev.seconds_scale
    return {
        "rank": rank, "world": world, "threads": threads, "load": load,
        "others_cores": others, "wall_s": statistics.median(r[0] for r in rows),
        "cpu_s": statistics.median(r[1] for r in rows), "steps": rows,
        # The CPU the step uses is its work (the serial sum); the wall step adds the waits.
        "predicted_s": t.step_s, "predicted_cpu_s": t.step_s_serial / k, "seconds_scale": k,
        "parts_cpu_s": {"compute": t.compute_s / k, "comm": t.comm_s / k,
                        "copies": t.copy_s / k, "optimizer": t.optimizer_s / k},
        "calibration": cal.to_dict(),
    }


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
        # Both runs keep the embedding and head whole on every TP rank.
        r = plan(what, world_size=world, tensor_parallel=tp, rank=rank,
                 tp_embeddings="replicate").per_rank
        out.append({"case": f"{name} dp{world // tp} x tp{tp}", "rank": rank, "held": held,
                    "planned": {"params": r.params_bytes, "grads": r.grads_bytes,
                                "optimizer": r.optimizer_bytes}})
        del model, opt
    return out


def finetune_case(rank: int, world: int, folder: str, options: dict[str, str], batch: int,
                  seq: int, steps: int) -> dict:
    """A fine-tune of the Hugging Face model in `folder` built as `shardwise train
    --model.hf folder <options>` builds it (build_hf on the run's Config: LoRA, NF4 base)
    with the trainer's AdamW, `steps` steps of its loss on random tokens (batch x seq per
    rank), gradients clipped as the trainer does. Returns the bytes held after the last
    backward and step (params: an NF4 shard's inner tensors as torchao stores them; grads;
    optimizer state), and the peak RSS growth over building and the steps, against RSS
    before building (after a warm-up run of the same configuration, so that first-use
    allocations of gloo, autograd, torchao and transformers are behind it). The high-water
    mark is reset after loading: reading the checkpoint maps its file, which is not a step's
    memory (`rss_after_load` keeps what loading left)."""
    from shardwise.engine.core.context import sharded_params
    from shardwise.train import options as O
    from shardwise.train.hf_model import build_hf, loss_sum
    from shardwise.train.metrics import stored_bytes
    from shardwise.train.trainer import _optimizer

    follow_live_bytes(True)
    cfg = O.build({"model.hf": folder, "data.path": folder, **options})
    vocab = 0

    def run(n: int) -> dict[str, int]:
        nonlocal vocab
        model = build_hf(cfg)
        vocab = model.get_input_embeddings().num_embeddings
        opt = _optimizer(model, cfg.train)
        after_load = status_kib("VmRSS") * 1024
        reset_high_water_mark()
        g = torch.Generator().manual_seed(rank)
        held: dict[str, int] = {}
        for i in range(n):
            x = torch.randint(0, vocab, (batch, seq + 1), generator=g)
            loss_sum(model, x[:, :-1], x[:, 1:])[0].backward()
            sw.clip_grad_norm_(model, 1.0)
            opt.step()
            if i == n - 1:
                sps = sharded_params(model)
                held = {  # an NF4 shard: its inner tensors; the rest: their storages
                    "params": sum(stored_bytes(sp.padded_shard) for sp in sps),
                    "grads": storages([sp.shard_grad for sp in sps
                                       if sp.shard_grad is not None]),
                    "optimizer": storages([v for s in opt.state.values() for v in s.values()
                                           if isinstance(v, torch.Tensor)]),
                    "frozen": sum(stored_bytes(sp.padded_shard) for sp in sps
                                  if not sp.requires_grad)}
            opt.zero_grad(set_to_none=True)
        held["after_load"] = after_load
        del model, opt
        return held

    run(1)  # warm-up
    exact = reset_high_water_mark()
    rss0 = status_kib("VmRSS") * 1024
    held = run(steps)
    hwm = status_kib("VmHWM") * 1024
    return {"rank": rank, "held": {k: v for k, v in held.items() if k != "after_load"},
            "rss_after_load": held["after_load"] - rss0, "rss_growth": hwm - rss0,
            "exact_hwm": exact}
