// The pool view: polls /v1/pool every second and redraws. No library, no request beyond this
// aggregator. A token for an aggregator that needs one goes in the address's fragment
// (/#token=...), which the browser never sends: it is sent as a bearer header instead.
"use strict";

const POLL_MS = 1000;
const SVG = "http://www.w3.org/2000/svg";
const token = new URLSearchParams(location.hash.slice(1)).get("token");

function el(tag, attrs, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

function svgEl(tag, attrs) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  return e;
}

const fixed = (v, d) => (v === null || v === undefined ? "–" : Number(v).toFixed(d));
const percent = (v) => (v === null || v === undefined ? "–" : (100 * v).toFixed(1) + "%");

// A line over time into `box`: `values` is [{t, v}] (v null: a gap), drawn on 0..max
// (max grows to fit), with dashed marks at `marks` ([{v, label}]).
function lineChart(box, name, values, opts) {
  box.replaceChildren();
  const known = values.filter((p) => p.v !== null && p.v !== undefined);
  if (known.length === 0) {
    box.append(el("div", { class: "nodata", "data-chart": name, "data-points": "0" }, opts.empty || "no data yet"));
    return;
  }
  const w = 300, h = 110, left = 30, top = 6, bottom = 16;
  const t0 = values[0].t, t1 = Math.max(values[values.length - 1].t, t0 + 1);
  let max = opts.max || 0;
  for (const p of known) max = Math.max(max, p.v);
  for (const m of opts.marks || []) max = Math.max(max, m.v * 1.1);
  if (max <= 0) max = 1;
  const x = (t) => left + ((t - t0) / (t1 - t0)) * (w - left - 4);
  const y = (v) => top + (1 - v / max) * (h - top - bottom);
  const svg = svgEl("svg", { viewBox: `0 0 ${w} ${h}`, preserveAspectRatio: "none",
    "data-chart": name, "data-points": String(known.length), "data-last": String(known[known.length - 1].v) });
  for (const m of opts.marks || []) {
    svg.append(svgEl("line", { class: "mark", x1: left, x2: w - 4, y1: y(m.v), y2: y(m.v) }));
    const label = svgEl("text", { class: "axis", x: w - 6, y: y(m.v) - 2, "text-anchor": "end" });
    label.textContent = m.label;
    svg.append(label);
  }
  for (const v of [0, max]) {
    const label = svgEl("text", { class: "axis", x: left - 4, y: y(v) + 3, "text-anchor": "end" });
    label.textContent = opts.format ? opts.format(v) : fixed(v, v < 10 ? 1 : 0);
    svg.append(label);
  }
  const span = svgEl("text", { class: "axis", x: w - 4, y: h - 3, "text-anchor": "end" });
  span.textContent = `last ${Math.round((t1 - t0) / 1000)} s`;
  svg.append(span);
  // A gap (no value) breaks the line.
  let run = [];
  const flush = () => {
    if (run.length === 1) {
      // A lone value between gaps: a dot, or it would not show.
      const [cx, cy] = run[0].split(",");
      svg.append(svgEl("circle", { class: "dot", cx, cy, r: 2 }));
    } else if (run.length) {
      svg.append(svgEl("polyline", { class: "line", points: run.join(" ") }));
    }
    run = [];
  };
  for (const p of values) {
    if (p.v === null || p.v === undefined) flush();
    else run.push(`${x(p.t).toFixed(1)},${y(p.v).toFixed(1)}`);
  }
  flush();
  box.append(svg);
}

// A small KV-use line for one endpoint's row (0..1).
function sparkline(values) {
  const w = 140, h = 28;
  const svg = svgEl("svg", { viewBox: `0 0 ${w} ${h}`, preserveAspectRatio: "none",
    "data-chart": "kv", "data-points": String(values.length) });
  if (values.length > 1) {
    const step = w / (values.length - 1);
    const pts = values.map((v, i) => `${(i * step).toFixed(1)},${(h - 1 - v * (h - 2)).toFixed(1)}`);
    svg.append(svgEl("polyline", { class: "line", points: pts.join(" ") }));
  }
  return svg;
}

