//! `decide`'s output: text for people, JSON for tools.

use std::fmt::Write as _;

use crate::decide::{Outcome, RequestReport};
use crate::mirror::{ScoreRow, ScoreTable};

/// The reports as one JSON document: `{"requests": [...]}`.
pub fn json(reports: &[RequestReport]) -> String {
    serde_json::json!({ "requests": reports }).to_string()
}

fn opt<T: std::fmt::Display>(v: Option<T>) -> String {
    v.map_or_else(|| "-".to_owned(), |v| v.to_string())
}

/// The reports as text.
pub fn text(reports: &[RequestReport]) -> String {
    let mut out = String::new();
    for r in reports {
        let _ = write!(out, "request {}: {} {}", r.index, r.method, r.path);
        match &r.outcome {
            Outcome::Routed { endpoint } => {
                let _ = writeln!(out, " -> {endpoint} (worker {})", r.worker);
            }
            Outcome::NoDestination => {
                let _ = writeln!(out, " -> no destination (Envoy would answer 503)");
            }
            Outcome::LocalReply {
                filter,
                status,
                body,
                ..
            } => {
                let _ = writeln!(out, " -> {status} from {filter}: {}", body.trim());
            }
            Outcome::Held { filter } => {
                let _ = writeln!(out, " -> still held by {filter}");
            }
            Outcome::Reset { filter } => {
                let _ = writeln!(out, " -> reset by {filter}");
            }
        }
        if let Some(ms) = r.held_ms {
            let _ = writeln!(out, "  held {ms} ms (virtual) before going on");
        }
        if let Some(scores) = &r.scores {
            scores_text(&mut out, scores);
        }
        for (name, value) in &r.upstream_headers {
            let _ = writeln!(out, "  upstream header   {name}: {value}");
        }
        for (name, value) in &r.response_headers {
            let _ = writeln!(out, "  response header   {name}: {value}");
        }
        let times: Vec<String> = r
            .filter_us
            .iter()
            .map(|t| format!("{} {:.0} µs", t.filter, t.us))
            .collect();
        let _ = writeln!(
            out,
            "  time: {}; chain {:.0} µs",
            times.join(", "),
            r.total_us
        );
        let calls: Vec<String> = r
            .filter_calls
            .iter()
            .map(|c| {
                format!(
                    "{} {} host calls ({} on shared data), {} VM entries",
                    c.filter, c.host_calls, c.shared_data, c.vm_entries
                )
            })
            .collect();
        let _ = writeln!(out, "  crossings: {}", calls.join("; "));
    }
    out
}

fn scores_text(out: &mut String, t: &ScoreTable) {
    if t.scorer == "cost" {
        return costs_text(out, t);
    }
    let w = &t.weights;
    let _ = writeln!(
        out,
        "  {} ({} pool; {} request blocks; weights prefix {}, inflight {}, queue {}, kv_cache {}, session {}){}",
        t.kind,
        pool_kind(t),
        t.request_blocks,
        w.prefix,
        w.inflight,
        w.queue,
        w.kv_cache,
        w.session,
        error_suffix(t),
    );
    if t.rows.is_empty() {
        return;
    }
    let width = endpoint_width(t);
    head_columns(out, width);
    let _ = writeln!(
        out,
        "  {:>6}  {:>8}  {:>6}  {:>8}  {:>7}  {:>7}",
        "prefix", "inflight", "queue", "kv_cache", "session", "total"
    );
    for r in &t.rows {
        row_columns(out, t, r, width);
        let _ = writeln!(
            out,
            "  {:>6.3}  {:>8.3}  {:>6.3}  {:>8.3}  {:>7.1}  {:>7.3}{}",
            r.prefix,
            r.inflight_score,
            r.queue,
            r.kv_cache,
            r.session,
            r.total,
            if r.hot { "  (hot: prefix ignored)" } else { "" },
        );
    }
}

/// The columns both tables open with: endpoint, matched blocks, in flight, waiting.
fn head_columns(out: &mut String, width: usize) {
    let _ = write!(
        out,
        "    {:width$}  {:>7}  {:>8}  {:>7}",
        "endpoint", "matched", "inflight", "waiting"
    );
}

fn row_columns(out: &mut String, t: &ScoreTable, r: &ScoreRow, width: usize) {
    let _ = write!(
        out,
        "  {} {:width$}  {:>7}  {:>8}  {:>7}",
        if r.best { "*" } else { " " },
        r.endpoint,
        format!("{}/{}", r.matched_blocks, t.request_blocks),
        r.inflight,
        opt(r.waiting),
    );
}

/// The endpoint column's width: the longest address, at least the header's.
fn endpoint_width(t: &ScoreTable) -> usize {
    t.rows
        .iter()
        .map(|r| r.endpoint.len())
        .max()
        .unwrap_or(8)
        .max(8)
}

fn pool_kind(t: &ScoreTable) -> &'static str {
    if t.pool_live {
        "aggregator"
    } else {
        "static"
    }
}

/// `: <why>` after a table's title when its request was refused.
fn error_suffix(t: &ScoreTable) -> String {
    t.error.as_ref().map_or(String::new(), |e| format!(": {e}"))
}

/// The cost scorer's table: each endpoint's predicted time to first token and its terms.
fn costs_text(out: &mut String, t: &ScoreTable) {
    let _ = writeln!(
        out,
        "  {} ({} pool; {} request blocks; cost scorer: predicted time to first token){}",
        t.kind,
        pool_kind(t),
        t.request_blocks,
        error_suffix(t),
    );
    if t.rows.is_empty() {
        return;
    }
    let width = endpoint_width(t);
    head_columns(out, width);
    let _ = writeln!(
        out,
        "  {:>8}  {:>8}  {:>7}  {:>10}  {:>9}  {:>7}",
        "uncached", "queued", "running", "prefill ms", "decode ms", "cost ms"
    );
    for r in &t.rows {
        row_columns(out, t, r, width);
        let _ = writeln!(
            out,
            "  {:>8.0}  {:>8.0}  {:>7}  {:>10.2}  {:>9.2}  {:>7.2}{}",
            r.uncached_tokens,
            r.queued_tokens,
            r.running,
            r.prefill_s * 1e3,
            r.decode_s * 1e3,
            r.cost_s * 1e3,
            if r.session > 0.0 {
                "  (session pin)"
            } else {
                ""
            },
        );
    }
}
