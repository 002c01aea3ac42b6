// Switchyard: one expert's page. Polls dashboard/expert/data for its latency histogram
// over the window, its load at each tick and the ranks that hold it.
"use strict";

const params = new URLSearchParams(location.search);
const asked = 1000 * Number(params.get("refresh") ?? 2);
const refreshMs = Math.max(500, Number.isFinite(asked) ? asked : 2000);
const $ = (id) => document.getElementById(id);
let chosen = params.get("window");
let renders = 0;
const LOAD = {key: "load", title: "Tokens between kept readings (every 10 s or more)", unit: "tokens",
  lines: [{key: "tokens", legend: "tokens", per: null}, {key: "calls", legend: "calls", per: null}]};

// The histogram's buckets as bars (one per finite bound, the last for +Inf), each with
// data-le and data-count.
function drawHistogram(svg, buckets) {
  const W = 460, H = 150, L = 40, B = 30, T = 8;
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.replaceChildren();
  const top = Math.max(1, ...buckets.map((b) => b.count));
  const width = (W - L - 8) / Math.max(1, buckets.length);
  buckets.forEach((b, i) => {
    const h = (H - T - B) * b.count / top;
    const bar = el("rect", {x: L + i * width + 1, y: H - B - h, width: width - 2, height: h,
      class: "bucket", fill: "#4a7fb5", "data-le": b.le, "data-count": b.count});
    bar.appendChild(el("title", {}, `≤ ${b.le === null ? "+Inf" : seconds(b.le)}: ${b.count}`));
    svg.appendChild(bar);
    if (i % Math.ceil(buckets.length / 8) === 0) {
      svg.appendChild(el("text", {x: L + i * width, y: H - B + 12, class: "axis"},
        b.le === null ? "+Inf" : seconds(b.le)));
    }
  });
  svg.appendChild(el("text", {x: L - 4, y: T + 8, class: "axis", "text-anchor": "end"}, top));
}

function render(d) {
  $("title").textContent = `layer ${d.layer}, expert ${d.expert}`;
  fillWindows($("window-select"), d.windows, d.window);
  $("window").textContent = d.window_s === null
    ? "since the services started" : `last ${Math.round(d.window_s)} s`;
  $("summary").textContent = d.calls
    ? `· ${d.calls} calls, ${d.tokens} tokens; p50 ${seconds(d.p50_s)}, p99 ${seconds(d.p99_s)}`
    : "· no calls in this window";
  // (JSON has no infinity: the +Inf bound arrives as null)
  drawHistogram($("histogram"), d.buckets.map((b) => ({le: b.le, count: b.count})));
  const points = d.load.map((p) => ({t: p.t, tokens: p.tokens, calls: p.calls}));
  const t1 = Math.max(Date.now() / 1000, ...points.map((p) => p.t));
  const t0 = d.window_s !== null ? t1 - d.window_s
    : Math.min(t1 - d.interval_s, ...points.map((p) => p.t));
  drawChart(chartCard($("load-charts"), LOAD), LOAD, points, [], t0, t1);
  $("ranks").textContent = (d.placement_ranks === null
    ? "initial placement" : `placed on rank ${d.placement_ranks.join(", ")}`
      + (d.placement_ranks.length > 1 ? ` (${d.placement_ranks.length} replicas)` : ""))
    + `; has computed on rank ${d.computed_on.join(", ") || "none"} since the services started`;
  $("ranks").dataset.placement = JSON.stringify(d.placement_ranks);
  $("ranks").dataset.computedOn = JSON.stringify(d.computed_on);
  $("updated").textContent = "updated " + new Date().toLocaleTimeString();
  document.body.dataset.renders = ++renders;
}

keyForm($("key-form"), $("admin-key"));
const query = () => {
  const q = new URLSearchParams({layer: params.get("layer"), expert: params.get("expert")});
  if (chosen !== null) q.set("window", chosen);
  return "?" + q;
};
const refresh = poll("expert/data", query, render, refreshMs);
onWindowChange($("window-select"), (value) => { chosen = value; }, refresh);
refresh();
