// Switchyard expert dashboard: polls dashboard/data and draws the layer x expert heatmap.
"use strict";

const params = new URLSearchParams(location.search);
const windowParam = params.get("window");
// At least half a second between polls, whatever the URL asks (0 too); 2 s by default
// and for what is not a number.
const asked = 1000 * Number(params.get("refresh") ?? 2);
const refreshMs = Math.max(500, Number.isFinite(asked) ? asked : 2000);
const $ = (id) => document.getElementById(id);
let shape = "";
let renders = 0;
let last = null;

function seconds(s) {
  if (s === null || s === undefined) return "–";
  if (s < 1e-3) return (s * 1e6).toPrecision(3) + " µs";
  if (s < 1) return (s * 1e3).toPrecision(3) + " ms";
  return s.toPrecision(3) + " s";
}

function colour(t) {  // 0 (light yellow) .. 1 (dark red)
  return `hsl(${Math.round(55 - 55 * t)}, 90%, ${Math.round(88 - 50 * t)}%)`;
}

function row(cells, numeric) {
  const tr = document.createElement("tr");
  cells.forEach((text, i) => {
    const td = document.createElement("td");
    td.textContent = text;
    if (numeric.includes(i)) td.className = "num";
    tr.appendChild(td);
  });
  return tr;
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
      tr.appendChild(td);
    }
    table.appendChild(tr);
  }
}

function render(d) {
  last = d;
  $("model").textContent = d.model;
  $("window").textContent = d.window_s === null
    ? "since the services started" : `last ${Math.round(d.window_s)} s`;
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
  $("slowest").tBodies[0].replaceChildren(...d.slowest.map((x) => row(
    [x.layer, x.expert, x.ranks.join(","), seconds(x.p50_s), seconds(x.p99_s), x.tokens],
    [3, 4, 5])));
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
    : `last rebalance: ${new Date(1000 * rebalance.started).toLocaleTimeString()}, `
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
  const services = [
    ...d.engines.map((e) => [`attention ${e.address}`, e.ready, e.dispatch_backend || "", ""]),
    ...d.services.map((s) => [s.url, s.up, s.error || "metrics scraped", busy(s.busy)]),
  ];
  $("services").tBodies[0].replaceChildren(...services.map(([name, ok, detail, share]) => {
    const tr = row([name, ok ? "up" : "down", detail, share], [3]);
    tr.children[1].className = ok ? "up" : "down";
    return tr;
  }));
  $("updated").textContent = "updated " + new Date().toLocaleTimeString();
  document.body.dataset.renders = ++renders;
}

// The data is an operator endpoint: with --admin-api-key the page asks for the key once
// and keeps it for this tab only (sessionStorage), sending it as a bearer token.
const KEY = "switchyard-admin-key";

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem(KEY, $("admin-key").value);
  $("admin-key").value = "";
  $("key-form").hidden = true;
});

async function refresh() {
  try {
    const query = windowParam ? "?window=" + encodeURIComponent(windowParam) : "";
    const key = sessionStorage.getItem(KEY);
    const response = await fetch("dashboard/data" + query,
                                 key ? {headers: {Authorization: "Bearer " + key}} : {});
    if (response.status === 401 || response.status === 403) {
      $("key-form").hidden = false;
      const body = await response.json().catch(() => null);
      throw new Error(body?.error?.message ?? `dashboard/data answered ${response.status}`);
    }
    if (!response.ok) throw new Error(`dashboard/data answered ${response.status}`);
    render(await response.json());
    $("error").hidden = true;
    $("key-form").hidden = true;
  } catch (err) {
    $("error").textContent = String(err);
    $("error").hidden = false;
  } finally {
    setTimeout(refresh, refreshMs);
  }
}

$("metric").addEventListener("change", () => last && render(last));
refresh();