function state(e) {
  if (!e.ready) return { key: "not-ready", text: e.stale && e.metrics_age_ms !== null
    ? `not ready, stale: metrics ${(e.metrics_age_ms / 1000).toFixed(1)} s old` : "not ready" };
  if (e.stale) return { key: "stale", text: e.metrics_age_ms === null ? "stale: never scraped"
    : `stale: metrics ${(e.metrics_age_ms / 1000).toFixed(1)} s old` };
  return { key: "ready", text: "ready" };
}

function renderRows(data) {
  const body = document.querySelector("#endpoints tbody");
  body.replaceChildren();
  for (const e of data.endpoints) {
    const s = state(e);
    const b = e.cached_blocks;
    const tr = el("tr", {
      class: s.key === "ready" ? "" : s.key === "stale" ? "stale" : "not-ready stale",
      "data-endpoint": e.address, "data-state": s.key, "data-waiting": e.waiting,
      "data-running": e.running, "data-kv": e.kv_cache_usage, "data-gpu": b.gpu,
      "data-cpu": b.cpu, "data-storage": b.storage, "data-routed": e.routed,
    });
    tr.append(el("td", {}, e.address + (e.models.length ? "  " + e.models.join(", ") : "")));
    const st = el("td", { class: "state" + (s.key === "ready" ? " ok" : "") }, s.text);
    if (e.last_error) st.title = e.last_error;
    tr.append(st);
    tr.append(el("td", { class: "num" }, String(e.waiting)));
    tr.append(el("td", { class: "num" }, String(e.running)));
    const kv = el("td");
    const bar = el("span", { class: "bar" });
    const fill = el("span");
    // Through the CSSOM: the page's Content-Security-Policy refuses inline style attributes.
    fill.style.width = `${Math.round(100 * Math.min(1, e.kv_cache_usage))}%`;
    bar.append(fill);
    kv.append(bar, document.createTextNode(percent(e.kv_cache_usage)));
    tr.append(kv);
    const spark = el("td", { class: "spark" });
    spark.append(sparkline(data.history.map((h) => h.kv[e.address]).filter((v) => v !== undefined)));
    tr.append(spark);
    tr.append(el("td", { class: "num" }, e.kv_events ? `${b.gpu} / ${b.cpu} / ${b.storage}` : "no KV events"));
    tr.append(el("td", { class: "num" }, percent(e.prefix_hit_rate)));
    tr.append(el("td", { class: "num" }, String(e.routed)));
    body.append(tr);
  }
}

function renderEmpty(data) {
  const box = document.getElementById("empty");
  box.replaceChildren();
  if (!data.loaded) {
    box.append(el("h2", {}, "No pool yet"),
      el("p", {}, "The aggregator has not read its endpoint source yet (its configuration file, or the first " +
        "Kubernetes discovery of the InferencePool). Until then the filters keep their last snapshot. " +
        "This page fills in by itself once it has."));
  } else if (data.endpoints.length === 0) {
    box.append(el("h2", {}, "The pool is empty"),
      el("p", {}, "The endpoint source lists no model server: no endpoint in the configuration, or no Ready pod " +
        "matches the InferencePool's selector. Requests through kvoy get 503 no-endpoint until one appears."));
  }
  box.hidden = box.childElementCount === 0;
  document.body.dataset.pool = !data.loaded ? "not-loaded" : data.endpoints.length === 0 ? "empty" : "live";
}

