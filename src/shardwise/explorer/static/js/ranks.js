// The mechanism view: one panel per rank (shard map, bytes, the step's events, timeline),
// and the playback that walks through the latest step's events in the order they began.

import {
  PHASE_COLOURS, PHASE_NAMES, RANK_COLOURS, el, fmtBytes, prepareCanvas, unitLabel,
} from "./util.js";

const PLAY_MS = 1400; // a step's events are replayed over this long, at their real proportions

function shardMap(rank, colour) {
  const units = rank.units || [];
  return el("div", { class: "shardmap", "data-testid": "shard-map" },
    units.filter((u) => u.params.length).map((u) => el("div", { class: "unit" },
      el("div", { class: "unit-name", text: unitLabel(u.name) }),
      u.params.map((p) => {
        const [a, b] = p.rows;
        const owned = b - a;
        const shape = p.shape.join("×") || "scalar";
        return el("div", { class: "param", "data-param": p.name, "data-rows": `${a}-${b}` },
          el("span", { class: "pname", text: `${p.name} (${shape})` }),
          el("div", { class: "bar", title: `rows ${a}..${b - 1} of ${p.dim0}` },
            el("div", { class: "own", style: {
              left: `${(100 * a) / p.dim0}%`, width: `${(100 * owned) / p.dim0}%`,
              background: colour } })),
          el("span", { class: "rows",
            text: owned === 0 ? "no rows (only padding)"
              : `${owned === 1 ? `row ${a}` : `rows ${a}–${b - 1}`} · ${p.numel} ` +
                `value${p.numel === 1 ? "" : "s"}` }));
      }))));
}

function memoryTable(rank, reference) {
  const m = rank.memory || {};
  const ran = (rank.events || []).length > 0;
  const total = (m.params || 0) + (m.grads || 0) + (m.optimizer || 0) + (m.working_peak || 0);
  const ref = reference.params + reference.grads + reference.optimizer;
  const row = (label, bytes, refBytes, key) => el("tr", { "data-kind": key },
    el("th", { text: label }),
    el("td", { class: "num", text: bytes === null ? "–" : fmtBytes(bytes) }),
    el("td", {}, el("div", { class: "membar" }, el("div", {
      class: `fill ${key}`, style: { width: `${Math.min(100, (100 * (bytes || 0)) / ref)}%` },
    }))),
    el("td", { class: "muted ref", text: refBytes === null ? "" : `/ ${fmtBytes(refBytes)}`,
      title: refBytes === null ? null : "one unsharded replica" }));
  return el("table", { class: "mem", "data-testid": "memory" },
    row("parameters", m.params, reference.params, "params"),
    row("gradients", ran ? m.grads : null, reference.grads, "grads"),
    row("optimizer state", ran ? m.optimizer : null, reference.optimizer, "optimizer"),
    row("unsharded working set", ran ? m.working_peak : null, null, "working"),
    el("tr", { class: "total" }, el("th", { text: "total" }),
      el("td", { class: "num", "data-testid": "rank-total", text: ran ? fmtBytes(total) : "–" }),
      el("td", { colspan: 2, class: "muted",
        text: ran ? `${((100 * total) / ref).toFixed(0)}% of an unsharded replica`
          : "after the first step" })));
}

function phaseText(e) {
  const what = PHASE_NAMES[e.phase] || e.phase;
  if (e.phase === "optimizer") return what;
  const unit = unitLabel(e.unit);
  return e.bytes ? `${what} ${unit} · ${fmtBytes(e.bytes)}` : `${what} ${unit}`;
}

export function renderRanks(container, state) {
  const ranks = state.ranks || [];
  container.replaceChildren(...ranks.map((r) => {
    const colour = RANK_COLOURS[r.rank % RANK_COLOURS.length];
    const mesh = r.mesh || { shard_rank: 0, shard_size: 1, replicate_size: 1 };
    const replica = Math.floor(r.rank / (mesh.shard_size || 1));
    const where = mesh.replicate_size > 1
      ? `shard ${mesh.shard_rank} of ${mesh.shard_size} · replica group ${replica} of ${mesh.replicate_size}`
      : `shard ${mesh.shard_rank} of ${mesh.shard_size}`;
    const events = r.events || [];
    return el("article", { class: "rank-panel", "data-testid": "rank-panel", "data-rank": r.rank,
      style: { borderTopColor: colour } },
      el("h3", {}, `rank ${r.rank} `, el("small", { text: `${where} · ${r.device || "cpu"}` })),
      shardMap(r, colour),
      memoryTable(r, state.reference),
      el("canvas", { class: "gantt", width: 320, height: 78 }),
      el("div", { class: "now", "data-testid": "now-playing",
        text: events.length ? "" : "No step yet: press Train Step." }),
      el("ol", { class: "phases", "data-testid": "phase-list" },
        events.map((e) => el("li", { "data-testid": "phase", "data-phase": e.phase,
          "data-unit": e.unit, "data-bytes": e.bytes, "data-collective": e.collective },
          el("i", { class: "dot", style: { background: PHASE_COLOURS[e.phase] || "#000" } }),
          phaseText(e)))));
  }));
}

