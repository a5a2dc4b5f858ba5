// Small helpers shared by every view: formatting, element creation, colours.

export const CLASS_COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"];
export const RANK_COLOURS = ["#0b6e99", "#b35c00", "#3f7f3f", "#8a3fa0"];
// One colour per engine phase (the Event schema's `phase`) and for the trainer's optimizer.
export const PHASE_COLOURS = {
  all_gather: "#2b7bd6", reduce_scatter: "#e07b00", all_reduce: "#9c4fd6",
  forward: "#2f9e44", backward: "#12877f", reshard: "#868e96", optimizer: "#c92a2a",
  step: "#495057",
};
export const PHASE_NAMES = {
  all_gather: "all-gather", reduce_scatter: "reduce-scatter", all_reduce: "all-reduce",
  forward: "forward", backward: "backward", reshard: "reshard",
  optimizer: "optimizer step on shards", step: "step",
};

export function fmtBytes(n) {
  if (n === null || n === undefined || Number.isNaN(n)) return "–";
  const units = ["B", "KB", "MB", "GB", "TB", "PB"];
  let i = 0;
  let v = Number(n);
  while (Math.abs(v) >= 1000 && i < units.length - 1) { v /= 1000; i += 1; }
  const digits = i === 0 ? 0 : v < 10 ? 2 : v < 100 ? 1 : 0;
  return `${v.toLocaleString("en-US", { maximumFractionDigits: digits })} ${units[i]}`;
}

export function fmtSeconds(s) {
  if (s < 1e-3) return `${(s * 1e6).toFixed(0)} µs`;
  if (s < 1) return `${(s * 1e3).toFixed(s < 0.01 ? 2 : 0)} ms`;
  return `${s.toFixed(2)} s`;
}

export function unitLabel(name) {
  return name === "" ? "root" : `unit ${name}`;
}

// el("div", {class: "x", "data-testid": "y"}, child, "text", ...)
export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "text") node.textContent = v;
    else if (k === "style" && typeof v === "object") Object.assign(node.style, v);
    else node.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined || c === false) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

// A canvas sized for the device's pixel ratio, so lines stay sharp on HiDPI screens.
export function prepareCanvas(canvas) {
  const ratio = window.devicePixelRatio || 1;
  const w = Number(canvas.dataset.w || canvas.getAttribute("width"));
  const h = Number(canvas.dataset.h || canvas.getAttribute("height"));
  canvas.dataset.w = w;
  canvas.dataset.h = h;
  if (canvas.width !== w * ratio) {
    canvas.width = w * ratio;
    canvas.height = h * ratio;
    canvas.style.width = `${w}px`;
    canvas.style.height = `${h}px`;
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, w, h);
  return { ctx, w, h };
}