// kvoy-async's lanes, per worker, lane and tenant (hidden when no worker reports).
function renderAsync(data) {
  const section = document.getElementById("async");
  const body = document.querySelector("#async-lanes tbody");
  body.replaceChildren();
  const workers = data.async || [];
  section.hidden = workers.length === 0;
  for (const w of workers) {
    const r = w.report;
    for (const lane of r.lanes) {
      const tenants = Object.entries(lane.tenants);
      const laneName = lane.backlog === null || lane.backlog === undefined
        ? lane.name : `${lane.name} (backlog ${lane.backlog})`;
      if (tenants.length === 0) tenants.push(["–", { queued: 0, running: 0, done: 0, dead_lettered: 0, retried: 0, tokens: 0 }]);
      for (const [tenant, c] of tenants) {
        const row = el("tr", { "data-lane": lane.name, "data-tenant": tenant }, undefined);
        for (const v of [w.worker, laneName, tenant, c.queued, c.running, c.done, c.dead_lettered, c.retried, c.tokens]) {
          row.append(el("td", {}, String(v)));
        }
        body.append(row);
      }
    }
  }
  document.getElementById("async-limits").textContent = workers.map((w) =>
    `${w.worker}: ${w.report.inflight} jobs in flight of ${w.report.inflight_limit} allowed` +
    (w.report.saturation === null || w.report.saturation === undefined ? "" : ` at saturation ${fixed(w.report.saturation, 2)}`)).join("; ");
}

function render(data) {
  const p = data.pool;
  const rates = data.history.filter((h) => h.hit_rate !== null);
  const lastRate = rates.length ? rates[rates.length - 1].hit_rate : null;
  renderEmpty(data);
  document.getElementById("saturation").textContent = data.endpoints.length ? fixed(p.saturation, 2) : "–";
  document.getElementById("queue-depth").textContent = String(p.waiting);
  // The proxies' own admission queues, as their snapshot polls report them.
  const held = document.getElementById("admission-held");
  const a = data.admission;
  held.textContent = a ? String(a.held) : "–";
  held.dataset.held = a ? String(a.held) : "";
  document.getElementById("admission-note").textContent = a
    ? `in ${a.proxies} ${a.proxies === 1 ? "proxy" : "proxies"}`
    : "no proxy reports an admission queue";
  document.getElementById("running").textContent = String(p.running);
  document.getElementById("ready").textContent = `${p.ready} / ${p.endpoints}`;
  document.getElementById("stale-note").textContent = p.stale ? `${p.stale} stale` : "";
  document.getElementById("hit-rate").textContent = percent(lastRate);
  const points = (f) => data.history.map((h) => ({ t: h.t_ms, v: f(h) }));
  // With no endpoint the pool's saturation is 1 by definition: nothing to draw.
  lineChart(document.getElementById("chart-saturation"), "saturation",
    data.endpoints.length ? points((h) => h.saturation) : [],
    { max: 1, marks: [{ v: 1, label: "admission holds" }], format: (v) => fixed(v, 1) });
  lineChart(document.getElementById("chart-queue"), "queue-depth", points((h) => h.queue_depth), { max: 1 });
  lineChart(document.getElementById("chart-hit-rate"), "hit-rate", points((h) => h.hit_rate),
    { max: 1, format: (v) => Math.round(100 * v) + "%", empty: "no prompts yet" });
  renderRows(data);
  renderAsync(data);
  const status = document.getElementById("status");
  status.className = "status";
  status.textContent = `updated ${new Date().toLocaleTimeString()} · ${data.history.length} samples, one a second`;
}

async function poll() {
  const status = document.getElementById("status");
  try {
    const r = await fetch("/v1/pool", { cache: "no-store", headers: token ? { Authorization: "Bearer " + token } : {} });
    if (r.status === 401) {
      status.className = "status error";
      status.textContent = "This aggregator needs its API token: open this page as /#token=<token>.";
    } else if (!r.ok) {
      status.className = "status error";
      status.textContent = `The aggregator answered ${r.status}; retrying.`;
    } else {
      render(await r.json());
    }
  } catch (err) {
    status.className = "status error";
    status.textContent = "The aggregator is unreachable; retrying every second.";
  }
  setTimeout(poll, POLL_MS);
}

poll();
