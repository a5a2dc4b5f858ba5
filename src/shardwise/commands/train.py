"""`shardwise train`: a real sharded training run from one command.

`--nproc N` starts PyTorch's own elastic launcher in-process (torchrun --standalone); under
an existing torchrun (single- or multi-node) the command just runs on its rank. The console
(progress bar, validation lines, summary) is printed by rank 0 only.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

from ..train import config as C
from ..train import options as O
from ..train import rundir


def load_config(argv: list[str]) -> C.Config:
    """Defaults < (on --resume: the run's saved config.toml) < --config FILE < the command line."""
    values, config_path = O.parse_argv(argv)
    file_values = O.read_toml(config_path) if config_path else {}
    merged = {**file_values, **values}
    cfg = rundir.resolve_name(O.build(merged))
    if cfg.resume:
        saved_path = Path(cfg.out_dir).expanduser() / cfg.name / "config.toml"
        saved = O.read_toml(saved_path) if saved_path.exists() else {}
        # Actions and placement belong to this invocation, not to the saved run.
        for k in ("name", "out_dir", "resume", "overwrite", "nproc", "threads", "trace",
                  "max_restarts"):
            saved.pop(k, None)
        cfg = O.build({**saved, **merged, "name": cfg.name})
    return cfg


def _mem(values: list[float]) -> str:
    return "/".join(f"{v:.0f}" if v >= 100 else f"{v:.1f}" for v in values) + " MB"


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024
    return f"{n:.1f} GB"


class ConsoleReporter:
    """Rank 0's console: a header, a tqdm bar, validation lines and the end summary."""

    def __init__(self) -> None:
        self.bar: tqdm | None = None
        self.tok_s = math.nan
        # Not a terminal (a log file, CI): plain lines, about 20 per run, instead of a bar
        # whose carriage returns would pile up in the file.
        self.plain_every = 0

    def start(self, info: dict[str, Any]) -> None:
        cfg: C.Config = info["config"]
        g = cfg.model.gpt()
        s = cfg.shard
        print(f"shardwise train: GPT '{cfg.model.preset}' ({info['params'] / 1e6:.2f}M params, "
              f"{g.n_layer} layers, d={g.d_model}, context {g.block_size}) on {info['world']} "
              f"ranks ({info['device']}, {info['threads']} threads/rank)")
        print(f"  {s.sharding_strategy}, wrap={s.auto_wrap_policy}, precision={s.mixed_precision}"
              f", cpu_offload={s.cpu_offload}; each rank holds {info['local_params']:,} of "
              f"{info['params']:,} parameters")
        if "precision_plan" in info:
            print(f"  {info['precision_plan']}")
        data = cfg.data.path or "the Python standard library's .py sources"
        print(f"  data: {data}: {info['train_bytes']:,} train / {info['val_bytes']:,} val bytes; "
              f"{info['tokens_per_step']:,} tokens per step")
        if info["start_step"]:
            print(f"  resumed at step {info['start_step']}")
        print(f"  run folder: {info['run_dir']}")
        if sys.stdout.isatty():
            self.bar = tqdm(total=info["steps"], initial=info["start_step"], desc="train",
                            dynamic_ncols=True, file=sys.stdout, mininterval=0.5)
        else:
            self.plain_every = max(1, (info["steps"] - info["start_step"]) // 20)

    def step(self, record: dict[str, Any]) -> None:
        # A smoothed rate: single steps on a shared CPU are noisy.
        r = record["tokens_per_s"]
        self.tok_s = r if math.isnan(self.tok_s) else 0.8 * self.tok_s + 0.2 * r
        line = (f"loss {record['loss']:.3f} | {self.tok_s:,.0f} tok/s | "
                f"mem {_mem(record['memory_mb'])}")
        if self.bar is not None:
            self.bar.set_postfix_str(line, refresh=False)
            self.bar.update(1)
        elif record["step"] % self.plain_every == 0:
            print(f"step {record['step']:>5} | {line}", flush=True)
        if record.get("nonfinite"):
            tqdm.write(f"step {record['step']:>5}: non-finite loss or grad norm; step skipped "
                       f"({record['nonfinite_skipped']} so far)", file=sys.stdout)

    def eval(self, step: int, val_loss: float) -> None:
        tqdm.write(f"step {step:>5}: val loss {val_loss:.4f}", file=sys.stdout)

    def checkpoint(self, step: int, path: str) -> None:
        pass  # the summary names the folder; one line per checkpoint would crowd the bar

    def end(self, s: dict[str, Any]) -> None:
        if self.bar is not None:
            self.bar.close()
        unsharded = [p - st + s["unsharded_state_mb"]
                     for p, st in zip(s["peak_memory_mb"], s["state_mb"])]
        print(f"\ndone: step {s['steps']} ({s['steps'] - s['start_step']} steps in "
              f"{s['wall_s']:.0f} s on {s['world']} ranks)")
        print(f"  final train loss {s['final_loss']:.4f} (mean of last 10: "
              f"{s['final_loss_avg10']:.4f}), val loss {s['final_val_loss']:.4f}")
        print(f"  throughput       {s['tokens_per_s']:,.0f} tokens/s (all ranks)")
        kind = "GPU allocated" if s["device"] == "cuda" else "RSS"
        print(f"  peak memory      {_mem(s['peak_memory_mb'])} per rank ({kind}); "
              f"unsharded about {_mem(unsharded)}")
        print(f"  training state   {_mem(s['state_mb'])} per rank (params+grads+AdamW, fp32); "
              f"unsharded {s['unsharded_state_mb']:.1f} MB")
        parts = ", ".join(f"{k.replace('_', '-')} {_bytes(v)}"
                          for k, v in sorted(s["bytes_per_step_rank0"].items()))
        print(f"  communication    {' / '.join(_bytes(b) for b in s['bytes_per_step'])} "
              f"per step per rank (rank 0: {parts or 'none'}; from the engine's events)")
        print(f"  run folder       {s['run_dir']}")
        if s.get("nonfinite_skipped"):
            print(f"  skipped steps    {s['nonfinite_skipped']} (non-finite loss or grad norm)")
        if s.get("trace"):
            _print_trace(s["trace"])
        if s["sample"]:
            print("\nsample:\n" + s["sample"].rstrip() + "\n")


def _print_trace(tr: dict[str, Any]) -> None:
    from ..observe.overlap import OverlapReport

    report = OverlapReport.from_dict(tr["report"])
    print("\noverlap (mean over ranks; exposed = time blocked waiting for communication):")
    print("  " + report.table().replace("\n", "\n  "))
    print(f"  trace: {tr['merged']} (open in https://ui.perfetto.dev); per rank and "
          f"overlap.json in {tr['dir']}")


def worker(cfg: C.Config) -> dict[str, Any]:
    """One rank's whole job (module-level: the launcher pickles it)."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from ..train.guard import EXIT_NONFINITE, NonFiniteError
    from ..train.trainer import run

    try:
        return run(cfg, ConsoleReporter())
    except NonFiniteError as e:
        # Raised on every rank alike: a clean end with an exit status, not a traceback per
        # rank (and, with --nproc, not a restart that would only diverge again).
        import torch.distributed as dist

        if dist.get_rank() == 0:
            print(f"shardwise train: error: {e}", file=sys.stderr, flush=True)
        return {"error": str(e), "exit_code": EXIT_NONFINITE}


def default_nproc() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(O.help_text())
        return 0
    from ..launch import launch, under_torchrun

    if under_torchrun():
        return _under_torchrun(argv)
    try:
        cfg = load_config(argv)
    except ValueError as e:
        print(f"shardwise train: error: {e}", file=sys.stderr)
        return 2
    results = launch(worker, cfg.nproc or default_nproc(), cfg, max_restarts=cfg.max_restarts)
    return max(r.get("exit_code", 0) if isinstance(r, dict) else 0 for r in results)


def _config_from_dict(d: dict[str, Any]) -> C.Config:
    """Rebuild the Config that rank 0 resolved (sent as JSON: nothing pickles between ranks)."""
    sections = {f.name: f.type for f in dataclasses.fields(C.Config) if f.name in C.SECTIONS}
    classes = {name: getattr(C, f"{name.capitalize()}Section") for name in sections}
    return C.Config(**{k: (classes[k](**v) if k in classes else v) for k, v in d.items()})


def _under_torchrun(argv: list[str]) -> int:
    """Rank 0 resolves the config (and the run folder's name); every rank gets its answer.

    Resolving on every rank would race: rank 0 creates the folder that another rank's
    "never overwrite" check then finds.
    """
    import shardwise as sw
    from shardwise.engine import collectives

    rank, _, _ = sw.init_distributed()
    answer: dict[str, Any] = {}
    if rank == 0:
        try:
            answer = {"config": dataclasses.asdict(load_config(argv))}
        except ValueError as e:
            answer = {"error": str(e)}
    answer = collectives.broadcast_json(answer, src=0)
    if "error" in answer:
        if rank == 0:
            print(f"shardwise train: error: {answer['error']}", file=sys.stderr)
        collectives.finish()
        return 2
    result = worker(_config_from_dict(answer["config"]))
    collectives.finish()
    return int(result.get("exit_code", 0))
