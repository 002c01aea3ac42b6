// Switchyard dashboard: small time-series charts drawn as plain SVG (no library), and
// the helpers both pages share.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const COLOURS = ["#4a7fb5", "#d9822b", "#3b9b59", "#b5484a", "#8a63b5", "#6b8e23",
  "#c0609a", "#2f9ea0"];
const EVENT_COLOURS = {rebalance: "#8a63b5", down: "#c62828", up: "#1a7f37",
  restart: "#d9822b", failover: "#b5484a"};

function seconds(s) {
  if (s === null || s === undefined) return "–";
  if (s < 1e-3) return (s * 1e6).toPrecision(3) + " µs";
  if (s < 1) return (s * 1e3).toPrecision(3) + " ms";
  return s.toPrecision(3) + " s";
}

function duration(s) {
  if (s === null || s === undefined) return "–";
  if (s < 60) return `${Math.floor(s)} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min ${Math.floor(s % 60)} s`;
  return `${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} min`;
}

function formatValue(unit, v) {
  if (v === null || v === undefined) return "–";
  if (unit === "s") return seconds(v);
  if (unit === "fraction") return `${Math.round(100 * v)}%`;
  return v >= 100 ? Math.round(v).toString() : v.toPrecision(3);
}

function clock(t) {
  return new Date(1000 * t).toLocaleTimeString();
}

function el(name, attrs = {}, text = "") {
  const node = document.createElementNS(SVG, name);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text) node.textContent = text;
  return node;
}

// The series of one chart: [{key, legend, values: [[t, v], ...]}], a `per` line
// expanded into one series per label value (point keys "key:VALUE").
function chartSeries(chart, points) {
  const out = [];
  for (const line of chart.lines) {
    const keys = line.per === null ? [line.key] : [...new Set(points.flatMap(
      (p) => Object.keys(p).filter((k) => k.startsWith(line.key + ":"))))].sort();
    for (const key of keys) {
      const label = line.per === null ? line.legend
        : line.legend.replace(`{{${line.per}}}`, key.slice(line.key.length + 1));
      out.push({key, legend: label, values: points.map((p) => [p.t, p[key]])});
    }
  }
  return out;
}

// Draw `chart` (a charts.CHARTS entry) over [t0, t1] into `svg`: a line per series
// (broken where a tick has no value), its latest value in the legend, and each event as a
// vertical line (data-kind, data-t; its text as the tooltip).
function drawChart(svg, chart, points, events, t0, t1) {
  const W = 460, H = 150, L = 52, R = 8, T = 8, B = 20;
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.replaceChildren();
  const series = chartSeries(chart, points);
  const all = series.flatMap((s) => s.values.map(([, v]) => v)).filter((v) => v !== null && v !== undefined);
  const top = chart.unit === "fraction" ? 1 : (Math.max(0, ...all) || 1) * 1.1;  // (all 0: 0..1)
  const x = (t) => L + (W - L - R) * (t1 > t0 ? (t - t0) / (t1 - t0) : 1);
  const y = (v) => T + (H - T - B) * (1 - v / top);
  svg.appendChild(el("rect", {x: L, y: T, width: W - L - R, height: H - T - B, class: "plot"}));
  svg.appendChild(el("text", {x: L - 4, y: T + 8, class: "axis", "text-anchor": "end"},
    formatValue(chart.unit, top)));
  svg.appendChild(el("text", {x: L - 4, y: H - B, class: "axis", "text-anchor": "end"}, "0"));
  svg.appendChild(el("text", {x: L, y: H - 5, class: "axis"}, clock(t0)));
  svg.appendChild(el("text", {x: W - R, y: H - 5, class: "axis", "text-anchor": "end"},
    clock(t1)));
  series.forEach((s, i) => {
    let d = "", pen = "M";
    for (const [t, v] of s.values) {
      if (v === null || v === undefined || t < t0) { pen = "M"; continue; }
      d += `${pen}${x(t).toFixed(1)},${y(v).toFixed(1)}`;
      pen = "L";
    }
    const path = el("path", {d, class: "line", stroke: COLOURS[i % COLOURS.length],
      "data-series": s.key});
    svg.appendChild(path);
  });
  for (const e of events) {
    if (e.t < t0 || e.t > t1) continue;
    const mark = el("line", {x1: x(e.t), x2: x(e.t), y1: T, y2: H - B, class: "event",
      stroke: EVENT_COLOURS[e.kind] || "#555", "data-kind": e.kind, "data-t": e.t});
    mark.appendChild(el("title", {}, `${clock(e.t)} ${e.text}`));
    svg.appendChild(mark);
  }
  const legend = svg.parentNode.querySelector(".legend");
  legend.replaceChildren(...series.map((s, i) => {
    const item = document.createElement("span");
    const last = [...s.values].reverse().find(([, v]) => v !== null && v !== undefined);
    item.style.color = COLOURS[i % COLOURS.length];
    item.textContent = `${s.legend} ${last ? formatValue(chart.unit, last[1]) : "–"}`;
    return item;
  }));
}

