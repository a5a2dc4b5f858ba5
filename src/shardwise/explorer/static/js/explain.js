// "How it works": what is learned, the training sequence, strength, caution, the four knobs
// and a minimal example, all filled with the current run's numbers.

import { PHASE_NAMES, el, fmtBytes, fmtSeconds, unitLabel } from "./util.js";

const STRATEGY_TEXT = {
  FULL_SHARD: "Parameters, gradients and optimizer state are all sharded; a unit's full " +
    "parameters are gathered for its forward, freed, and gathered again for its backward (ZeRO-3).",
  SHARD_GRAD_OP: "Gradients and optimizer state are sharded; gathered parameters are kept " +
    "from forward to backward, saving one all-gather per unit at the cost of memory.",
  NO_SHARD: "Nothing is sharded: every rank holds everything and gradients are all-reduced " +
    "(this is DDP, shown for comparison).",
  HYBRID_SHARD: "Sharded inside a node, replicated across nodes: gathers stay on the fast " +
    "intra-node links; gradients are reduce-scattered in the node, then all-reduced across.",
};

function card(title, testid, ...body) {
  return el("div", { class: "how-card", "data-testid": testid }, el("h3", { text: title }), ...body);
}

function learned(state) {
  const ranks = state.ranks || [];
  const params = ranks.length ? ranks[0].units.flatMap((u) => u.params) : [];
  const mesh = ranks.length ? ranks[0].mesh : { replicate_size: 1, shard_size: 1 };
  const copies = mesh.replicate_size;
  return card("What is learned: the shards", "how-learned",
    el("p", { text: `The model is one function of ${state.param_count} numbers, but after ` +
      "sharding no rank stores them all. Each parameter is split along its first dimension " +
      "(padded to a multiple of the shard group, then cut into equal chunks); a rank keeps " +
      "its rows, its gradient rows and the Adam moments of those rows. Training updates the " +
      "shards; the whole model exists only as their union, gathered one unit at a time." }),
    el("table", { class: "grid-table" },
      el("tr", {}, el("th", { text: "parameter" }),
        ranks.map((r) => el("th", { text: `rank ${r.rank}` }))),
      params.map((p, i) => el("tr", {}, el("td", { text: `${p.name} (${p.shape.join("×")})` }),
        ranks.map((r) => {
          const q = r.units.flatMap((u) => u.params)[i];
          const [a, b] = q ? q.rows : [0, 0];
          return el("td", { class: "num", text: b - a > 1 ? `rows ${a}–${b - 1}` : b > a ? `row ${a}` : "–" });
        })))),
    el("p", { class: "muted", text: copies > 1
      ? `Each value is stored ${copies} times (once per replica group).`
      : "Each value is stored exactly once across the ranks." }));
}

function sequence(state) {
  const evs = (state.ranks && state.ranks[0] && state.ranks[0].events) || [];
  const items = evs.length
    ? evs.map((e) => el("li", {}, `${PHASE_NAMES[e.phase] || e.phase}` +
      (e.phase === "optimizer" ? "" : ` ${unitLabel(e.unit)}`) +
      (e.bytes ? ` (${fmtBytes(e.bytes)})` : "")))
    : [el("li", { text: "Press Train Step to record a step." })];
  const per = state.n_points / state.config.world_size;
  return card("Training sequence", "how-sequence",
    el("p", { text: `Prepare data: every rank draws the same ${state.n_points} points from ` +
      `the seed and trains on its own ${per}. Initialise: the same model on every rank, then ` +
      "each keeps only its shards. Each step: forward (per unit: gather, compute, reshard), " +
      "backward (gather again, compute gradients, reduce-scatter them so each rank keeps the " +
      "summed rows it owns), then the optimizer updates only the shards. Validate: the full " +
      "model is gathered to score all points and draw the regions. Rank 0's last step, in the " +
      "order events began:" }),
    el("ol", { class: "seq" }, items));
}

function strength(state) {
  const ref = state.reference.params + state.reference.grads + state.reference.optimizer;
  const ranks = state.ranks || [];
  const sharded = ranks.map((r) => r.memory.params + (r.memory.optimizer || 0) +
    (r.memory.grads || 0));
  const ran = state.step > 0;
  const world = state.config.world_size;
  const big = 7e9 * 16; // a 7B model: fp32 params + grads + two Adam moments
  return card("Strength: memory per rank", "how-strength",
    el("p", { text: "The training state (parameters, gradients, optimizer moments) is split, " +
      "so each rank holds about 1/N of it, plus a working set: the full parameters of the " +
      "unit being computed, which exist only for that moment. That is how a model whose " +
      "state is larger than one device trains on several, with no hand-written slicing." }),
    el("table", { class: "grid-table" },
      el("tr", {}, el("th", { text: "" }), ranks.map((r) => el("th", { text: `rank ${r.rank}` })),
        el("th", { text: "unsharded" })),
      el("tr", {}, el("td", { text: "state after a step" }),
        sharded.map((b) => el("td", { class: "num", text: ran ? fmtBytes(b) : "–" })),
        el("td", { class: "num", text: fmtBytes(ref) })),
      el("tr", {}, el("td", { text: "peak working set" }),
        ranks.map((r) => el("td", { class: "num",
          text: ran ? fmtBytes(r.memory.working_peak) : "–" })),
        el("td", { class: "num", text: "0 (always full)" }))),
    el("p", { class: "muted", text: `At scale: a 7B-parameter model needs ${fmtBytes(big)} of ` +
      `fp32 training state; over ${world} rank(s) with ${state.config.strategy} that is ` +
      `about ${fmtBytes(state.config.strategy === "NO_SHARD" ? big
        : big / (state.config.local_world_size || world))} per rank.` }));
}

