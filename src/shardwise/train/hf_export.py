"""A run's checkpoint as a folder other tools load, offline in one process:

- `--hf`: config.json, safetensors weights and the tokenizer's files, which
  `AutoModelForCausalLM.from_pretrained(OUT)` and `AutoTokenizer.from_pretrained(OUT)` load.
  A LoRA run's adapters are merged into the base weights (W + (alpha / r) * B @ A), read
  from the model.hf folder one file at a time;
- `--adapter`: a LoRA run's peft adapter folder alone (adapter_config.json and
  adapter_model.safetensors), which `PeftModel.from_pretrained(base, OUT)` loads;
- the built-in GPT: model.safetensors and shardwise_gpt.json, its shape, so that
  `shardwise generate OUT` (or `load_gpt`) rebuilds it without the run's config.

Everything is written into `OUT.partial` and renamed when complete: a folder appears whole or
not at all, and an existing non-empty folder is never written over.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from .config import Config
from .hf_folder import CONFIG_FILES, TOKENIZER_FILES

GPT_SHAPE = "shardwise_gpt.json"


def run_config(ckpt: str) -> Config:
    """The config of the run a checkpoint belongs to (runs/NAME/checkpoints/step-N)."""
    from .options import build, read_toml

    run = Path(ckpt).resolve().parent.parent
    if not (run / "config.toml").is_file():
        raise ValueError(f"{ckpt!r} is not inside a run folder (no config.toml two levels up): "
                         "--hf, --adapter and generate need the run's config")
    values = read_toml(run / "config.toml")
    for k in ("resume", "resume_from", "overwrite"):
        values.pop(k, None)
    return build({**values, "name": run.name, "out_dir": str(run.parent)})


def _check_new(out: str) -> None:
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise ValueError(f"out={out!r} already exists and is not an empty folder; give a new "
                         "folder (an export never writes over what is there)")


def _tensors(ckpt: str, tmp: str, verify: bool) -> dict[str, torch.Tensor]:
    """The checkpoint's model tensors, consolidated (for the small adapter checkpoints)."""
    from safetensors.torch import load_file

    from ..checkpoint.export import export_checkpoint

    path = os.path.join(tmp, "ckpt.safetensors")
    export_checkpoint(ckpt, path, verify=verify)
    return load_file(path)


def _copy_side_files(src: str, dst: str) -> None:
    for name in (*CONFIG_FILES, *TOKENIZER_FILES):
        if os.path.isfile(os.path.join(src, name)):
            shutil.copy2(os.path.join(src, name), os.path.join(dst, name))


def _adapted(adapters: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """base weight key -> (A, B), from peft's `base_model.model.<mod>.lora_A.<name>.weight`."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in adapters.items():
        head, sep, tail = key.partition(".lora_A.")
        which = "A"
        if not sep:
            head, sep, tail = key.partition(".lora_B.")
            which = "B"
        if not sep:
            continue
        mod = head.removeprefix("base_model.model.")
        pairs.setdefault(f"{mod}.weight", {})[which] = t
    return {k: (v["A"], v["B"]) for k, v in pairs.items()}


def _stored_transposed(src: str) -> list[str]:
    """Module names whose weight the base model stores as (in, out): transformers' Conv1D
    (GPT-2). peft adds (B @ A).T there (fan_in_fan_out), and a square one gives no shape
    error to tell the orientations apart."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.pytorch_utils import Conv1D

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src))
    return [n for n, m in skeleton.named_modules() if isinstance(m, Conv1D)]


def _is_transposed(key: str, transposed: list[str]) -> bool:
    # A file's keys may lack the model's base prefix ("h.0..." for "transformer.h.0...").
    module = key.removesuffix(".weight")
    return any(n == module or n.endswith("." + module) or module.endswith("." + n)
               for n in transposed)