// One chart's card (title, SVG, legend) in `container`, made once per chart key.
function chartCard(container, chart) {
  let card = container.querySelector(`#chart-${chart.key}`);
  if (!card) {
    card = document.createElement("figure");
    card.id = `chart-${chart.key}`;
    card.className = "chart";
    const caption = document.createElement("figcaption");
    caption.textContent = chart.title;
    const legend = document.createElement("div");
    legend.className = "legend";
    card.append(caption, el("svg"), legend);
    container.appendChild(card);
  }
  return card.querySelector("svg");
}

// The window picker: the server's choices, plus the one the page's URL asked for first
// (a number of seconds) if it is not one of them.
const firstWindow = Number(new URLSearchParams(location.search).get("window"));

function fillWindows(select, windows, asked) {
  const label = (w) => w === null ? "since start"
    : w % 60 === 0 ? `last ${w / 60} min` : `last ${w} s`;
  const values = [...windows];
  for (const w of [firstWindow, asked]) {
    if (w !== null && w > 0 && !values.includes(w)) values.unshift(w);
  }
  const key = values.map(String).join(",");
  if (select.dataset.key !== key) {
    select.replaceChildren(...values.map((w) => {
      const option = document.createElement("option");
      option.value = w === null ? "all" : String(w);
      option.textContent = label(w);
      return option;
    }));
    select.dataset.key = key;
  }
  select.value = asked === null ? "all" : String(asked);
}

// A window picked: remembered in the page's URL (without reloading it), and fetched now.
function onWindowChange(select, choose, refresh) {
  select.addEventListener("change", (event) => {
    choose(event.target.value);
    const url = new URL(location.href);
    url.searchParams.set("window", event.target.value);
    history.replaceState(null, "", url);
    refresh();
  });
}

// The data endpoints are operator endpoints: with --admin-api-key the page asks for the
// key once and keeps it for this tab only (sessionStorage), sending it as a bearer token.
const KEY = "switchyard-admin-key";

function keyForm(form, input) {
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    sessionStorage.setItem(KEY, input.value);
    input.value = "";
    form.hidden = true;
  });
}

// Poll `path` (its query built by `query()`) every `refreshMs`, handing each answer to
// `render`; errors show in #error, and a 401/403 opens the key form.
function poll(path, query, render, refreshMs) {
  const $ = (id) => document.getElementById(id);
  let timer = null;
  async function refresh() {
    clearTimeout(timer);
    try {
      const key = sessionStorage.getItem(KEY);
      const response = await fetch(path + query(),
                                   key ? {headers: {Authorization: "Bearer " + key}} : {});
      if (response.status === 401 || response.status === 403) {
        $("key-form").hidden = false;
        const body = await response.json().catch(() => null);
        throw new Error(body?.error?.message ?? `${path} answered ${response.status}`);
      }
      if (!response.ok) {
        const body = await response.json().catch(() => null);
        throw new Error(body?.error?.message ?? `${path} answered ${response.status}`);
      }
      render(await response.json());
      $("error").hidden = true;
      $("key-form").hidden = true;
    } catch (err) {
      $("error").textContent = String(err);
      $("error").hidden = false;
    } finally {
      timer = setTimeout(refresh, refreshMs);
    }
  }
  return refresh;
}
