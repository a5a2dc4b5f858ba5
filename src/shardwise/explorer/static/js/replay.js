// Replay of a recorded `shardwise train` run: per-rank timelines and memory over time.

import { getJSON } from "./api.js";
import { lineChart } from "./charts.js";
import { renderLegend } from "./ranks.js";
import {
  PHASE_COLOURS, PHASE_NAMES, RANK_COLOURS, el, fmtBytes, prepareCanvas, unitLabel,
} from "./util.js";

const $ = (id) => document.getElementById(id);

function drawTimeline(canvas, rank, span) {
  const { ctx, w, h } = prepareCanvas(canvas);
  const X = (t) => 4 + (t / (span || 1)) * (w - 8);
  ctx.fillStyle = "#f8f9fa";
  ctx.fillRect(0, 0, w, h);
  const hideRoot = rank.events.some((e) => e.unit !== "" && !e.collective &&
    (e.phase === "forward" || e.phase === "backward"));
  for (const e of rank.events) {
    if (e.phase === "reshard") {
      // A tick where the unit's full parameters were freed (its duration is negligible,
      // or time spent waiting on a gather that must finish first).
      ctx.fillStyle = PHASE_COLOURS.reshard;
      ctx.fillRect(X(e.t1) - 0.75, 16, 1.5, 42);
      continue;
    }
    if (hideRoot && e.unit === "" && !e.collective) continue;
    ctx.fillStyle = PHASE_COLOURS[e.phase] || "#000";
    ctx.fillRect(X(e.t0), e.collective ? 42 : 20, Math.max(1.5, X(e.t1) - X(e.t0)), 18);
  }
  const peak = Math.max(1, ...rank.memory.map((m) => m[1]));
  ctx.strokeStyle = "#343a40";
  ctx.beginPath();
  let last = 0;
  ctx.moveTo(X(0), h - 3);
  for (const [t, b] of rank.memory) {
    ctx.lineTo(X(t), h - 3 - (20 * last) / peak);
    ctx.lineTo(X(t), h - 3 - (20 * b) / peak);
    last = b;
  }
  ctx.stroke();
  // Step boundaries: the first event of each step.
  const firsts = new Map();
  for (const e of rank.events) if (!firsts.has(e.step)) firsts.set(e.step, e.t0);
  ctx.fillStyle = "#212529";
  ctx.font = "10px system-ui, sans-serif";
  for (const [step, t] of firsts) ctx.fillText(`step ${step}`, X(t), 11);
}

async function showWindow(summary) {
  const start = Number($("replay-start").value);
  const count = Number($("replay-count").value);
  const win = await getJSON(`/api/replay/window?start=${start}&count=${count}`);
  const span = Math.max(0, ...win.ranks.flatMap((r) => r.events.map((e) => e.t1)));
  $("replay-ranks").replaceChildren(...win.ranks.map((r) => {
    const canvas = el("canvas", { width: 900, height: 86 });
    const bytes = r.events.filter((e) => e.collective).reduce((s, e) => s + e.bytes, 0);
    const row = el("div", { class: "replay-rank", "data-testid": "replay-rank",
      "data-rank": r.rank, style: { borderLeftColor: RANK_COLOURS[r.rank % 4] } },
    el("div", { class: "muted", text: `rank ${r.rank}: ${r.events.length} events, ` +
      `${fmtBytes(bytes)} sent through collectives, ${span.toFixed(1)} ms shown` }), canvas);
    drawTimeline(canvas, r, span);
    canvas.title = r.events.slice(0, 40).map((e) => `${PHASE_NAMES[e.phase] || e.phase} ` +
      `${unitLabel(e.unit)} ${e.bytes ? fmtBytes(e.bytes) : ""}`).join("\n");
    return row;
  }));
  if (!win.steps.length) {
    $("replay-ranks").append(el("p", { class: "muted",
      text: `No recorded events in steps ${start}..${start + count - 1}; recorded steps: ` +
        `${summary.steps[0]}..${summary.steps[summary.steps.length - 1]}.` }));
  }
}

function memoryChart(summary) {
  const series = [];
  const byRank = new Map();
  for (const m of summary.metrics) {
    (Array.isArray(m.memory_mb) ? m.memory_mb : [m.memory_mb]).forEach((v, r) => {
      if (typeof v !== "number") return;
      if (!byRank.has(r)) byRank.set(r, []);
      byRank.get(r).push([m.step, v]);
    });
  }
  for (const [r, pts] of byRank) {
    series.push({ points: pts, colour: RANK_COLOURS[r % 4], label: `rank ${r} memory (MB)` });
  }
  if (!series.length) {
    // No metrics: the reconstructed peak working set per recorded step instead.
    summary.ranks.forEach((r) => series.push({
      points: summary.per_step.filter((s) => s.ranks.some((x) => x.rank === r))
        .map((s) => [s.step, s.ranks.find((x) => x.rank === r).working_peak / 1e6]),
      colour: RANK_COLOURS[r % 4], label: `rank ${r} peak working set (MB)` }));
  }
  const xs = series.flatMap((s) => s.points.map((p) => p[0]));
  const xMin = Math.min(...xs);
  const xMax = Math.max(...xs, xMin + 1);
  lineChart($("replay-memory"), series, { xMin, xMax, xLabel: "step",
    yFmt: (v) => v.toFixed(1), xTicks: Math.min(10, xMax - xMin),
    xFmt: (v) => String(Math.round(v)) });
}

function table(summary) {
  const head = el("tr", {}, el("th", { text: "step" }),
    summary.ranks.map((r) => el("th", {
      text: `rank ${r}: span / collectives / bytes / working set`,
      title: "span: first to last event; collectives: time with a collective in flight " +
        "(overlapping ones once; they also overlap compute); bytes: sent by the rank " +
        "(received alike); working set: peak of gathered units, from all-gather and " +
        "reshard events; –: the rank did not exist in that step (a resume at another " +
        "world size)" })));
  const cell = (s, rank) => {
    const r = s.ranks.find((x) => x.rank === rank);
    return el("td", { class: "num", "data-rank": rank, text: r ? `${r.span_ms.toFixed(1)} ms / ` +
      `${r.comm_ms.toFixed(1)} ms / ${fmtBytes(r.bytes)} / ${fmtBytes(r.working_peak)}` : "–" });
  };
  const rows = summary.per_step.slice(0, 200).map((s) => el("tr", {},
    el("td", { class: "num", text: s.step }),
    summary.ranks.map((rank) => cell(s, rank))));
  $("replay-table").replaceChildren(el("table", { class: "grid-table" }, head, rows));
}

export async function startReplay() {
  const summary = await getJSON("/api/replay");
  document.querySelector("h1").textContent = "Fully Sharded Data Parallel, replayed";
  document.querySelector(".sub").textContent = `A recorded shardwise train run (${summary.path}),` +
    ` ${summary.ranks.length} rank(s), ${summary.steps.length} step(s) with events.`;
  $("replay-name").textContent = summary.name;
  $("replay-config").textContent = summary.config_text || "(no config.toml)";
  if (summary.steps.length) $("replay-start").value = String(summary.steps[0]);
  $("replay-start").addEventListener("change", () => showWindow(summary));
  $("replay-count").addEventListener("change", () => showWindow(summary));
  renderLegend($("replay-legend"));
  memoryChart(summary);
  table(summary);
  await showWindow(summary);
}
