"""The console of `shardwise train` (rank 0 only): a header, progress, validation lines and
the end summary. Library code hands it records (train/trainer.py's `Reporter`); only this
file prints them.
"""

from __future__ import annotations

import math
import sys
import threading
from typing import Any

from tqdm import tqdm

from ..train import config as C

MiB = 2**20


def _mem(values: list[float]) -> str:
    return "/".join(f"{v:.0f}" if v >= 100 else f"{v:.1f}" for v in values) + " MiB"


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.2f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024
    return f"{n:.2f} GiB"


def _clock(s: float) -> str:
    s = max(0, int(round(s)))
    h, rest = divmod(s, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


class ConsoleReporter:
    """Rank 0's console: a header, a tqdm bar, validation lines and the end summary."""

    def __init__(self) -> None:
        # tqdm's default lock is a multiprocessing semaphore: a worker stopped by SIGTERM
        # never frees it and the resource tracker warns about a leak. One process, one
        # thread writing: a thread lock is enough.
        tqdm.set_lock(threading.RLock())
        self.bar: tqdm | None = None
        self.tok_s = math.nan
        self.start_step = 0
        self.steps = 0
        # Not a terminal (a log file, CI): plain lines, about 20 per run, instead of a bar
        # whose carriage returns would pile up in the file.
        self.plain_every = 0
        self.tp = 1
        self.world = 1
        self.mfu: dict[str, Any] | None = None  # start's FLOPs and peak, when known

    def start(self, info: dict[str, Any]) -> None:
        cfg: C.Config = info["config"]
        s = cfg.shard
        tp, world = cfg.parallel.tp, info["world"]
        two_d = f", tp={tp} (dp={world // tp})" if tp > 1 else ""
        where = f"on {info['world']} ranks ({info['device']}, {info['threads']} threads/rank)"
        if cfg.model.hf:
            print(f"shardwise train: {cfg.model.hf} ({info['params'] / 1e6:.2f}M params, "
                  f"context {cfg.model.seq_len()}, {cfg.model.dtype}) {where}")
            if cfg.lora.rank:
                lo = cfg.lora
                print(f"  {'QLoRA' if cfg.model.quantize else 'LoRA'} rank {lo.rank}, alpha "
                      f"{lo.scale():g}, targets {lo.targets or 'peft default'}: "
                      f"{info['trainable']:,} trainable parameters; only they are checkpointed")
                if cfg.model.quantize:
                    print(f"  base linear weights (all but lm_head) in {cfg.model.quantize.upper()}"
                          f", quantized from {cfg.model.dtype} as each rank loads its rows")
        else:
            g = cfg.model.gpt()
            print(f"shardwise train: GPT '{cfg.model.preset}' ({info['params'] / 1e6:.2f}M "
                  f"params, {g.n_layer} layers, d={g.d_model}, context {g.block_size}) {where}")
        if "topology" in info:
            print(f"  {_topology(info['topology'])}")
        print(f"  {s.sharding_strategy}, wrap={s.auto_wrap_policy}, precision={s.mixed_precision}"
              f", cpu_offload={s.cpu_offload}{two_d}; each rank holds {info['local_params']:,} of "
              f"{info['params']:,} parameters")
        if "precision_plan" in info:
            print(f"  {info['precision_plan']}")
        data = cfg.data.path or "the Python standard library's .py sources"
        unit = "tokens" if cfg.model.hf else "bytes"
        print(f"  data: {data}: {info['train_bytes']:,} train / {info['val_bytes']:,} val "
              f"{unit}; {info['tokens_per_step']:,} tokens per step")
        if info.get("eval"):
            print(f"  evaluation: {info['eval']}")
        for line in info.get("moved_aside", []):
            print(f"  set aside in checkpoints/: {line} (a save would have tripped over it)")
        if info["start_step"]:
            saved, now = info.get("saved_tokens_per_step"), info["tokens_per_step"]
            change = (f"; tokens per step change from {saved:,} to {now:,} (another "
                      "data-parallel size: each step reads a different global batch, and the "
                      "schedule still counts steps)") if saved and saved != now else ""
            print(f"  resumed at step {info['start_step']}{change}")
        if info.get("restart"):
            print(f"  restart {info['restart']} of the workers (after a failure), from the "
                  "latest checkpoint")
        print(f"  run folder: {info['run_dir']}")
        self.start_step, self.steps = info["start_step"], info["steps"]
        self.world, self.mfu = info["world"], info if info.get("flops_per_token") else None
        self.tp = tp
        if sys.stdout.isatty():
            self.bar = tqdm(total=info["steps"], initial=info["start_step"], desc="train",
                            dynamic_ncols=True, file=sys.stdout, mininterval=0.5)
        else:
            self.plain_every = max(1, (info["steps"] - info["start_step"]) // 20)

    def step(self, record: dict[str, Any]) -> None:
        # A smoothed rate: single steps on a shared CPU are noisy. The first step pays for
        # lazy initialization (the summary leaves it out): shown alone, it must not seed the
        # average, which it dragged to 0.65x the summary's rate over a 4-step run.
        r = record["tokens_per_s"]
        fresh = math.isnan(self.tok_s) or record["step"] == self.start_step + 2
        self.tok_s = r if fresh else 0.8 * self.tok_s + 0.2 * r
        line = (f"loss {record['loss']:.3f} | lr {record['lr']:.2e} | gnorm "
                f"{record['grad_norm']:.3g} | {self.tok_s:,.0f} tok/s | "
                f"mem {_mem(record['memory_mb'])}")
        if "mfu_pct" in record:
            line += f" | mfu {record['mfu_pct']:.1f}%"
        if self.bar is not None:
            self.bar.set_postfix_str(line, refresh=False)  # the bar shows elapsed and ETA
            self.bar.update(1)
        elif record["step"] % self.plain_every == 0 or record["step"] == self.steps:
            done = record["step"] - self.start_step
            elapsed = record.get("time_s", 0.0)
            eta = elapsed / done * (self.steps - record["step"]) if done else 0.0
            print(f"step {record['step']:>5}/{self.steps} | {line} | {_clock(elapsed)} "
                  f"elapsed, ETA {_clock(eta)}", flush=True)
        if record.get("nonfinite"):
            tqdm.write(f"step {record['step']:>5}: non-finite loss or grad norm; step skipped "
                       f"({record['nonfinite_skipped']} so far)", file=sys.stdout)

    def eval(self, step: int, val_loss: float,
             metrics: dict[str, float] | None = None) -> None:
        m = metrics or {}
        more = "".join(f" | {label} {m[k]:{fmt}}" for k, label, fmt in (
            ("val_perplexity", "perplexity", ".4g"), ("val_accuracy", "token accuracy", ".2%"))
            if k in m)
        tqdm.write(f"step {step:>5}: val loss {val_loss:.4f}{more}", file=sys.stdout)

    def checkpoint(self, step: int, path: str) -> None:
        pass  # the summary names the folder; one line per checkpoint would crowd the bar

    def end(self, s: dict[str, Any]) -> None:
        if self.bar is not None:
            self.bar.close()
        unsharded = [p - st + s["unsharded_state_mb"]
                     for p, st in zip(s["peak_memory_mb"], s["state_mb"])]
        seen = s.get("epochs")
        epochs = f", {seen:.2f} epochs of the training data" if seen is not None else ""
        print(f"\ndone: step {s['steps']} ({s['steps'] - s['start_step']} steps in "
              f"{s['wall_s']:.0f} s on {s['world']} ranks{epochs})")
        print(f"  final train loss {s['final_loss']:.4f} (mean of last 10: "
              f"{s['final_loss_avg10']:.4f}), val loss {s['final_val_loss']:.4f}")
        if s.get("best"):
            print(f"  best val loss    {s['best']['val_loss']:.4f} at step {s['best']['step']} "
                  "(weights in checkpoints/best)")
        if math.isnan(s["tokens_per_s"]):
            print("  throughput       not measured: the first step of a run pays for "
                  "initialization and is not timed (run 2 or more steps)")
        else:
            print(f"  throughput       {s['tokens_per_s']:,.0f} tokens/s (all ranks)")
            if self.mfu:
                print(f"  {_mfu_line(self.mfu, s['tokens_per_s'], self.world)}")
        kind = "GPU allocated" if s["device"] == "cuda" else "RSS"
        print(f"  peak memory      {_mem(s['peak_memory_mb'])} per rank ({kind}, training); "
              f"unsharded about {_mem(unsharded)}")
        sampled = s.get("sample_peak_memory_mb") or []
        if any(after > 1.05 * before for after, before in zip(sampled, s["peak_memory_mb"])):
            print(f"  sampling peak    {_mem(sampled)} per rank (generating the sample after "
                  "training)")
        print(f"  training state   {_mem(s['state_mb'])} per rank (params; grads+AdamW of the "
              f"trainable ones); "
              f"unsharded {s['unsharded_state_mb']:.1f} MiB")
        parts = ", ".join(f"{k.replace('_', '-')} {_bytes(v)}"
                          for k, v in sorted(s["bytes_per_step_rank0"].items()))
        print(f"  communication    {' / '.join(_bytes(b) for b in s['bytes_per_step'])} "
              f"sent per step per rank, received alike (rank 0: {parts or 'none'}; from the "
              "engine's events, ring collectives)")
        if self.tp > 1:
            # TP's activation all-reduces run in torch's parallel styles, outside the engine:
            # at dp 1 the line above read "0 B" for a run that communicates in every block.
            print(f"                   FSDP's collectives only: tensor parallelism's (tp="
                  f"{self.tp}) are not counted")
        print(f"  run folder       {s['run_dir']}")
        if s.get("nonfinite_skipped"):
            print(f"  skipped steps    {s['nonfinite_skipped']} (non-finite loss or grad norm)")
        if s.get("trace"):
            _print_trace(s["trace"])
        if s["sample"]:
            print("\nsample:\n" + s["sample"].rstrip() + "\n")


def _topology(t: dict[str, Any]) -> str:
    nodes = (f"{t['nodes']} node{'s' if t['nodes'] != 1 else ''} x {t['ranks_per_node']} "
             "ranks" if t["nodes"] else f"{t['world']} ranks (uneven over nodes)")
    return f"topology: {nodes} (launched by {t['launcher']}); mesh {t['mesh']}"


def _mfu_line(info: dict[str, Any], tokens_per_s: float, world: int) -> str:
    """MFU over the timed steps: model FLOPs per token x tokens/s per device / peak."""
    achieved = info["flops_per_token"] * tokens_per_s / world / 1e12
    return (f"MFU              {100 * achieved / info['peak_tflops']:.1f}% ({achieved:.3g} of "
            f"{info['peak_tflops']:.3g} TFLOP/s per device; peak: {info['peak_source']}; "
            f"{info['flops_per_token'] / 1e6:.3g} MFLOPs per token)")


def _print_trace(tr: dict[str, Any]) -> None:
    from ..observe.overlap import OverlapReport

    report = OverlapReport.from_dict(tr["report"])
    print("\noverlap (mean over ranks; exposed = time blocked waiting for communication):")
    print("  " + report.table().replace("\n", "\n  "))
    print(f"  trace: {tr['merged']} (open in https://ui.perfetto.dev); per rank and "
          f"overlap.json in {tr['dir']}")
