"""Planning FSDP x tensor parallelism: one TP rank is an FSDP rank of a thinner model.

With tensor-parallel degree t on W ranks, FSDP shards over dp = W / t ranks, and each rank
holds 1/t of every block matrix (Megatron's plan: attention's heads and the MLP's hidden
units split, norms whole). The embedding and the output head are a stated choice,
`tp_embeddings`: "split" by vocabulary rows across the TP group (torchtitan's Llama plan:
RowwiseParallel embedding, ColwiseParallel head, a loss-parallel cross-entropy; the
default), or "replicate", whole on every TP rank (as `shardwise train --parallel.tp` runs
its GPT). For Llama 3 70B on 64 ranks in bf16 that is 16.4 against 19.85 GiB of model
states per rank at tp 8. So a TP plan is the FSDP plan of dp ranks whose block units hold
1/t of their matrices, plus the TP activations' all-reduces, which FSDP's prefetching
cannot hide: each sits between two matmuls of the same layer.

Per layer and step (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", table 2 without sequence parallelism):

- 2 all-reduces forward (after attention's out projection and the MLP's down projection)
  and 2 backward (the gradients of both branches' inputs), each of b x s x d elements in
  the compute dtype; activation checkpointing repeats the 2 forward ones;
- activations per token: the residual-stream tensors (norm inputs and outputs: 4d) stay
  whole on every TP rank, the rest (q, k, v, attention output, the MLP's 2f) is split.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..engine.api.fully_shard import ParamSpec, UnitSpec
from ..engine.core.events import wire_bytes
from .estimate import TimeEstimate
from .profiles import DeviceProfile, InterconnectProfile
from .shape import FP32, TransformerShape
from .timing import CommVolume
from .units import ModelUnits, PlanUnit


@dataclass(frozen=True)
class TPRankShape(TransformerShape):
    """The work of one TP rank of a transformer of this shape split `tp` ways."""

    tp: int = 1
    # Sequence parallelism: the residual stream's tensors split by sequence across tp.
    sp: int = 0
    # The output head split across tp too (loss parallel): its FLOPs and logits divide.
    tp_head: int = 0

    def _stream(self) -> int:
        """How many ways the residual stream is split (1 without sequence parallelism)."""
        return self.tp if self.sp else 1

    def block_input_bytes(self, act_bytes: int) -> int:
        return self.d_model * act_bytes // self._stream()

    def block_matmul_flops_per_token(self) -> float:
        return super().block_matmul_flops_per_token() / self.tp

    def attention_flops_per_token(self, seq_len: int) -> float:
        return super().attention_flops_per_token(seq_len) / self.tp  # heads are split

    def root_flops_per_token(self) -> float:
        return super().root_flops_per_token() / (self.tp if self.tp_head else 1)

    def block_activation_bytes(self, act_bytes: int) -> int:
        # norm1 in/out, norm2 in/out: the residual stream, whole on every TP rank unless
        # sequence parallelism splits it
        whole = 4 * self.d_model // self._stream()
        # q, k, v, attention output and the MLP's hidden tensors: split with the heads and
        # the hidden units (the router's logits too, approximately)
        split = (self.attention_saved_elems() + self.mlp_saved_elems()) // self.tp
        stats = 2 * 2 * act_bytes
        lse = self.n_heads // self.tp * FP32
        return (whole + split) * act_bytes + stats + lse

    def block_backward_transient_bytes(self, act_bytes: int) -> int:
        hidden = self.mlp_matrices * self.active_experts * self.ffn_dim // self.tp
        return (self.d_model + hidden) * act_bytes

    def root_activation_bytes(self, act_bytes: int) -> int:
        if not self.tp_head:
            return super().root_activation_bytes(act_bytes)
        logits = self.vocab_size * FP32
        return super().root_activation_bytes(act_bytes) - logits + logits // self.tp

    def root_transient_bytes(self, act_bytes: int) -> int:
        return super().root_transient_bytes(act_bytes) // (self.tp if self.tp_head else 1)


def check_tp(tp: int, world: int, shape: TransformerShape | None) -> None:
    """ValueError naming the value and what is allowed (no collective: planning only)."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor_parallel={tp!r} must be a positive int")
    if world % tp:
        raise ValueError(f"tensor_parallel={tp} must divide world_size={world}; allowed: "
                         f"{[k for k in range(1, world + 1) if world % k == 0]}")
    if shape is not None:
        for name, n in (("n_heads", shape.n_heads), ("n_kv_heads", shape.n_kv_heads),
                        ("d_model", shape.d_model), ("ffn_dim", shape.ffn_dim)):
            if n % tp:
                raise ValueError(f"tensor_parallel={tp} must divide the model's {name}={n}")


