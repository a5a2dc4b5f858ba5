"""The sections of `shardwise train`'s configuration about what a run keeps and reports:
LoRA adapters, checkpoints, logs (config.py holds the rest and the whole `Config`; the same
conventions: every field documented as `name: text`, validated in `__post_init__`)."""

from __future__ import annotations

from dataclasses import dataclass

from .validate import check as _check
from .validate import positive as _positive
from .validate import typed as _typed


@dataclass
class LoraSection:
    """LoRA adapters (peft) on a model.hf: only the adapters train and are checkpointed.

    rank: the adapters' rank r (0: no LoRA, train every weight).
    alpha: the adapters' scale numerator: the update is (alpha / rank) * B @ A (0: 2 * rank).
    targets: comma-separated names of the linear layers to adapt, e.g. q_proj,v_proj
        ("": peft's default for the architecture).
    dropout: dropout on the adapters' input.
    """

    rank: int = 0
    alpha: float = 0.0
    targets: str = ""
    dropout: float = 0.0

    def __post_init__(self) -> None:
        _typed("lora", self)
        _positive("lora", self, "rank", "alpha", zero_ok=True)
        _check(0.0 <= self.dropout < 1.0, f"lora.dropout={self.dropout!r} must be in [0, 1)")
        names = [t.strip() for t in self.targets.split(",")] if self.targets else []
        bad = [t for t in names if not t or not all(p.isidentifier() for p in t.split("."))]
        _check(not bad, f"lora.targets={self.targets!r} is not allowed: give comma-separated "
               "module names such as q_proj,v_proj")

    def target_list(self) -> list[str] | None:
        return [t.strip() for t in self.targets.split(",")] if self.targets else None

    def scale(self) -> float:
        return self.alpha or 2.0 * self.rank


@dataclass
class CheckpointSection:
    """Sharded checkpoints in the run folder.

    interval: steps between checkpoints (0: only at the end).
    keep: how many of the latest checkpoints to keep.
    best: also keep the weights with the lowest validation loss so far in
        checkpoints/best (replaced only by a better one, never pruned).
    stop_signal: a signal that, like SIGTERM, makes the run finish the step in progress on
        every rank, write a checkpoint and exit: SIGUSR1, SIGUSR2, SIGHUP or SIGALRM, for
        `sbatch --signal=USR1@120` ("": SIGTERM alone; docs/launching.md).
    """

    interval: int = 250
    keep: int = 2
    best: bool = True
    stop_signal: str = ""

    def __post_init__(self) -> None:
        from .preempt import STOP_SIGNALS, signal_name

        _typed("checkpoint", self)
        _positive("checkpoint", self, "interval", zero_ok=True)
        _positive("checkpoint", self, "keep")
        name = signal_name(self.stop_signal)
        _check(name in ("", *STOP_SIGNALS), f"checkpoint.stop_signal={self.stop_signal!r} is "
               f"not one of: {', '.join(STOP_SIGNALS)} (or \"\" for SIGTERM alone)")
        self.stop_signal = name


@dataclass
class LogSection:
    """What the run records besides metrics.jsonl.

    event_steps: record the engine's events (events-rank{r}.jsonl) for the first this many
        steps (-1: all, 0: none).
    sample_tokens: bytes of text to sample from the trained model at the end (0: none).
    sample_prompt: the text the sample starts from ("": with model.hf, the start of the
        validation split).
    trace_steps: with --trace: how many steps to trace (traces grow with every step).
    trace_after: with --trace: steps to run before tracing starts (the first step pays for
        lazy initialization and records the prefetch order).
    to: more metric sinks, comma-separated: tensorboard, wandb (offline), mlflow (a local
        file store), csv; each writes into the run folder (docs/training.md).
    peak_tflops: one device's peak TFLOP/s for MFU (0: a GPU's datasheet figure, else a
        matmul measured at start-up).
    """

    event_steps: int = 5
    sample_tokens: int = 300
    sample_prompt: str = "def "
    trace_steps: int = 3
    trace_after: int = 1
    to: str = ""
    peak_tflops: float = 0.0

    def __post_init__(self) -> None:
        _typed("log", self)
        from ..observe.metric_sinks import parse_sinks

        parse_sinks(self.to)  # an unknown or uninstalled sink fails here, before launch
        _positive("log", self, "peak_tflops", zero_ok=True)
        _check(self.event_steps >= -1, f"log.event_steps={self.event_steps!r} must be >= -1")
        _positive("log", self, "sample_tokens", zero_ok=True)
        _positive("log", self, "trace_steps")
        _positive("log", self, "trace_after", zero_ok=True)
