//! The conversion: snapshot and relayed decisions in, a fresh [`Router`] as a proxy that
//! polled the aggregator just now would have it, one routed request out as JSON.

use std::time::Duration;

use serde_json::{json, Value};
use thiserror::Error;

use kvoy_shared::prefix_affinity::{
    BreakReason, ConfigError, DecisionKind, PluginConfig, RouteError, Router, Scorer,
    SessionOutcome,
};
use kvoy_shared::relay::{self, DecisionBatch, RelayedDecision};
use kvoy_shared::request::{classify_path, PathClass, RequestError};
use kvoy_shared::session::decode_token;
use kvoy_shared::snapshot::Snapshot;
use kvoy_shared::snapshot_board::{self, PollError};
use kvoy_shared::{Health, Outstanding};

/// The filter configuration the panel scores with when the operator gives none: kvoy's
/// defaults, with the pool from the aggregator (and no address refused: the aggregator's
/// pool is what is shown).
pub const DEFAULT_CONFIG: &str = r#"{"aggregator":{"cluster":"kvoy_aggregator"},"allowed_destinations":[{"cidr":"0.0.0.0/0"},{"cidr":"::/0"}]}"#;

/// The router's seed: it keys the index's tables and draws tie-breaks, which the answer
/// reports as ties rather than as a pick.
const SEED: u64 = 0x6b76_6f79;

