// Switchyard dashboard: polls dashboard/data for the chosen window and draws the time
// series, the layer x expert heatmap and the tables.
"use strict";

const params = new URLSearchParams(location.search);
// At least half a second between polls, whatever the URL asks (0 too); 2 s by default
// and for what is not a number.
const asked = 1000 * Number(params.get("refresh") ?? 2);
const refreshMs = Math.max(500, Number.isFinite(asked) ? asked : 2000);
const $ = (id) => document.getElementById(id);
let chosen = params.get("window");  // null: the server's default
let shape = "";
let renders = 0;
let last = null;

function row(cells, numeric) {
  const tr = document.createElement("tr");
  cells.forEach((cell, i) => {
    const td = document.createElement("td");
    if (cell instanceof Node) td.appendChild(cell); else td.textContent = cell;
    if (numeric.includes(i)) td.className = "num";
    tr.appendChild(td);
  });
  return tr;
}

function link(href, text) {
  const a = document.createElement("a");
  a.href = href;
  a.textContent = text;
  return a;
}

function expertHref(layer, expert) {
  const query = new URLSearchParams({layer, expert});
  if (chosen !== null) query.set("window", chosen);
  return `dashboard/expert?${query}`;
}

function colour(t) {  // 0 (light yellow) .. 1 (dark red)
  return `hsl(${Math.round(55 - 55 * t)}, 90%, ${Math.round(88 - 50 * t)}%)`;
}

function buildGrid(layers, numExperts) {
  const table = $("heatmap");
  table.replaceChildren();
  // Cells as large as fit: 8 experts get big squares, 256 get small ones.
  const size = Math.max(12, Math.min(44, Math.floor(880 / Math.max(numExperts, 1))));
  table.style.setProperty("--cell", size + "px");
  const head = document.createElement("tr");
  head.appendChild(document.createElement("th"));
  for (let e = 0; e < numExperts; e++) {
    const th = document.createElement("th");
    th.textContent = e;
    head.appendChild(th);
  }
  table.appendChild(head);
  for (const layer of layers) {
    const tr = document.createElement("tr");
    const th = document.createElement("th");
    th.textContent = "L" + layer;
    tr.appendChild(th);
    for (let e = 0; e < numExperts; e++) {
      const td = document.createElement("td");
      td.className = "cell";
      td.id = `cell-${layer}-${e}`;
      td.dataset.layer = layer;
      td.dataset.expert = e;
      td.addEventListener("click", () => { location.href = expertHref(layer, e); });
      tr.appendChild(td);
    }
    table.appendChild(tr);
  }
}

function renderHeatmap(d) {
  const key = d.moe_layers.join(",") + "/" + d.num_experts;
  if (key !== shape) {
    buildGrid(d.moe_layers, d.num_experts);
    shape = key;
  }
  const metric = $("metric").value;
  const byCell = new Map(d.experts.map((x) => [`${x.layer}-${x.expert}`, x]));
  const max = Math.max(0, ...d.experts.map((x) => x[metric] || 0));
  for (const td of document.querySelectorAll("#heatmap td.cell")) {
    const x = byCell.get(`${td.dataset.layer}-${td.dataset.expert}`);
    const calls = x ? x.calls : 0;
    td.dataset.calls = calls;
    td.dataset.tokens = x ? x.tokens : 0;
    td.dataset.p50S = x && x.p50_s !== null ? x.p50_s : "";
    td.dataset.p99S = x && x.p99_s !== null ? x.p99_s : "";
    td.title = `layer ${td.dataset.layer} expert ${td.dataset.expert}` + (calls
      ? ` (rank ${x.ranks.join(",")}): p50 ${seconds(x.p50_s)}, p99 ${seconds(x.p99_s)},`
        + ` ${x.tokens} tokens in ${calls} calls`
      : ": no tokens in this window");
    td.style.background = calls && max > 0 ? colour((x[metric] || 0) / max) : "";
  }
  $("legend").textContent = `colour: ${$("metric").selectedOptions[0].text}, `
    + (metric === "tokens" ? `0 to ${max}` : `0 to ${seconds(max)}`) + "; grey: idle";
}

function renderCharts(d) {
  const t1 = Math.max(Date.now() / 1000, ...d.points.map((p) => p.t));
  const t0 = d.window_s !== null ? t1 - d.window_s
    : Math.min(t1 - d.interval_s, ...d.points.map((p) => p.t));
  for (const chart of d.charts) {
    drawChart(chartCard($("charts"), chart), chart, d.points, d.events, t0, t1);
  }
}

