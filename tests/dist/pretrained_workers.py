"""sw.load_pretrained against `from_pretrained`, bit for bit, on real ranks.

Every case builds the folder's model on the meta device, shards it, loads, and compares each
parameter's `full_tensor()` and every buffer with `AutoModelForCausalLM.from_pretrained`
(`torch.equal`). Reads are counted under the loader (its one pread path is wrapped, each
read attributed to the tensor whose bytes it covers): each rank must read exactly its own
block of each sharded tensor, in the stored dtype, and buffers whole.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

import shardwise as sw
from shardwise.checkpoint import block_reader, pretrained_files
from shardwise.checkpoint.slots import model_view, owned_block
from tests import hf_models as H

TP_PLAN = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
           "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
           "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
           "mlp.down_proj": RowwiseParallel()}


class _Counted:
    """BlockReader._read, counting the bytes of every read by the stored key they fall in
    (from the file's header: a read that straddles two tensors fails)."""

    reads: dict[str, int] = defaultdict(int)
    where: dict[str, list[pretrained_files.StoredTensor]] = {}

    @staticmethod
    def read(reader: Any, path: str, offset: int, into: torch.Tensor) -> None:
        n = into.numel()
        owner = [st for st in _Counted.where[path]
                 if st.offset <= offset and offset + n <= st.offset + st.nbytes]
        assert len(owner) == 1 and n > 0, (path, offset, n)
        _Counted.reads[owner[0].key] += n
        _REAL_READ(reader, path, offset, into)


_REAL_READ = block_reader.BlockReader._read


def counted_load(model: nn.Module, folder: str, **kw: Any) -> tuple[sw.LoadResult, dict]:
    _Counted.reads = defaultdict(int)
    _Counted.where = defaultdict(list)
    for st in pretrained_files.find_files(folder).tensors.values():
        _Counted.where[st.file].append(st)
    block_reader.BlockReader._read = _Counted.read  # type: ignore[method-assign]
    try:
        result = sw.load_pretrained(model, folder, **kw)
    finally:
        block_reader.BlockReader._read = _REAL_READ  # type: ignore[method-assign]
    return result, dict(_Counted.reads)


def expected_reads(model: nn.Module, folder: str, key_of: dict[str, str]) -> dict[str, int]:
    """Bytes each rank must read per stored key: its own block (sharded), all (the rest)."""
    stored = pretrained_files.find_files(folder).tensors
    out = {}
    for e in model_view(model).entries:
        st = stored[key_of.get(e.key, e.key)]
        if e.sp is not None:
            n = 1
            for s in owned_block(e.sp):
                n *= s.stop - s.start
        else:
            n = e.tensor.numel()
        if n:
            out[st.key] = n * st.dtype.itemsize
    return out


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def assert_equal_to(model: nn.Module, ref: nn.Module, what: str) -> None:
    got = dict(model.named_parameters())
    want = dict(ref.named_parameters())
    assert got.keys() == want.keys(), (what, set(got) ^ set(want))
    for name, p in want.items():
        g = full(got[name].detach())
        assert g.dtype == p.dtype and torch.equal(g, p.detach()), f"{what}: {name} differs"
    for name, b in ref.named_buffers():
        assert torch.equal(model.get_buffer(name), b), f"{what}: buffer {name} differs"


def shard(model: nn.Module, strategy: str, world: int) -> nn.Module:
    if strategy == "HYBRID_SHARD":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        return sw.shard_model(model, sharding_strategy=strategy, auto_wrap_policy="transformer",
                              mesh=mesh)
    return sw.shard_model(model, sharding_strategy=strategy, auto_wrap_policy="transformer")


def tp_shard(model: nn.Module, dp: int, tp: int) -> nn.Module:
    """torchtitan's recipe on a meta model: TP each decoder layer, then fully_shard."""
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    for layer in model.model.layers:
        parallelize_module(layer, mesh["tp"], TP_PLAN)
        sw.fully_shard(layer, mesh=mesh["dp"])
    return sw.fully_shard(model, mesh=mesh["dp"])


def matches(rank: int, world: int, cases: list[tuple[str, str, str]]) -> dict[str, int]:
    """(folder, strategy, what) cases: exact weights, own-block reads, ties, a forward."""
    out = {}
    for folder, strategy, what in cases:
        model = H.meta_model(folder)
        if strategy.startswith("TP"):
            dp, tp = (int(x) for x in strategy[2:].split("x"))
            tp_shard(model, dp, tp)
        else:
            shard(model, strategy, world)
        result, reads = counted_load(model, folder)
        ref = H.reference(folder)
        assert_equal_to(model, ref, f"{what} {strategy}")
        assert reads == expected_reads(model, folder, {}), (what, strategy, reads)
        assert result.bytes_read == sum(reads.values())
        assert not result.missing_keys and not result.unexpected_keys, result
        tied = ref.config.tie_word_embeddings
        head, emb = model.get_output_embeddings(), model.get_input_embeddings()
        assert (head.weight is emb.weight) == tied, (what, tied)
        assert ("lm_head.weight" in result.loaded_keys) != tied
        if not strategy.startswith("TP"):
            model.eval()  # from_pretrained returns eval mode (GPT-2 has dropout)
            ids = torch.arange(12).reshape(2, 6) % H.VOCAB
            with torch.no_grad():
                d = (model(input_ids=ids).logits - ref(input_ids=ids).logits).abs().max()
            assert d.item() <= 1e-5, (what, strategy, d.item())
        out[f"{what}/{strategy}"] = result.bytes_read
    return out


def _raises(kind: type[Exception], fn: Any, *fragments: str) -> str:
    try:
        fn()
    except kind as e:
        for f in fragments:
            assert f in str(e), (f, str(e))
        return str(e)
    raise AssertionError(f"no {kind.__name__} raised; expected one naming {fragments}")


def keys_and_refusals(rank: int, world: int, paths: dict[str, str]) -> None:
    """Strict refusals name keys and write nothing; strict=False; unexpected keys; prefixes;
    a shardwise export round trip."""
    from shardwise.engine.core.context import sharded_params

    llama, ref = paths["llama"], H.reference(paths["llama"])

    def fresh(folder: str = llama) -> nn.Module:
        return shard(H.meta_model(folder), "FULL_SHARD", world)

    m = fresh()
    _raises(sw.CheckpointError, lambda: sw.load_pretrained(m, paths["missing"]),
            "missing keys model.norm.weight", "Nothing was loaded")
    _raises(sw.CheckpointError, lambda: sw.load_pretrained(m, paths["mismatch"]),
            "model.layers.0.mlp.gate_proj.weight (checkpoint [44, 24], model [40, 24])")
    # A refusal on one rank only (it was given another file) raises on every rank.
    mine = llama if rank == 0 else paths["missing"]
    msg = _raises(sw.CheckpointError, lambda: sw.load_pretrained(m, mine), "model.norm.weight")
    assert rank != 0 or "raised on rank 1" in msg, msg
    assert all(sp.is_meta for sp in sharded_params(m)), "a refused load wrote shards"
    _raises(ValueError, lambda: sw.load_pretrained(m, paths["missing"], strict=False),
            "model.norm.weight", "meta device", "sw.materialize")
    # strict=False on a materialized model: the rest loads, the absent key keeps its value.
    sw.materialize(m, init_fn=m._init_weights)
    before = full(m.model.norm.weight.detach()).clone()
    r = sw.load_pretrained(m, paths["missing"], strict=False)
    assert r.missing_keys == ["model.norm.weight"], r
    assert torch.equal(full(m.model.norm.weight.detach()), before)
    with torch.no_grad():
        ref_norm = ref.model.norm.weight.clone()
        ref.model.norm.weight.copy_(before)
    assert_equal_to(m, ref, "strict=False")
    with torch.no_grad():
        ref.model.norm.weight.copy_(ref_norm)
    # Unexpected keys are reported (HF's ignored ones, a stale rotary inv_freq, are not).
    m = fresh()
    r = sw.load_pretrained(m, paths["extra"])
    assert r.unexpected_keys == ["extra.weight"], r.unexpected_keys
    assert_equal_to(m, ref, "extra keys")
    # Keys without the base model prefix (a base model's checkpoint; GPT-2's hub layout).
    for kind in ("qwen2", "gpt2"):
        m = fresh(paths[kind])
        r = sw.load_pretrained(m, paths[f"{kind}-noprefix"])
        assert not r.missing_keys and not r.unexpected_keys, r
        assert_equal_to(m, H.reference(paths[kind]), f"{kind} without prefix")
    # A shardwise export loads back (tied weights recorded in its metadata).
    m = fresh(paths["qwen2"])
    sw.load_pretrained(m, paths["qwen2"])
    sw.export_safetensors(paths["export"], m)
    m2 = fresh(paths["qwen2"])
    sw.load_pretrained(m2, paths["export"])
    assert_equal_to(m2, H.reference(paths["qwen2"]), "shardwise export")


def lora_config() -> Any:
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                      init_lora_weights=False)