# Megatron's plan by the projection's name: colwise layers split their outputs (a weight's
# rows, and its bias), rowwise layers their inputs (a weight's columns; the bias, added
# after the all-reduce, stays whole). Names of our GPT, Hugging Face's Llama family
# (Mixtral's fused experts included) and GPT-2, whose Conv1D stores weights transposed.
COLWISE = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "w_qkv", "w_in", "w1", "w3",
           "gate_up_proj", "gate_up_proj_bias", "c_attn", "c_fc", "query_key_value",
           "dense_h_to_4h", "other"}
ROWWISE = {"o_proj", "down_proj", "w_out", "w2", "c_proj", "dense", "dense_4h_to_h"}
TRANSPOSED = {"c_attn", "c_fc", "c_proj"}  # GPT-2's Conv1D: (in, out)


TP_EMBEDDINGS = ("split", "replicate")


def check_tp_embeddings(value: object) -> str:
    """`value` if it is one of TP_EMBEDDINGS; ValueError naming it and them otherwise."""
    if not isinstance(value, str) or value not in TP_EMBEDDINGS:
        raise ValueError(f"tp_embeddings={value!r} is not allowed; allowed: "
                         f"{', '.join(TP_EMBEDDINGS)}")
    return value


def tp_dim(name: str, shape: tuple[int, ...], root: bool, vocab: int | None,
           split_tables: bool) -> int | None:
    """The dim TP splits this parameter along (None: whole on every TP rank).

    Blocks: colwise projections by their output rows, rowwise by their input columns,
    norms and the router whole; any other matrix (a model we cannot name) is split too.
    The root: the embedding and the output head (the tables with `vocab` rows) only when
    the plan splits them (`split_tables`: tp_embeddings="split", torchtitan's plan, with a
    loss-parallel cross-entropy); the position table and the final norm always whole.
    """
    if not shape:
        return None
    if root:
        return 0 if split_tables and len(shape) == 2 and shape[0] == vocab else None
    parts = name.split(".")
    layer = parts[-2] if parts[-1] in ("weight", "bias") and len(parts) > 1 else parts[-1]
    is_bias = parts[-1] == "bias" or layer.endswith("_bias")
    out_dim, in_dim = (-1, -2) if layer in TRANSPOSED else (-2, -1)
    if layer in COLWISE:
        return len(shape) - 1 if is_bias or len(shape) == 1 else len(shape) + out_dim
    if layer in ROWWISE:
        return None if is_bias or len(shape) == 1 else len(shape) + in_dim
    if layer == "gate" or len(shape) < 2:
        return None  # the MoE router (replicated), norms and other vectors
    return 0  # an unnamed matrix: split (its count is right whichever dim it is)


