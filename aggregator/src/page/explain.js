// The explain panel: scores one request against the aggregator's current snapshot with kvoy's
// own router (kvoy-shared compiled to WebAssembly, /explain/kvoy_explain.js), its prefix index
// rebuilt from the decisions the proxies relayed (GET /v1/decisions), and shows every
// candidate's terms and the pick. The address's fragment can carry the request, so that a link
// explains it on opening: #explain=<base64url of the body>&api=chat|completions|responses
// [&session=<x-session-token>] (and #token=... for an aggregator that needs one).
"use strict";

const params = new URLSearchParams(location.hash.slice(1));
const token = params.get("token");
const auth = token ? { Authorization: "Bearer " + token } : {};
const APIS = { chat: "/v1/chat/completions", completions: "/v1/completions", responses: "/v1/responses" };
const PAGE = 4096;
// Bounded: the relay holds at most 2^20 keys, at most 2^18 a page.
const MAX_PAGES = 1024;

const $ = (id) => document.getElementById(id);
const section = $("explain");

function el(tag, attrs, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

function fromBase64Url(s) {
  const b64 = s.replace(/-/g, "+").replace(/_/g, "/");
  const bin = atob(b64 + "===".slice((b64.length + 3) % 4));
  return Uint8Array.from(bin, (c) => c.charCodeAt(0));
}

function toBase64Url(bytes) {
  let bin = "";
  for (const b of bytes) bin += String.fromCharCode(b);
  return btoa(bin).replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
}

// Why the panel cannot explain now: a state name (data-explain) and what to tell the operator.
class Unavailable extends Error {
  constructor(state, message) {
    super(message);
    this.state = state;
  }
}

let module = null;
async function wasm() {
  if (module) return module;
  let m;
  try {
    m = await import("/explain/kvoy_explain.js");
    await m.default({ module_or_path: "/explain/kvoy_explain_bg.wasm" });
  } catch (err) {
    const probe = await fetch("/explain/kvoy_explain.js", { method: "HEAD", cache: "no-store" }).catch(() => null);
    if (probe && probe.status === 404) {
      throw new Unavailable("not-built",
        "The explain panel was not built into this kvoy-aggregator: its WebAssembly module is missing. " +
        "Build it with `make explain` (`make build` does it too; it needs `make deps` for the wasm32-unknown-unknown " +
        "target and the pinned wasm-bindgen CLI), then rebuild kvoy-aggregator.");
    }
    throw new Unavailable("failed", `The explain panel's WebAssembly module did not load: ${err}`);
  }
  module = m;
  return m;
}

async function fetchBytes(path) {
  const r = await fetch(path, { cache: "no-store", headers: auth });
  if (r.status === 401) {
    throw new Unavailable("unauthorized", "This aggregator needs its API token: open this page as /#token=<token>.");
  }
  if (r.status === 503 && r.headers.get("x-kvoy-aggregator-status") === "not-loaded") {
    throw new Unavailable("not-loaded", "The aggregator has not read its endpoint source yet: there is no pool to score against.");
  }
  if (!r.ok) throw new Unavailable("failed", `${path} answered ${r.status}.`);
  return new Uint8Array(await r.arrayBuffer());
}

// The explainer, fed what the proxies route with: the snapshot they poll and every decision
// the relay holds, oldest first.
async function explainer(m, config) {
  let e;
  try {
    e = new m.Explainer(config);
  } catch (err) {
    throw new Unavailable("config", err.message);
  }
  try {
    e.setSnapshot(await fetchBytes("/v1/snapshot?format=2"));
    let cursor = "0";
    for (let page = 0; page < MAX_PAGES; page++) {
      const [count, next] = e.addDecisions(await fetchBytes(`/v1/decisions?after=${cursor}&limit=${PAGE}`));
      if (count === "0" || next === cursor) break;
      cursor = next;
    }
    return e;
  } catch (err) {
    e.free();
    throw err instanceof Unavailable ? err : new Unavailable("failed", err.message);
  }
}

const ms = (s) => (s === undefined || s === null ? "–" : (1000 * s).toFixed(2) + " ms");
const num = (v, d) => (v === undefined || v === null ? "–" : Number(v).toFixed(d));

function show(state, verdict) {
  section.dataset.explain = state;
  $("explain-out").hidden = false;
  $("explain-verdict").textContent = verdict;
  $("explain-table").hidden = true;
  $("explain-error").hidden = true;
  $("explain-notes").replaceChildren();
  for (const k of ["chosen", "tied", "matchedBlocks", "requestBlocks", "status"]) delete section.dataset[k];
}

function note(text) {
  $("explain-notes").append(el("li", {}, text));
}

function sessionText(c, session) {
  if (!c.pinned) return "";
  return session.state === "honoured" ? "pinned, followed" : "pinned";
}

function render(a) {
  if (!a.ok) {
    show("error", `The proxy would answer ${a.status} ${a.code}: ${a.message}`);
    section.dataset.status = String(a.status);
    const pre = $("explain-error");
    pre.textContent = a.body;
    pre.hidden = false;
    return;
  }
  const tie = a.tied.length > 1;
  const head = tie
    ? `Tie between ${a.tied.join(", ")}: the same predicted cost; the proxy picks one of them at random.`
    : `kvoy would pick ${a.chosen}` + (a.request_blocks ? ` (${a.matched_blocks} of ${a.request_blocks} prefix blocks matched there).` : ".");
  show(tie ? "tie" : "picked", head);
  section.dataset.chosen = tie ? "" : a.chosen;
  section.dataset.tied = a.tied.join(" ");
  section.dataset.matchedBlocks = String(a.matched_blocks);
  section.dataset.requestBlocks = String(a.request_blocks);
  const body = $("explain-table").querySelector("tbody");
  body.replaceChildren();
  for (const c of a.candidates) {
    const t = c.cost || {};
    const tr = el("tr", {
      class: c.chosen && !tie ? "chosen" : c.tied ? "tied" : "",
      "data-explain-endpoint": c.address, "data-matched": c.matched_blocks,
      "data-cost-s": t.total_s === undefined ? "" : String(t.total_s),
      "data-chosen": String(c.chosen && !tie), "data-tied": String(c.tied),
    });
    const mark = c.chosen && !tie ? "▶ " : c.tied ? "= " : "";
    tr.append(el("td", {}, mark + c.address));
    tr.append(el("td", {}, c.health));
    tr.append(el("td", { class: "num" }, `${c.matched_blocks} / ${a.request_blocks}`));
    tr.append(el("td", { class: "num" }, num(t.uncached_tokens, 0)));
    tr.append(el("td", { class: "num" }, num(t.queued_tokens, 0)));
    tr.append(el("td", { class: "num" }, `${c.waiting ?? "–"} / ${c.running ?? "–"}`));
    tr.append(el("td", { class: "num" }, c.kv_cache_usage === null ? "–" : (100 * c.kv_cache_usage).toFixed(1) + "%"));
    tr.append(el("td", { class: "num" }, t.rate === undefined ? "–" : Math.round(t.rate).toLocaleString("en") + " tok/s"));
    tr.append(el("td", { class: "num" }, [t.prefill_s, t.decode_s, t.kv_s, t.footprint_s].map(ms).join(" + ")));
    const score = c.score ? ` · score ${num(c.score.total, 3)}${c.score.hot ? " (hot spot)" : ""}` : "";
    tr.append(el("td", { class: "num cost" }, ms(t.total_s) + score));
    tr.append(el("td", {}, sessionText(c, a.session)));
    body.append(tr);
  }
  $("explain-table").hidden = false;
  const s = a.session;
  if (s.state === "honoured") note(`Session: the token pins ${s.pin}; the proxy follows it.`);
  else if (s.state === "broken") note(`Session: the token pins ${s.pin}, which the proxy does not follow: ${s.reason}.`);
  else if (s.state === "invalid_token") note("Session: the token is not a kvoy session token (base64 of ip:port); the proxy ignores it.");
  for (const l of a.left_out) note(`${l.address} is not a candidate: ${l.why}.`);
  for (const r of a.refused) note(`${r.address} is left out by the filter configuration: ${r.reason}.`);
  note(`Scored with the ${a.scorer} scorer as a proxy that polled the aggregator just now (snapshot version ${a.snapshot.version}, ` +
    `${a.snapshot.endpoints} endpoints): ${a.model}, ${a.prompt_bytes} prompt bytes ≈ ${Math.round(a.prompt_tokens)} tokens at ` +
    `${num(a.bytes_per_token, 2)} bytes a token, ${a.request_blocks} prefix blocks.`);
  if (a.index.relayed_decisions === 0) {
    note("No relayed decisions: the proxies have routed nothing yet, or they do not relay (aggregator.relay_decisions: false, " +
      "or no aggregator in their configuration). A proxy's own decisions are then unknown here, and its prefix matches with them.");
  } else {
    note(`The prefix index: ${a.index.applied} decisions the proxies relayed through the aggregator` +
      (a.index.dropped ? ` (${a.index.dropped} for addresses no longer in the pool, dropped as the proxies drop them)` : "") + ".");
  }
  note("Not known here, and counted as nothing: a proxy's own requests in flight (its pending prefill work and decoding " +
    "requests; the servers' own queue and running counts are in the snapshot), its decisions of the last poll interval " +
    "not relayed yet, the bytes per token it learned from the servers' answers (used here: the configured figure), its " +
    "recent fleet-pressure average, and session bindings by x-session-id, cookie or previous_response_id (they live in " +
    "the proxy). With those at rest the proxy decides as shown.");
}

function api() {
  return $("explain-api").value;
}

async function run() {
  const body = new TextEncoder().encode($("explain-body").value);
  const session = $("explain-session").value.trim();
  show("running", "Scoring against the current snapshot…");
  let e = null;
  try {
    const m = await wasm();
    e = await explainer(m, $("explain-config").value);
    render(JSON.parse(e.explain(api(), body, session || undefined)));
  } catch (err) {
    if (err instanceof Unavailable) show(err.state, err.message);
    else show("failed", `The explanation failed: ${err.message || err}`);
  } finally {
    if (e) e.free();
  }
}

function link() {
  const p = new URLSearchParams();
  if (token) p.set("token", token);
  p.set("explain", toBase64Url(new TextEncoder().encode($("explain-body").value)));
  const name = Object.entries(APIS).find(([, path]) => path === api());
  p.set("api", name ? name[0] : "chat");
  const session = $("explain-session").value.trim();
  if (session) p.set("session", session);
  history.replaceState(null, "", "#" + p.toString());
}

$("explain-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  run();
});
$("explain-link").addEventListener("click", link);

// A request in the address: fill the panel and explain it at once.
const given = params.get("explain");
if (given !== null) {
  let text = null;
  try {
    text = new TextDecoder().decode(fromBase64Url(given));
  } catch (err) {
    show("failed", "The address's #explain= is not base64url: nothing to explain.");
  }
  if (text !== null) {
    $("explain-body").value = text;
    const a = params.get("api");
    if (a && (APIS[a] || Object.values(APIS).includes(a))) $("explain-api").value = APIS[a] || a;
    if (params.get("session")) $("explain-session").value = params.get("session");
    run();
  }
}