function caution(state) {
  const c = state.caution;
  const cfg = state.config;
  const measured = (state.ranks || []).map((r) => (r.events || [])
    .filter((e) => e.collective).reduce((sum, e) => sum + e.bytes, 0));
  const source = "Numbers from the project's planner (shardwise.planner) for this configuration.";
  const precision = cfg.mixed_precision === "none" ? "fp32" : cfg.mixed_precision;
  const memory = c.memory_per_rank === null ? ""
    : ` The planner puts each rank's peak memory at ${fmtBytes(c.memory_per_rank)}, which ` +
      `${c.fits ? "fits" : "does not fit"} on an ${c.ref_device}.`;
  return card("Caution: interconnect bandwidth", "how-caution",
    el("p", { text: "Sharding trades memory for communication: every step moves each unit's " +
      "parameters (gathers) and gradients (reduce-scatters) between ranks. On slow links the " +
      "step waits for the network, which is why FSDP at scale needs fast interconnects " +
      "(NVLink inside a node, InfiniBand between nodes)." }),
    el("p", {}, "This toy run, last step, bytes each rank sent through its collectives (and " +
      "received alike): ",
      el("b", { "data-testid": "measured-bytes",
        text: state.step ? measured.map(fmtBytes).join(" / ") : "–" }), "."),
    el("p", { text: `The same configuration (${cfg.strategy}, ${cfg.world_size} rank(s), ` +
      `${precision}, ${cfg.wrap === "layer" ? "one unit per block" : "one unit"}) for a ` +
      `${c.ref_model}, ${c.ref_tokens_per_rank} tokens per rank per step on ${c.ref_device}s, ` +
      `sends ${fmtBytes(c.total_bytes_per_rank)} per rank per step; its compute takes ` +
      `${fmtSeconds(c.compute_s)}.${memory}` }),
    el("table", { class: "grid-table", "data-testid": "caution-table" },
      el("tr", {}, el("th", { text: "link" }), el("th", { text: "communication" }),
        el("th", { text: "step" }), el("th", { text: "bound by" })),
      c.links.map((l) => el("tr", {}, el("td", { text: l.name }),
        el("td", { class: "num", text: fmtSeconds(l.seconds) }),
        el("td", { class: "num", text: fmtSeconds(l.step_s) }),
        el("td", { text: l.bound === "compute" ? "compute (communication hidden)"
          : "the interconnect: the GPUs wait" })))),
    el("p", { class: "muted", text: [source, ...(c.notes || [])].join(" ") }));
}

function knobs(state, offload) {
  const cfg = state.config;
  const rows = [
    ["sharding_strategy", cfg.strategy, STRATEGY_TEXT[cfg.strategy], "FULL_SHARD"],
    ["auto_wrap_policy", cfg.wrap === "layer" ? "lambda m: isinstance(m, nn.Linear)" : "None",
      "Which modules become units. One unit is one all-gather and one reduce-scatter: per " +
      "layer keeps the working set to one layer; the whole model gathers everything at once.",
      "transformer / size"],
    ["mixed_precision", cfg.mixed_precision === "none" ? "None" : `"${cfg.mixed_precision}"`,
      "The dtype units are gathered and computed in; gradients are reduced in fp32 and the " +
      "shards (the master weights) stay fp32. Halves gather bytes and the working set.",
      "bf16"],
    ["cpu_offload", cfg.cpu_offload ? "True" : "False",
      `Keep shards in host memory and copy them to the GPU per unit. ${offload.reason}`,
      "False"],
  ];
  return card("Key parameters", "how-params",
    el("table", { class: "grid-table knobs" },
      el("tr", {}, el("th", { text: "parameter" }), el("th", { text: "now" }),
        el("th", { text: "typical" }), el("th", { text: "what it does" })),
      rows.map(([k, v, text, typical]) => el("tr", { "data-param": k },
        el("td", {}, el("code", { text: k })), el("td", {}, el("code", { text: v })),
        el("td", { text: typical }), el("td", { text })))));
}

function example(state) {
  const cfg = state.config;
  const wrap = cfg.wrap === "layer" ? "lambda m: isinstance(m, nn.Linear)" : "None";
  const mp = cfg.mixed_precision === "none" ? "None" : `"${cfg.mixed_precision}"`;
  const code = [
    "import torch, shardwise as sw",
    "from torch import nn",
    "",
    "rank, world, device = sw.init_distributed()  # torchrun's env",
    "model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(),",
    "                      nn.Linear(32, 4))     # 676 parameters",
    `sw.shard_model(model, sharding_strategy="${cfg.strategy}",`,
    `               auto_wrap_policy=${wrap},`,
    `               mixed_precision=${mp}, cpu_offload=${cfg.cpu_offload ? "True" : "False"})`,
    "# The optimizer sees only this rank's rows:",
    "opt = torch.optim.AdamW(model.parameters(), lr=0.02)",
    "loss = nn.functional.cross_entropy(model(x), y)  # this rank's batch",
    "loss.backward(); opt.step(); opt.zero_grad()",
  ].join("\n");
  return card("Minimal example", "how-example",
    el("pre", {}, el("code", { text: code })),
    el("p", { class: "muted" }, "Run it with ",
      el("code", { text: `torchrun --standalone --nproc-per-node ${cfg.world_size} mlp.py` }),
      ", or try ", el("code", { text: "shardwise demo" }), "."));
}

export function renderHow(container, state) {
  container.replaceChildren(learned(state), sequence(state), strength(state), caution(state),
    example(state), knobs(state, state.offload));
}
