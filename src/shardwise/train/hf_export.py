"""A run's checkpoint as a folder other tools load, offline in one process:

- `--hf`: config.json, safetensors weights and the tokenizer's files, which
  `AutoModelForCausalLM.from_pretrained(OUT)` and `AutoTokenizer.from_pretrained(OUT)` load.
  A LoRA run's adapters are merged into the base weights (W + (alpha / r) * B @ A), read
  from the model.hf folder one file at a time; a QLoRA run's (model.quantize nf4) into the
  base it computed with, the NF4 weights dequantized, and written in bf16 (train/qlora.py);
- `--adapter`: a LoRA run's peft adapter folder alone (adapter_config.json and
  adapter_model.safetensors), which `PeftModel.from_pretrained(base, OUT)` loads;
- the built-in GPT: model.safetensors and shardwise_gpt.json, its shape, so that
  `shardwise generate OUT` (or `load_gpt`) rebuilds it without the run's config.

The weights are split into files of at most `max_shard_bytes` (HF's layout: model.safetensors,
or model-0000i-of-0000n.safetensors plus model.safetensors.index.json), as `save_pretrained`
does; a LoRA merge is re-split the same way, whatever the base folder's layout.

Everything is written into `OUT.partial` and renamed when complete: a folder appears whole or
not at all. An existing non-empty folder is never written over, unless `force`: then the
files an export writes (`EXPORT_FILES`, shards of any count) are replaced and every other file
in it is kept.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch

from .config import Config
from .hf_folder import CONFIG_FILES, TOKENIZER_FILES
from .hf_model import DTYPES
from .qlora import as_trained, linear_names, mark_bf16, qlora_dtype, quantized_keys

GPT_SHAPE = "shardwise_gpt.json"
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
# What an export folder holds (besides weight shards of any count): what `force` replaces.
EXPORT_FILES = (*CONFIG_FILES, *TOKENIZER_FILES, *ADAPTER_FILES, GPT_SHAPE,
                "model.safetensors", "model.safetensors.index.json")
_SHARD = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
# safetensors' dtype names (a file header's spelling) -> torch.
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
              "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
              "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


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


def _check_new(out: str, force: bool) -> None:
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"out={out!r} is a file; give a folder (new, or with --force one "
                         "holding an earlier export)")
    if os.path.isdir(out) and os.listdir(out) and not force:
        raise ValueError(f"out={out!r} already exists and is not an empty folder; give a new "
                         "folder, or pass --force to replace the export files in it (other "
                         "files are kept)")


def _is_export_file(name: str) -> bool:
    return name in EXPORT_FILES or bool(_SHARD.match(name))


def _publish(partial: str, out: str) -> list[str]:
    """Move the finished export into `out`: a rename when `out` is new or empty; else (force)
    the export files already there are replaced and the rest kept. Returns the replaced names."""
    if not os.path.isdir(out) or not os.listdir(out):
        if os.path.isdir(out):
            os.rmdir(out)
        os.replace(partial, out)
        return []
    old = sorted(n for n in os.listdir(out) if _is_export_file(n))
    for name in old:
        os.remove(os.path.join(out, name))
    for name in sorted(os.listdir(partial)):
        os.replace(os.path.join(partial, name), os.path.join(out, name))
    return old


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


def _base_files(src: str) -> list[str]:
    index = os.path.join(src, "model.safetensors.index.json")
    return (sorted(set(json.loads(Path(index).read_text())["weight_map"].values()))
            if os.path.isfile(index) else ["model.safetensors"])


def _merged(cfg: Config, adapters: dict[str, torch.Tensor], out: str,
            max_shard_bytes: int) -> None:
    """The base weights with the adapters merged, written in files of at most
    `max_shard_bytes` (one base tensor in memory at a time)."""
    from safetensors import safe_open

    from ..checkpoint.export import ConsolidatedWriter
    from ..checkpoint.safetensors_io import Entry

    src = cfg.model.hf
    pairs = _adapted(adapters)
    transposed = _stored_transposed(src)
    scale = cfg.lora.scale() / cfg.lora.rank
    files = _base_files(src)
    entries: list[tuple[str, Entry]] = []
    meta = {"format": "pt"}
    for name in files:  # headers only: the output's split is planned before writing
        with safe_open(os.path.join(src, name), "pt") as f:
            meta = f.metadata() or meta
            for key in f.keys():
                sl = f.get_slice(key)
                dtype = _ST_DTYPES[sl.get_dtype()]
                entries.append((name, Entry(key, qlora_dtype(cfg, dtype),
                                            tuple(sl.get_shape()))))
    # QLoRA: the base linears the run held in NF4 are merged from their dequantized values.
    spec = cfg.model.nf4()  # the run's model.nf4_* (an older run's config: the defaults)
    quantized = quantized_keys([e.key for _, e in entries], linear_names(src), spec) \
        if cfg.model.quantize else set()
    writer = ConsolidatedWriter(out, [e for _, e in entries], max_shard_bytes, meta)
    used = set()
    try:
        for name in files:
            with safe_open(os.path.join(src, name), "pt") as f:
                for key in f.keys():
                    t = f.get_tensor(key)
                    out_dtype = qlora_dtype(cfg, t.dtype)
                    if key in quantized:
                        t = as_trained(t, DTYPES[cfg.model.dtype], spec)
                    if key in pairs:
                        a, b = pairs[key]
                        delta = b.float() @ a.float()  # (out, in)
                        if _is_transposed(key, transposed):
                            delta = delta.T
                        t = t.float() + scale * delta
                        used.add(key)
                    writer.write(key, t.to(out_dtype).contiguous())
        writer.close()
    except BaseException:
        writer.abort()
        raise
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


def export_run(ckpt: str, out: str, *, adapter: bool = False, verify: bool = True,
               max_shard_bytes: int | None = None, force: bool = False) -> Config:
    """Write the export of checkpoint `ckpt` (inside its run folder) at `out`; return the
    run's config. See the module docstring for what each kind holds. `max_shard_bytes`:
    split the weights past this size (None: Hugging Face's 5 GB); `force`: replace an
    earlier export in `out`."""
    from ..checkpoint.export import DEFAULT_MAX_SHARD_BYTES, export_checkpoint

    cfg = run_config(ckpt)
    out = os.path.abspath(out)
    _check_new(out, force)
    if adapter and max_shard_bytes is not None:
        raise ValueError("--max-shard-size does not apply to --adapter: peft loads one "
                         "adapter_model.safetensors")
    shard = DEFAULT_MAX_SHARD_BYTES if max_shard_bytes is None else max_shard_bytes
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
            export_checkpoint(ckpt, partial, verify=verify, max_shard_bytes=shard)
            shape = {"model_type": "shardwise-gpt", **dataclasses.asdict(cfg.model.gpt())}
            Path(partial, GPT_SHAPE).write_text(json.dumps(shape, indent=2) + "\n")
        elif not cfg.lora.rank:
            export_checkpoint(ckpt, partial, verify=verify, max_shard_bytes=shard)
            _copy_side_files(cfg.model.hf, partial)
        else:
            with tempfile.TemporaryDirectory(dir=os.path.dirname(out)) as tmp:
                adapters = _tensors(ckpt, tmp, verify)
            if adapter:
                _adapter_folder(cfg, adapters, partial)
            else:
                _merged(cfg, adapters, partial, shard)
                _copy_side_files(cfg.model.hf, partial)
                if cfg.model.quantize:
                    mark_bf16(partial)
        _publish(partial, out)
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