/// What the explainer could not use.
#[derive(Debug, Error, PartialEq)]
pub enum ExplainError {
    #[error("the filter configuration is not valid: {0}")]
    Config(#[from] ConfigError),
    #[error("the aggregator's snapshot cannot be read: {0}")]
    Snapshot(PollError),
    #[error("no snapshot yet: the aggregator's pool is needed to score against")]
    NoSnapshot,
    #[error("a page of relayed decisions cannot be read: {0}")]
    Decisions(#[from] relay::DecodeError),
    #[error("`{0}` is not a path kvoy routes by its body (/v1/chat/completions, /v1/completions, /v1/responses)")]
    NotRoutedByBody(String),
}

/// The inputs of one explanation: the filter's configuration, the aggregator's snapshot and
/// the relayed decisions, as the page fetched them.
#[derive(Debug)]
pub struct Explainer {
    config: PluginConfig,
    snapshot: Option<Snapshot>,
    decisions: Vec<RelayedDecision>,
}

impl Explainer {
    /// An explainer scoring with the filter configuration `config_json` (the JSON of the
    /// `kvoy` filter's configuration; empty: [`DEFAULT_CONFIG`]).
    pub fn new(config_json: &str) -> Result<Self, ExplainError> {
        let raw = match config_json.trim() {
            "" => DEFAULT_CONFIG,
            given => given,
        };
        Ok(Explainer {
            config: PluginConfig::from_json(raw.as_bytes())?,
            snapshot: None,
            decisions: Vec::new(),
        })
    }

    /// The aggregator's answer to `GET /v1/snapshot` (a full snapshot), read as the filter's
    /// poller reads it.
    pub fn set_snapshot(&mut self, body: &[u8]) -> Result<(), ExplainError> {
        let mut snapshot = Snapshot::default();
        snapshot_board::apply_poll(&mut snapshot, Some(200), body)
            .map_err(ExplainError::Snapshot)?;
        self.snapshot = Some(snapshot);
        Ok(())
    }

    /// One page of `GET /v1/decisions` (a [`DecisionBatch`]): its decisions are kept, in
    /// order, for the index. Returns how many it held and the cursor to ask from next.
    pub fn add_decisions(&mut self, body: &[u8]) -> Result<(usize, u64), ExplainError> {
        let batch = DecisionBatch::decode(body)?;
        let count = batch.decisions.len();
        self.decisions.extend(batch.decisions);
        Ok((count, batch.cursor))
    }

    /// Relayed decisions kept so far.
    pub fn decisions(&self) -> usize {
        self.decisions.len()
    }

    /// Routes `body` as a request to `path` with a router rebuilt from the snapshot and the
    /// relayed decisions (so that explaining never teaches the index anything), and answers
    /// with the decision and every candidate's terms, or the error the proxy would answer
    /// (`"ok": false`, with its status and OpenAI error body). `session_token` is an
    /// `x-session-token` the request would carry.
    pub fn explain(
        &self,
        path: &str,
        body: &[u8],
        session_token: Option<&str>,
    ) -> Result<Value, ExplainError> {
        let snapshot = self.snapshot.as_ref().ok_or(ExplainError::NoSnapshot)?;
        let api = match classify_path(path) {
            PathClass::Api(api) => api,
            PathClass::Ambiguous => {
                return Ok(refused(&RouteError::BadRequest(RequestError::BadPath)))
            }
            PathClass::Other => return Err(ExplainError::NotRoutedByBody(path.to_owned())),
        };
        let mut router = Router::new(self.config.clone(), SEED);
        // As the filter's poller: the live pool with its loads (just fetched).
        let pool = snapshot_board::live_pool(snapshot, true);
        let refused_endpoints: Vec<Value> = router
            .set_pool(pool.clone())
            .iter()
            .map(|r| json!({"address": r.address.to_string(), "reason": r.reason.to_string()}))
            .collect();
        // The relayed decisions into the index, as a proxy's log replays them; an address
        // outside the pool is dropped, as the filter drops it.
        let mut applied = 0usize;
        for d in &self.decisions {
            if let Some(id) = router.pool().id_of(d.endpoint) {
                router.apply_remote(id, &d.keys);
                applied += 1;
            }
        }
        // The same pool again: what the index believes is cut to what each server reports
        // holding, as at every snapshot the filter takes.
        router.set_pool(pool);
        let outstanding = vec![Outstanding::default(); router.pool().id_bound()];
        let pin = session_token.map(str::trim).filter(|t| !t.is_empty());
        let pinned = pin.map(|t| decode_token(t).map(|a| a.to_string()));
        let parsed = router.parse(api, body);
        let decision = match router.route_parsed(
            parsed,
            &outstanding,
            pinned.as_ref().and_then(|p| p.as_deref()),
            Duration::ZERO,
        ) {
            Ok(d) => d,
            Err(e) => return Ok(refused(&e)),
        };
        let mut ties = Vec::new();
        router.last_ties(&mut ties);
        let address = |id| {
            router
                .pool()
                .get(id)
                .map_or_else(String::new, |e| e.address_text.clone())
        };
        let candidates = router.last_candidates();
        let costs = router.last_costs();
        let scores = router.last_scores();
        let rows: Vec<Value> = candidates
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let health = router.pool().get(c.id).map(|e| e.health);
                let mut row = json!({
                    "address": address(c.id),
                    "slot": c.id.0,
                    "health": health.map_or("unknown", health_label),
                    "matched_blocks": c.matched,
                    "matched_bytes": c.matched_bytes,
                    "pinned": c.pinned,
                    "waiting": c.load.waiting,
                    "running": c.load.running,
                    "kv_cache_usage": c.load.kv_cache_usage,
                    "kv_capacity_tokens": c.kv_capacity_tokens,
                    "chosen": c.id == decision.endpoint,
                    "tied": ties.len() > 1 && ties.contains(&i),
                });
                if let Some(t) = costs.get(i) {
                    row["cost"] = json!({
                        "uncached_tokens": t.uncached_tokens,
                        "queued_tokens": t.queued_tokens,
                        "running": t.running,
                        "rate": t.rate,
                        "prefill_s": t.prefill_s,
                        "decode_s": t.decode_s,
                        "kv_s": t.kv_s,
                        "footprint_s": t.footprint_s,
                        "claimed": t.claimed,
                        "seat_s": t.seat_s,
                        "total_s": t.total_s,
                    });
                }
                if let Some(s) = scores.get(i) {
                    row["score"] = json!({
                        "prefix": s.prefix,
                        "inflight": s.inflight,
                        "queue": s.queue,
                        "kv_cache": s.kv_cache,
                        "total": s.total,
                        "hot": s.hot,
                    });
                }
                row
            })
            .collect();
        let (model, prompt_bytes) = router.last_prompt();
        let model = model.to_owned();
        // Pool members that are not candidates, and why.
        let left_out: Vec<Value> = router
            .pool()
            .iter()
            .filter(|(id, _)| !candidates.iter().any(|c| c.id == *id))
            .map(|(_, e)| {
                let why = if decision.kind == DecisionKind::Scored && !e.serves(&model) {
                    format!("does not serve {model}")
                } else {
                    format!("{}: healthier endpoints serve it", health_label(e.health))
                };
                json!({"address": e.address_text, "health": health_label(e.health), "why": why})
            })
            .collect();
        let tied: Vec<String> = ties
            .iter()
            .filter_map(|&i| candidates.get(i))
            .map(|c| address(c.id))
            .collect();
        let bytes_per_token = router.bytes_per_token(&model);
        Ok(json!({
            "ok": true,
            "kind": kind_label(decision.kind),
            "scorer": match router.config().scorer {
                Scorer::Cost => "cost",
                Scorer::Weighted => "weighted",
            },
            "model": model,
            "prompt_bytes": prompt_bytes,
            "prompt_tokens": prompt_bytes as f64 / bytes_per_token,
            "bytes_per_token": bytes_per_token,
            "request_blocks": decision.request_blocks,
            "chosen": address(decision.endpoint),
            "matched_blocks": decision.matched_blocks,
            "tied": if tied.len() > 1 { tied } else { Vec::new() },
            "session": session_json(pin, pinned.as_ref(), decision.session),
            "candidates": rows,
            "left_out": left_out,
            "refused": refused_endpoints,
            "index": {
                "relayed_decisions": self.decisions.len(),
                "applied": applied,
                "dropped": self.decisions.len() - applied,
            },
            "snapshot": {
                "epoch": snapshot.epoch.to_string(),
                "version": snapshot.version.to_string(),
                "endpoints": snapshot.endpoints.len(),
            },
        }))
    }
}