export function renderLegend(container) {
  container.replaceChildren(...Object.entries(PHASE_NAMES).filter(([k]) => k !== "step")
    .map(([k, v]) => el("span", {}, el("i", { class: "dot", style: {
      background: PHASE_COLOURS[k] } }), v)));
}

function drawGantt(canvas, rank, span, playhead, hideRoot) {
  const { ctx, w, h } = prepareCanvas(canvas);
  const X = (t) => 4 + (t / (span || 1)) * (w - 8);
  ctx.fillStyle = "#f8f9fa";
  ctx.fillRect(0, 0, w, h);
  const lanes = { compute: 6, comm: 28 };
  for (const e of rank.events) {
    if (e.phase === "reshard") {
      ctx.fillStyle = PHASE_COLOURS.reshard;
      ctx.fillRect(X(e.t0) - 1, lanes.compute, 2, 38);
      continue;
    }
    if (hideRoot && e.unit === "" && (e.phase === "forward" || e.phase === "backward")) continue;
    const y = e.collective ? lanes.comm : lanes.compute;
    ctx.globalAlpha = e.t0 <= playhead ? 1 : 0.25;
    ctx.fillStyle = PHASE_COLOURS[e.phase] || "#000";
    ctx.fillRect(X(e.t0), y, Math.max(2, X(e.t1) - X(e.t0)), 16);
    ctx.globalAlpha = 1;
  }
  // The unsharded working set after each event, as a step line.
  const peak = Math.max(1, ...rank.events.map((e) => e.live || 0));
  ctx.strokeStyle = "#343a40";
  ctx.lineWidth = 1.5;
  ctx.beginPath();
  let last = 0;
  ctx.moveTo(X(0), h - 4);
  for (const e of [...rank.events].sort((a, b) => a.t1 - b.t1)) {
    if (e.t1 > playhead) break;
    const y = h - 4 - (22 * (e.live || 0)) / peak;
    ctx.lineTo(X(e.t1), h - 4 - (22 * last) / peak);
    ctx.lineTo(X(e.t1), y);
    last = e.live || 0;
  }
  ctx.stroke();
  ctx.strokeStyle = "#212529";
  ctx.beginPath();
  ctx.moveTo(X(Math.min(playhead, span)), 0);
  ctx.lineTo(X(Math.min(playhead, span)), h);
  ctx.stroke();
}

// Walks all panels through the latest step's events on one shared clock: panels show real
// overlap between ranks, because event times are on one clock (see session.py).
export class Player {
  constructor(container) {
    this.container = container;
    this.frame = null;
  }

  play(state) {
    if (this.frame) cancelAnimationFrame(this.frame);
    const ranks = state.ranks || [];
    const span = Math.max(0, ...ranks.flatMap((r) => r.events.map((e) => e.t1)));
    const hideRoot = ranks.some((r) => r.events.some((e) => e.unit !== "" &&
      (e.phase === "forward" || e.phase === "backward")));
    const panels = [...this.container.querySelectorAll('[data-testid="rank-panel"]')];
    const begin = performance.now();
    const tick = () => {
      const frac = span ? Math.min(1, (performance.now() - begin) / PLAY_MS) : 1;
      const playhead = frac * span;
      panels.forEach((panel, i) => {
        const rank = ranks[i];
        if (!rank) return;
        drawGantt(panel.querySelector("canvas.gantt"), rank, span, playhead, hideRoot);
        const items = panel.querySelectorAll('[data-testid="phase"]');
        let current = null;
        rank.events.forEach((e, k) => {
          const li = items[k];
          const started = e.t0 <= playhead;
          li.classList.toggle("pending", !started);
          li.classList.toggle("active", started && e.t1 > playhead);
          if (started) current = e;
        });
        const now = panel.querySelector('[data-testid="now-playing"]');
        if (rank.events.length) {
          now.textContent = frac < 1 && current
            ? `now: ${PHASE_NAMES[current.phase] || current.phase} ${current.phase === "optimizer" ? "" : unitLabel(current.unit)}`
            : `step ${state.step}: ${rank.events.length} events in ${span.toFixed(1)} ms`;
        }
      });
      if (frac < 1) this.frame = requestAnimationFrame(tick);
    };
    tick();
  }
}
