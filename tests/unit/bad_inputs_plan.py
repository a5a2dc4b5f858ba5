"""The planner's knobs given a bad value (`sw.plan`): rows of the bad-input table, after the
engine's (bad_inputs.py) and before the CLI's (bad_inputs_cli.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import shardwise as sw

from .bad_inputs import Case, P, api, inf


def _plan(**kw: Any) -> Callable[[], Any]:
    kw.setdefault("world_size", 2)
    count = kw.pop("count", 1e6)
    return lambda: sw.plan(count, **kw)


PLAN_CASES: list[Case] = [
    api("plan(model_or_param_count)", "-5", "model_or_param_count=-5 must be an nn.Module",
        _plan(count=-5)),
    api("plan(model_or_param_count)", "inf", "model_or_param_count=inf", _plan(count=inf)),
    api("plan(model_or_param_count)", "'7b'", "model_or_param_count='7b'", _plan(count="7b")),
    api("plan(coalesce_bytes)", "-3", "coalesce_bytes=-3 must be None (the default, "
        "4194304 bytes) or an int >= 0", _plan(coalesce_bytes=-3)),
    api("plan(quantize)", "'int4'", "quantize='int4' is not allowed: None, 'nf4' or sw.NF4",
        _plan(quantize="int4")),
    api("plan(quantize)", "'nf4' (a count)", "quantize=nf4 needs a model",
        _plan(quantize="nf4")),
    api("plan(world_size)", "0", f"world_size=0 {P}: must be an int >= 1", _plan(world_size=0)),
    api("plan(world_size)", "True", "world_size=True", _plan(world_size=True)),
    api("plan(sharding_strategy)", "'X'", "sharding_strategy='X' is not one of",
        _plan(sharding_strategy="X")),
    api("plan(auto_wrap_policy)", "'blocks'", "auto_wrap_policy='blocks'",
        _plan(auto_wrap_policy="blocks")),
    api("plan(mixed_precision)", "'int8'", "mixed_precision='int8' is not allowed",
        _plan(mixed_precision="int8")),
    api("plan(optimizer)", "'lion'", "optimizer='lion' is not one of: adamw, adam",
        _plan(optimizer="lion")),
    api("plan(cpu_offload)", "'y'", "cpu_offload='y' is not allowed", _plan(cpu_offload="y")),
    api("plan(batch_size)", "0", "batch_size=0 must be a positive int or None",
        _plan(batch_size=0)),
    api("plan(batch_size)", "True", "batch_size=True", _plan(batch_size=True)),
    api("plan(seq_len)", "2.5", "seq_len=2.5 must be a positive int", _plan(seq_len=2.5)),
    api("plan(activation_checkpointing)", "'yes'", f"activation_checkpointing='yes' {P}",
        _plan(activation_checkpointing="yes")),
    api("plan(device)", "'tpu'", "device='tpu' is not one of: a100-40gb", _plan(device="tpu")),
    api("plan(interconnect)", "'wifi'", "interconnect='wifi' is not one of: nvlink",
        _plan(interconnect="wifi")),
    api("plan(interconnect)", "3", "interconnect=3", _plan(interconnect=3)),
    api("plan(shape)", "{'layers': 2}", "shape has unknown keys ['layers']",
        _plan(shape={"layers": 2})),
    api("plan(shape)", "[1]", "shape=[1] must be a TransformerShape, a dict or None",
        _plan(shape=[1])),
    api("plan(ranks_per_node)", "0", f"ranks_per_node=0 {P}: must be an int >= 1",
        _plan(ranks_per_node=0)),
    api("plan(tensor_parallel)", "3", "tensor_parallel=3 must divide world_size=2",
        _plan(tensor_parallel=3)),
    api("plan(tensor_parallel)", "0", "tensor_parallel=0 must be a positive int",
        _plan(tensor_parallel=0)),
    api("plan(sequence_parallel)", "'yes'", f"sequence_parallel='yes' {P}",
        _plan(sequence_parallel="yes")),
    api("plan(ranks_per_node)", "3 (world 4, HYBRID_SHARD)", "ranks_per_node=3 does not divide",
        _plan(world_size=4, ranks_per_node=3, sharding_strategy="HYBRID_SHARD")),
    api("plan(rank)", "2 (world 2)", f"rank=2 {P}: must be an int in [0, 1]", _plan(rank=2)),
    api("plan(rank)", "'0'", "rank='0'", _plan(rank="0")),
    api("plan(model_or_param_count)", "'llama9' (no such preset)", "model_or_param_count="
        "'llama9': 'llama9' is neither a preset (llama3-8b, llama3-70b, llama3-405b, "
        "qwen2-7b, mixtral-8x7b) nor a config.json file", _plan(count="llama9")),
    api("plan(model_or_param_count)", "{'model_type': 'bert', ...}", "model_type='bert' is "
        "not supported; supported: gemma, gpt2, llama, mistral, mixtral, qwen2",
        _plan(count={"model_type": "bert", "hidden_size": 64})),
    api("plan(model_or_param_count)", "a llama config without num_hidden_layers",
        "the field 'num_hidden_layers' is missing (a llama config needs hidden_size, "
        "num_hidden_layers", _plan(count={"model_type": "llama", "hidden_size": 64,
                                          "num_attention_heads": 4, "vocab_size": 10,
                                          "intermediate_size": 8})),
    api("plan(shape)", "{...} with a config", "a config carries its own shape",
        _plan(count="llama3-8b", shape={"n_layers": 1, "d_model": 8, "n_heads": 1,
                                        "vocab_size": 8})),
    api("plan(tp_embeddings)", "'yes'", "tp_embeddings='yes' is not allowed; allowed: split, "
        "replicate", _plan(tp_embeddings="yes")),
]