/// The answer for a request the proxy refuses: its status and OpenAI error body.
fn refused(e: &RouteError) -> Value {
    let body = e.body();
    json!({
        "ok": false,
        "status": e.status(),
        "code": e.code(),
        "message": e.to_string(),
        "body": body,
        "error": serde_json::from_str::<Value>(&body).unwrap_or(Value::Null),
    })
}

fn session_json(
    token: Option<&str>,
    pinned: Option<&Option<String>>,
    outcome: SessionOutcome,
) -> Value {
    let (state, reason) = match (token, outcome) {
        (None, _) => ("none", None),
        (Some(_), _) if matches!(pinned, Some(None)) => ("invalid_token", None),
        (Some(_), SessionOutcome::Honoured) => ("honoured", None),
        (Some(_), SessionOutcome::Broken(r)) => ("broken", Some(break_label(r))),
        (Some(_), SessionOutcome::None) => ("none", None),
    };
    json!({
        "token": token,
        "pin": pinned.and_then(|p| p.as_deref()),
        "state": state,
        "reason": reason,
    })
}

fn break_label(r: BreakReason) -> &'static str {
    match r {
        BreakReason::NotInPool => "the pinned address is not in the pool",
        BreakReason::NotServing => "the pinned endpoint does not serve the model",
        BreakReason::Unhealthy => "the pinned endpoint is stale or not ready",
        BreakReason::Overloaded => "the pinned endpoint is far more loaded than the least loaded",
        BreakReason::Outscored => "another endpoint scored better",
    }
}

fn health_label(h: Health) -> &'static str {
    match h {
        Health::Ready => "ready",
        Health::Stale => "stale",
        Health::NotReady => "not ready",
    }
}

fn kind_label(k: DecisionKind) -> &'static str {
    match k {
        DecisionKind::Scored => "scored",
        DecisionKind::Passthrough => "passthrough",
        DecisionKind::Fallback => "fallback",
    }
}

#[cfg(test)]
mod tests;