def _merged(cfg: Config, adapters: dict[str, torch.Tensor], out: str) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    src = cfg.model.hf
    pairs = _adapted(adapters)
    transposed = _stored_transposed(src)
    scale = cfg.lora.scale() / cfg.lora.rank
    index = os.path.join(src, "model.safetensors.index.json")
    files = (sorted(set(json.loads(Path(index).read_text())["weight_map"].values()))
             if os.path.isfile(index) else ["model.safetensors"])
    used = set()
    for name in files:  # one base file in memory at a time
        tensors = {}
        with safe_open(os.path.join(src, name), "pt") as f:
            meta = f.metadata() or {"format": "pt"}
            for key in f.keys():
                t = f.get_tensor(key)
                if key in pairs:
                    a, b = pairs[key]
                    delta = b.float() @ a.float()  # (out, in)
                    if _is_transposed(key, transposed):
                        delta = delta.T
                    t = (t.float() + scale * delta).to(t.dtype)
                    used.add(key)
                tensors[key] = t.contiguous()
        save_file(tensors, os.path.join(out, name), metadata=meta)
    if os.path.isfile(index):
        shutil.copy2(index, os.path.join(out, "model.safetensors.index.json"))
    missing = sorted(set(pairs) - used)
    if missing:
        raise ValueError(f"adapters for {missing[:3]} match no weight of {src!r}: the base "
                         "model folder changed since the run")


def _adapter_folder(cfg: Config, adapters: dict[str, torch.Tensor], out: str) -> None:
    from safetensors.torch import save_file

    from .hf_model import lora_config

    # peft stores adapter keys without the adapter's name: lora_A.default.weight -> lora_A.weight
    saved = {k.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B."):
             t.contiguous() for k, t in adapters.items()}
    save_file(saved, os.path.join(out, "adapter_model.safetensors"), metadata={"format": "pt"})
    lora_config(cfg).save_pretrained(out)


def export_run(ckpt: str, out: str, *, adapter: bool = False, verify: bool = True) -> Config:
    """Write the export of checkpoint `ckpt` (inside its run folder) at `out`; return the
    run's config. See the module docstring for what each kind holds."""
    from ..checkpoint.export import export_checkpoint

    cfg = run_config(ckpt)
    out = os.path.abspath(out)
    _check_new(out)
    if adapter and not cfg.lora.rank:
        raise ValueError(f"--adapter: run {cfg.name!r} trained no LoRA adapter (lora.rank=0); "
                         "export it with --hf")
    if cfg.lora.rank and not os.path.isdir(cfg.model.hf):
        raise ValueError(f"run {cfg.name!r} adapts model.hf={cfg.model.hf!r}, which is gone: "
                         "the merged export needs the base weights (or use --adapter)")
    partial = f"{out}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    try:
        if not cfg.model.hf:
            export_checkpoint(ckpt, partial, verify=verify)
            shape = {"model_type": "shardwise-gpt", **dataclasses.asdict(cfg.model.gpt())}
            Path(partial, GPT_SHAPE).write_text(json.dumps(shape, indent=2) + "\n")
        elif not cfg.lora.rank:
            export_checkpoint(ckpt, partial, verify=verify)
            _copy_side_files(cfg.model.hf, partial)
        else:
            with tempfile.TemporaryDirectory(dir=os.path.dirname(out)) as tmp:
                adapters = _tensors(ckpt, tmp, verify)
            if adapter:
                _adapter_folder(cfg, adapters, partial)
            else:
                _merged(cfg, adapters, partial)
                _copy_side_files(cfg.model.hf, partial)
        if os.path.isdir(out):
            os.rmdir(out)  # empty: checked above
        os.replace(partial, out)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return cfg


def load_gpt(folder: str) -> torch.nn.Module:
    """The built-in GPT from its export folder (shardwise_gpt.json + model.safetensors)."""
    from safetensors.torch import load_file

    from .model import GPT, GPTConfig

    shape = json.loads(Path(folder, GPT_SHAPE).read_text())
    shape.pop("model_type", None)
    model = GPT(GPTConfig(**shape))
    model.load_state_dict(load_file(os.path.join(folder, "model.safetensors")))
    return model.eval()
