// Entry point: picks live or replay mode, wires the controls and applies server state.

import { getJSON, post, subscribe } from "./api.js";
import { lineChart, regionsPlot } from "./charts.js";
import { renderHow } from "./explain.js";
import { Player, renderLegend, renderRanks } from "./ranks.js";
import { startReplay } from "./replay.js";

const $ = (id) => document.getElementById(id);
const CONTROLS = {
  strategy: "ctl-strategy", world_size: "ctl-world", mixed_precision: "ctl-precision",
  wrap: "ctl-wrap",
};

let current = null; // the last state applied
let playKey = ""; // which step the mechanism panels are showing
let player = null;

function setStatus(text, kind = "") {
  const pill = $("status");
  pill.textContent = text;
  pill.className = `pill ${kind}`;
}

function statusText(state) {
  switch (state.status) {
    case "starting": return ["starting ranks…", "busy"];
    case "training": return ["training", "busy"];
    case "paused": return ["paused", ""];
    case "done": return ["run complete: Reset for new data", "ok"];
    case "error": return ["error", "bad"];
    default: return ["ready", "ok"];
  }
}

function renderControls(state) {
  const cfg = state.config;
  for (const [key, id] of Object.entries(CONTROLS)) {
    const node = $(id);
    if (document.activeElement !== node) node.value = String(cfg[key]);
    node.disabled = state.status === "starting";
  }
  const offload = $("ctl-offload");
  offload.checked = cfg.cpu_offload;
  offload.disabled = !state.offload.available || state.status === "starting";
  $("offload-reason").textContent = state.offload.available ? "" : state.offload.reason;
  offload.title = state.offload.reason;
  const err = $("error");
  err.hidden = !state.error;
  err.textContent = state.error ? `The run failed: ${state.error}` : "";
}

function renderSimulation(state) {
  const ev = state.eval;
  $("loss-value").textContent = ev ? ev.loss.toFixed(3) : "–";
  $("accuracy-value").textContent = ev ? `${(100 * ev.accuracy).toFixed(1)}%` : "–";
  regionsPlot($("regions"), state);
  const hist = state.history || [];
  lineChart($("loss-chart"), [
    { points: hist.map((h) => [h.step, h.loss]), colour: "#c92a2a", label: "loss, all points" },
    { points: hist.filter((h) => h.train_loss !== null).map((h) => [h.step, h.train_loss]),
      colour: "#868e96", label: "training batch (mean over ranks)", dashed: true },
  ], { xMax: state.steps, yMin: 0, xLabel: "step" });
  lineChart($("acc-chart"), [
    { points: hist.map((h) => [h.step, h.accuracy]), colour: "#2b7bd6", label: "accuracy" },
  ], { xMax: state.steps, yMin: 0, yMax: 1, xLabel: "step",
    yFmt: (v) => `${Math.round(100 * v)}%`, hlines: [{ y: 0.25, label: "chance" }],
    legendBottom: true });
}

function apply(state) {
  if (current && state.seq < current.seq) return; // an older message arriving late
  current = state;
  $("step-counter").textContent = `Step ${state.step} / ${state.steps}`;
  const [text, kind] = statusText(state);
  setStatus(text, kind);
  renderControls(state);
  const key = JSON.stringify([state.run, state.step, state.ranks.length]);
  if (key !== playKey) {
    playKey = key;
    renderRanks($("ranks"), state);
    player.play(state);
  }
  renderSimulation(state);
  renderHow($("how-body"), state);
}

async function act(action, body) {
  try {
    apply(await post(action, body));
  } catch (err) {
    const box = $("error");
    box.hidden = false;
    box.textContent = String(err.message || err);
  }
}

function startLive() {
  player = new Player($("ranks"));
  renderLegend($("legend"));
  $("btn-reset").addEventListener("click", () => act("reset"));
  $("btn-train").addEventListener("click", () => act("train"));
  $("btn-pause").addEventListener("click", () => act("pause"));
  $("btn-step").addEventListener("click", () => act("step"));
  for (const [key, id] of Object.entries(CONTROLS)) {
    $(id).addEventListener("change", (ev) => {
      const value = key === "world_size" ? Number(ev.target.value) : ev.target.value;
      act("config", { [key]: value });
    });
  }
  $("ctl-offload").addEventListener("change", (ev) => act("config",
    { cpu_offload: ev.target.checked }));
  subscribe(apply, (s) => { if (s !== "connected") setStatus(s, "busy"); });
}

async function main() {
  const info = await getJSON("/api/info");
  if (info.mode === "replay") {
    $("live").hidden = true;
    $("replay").hidden = false;
    setStatus("replay", "ok");
    await startReplay();
  } else {
    startLive();
  }
}

main().catch((err) => setStatus(`failed: ${err.message || err}`, "bad"));
