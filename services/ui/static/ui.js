// rollbus ui: counts the token view's colours, keeps the overview live by polling, draws the per-version plot.
"use strict";

function countTokens() {
  const view = document.getElementById("trajectory");
  if (!view) return;
  const counts = { trained: 0, drift: 0, ctx: 0, prompt: 0 };
  for (const run of view.querySelectorAll(".tok")) {
    for (const cls of Object.keys(counts)) {
      if (run.classList.contains(cls)) counts[cls] += Number(run.dataset.n);
    }
  }
  for (const [cls, n] of Object.entries(counts)) {
    const out = document.getElementById("count-" + cls);
    if (out) out.textContent = String(n);
  }
  document.body.dataset.tokensCounted = "yes";
}

function lookup(data, path) {
  return path.split(".").reduce((value, key) => (value == null ? undefined : value[key]), data);
}

function plot(data) {
  const svg = document.getElementById("per-version-plot");
  if (!svg) return;
  const rows = data.per_version || [];
  const ns = "http://www.w3.org/2000/svg";
  svg.replaceChildren();
  if (rows.length === 0) return;
  const x = (i) => 30 + (rows.length === 1 ? 170 : (i * 340) / (rows.length - 1));
  const y = (v) => 105 - v * 90;
  for (const [key, colour] of [["reward_mean", "#3050c8"], ["solve_rate", "#1a7f37"]]) {
    const line = document.createElementNS(ns, "polyline");
    line.setAttribute("points", rows.map((r, i) => x(i) + "," + y(Math.max(0, Math.min(1, r[key])))).join(" "));
    line.setAttribute("fill", "none");
    line.setAttribute("stroke", colour);
    line.setAttribute("stroke-width", "2");
    svg.appendChild(line);
  }
  rows.forEach((r, i) => {
    for (const [key, colour] of [["reward_mean", "#3050c8"], ["solve_rate", "#1a7f37"]]) {
      const dot = document.createElementNS(ns, "circle");
      dot.setAttribute("cx", x(i));
      dot.setAttribute("cy", y(Math.max(0, Math.min(1, r[key]))));
      dot.setAttribute("r", "3");
      dot.setAttribute("fill", colour);
      svg.appendChild(dot);
    }
    const label = document.createElementNS(ns, "text");
    label.setAttribute("x", x(i) - 6);
    label.setAttribute("y", 118);
    label.setAttribute("font-size", "9");
    label.textContent = "v" + r.version;
    svg.appendChild(label);
  });
}

function show(data) {
  for (const el of document.querySelectorAll("[data-k]")) {
    const value = lookup(data, el.dataset.k);
    if (value === undefined || value === null) continue;
    if (el.dataset.fmt === "pct") el.textContent = (100 * value).toFixed(1) + "%";
    else if (typeof value === "number" && !Number.isInteger(value)) el.textContent = String(Number(value.toPrecision(4)));
    else el.textContent = String(value);
  }
  plot(data);
}

function poll(url) {
  fetch(url)
    .then((r) => r.json())
    .then(show)
    .catch(() => {})
    .finally(() => setTimeout(() => poll(url), 2000));
}

document.addEventListener("DOMContentLoaded", () => {
  countTokens();
  const overview = document.getElementById("overview");
  if (overview) {
    const first = document.getElementById("overview-data");
    if (first) plot(JSON.parse(first.textContent));
    setTimeout(() => poll(overview.dataset.poll), 2000);
  }
});