def peft_model(model: nn.Module) -> nn.Module:
    from peft import get_peft_model

    return get_peft_model(model, lora_config())


def peft_keys(rank: int, world: int, paths: dict[str, str]) -> None:
    """A meta peft model: full peft state dicts and `base_model.model.` keys load, a base
    folder fills the base weights, an adapter folder the adapters."""
    from peft import PeftModel

    llama = paths["llama"]
    ref = PeftModel.from_pretrained(H.reference(llama), paths["adapter"])

    def fresh() -> nn.Module:
        return shard(peft_model(H.meta_model(llama)), "FULL_SHARD", world)

    for what in ("peft-full", "peft-prefixed"):
        m = fresh()
        r = sw.load_pretrained(m, paths[what])
        assert not r.missing_keys and not r.unexpected_keys, (what, r)
        assert_equal_to(m, ref, what)
    # A base folder into a peft model: adapter weights are not missing, but must exist.
    m = fresh()
    _raises(ValueError, lambda: sw.load_pretrained(m, llama), "lora_A.default.weight",
            "meta device")
    sw.materialize(m, init_fn=m.base_model.model._init_weights)
    adapters = {k: full(v.detach()).clone() for k, v in m.named_parameters() if "lora_" in k}
    r = sw.load_pretrained(m, llama)
    assert not r.missing_keys and not r.unexpected_keys, r
    base = H.reference(llama)
    for k, v in m.named_parameters():
        if "lora_" in k:
            assert torch.equal(full(v.detach()), adapters[k]), k
        else:
            inner = k.removeprefix("base_model.model.").replace("base_layer.", "")
            assert torch.equal(full(v.detach()), base.get_parameter(inner)), k
    # The adapter folder (keys without the adapter name) fills the adapters.
    r = sw.load_pretrained(m, paths["adapter"], strict=False)
    assert r.missing_keys and all("lora_" not in k for k in r.missing_keys), r
    assert_equal_to(m, ref, "adapter folder")


def keys_and_peft(rank: int, world: int, paths: dict[str, str]) -> None:
    keys_and_refusals(rank, world, paths)
    peft_keys(rank, world, paths)
