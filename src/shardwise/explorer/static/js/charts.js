// Canvas drawing of our own (no chart library): line charts and the decision-region plot.

import { CLASS_COLOURS, prepareCanvas } from "./util.js";

const AXIS = "#6c757d";
const GRIDLINE = "#e9ecef";

// series: [{points: [[x, y], ...], colour, label, dashed}]; opts: {xMax, yMin, yMax, yFmt,
// xLabel, hlines: [{y, label}]}
export function lineChart(canvas, series, opts = {}) {
  const { ctx, w, h } = prepareCanvas(canvas);
  const pad = { l: 52, r: 12, t: 10, b: 26 };
  const all = series.flatMap((s) => s.points);
  const xMax = opts.xMax ?? Math.max(1, ...all.map((p) => p[0]));
  const xMin = opts.xMin ?? 0;
  let yMin = opts.yMin ?? Math.min(0, ...all.map((p) => p[1]));
  let yMax = opts.yMax ?? Math.max(1e-9, ...all.map((p) => p[1]));
  if (yMax === yMin) { yMax += 1; yMin -= 0; }
  const X = (x) => pad.l + ((x - xMin) / (xMax - xMin || 1)) * (w - pad.l - pad.r);
  const Y = (y) => h - pad.b - ((y - yMin) / (yMax - yMin)) * (h - pad.t - pad.b);
  const fmt = opts.yFmt || ((v) => v.toFixed(2));

  ctx.font = "11px system-ui, sans-serif";
  ctx.fillStyle = AXIS;
  ctx.strokeStyle = GRIDLINE;
  ctx.lineWidth = 1;
  for (let i = 0; i <= 4; i += 1) {
    const v = yMin + ((yMax - yMin) * i) / 4;
    ctx.beginPath();
    ctx.moveTo(pad.l, Y(v));
    ctx.lineTo(w - pad.r, Y(v));
    ctx.stroke();
    ctx.textAlign = "right";
    ctx.fillText(fmt(v), pad.l - 6, Y(v) + 4);
  }
  const xticks = opts.xTicks ?? Math.min(12, Math.round(xMax - xMin));
  ctx.textAlign = "center";
  for (let i = 0; i <= xticks; i += 1) {
    const v = xMin + ((xMax - xMin) * i) / (xticks || 1);
    ctx.fillText(opts.xFmt ? opts.xFmt(v) : String(Math.round(v)), X(v), h - pad.b + 14);
  }
  if (opts.xLabel) {
    ctx.textAlign = "right";
    ctx.fillText(opts.xLabel, w - pad.r, h - 2);
  }
  for (const line of opts.hlines || []) {
    ctx.save();
    ctx.setLineDash([4, 4]);
    ctx.strokeStyle = AXIS;
    ctx.beginPath();
    ctx.moveTo(pad.l, Y(line.y));
    ctx.lineTo(w - pad.r, Y(line.y));
    ctx.stroke();
    ctx.restore();
    ctx.textAlign = "left";
    ctx.fillText(line.label, pad.l + 4, Y(line.y) - 4);
  }
  for (const s of series) {
    if (!s.points.length) continue;
    ctx.save();
    ctx.strokeStyle = s.colour;
    ctx.fillStyle = s.colour;
    ctx.lineWidth = 2;
    if (s.dashed) ctx.setLineDash([5, 3]);
    ctx.beginPath();
    s.points.forEach(([x, y], i) => {
      if (s.step && i > 0) ctx.lineTo(X(x), Y(s.points[i - 1][1]));
      if (i === 0) ctx.moveTo(X(x), Y(y)); else ctx.lineTo(X(x), Y(y));
    });
    ctx.stroke();
    if (!s.step) {
      for (const [x, y] of s.points) {
        ctx.beginPath();
        ctx.arc(X(x), Y(y), 2.5, 0, 2 * Math.PI);
        ctx.fill();
      }
    }
    ctx.restore();
  }
  // Legend, top right (or bottom right, where a rising curve leaves room).
  ctx.textAlign = "right";
  const labelled = series.filter((s) => s.label);
  labelled.forEach((s, i) => {
    ctx.fillStyle = s.colour;
    const y = opts.legendBottom ? h - pad.b - 8 - 13 * (labelled.length - 1 - i)
      : pad.t + 12 + 13 * i;
    ctx.fillText(s.label, w - pad.r - 2, y);
  });
}

// Decision regions (one class digit and one confidence per lattice point) plus the data.
export function regionsPlot(canvas, state) {
  const { ctx, w, h } = prepareCanvas(canvas);
  const { n, extent } = state.grid;
  const ev = state.eval;
  if (ev && ev.regions && ev.regions.length === n * n) {
    // One pixel per lattice point, scaled up smoothly: no seams between cells.
    const small = document.createElement("canvas");
    small.width = n;
    small.height = n;
    const sctx = small.getContext("2d");
    const img = sctx.createImageData(n, n);
    for (let k = 0; k < n * n; k += 1) {
      const hex = CLASS_COLOURS[Number(ev.regions[k])];
      const alpha = 0.08 + 0.5 * Math.max(0, (ev.confidence[k] - 0.25) / 0.75);
      // Blend with white here, so the scaled image stays opaque and even.
      for (let c = 0; c < 3; c += 1) {
        const v = parseInt(hex.slice(1 + 2 * c, 3 + 2 * c), 16);
        img.data[4 * k + c] = Math.round(255 * (1 - alpha) + v * alpha);
      }
      img.data[4 * k + 3] = 255;
    }
    sctx.putImageData(img, 0, 0);
    ctx.imageSmoothingEnabled = true;
    ctx.drawImage(small, 0, 0, w, h);
  }
  const X = (u) => ((u + extent) / (2 * extent)) * w;
  const Y = (v) => ((extent - v) / (2 * extent)) * h;
  for (const [u, v, c] of state.points || []) {
    ctx.beginPath();
    ctx.arc(X(u), Y(v), 3.6, 0, 2 * Math.PI);
    ctx.fillStyle = CLASS_COLOURS[c];
    ctx.fill();
    ctx.lineWidth = 1;
    ctx.strokeStyle = "rgba(0,0,0,0.55)";
    ctx.stroke();
  }
  ctx.strokeStyle = "#adb5bd";
  ctx.strokeRect(0.5, 0.5, w - 1, h - 1);
}