function renderTables(d) {
  $("slowest").tBodies[0].replaceChildren(...d.slowest.map((x) => row(
    [link(expertHref(x.layer, x.expert), x.layer), link(expertHref(x.layer, x.expert), x.expert),
     x.ranks.join(","), seconds(x.p50_s), seconds(x.p99_s), x.tokens], [3, 4, 5])));
  const ranks = d.balance.ranks;
  const total = ranks.reduce((sum, r) => sum + r.tokens, 0);
  const fair = ranks.length ? total / ranks.length : 0;
  $("balancedness").textContent = d.balance.balancedness === null ? ""
    : `· balancedness ${d.balance.balancedness.toFixed(2)}`;
  $("balancedness").title = "mean over max of the ranks' rows, layer by layer (1: even)";
  $("ranks").tBodies[0].replaceChildren(...ranks.map((r) => {
    const tr = row([r.rank, r.tokens, total ? `${Math.round(100 * r.tokens / total)}%` : "–",
      ""], [1, 2]);
    const bar = document.createElement("div");
    bar.className = "bar";
    bar.style.width = `${fair ? Math.min(100, 50 * r.tokens / fair) : 0}%`;
    bar.title = fair ? `${(r.tokens / fair).toFixed(2)}x a fair share` : "";
    tr.children[3].appendChild(bar);
    return tr;
  }));
  const rebalance = d.eplb.last;
  $("rebalance").textContent = !d.eplb.enabled ? "expert rebalancing: off (--enable-eplb)"
    : !rebalance ? "expert rebalancing: on, none yet"
    : `last rebalance: ${clock(rebalance.started)}, `
      + `${rebalance.duration_s.toFixed(2)} s (load ${rebalance.load_s.toFixed(2)} s), `
      + `placement version ${rebalance.version}, ${rebalance.moved} copies moved`
      + (rebalance.error ? `, failed: ${rebalance.error}` : "");
  const spec = d.speculation;
  $("speculation").textContent = !spec.drafts ? "no drafts in the window"
    : `acceptance ${Math.round(100 * spec.acceptance)}% of ${spec.draft_tokens} draft tokens; `
      + `mean accepted length ${spec.mean_accepted_length.toFixed(2)} tokens a verify step `
      + `(${spec.drafts} drafts)`;
  $("stages").tBodies[0].replaceChildren(...d.stages.map((x) => row(
    [x.stage, x.backend, x.calls, seconds(x.p50_s), seconds(x.p99_s)], [2, 3, 4])));
  const busy = (b) => Object.entries(b || {})
    .map(([side, f]) => `${side} ${Math.round(100 * f)}%`).join(", ");
  const now = Date.now() / 1000;
  $("services").tBodies[0].replaceChildren(...d.services.map((s) => {
    const address = s.url.replace(/^https?:\/\//, "").replace(/\/metrics$/, "");
    const tr = row([s.name, s.up ? "up" : "down", address, busy(s.busy),
      s.up && s.started ? duration(now - s.started) : ""], [4]);
    tr.children[1].className = s.up ? "up" : "down";
    if (s.detail) tr.children[1].title = s.detail;
    tr.dataset.role = s.role;
    return tr;
  }));
  const r = d.requests;
  $("request-summary").textContent = `· ${r.e2e.calls} finished, ${d.output_tokens} tokens; `
    + `TTFT p50 ${seconds(r.ttft.p50_s)} p99 ${seconds(r.ttft.p99_s)}; `
    + `TPOT p50 ${seconds(r.tpot.p50_s)} p99 ${seconds(r.tpot.p99_s)}`;
  $("requests").tBodies[0].replaceChildren(...d.slowest_requests.map((x) => row(
    [clock(x.ended), x.id, seconds(x.e2e_s), seconds(x.ttft_s), x.output_tokens,
     x.finish_reasons.join(","),
     x.trace_url ? link(x.trace_url, "trace") : (d.tracing_ui ? "not traced" : "")],
    [2, 3, 4])));
  for (const a of document.querySelectorAll("#requests a")) a.target = "_blank";
  $("events").tBodies[0].replaceChildren(...[...d.events].reverse().map((e) => {
    const tr = row([clock(e.t), e.kind, e.text], []);
    tr.className = `event-${e.kind}`;
    return tr;
  }));
}

function render(d) {
  last = d;
  $("model").textContent = d.model;
  fillWindows($("window-select"), d.windows, d.window);
  $("window").textContent = d.window_s === null
    ? "since the services started" : `last ${Math.round(d.window_s)} s`;
  renderCharts(d);
  renderHeatmap(d);
  renderTables(d);
  $("updated").textContent = "updated " + new Date().toLocaleTimeString();
  document.body.dataset.renders = ++renders;
}

keyForm($("key-form"), $("admin-key"));
const refresh = poll("dashboard/data",
  () => chosen === null ? "" : "?window=" + encodeURIComponent(chosen), render, refreshMs);
onWindowChange($("window-select"), (value) => { chosen = value; }, refresh);
$("metric").addEventListener("change", () => last && renderHeatmap(last));
refresh();
