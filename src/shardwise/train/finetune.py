"""What changes when `shardwise train` fine-tunes a Hugging Face model (`--model.hf`): the
defaults of the optimization, and how long a run is (steps or epochs).

[Note: fine-tuning defaults] The dataclass defaults in config.py suit pretraining the
built-in GPT from scratch (lr 3e-3, weight decay 0.1, beta2 0.95, 1000 steps). A pretrained
model needs far smaller steps: measured on a tiny Llama, validation loss 4.75 at lr 3e-3
against 4.62 at 3e-4. So a `--model.hf` run takes these defaults for every key the user did
not give (command line, --config file, or a resumed run's saved config.toml):

- train.lr 2e-5 for full fine-tuning (torchtune's and Llama recipes' full fine-tune rate;
  HF Trainer uses 5e-5), 2e-4 with LoRA (peft/QLoRA recipes: the adapters start at zero
  and only they move, so they take a 10x larger step);
- train.weight_decay 0: decay pulls pretrained weights toward zero, not toward where they
  were (HF Trainer's default is 0 too);
- train.beta2 0.999: AdamW's usual value (0.95 steadies the long pretraining runs);
- train.warmup_ratio 0.03: a warm-up of 3% of the run, whatever its length;
- train.epochs 1 (train.steps unset): one pass over the training split; a fine-tuning set
  is small and more passes start to memorize it. Raise it for very small sets;
- log.sample_prompt "": the sample at the end continues the start of the validation split
  (the toy GPT's `def ` means nothing to a chat model);
- train.eval_batches 0: each evaluation covers the whole eval set, every token once (a
  fine-tune's eval file is what its loss is judged on; the built-in GPT samples 8 batches
  per rank of its large held-out split).

An explicit value always wins. Giving train.steps drops the epochs default.

[Note: run length] `train.steps` is the run's total, counted from its first step: a
`--resume` with the same value continues to it, and so does one with `--data.reset` (the
new phase trains the steps left). `train.epochs` counts passes over the current phase's
training split: ceil(epochs * steps per epoch) steps after the phase began, where a step
takes `batch_size x grad_accum x data-parallel ranks` sequences and an epoch's ragged tail
is dropped. Give one of the two.
"""

from __future__ import annotations

import math
from typing import Any

FULL_LR = 2e-5
LORA_LR = 2e-4


def implied_defaults(values: dict[str, Any]) -> dict[str, Any]:
    """The defaults that depend on what else was given, for the keys absent from `values`
    (flat dotted keys, raw strings or TOML values): the other half of a given pair
    (train.epochs given: train.steps 0; train.warmup_ratio given: train.warmup_steps 0), and
    for a `model.hf` run the fine-tuning defaults ([Note: fine-tuning defaults])."""
    d: dict[str, Any] = {}
    if "train.epochs" in values:
        d["train.steps"] = 0
    if "train.warmup_ratio" in values:
        d["train.warmup_steps"] = 0
    if values.get("model.hf"):
        try:
            lora = int(str(values.get("lora.rank", 0)).replace("_", "")) > 0
        except ValueError:
            lora = False  # a bad lora.rank: the config's own check names it
        d.update({"train.lr": LORA_LR if lora else FULL_LR, "train.weight_decay": 0.0,
                  "train.beta2": 0.999, "log.sample_prompt": "", "train.eval_batches": 0})
        if "train.warmup_steps" not in values:
            d.update({"train.warmup_steps": 0, "train.warmup_ratio": 0.03})
        if "train.steps" not in values and "train.epochs" not in values:
            d.update({"train.steps": 0, "train.epochs": 1.0})
    return {k: v for k, v in d.items() if k not in values}


def resumed_values(saved: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """A resumed run's saved values, less those that `given` (this invocation's) replace as
    a pair: the run's length is train.steps or train.epochs, and warm-up train.warmup_steps
    or train.warmup_ratio, so giving one drops the saved other."""
    out = dict(saved)
    for pair in (("train.steps", "train.epochs"), ("train.warmup_steps", "train.warmup_ratio")):
        if any(k in given for k in pair):
            for k in pair:
                out.pop(k, None)
    return out


def steps_per_epoch(windows: int, global_batch: int) -> int:
    """Optimizer steps in one pass over `windows` training sequences (the ragged tail that
    does not fill a global batch is dropped, as the batch stream does)."""
    return max(1, windows // global_batch)


def run_end(steps: int, epochs: float, phase: int, per_epoch: int) -> int:
    """The last step of the run: train.steps (a total), or the phase's start plus the
    steps of train.epochs passes ([Note: run length])."""
    return steps if steps else phase + math.ceil(epochs * per_epoch)


def warmup(steps: int, ratio: float, span: int) -> int:
    """Warm-up steps: train.warmup_steps, or train.warmup_ratio of the phase's `span`."""
    return steps if steps or not ratio else math.ceil(ratio * span)


def epochs_seen(epoch: int, index: int, windows: int, global_batch: int) -> float:
    """Passes over the training split that a batch stream at (epoch, index) has made since
    its phase began."""
    return epoch + index / (steps_per_epoch(windows, global_batch) * global_batch)


def check_given(hf: str, given: dict[str, Any]) -> None:
    """Options this invocation gave that a `model.hf` run would not use: refused by name
    (they used to be ignored without a word)."""
    if hf and "data.max_bytes" in given:
        raise ValueError(f"data.max_bytes={given['data.max_bytes']!r} does not apply with "
                         f"model.hf={hf!r}: a fine-tuning run tokenizes all of data.path; give "
                         "a smaller file or folder to train on less")