def _split(p: ParamSpec, dim: int | None, tp: int) -> ParamSpec:
    if dim is None:
        return p
    shape = list(p.shape)
    shape[dim] = -(-shape[dim] // tp)
    return replace(p, shape=tuple(shape))


def split_units(mu: ModelUnits, tp: int, sequence_parallel: bool = False,
                tp_embeddings: str = "split") -> ModelUnits:
    """Each block unit's matrices divided by `tp` (planner/tp.py's `tp_dim`); the root's
    embedding and head too with tp_embeddings="split"."""
    split = check_tp_embeddings(tp_embeddings) == "split"
    vocab = mu.shape.vocab_size if mu.shape is not None else None
    units = tuple(
        PlanUnit(UnitSpec(u.spec.name, tuple(
            _split(p, tp_dim(p.fqn, p.shape, u.head, vocab, split), tp)
            for p in u.spec.params)), u.layers, u.head)
        for u in mu.units)
    shape = (TPRankShape(**mu.shape.to_dict(), tp=tp, sp=int(sequence_parallel),
                         tp_head=int(split))
             if mu.shape is not None else None)
    note = (f"tensor parallel {tp}: block matrices split {tp} ways (Megatron plan), "
            f"{describe_tables(tp_embeddings, tp)}, norms whole; FSDP shards over the rest"
            + ("; sequence parallel: the residual stream split by sequence" if sequence_parallel
               else ""))
    return replace(mu, units=units, shape=shape, notes=(*mu.notes, note))


def describe_tables(tp_embeddings: str, tp: int) -> str:
    """What the plan does with the embedding and the output head, in words."""
    if tp_embeddings == "split":
        return (f"embedding and output head split {tp} ways by vocabulary rows "
                "(tp_embeddings=split: torchtitan's plan, loss parallel)")
    return ("embedding and output head whole on every TP rank (tp_embeddings=replicate: "
            "as shardwise train --parallel.tp runs its GPT)")


@dataclass(frozen=True)
class TPComm:
    """The TP group's all-reduces of activations, per rank per step."""

    tp: int
    dp: int
    # 4 all-reduces (2 forward, 2 backward), 6 with activation checkpointing; with sequence
    # parallelism each becomes a reduce-scatter plus an all-gather (the same bytes).
    all_reduces_per_layer: int
    layers: int
    bytes_per_all_reduce: int  # b x s x d_model in the compute dtype
    sent_bytes: int  # this rank, per step (ring all-reduce: 2 (t-1)/t of each buffer)
    inter_node: bool  # the TP group spans nodes (it should not)
    seconds: float | None  # exposed: on the critical path between a layer's matmuls
    sequence_parallel: bool = False


def tp_comm(shape: TransformerShape, tp: int, dp: int, batch: int | None, seq_len: int | None,
            act_bytes: int, checkpointing: bool, sequence_parallel: bool, ranks_per_node: int,
            link: InterconnectProfile | None, inter: InterconnectProfile | None) -> TPComm:
    per_layer = 6 if checkpointing else 4
    hops = 2 if sequence_parallel else 1  # RS + AG: twice the latency, the same bytes
    nbytes = (batch or 0) * (seq_len or 0) * shape.d_model * act_bytes
    count = per_layer * shape.n_layers
    sent = count * wire_bytes("all_reduce", nbytes, tp)
    inter_node = tp > ranks_per_node
    seconds = None
    chosen = inter if inter_node else link
    if chosen is not None and nbytes:
        bw = chosen.per_rank_bandwidth(ranks_per_node if inter_node else 1, "all_reduce")
        seconds = count * (2 * (tp - 1) * hops * chosen.latency_s
                           + wire_bytes("all_reduce", nbytes, tp) / bw)
    return TPComm(tp, dp, per_layer, shape.n_layers, nbytes, sent, inter_node, seconds,
                  sequence_parallel)


def describe(c: TPComm) -> str:
    where = "inter-node (TP should stay inside a node)" if c.inter_node else "intra-node"
    from .report import secs, size

    t = f", {secs(c.seconds)} per step, exposed" if c.seconds is not None else ""
    kind = "all-reduces (as reduce-scatter + all-gather)" if c.sequence_parallel \
        else "all-reduces"
    return (f"tensor parallel {c.tp} x FSDP {c.dp}: {c.all_reduces_per_layer} {kind} "
            f"per layer x {c.layers} layers of {size(c.bytes_per_all_reduce)} each over the "
            f"TP group, {size(c.sent_bytes)} sent per rank per step, {where}{t}")


def with_tp_comm(comm: CommVolume, c: TPComm) -> CommVolume:
    """FSDP's collectives plus the TP all-reduces (counted in all_reduce_bytes)."""
    inter = c.sent_bytes if c.inter_node else 0
    return replace(comm, all_reduce_bytes=comm.all_reduce_bytes + c.sent_bytes,
                   sent_bytes=comm.sent_bytes + c.sent_bytes,
                   received_bytes=comm.received_bytes + c.sent_bytes,
                   intra_node_bytes=comm.intra_node_bytes + c.sent_bytes - inter,
                   inter_node_bytes=comm.inter_node_bytes + inter,
                   collectives=comm.collectives + c.all_reduces_per_layer * c.layers)


def with_tp_time(t: TimeEstimate, c: TPComm, dev: DeviceProfile, act_dtype: torch.dtype
                 ) -> TimeEstimate:
    """The step with the TP all-reduces on the critical path (nothing hides them)."""
    if c.seconds is None:
        return t
    dtype_name = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(act_dtype, "fp32")
    x = c.seconds
    step = t.step_s + x
    verdict = t.verdict + (f" Tensor parallel adds {x:.3g} s of exposed all-reduces "
                           f"({100 * x / step:.0f}% of the step).")
    return replace(t, comm_s=t.comm_s + x, step_s_overlap=t.step_s_overlap + x,
                   step_s_serial=t.step_s_serial + x, step_s=step,
                   mfu=t.model_flops / (step * dev.peak_flops[dtype_name]),
                   tokens_per_s=t.tokens_per_s * t.step_s / step, verdict=verdict)
