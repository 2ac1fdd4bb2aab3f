//! The request path as one call: body in, endpoint (or an HTTP error) out.

use thiserror::Error;

use crate::prefix_affinity::config::{InvalidBodyPolicy, PluginConfig, RefusedEndpoint, Scorer};
use crate::prefix_affinity::cost::{
    self, CostTerms, OutputLength, Pressure, RequestSize, TokenRatio,
};
use std::time::Duration;

use crate::endpoint::{EndpointId, Pool};
use crate::index::{Match, PrefixIndex, Tier};
use crate::outstanding::{Charge, Outstanding};
use crate::prefix::{BlockKey, KeySchedule, PrefixHasher};
use crate::prefix_affinity::score::{self, Candidate, EndpointScore};
use crate::request::{self, Api, ParsedRequest, RequestError};
use crate::rng::Rng;

/// Where a request goes and why.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Decision {
    pub endpoint: EndpointId,
    /// Leading prefix blocks the chosen endpoint was believed to hold.
    pub matched_blocks: u32,
    /// Prefix blocks of the request.
    pub request_blocks: u32,
    /// The most leading blocks any candidate was believed to hold: above `matched_blocks`,
    /// the request left its prefix's holder because load outweighed the cache (a spill).
    pub longest_match: u32,
    pub kind: DecisionKind,
    pub session: SessionOutcome,
    /// What the caller charges the chosen endpoint's [`Outstanding`] entry with: the
    /// estimated prompt tokens it computes for this request (the cost model's `uncached`,
    /// pending prefill there until the answer begins), the prompt's tokens (KV held until the
    /// request finishes) and the rate it was costed at.
    pub charge: Charge,
    /// The prefill endpoint of a disaggregated request (see [`crate::disagg`]): `endpoint`
    /// answers it, this one computes its prompt first. `None`: served whole by `endpoint`.
    pub prefill: Option<PrefillChoice>,
}

/// The prefill half of a disaggregated decision.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PrefillChoice {
    pub endpoint: EndpointId,
    /// Leading prefix blocks it was believed to hold.
    pub matched_blocks: u32,
    /// What the caller charges its [`Outstanding`] entry with until the answer begins (the
    /// decode endpoint starts only once the prefill is done).
    pub charge: Charge,
}

/// What became of a request's session pin.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SessionOutcome {
    /// The request had no pin.
    None,
    /// The request went to its pinned endpoint.
    Honoured,
    /// The pin was not followed.
    Broken(BreakReason),
}

/// Why a session pin was not followed (the session filter then rebinds to where it went).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BreakReason {
    /// The pinned address is not in the pool (a forged or outdated token or binding).
    NotInPool,
    /// The pinned endpoint does not serve the request's model.
    NotServing,
    /// The pinned endpoint is stale or not ready while healthier ones serve the model.
    Unhealthy,
    /// Soft pin only: the pinned endpoint is far more loaded than the least-loaded candidate.
    Overloaded,
    /// The scores chose another endpoint despite the pin.
    Outscored,
}

impl BreakReason {
    /// A short label for metrics and logs.
    pub fn label(self) -> &'static str {
        match self {
            BreakReason::NotInPool => "not_in_pool",
            BreakReason::NotServing => "not_serving",
            BreakReason::Unhealthy => "unhealthy",
            BreakReason::Overloaded => "overloaded",
            BreakReason::Outscored => "outscored",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecisionKind {
    /// Scored on prefix and load.
    Scored,
    /// Not an inference request (e.g. `GET /v1/models`): least-loaded endpoint.
    Passthrough,
    /// The body could not be parsed and the policy is `fallback`: least-loaded endpoint.
    Fallback,
}

/// A request the router refuses, mapped to the status and OpenAI error it is answered with.
#[derive(Debug, Error, PartialEq)]
pub enum RouteError {
    #[error(transparent)]
    BadRequest(RequestError),
    #[error("the model `{0}` does not exist or is not served by this pool")]
    UnknownModel(String),
    #[error("no endpoint is available")]
    NoEndpoint,
}

impl RouteError {
    pub fn status(&self) -> u16 {
        match self {
            RouteError::BadRequest(RequestError::TooLarge { .. }) => 413,
            RouteError::BadRequest(_) => 400,
            RouteError::UnknownModel(_) => 404,
            RouteError::NoEndpoint => 503,
        }
    }

    /// OpenAI's `error.code`.
    pub fn code(&self) -> &'static str {
        match self {
            RouteError::BadRequest(RequestError::TooLarge { .. }) => "request_too_large",
            RouteError::BadRequest(_) => "invalid_request",
            RouteError::UnknownModel(_) => "model_not_found",
            RouteError::NoEndpoint => "no_endpoint_available",
        }
    }

    /// A short label for metrics and logs.
    pub fn reason(&self) -> &'static str {
        match self {
            RouteError::BadRequest(RequestError::TooLarge { .. }) => "body_too_large",
            RouteError::BadRequest(_) => "bad_request",
            RouteError::UnknownModel(_) => "unknown_model",
            RouteError::NoEndpoint => "no_endpoint",
        }
    }

    /// The JSON body, in OpenAI's error shape.
    pub fn body(&self) -> String {
        let (kind, param) = match self {
            RouteError::BadRequest(e) => ("invalid_request_error", e.param()),
            RouteError::UnknownModel(_) => ("invalid_request_error", Some("model")),
            RouteError::NoEndpoint => ("service_unavailable", None),
        };
        crate::protocol::openai_error_body(&self.to_string(), kind, param, Some(self.code()))
    }
}

/// Per-VM routing state: the config, the prefix index and reusable scratch buffers.
#[derive(Debug)]
pub struct Router {
    config: PluginConfig,
    /// The pool routed to: the configured one, or the aggregator's (see [`Router::set_pool`]).
    pool: Pool,
    index: PrefixIndex,
    hasher: PrefixHasher,
    rng: Rng,
    ids: Vec<EndpointId>,
    candidates: Vec<Candidate>,
    scores: Vec<EndpointScore>,
    costs: Vec<CostTerms>,
    /// The prefill candidates of a disaggregated request, and their costs (apart from the
    /// decode choice's, which explanations read).
    prefill_ids: Vec<EndpointId>,
    prefill_candidates: Vec<Candidate>,
    prefill_costs: Vec<CostTerms>,
    /// A split request's decode candidates' costs ([`cost::decode_terms`]), same order as
    /// `candidates`.
    decode_costs: Vec<CostTerms>,
    /// The pool has prefill endpoints (requests may be split).
    disaggregated: bool,
    keys: Vec<BlockKey>,
    /// Leading keys each endpoint holds (by id), by tier, for the request being routed.
    matched: Vec<Match>,
    /// Bytes per token learned per model from the servers' `usage`.
    ratio: TokenRatio,
    output: OutputLength,
    /// Uncached tokens of a typical request routed here (EWMA): sizes a server's queue.
    typical_tokens: Option<f64>,
    /// The fleet's pressure as this router has seen it (weighs the uncached tokens).
    pressure: Pressure,
    /// The model and prompt bytes of the last request routed by its body.
    last_model: String,
    last_prompt_bytes: u64,
    /// What the last [`Router::set_pool`] left out.
    refused: Vec<RefusedEndpoint>,
}

/// Weight of the newest request in [`Router`]'s typical request size.
const TYPICAL_ALPHA: f64 = 0.05;
/// How many more prefix keys than its reported cache holds (in the model's bytes) the index
/// keeps for an endpoint: a quarter more, for the lag of the report and the keys' spans.
pub const CACHED_KEYS_SLACK: f64 = 1.25;

impl Router {
    /// `seed` drives tie-breaks and keys the index's hash maps.
    pub fn new(config: PluginConfig, seed: u64) -> Self {
        let index = PrefixIndex::new(
            config.pool.id_bound(),
            config.lru_blocks_per_endpoint,
            seed.rotate_left(17),
        );
        let hasher = PrefixHasher::with_schedule(KeySchedule {
            block_size: config.block_size,
            max_keys: config.max_blocks,
            dense: config.dense_blocks,
            group: config.blocks_per_doubling,
        });
        let disaggregated = config.pool.has_prefill_role();
        Router {
            pool: config.pool.clone(),
            config,
            index,
            hasher,
            rng: Rng::new(seed),
            ids: Vec::new(),
            candidates: Vec::new(),
            scores: Vec::new(),
            costs: Vec::new(),
            prefill_ids: Vec::new(),
            prefill_candidates: Vec::new(),
            prefill_costs: Vec::new(),
            decode_costs: Vec::new(),
            disaggregated,
            keys: Vec::new(),
            matched: Vec::new(),
            ratio: TokenRatio::default(),
            output: OutputLength::default(),
            typical_tokens: None,
            pressure: Pressure::default(),
            last_model: String::new(),
            last_prompt_bytes: 0,
            refused: Vec::new(),
        }
    }

    /// Records a server's own prompt-token count for a prompt of `prompt_bytes` bytes of
    /// `model` (from a response's `usage`), to learn the model's bytes per token.
    pub fn observe_usage(&mut self, model: &str, prompt_bytes: u64, prompt_tokens: u64) {
        if self.config.cost.learn_bytes_per_token {
            self.ratio.observe(model, prompt_bytes, prompt_tokens);
        }
    }

    /// Records a server's own output-token count for an answer of `model` (from its `usage`),
    /// to learn the model's expected output length.
    pub fn observe_output(&mut self, model: &str, output_tokens: u64) {
        if self.config.cost.learn_output_tokens {
            self.output.observe(model, output_tokens);
        }
    }

    /// The output tokens a request of `model` is expected to generate: learned, else
    /// configured, else the default.
    pub fn output_tokens(&self, model: &str) -> f64 {
        let cost = &self.config.cost;
        self.output
            .get(model)
            .filter(|_| cost.learn_output_tokens)
            .unwrap_or_else(|| cost.model_output_tokens(model))
    }

    /// The bytes-per-token ratio used for `model`: learned, else configured, else the default.
    pub fn bytes_per_token(&self, model: &str) -> f64 {
        let cost = &self.config.cost;
        self.ratio
            .get(model)
            .filter(|_| cost.learn_bytes_per_token)
            .or_else(|| cost.model(model).and_then(|m| m.bytes_per_token))
            .unwrap_or(cost.bytes_per_token)
    }

    pub fn config(&self) -> &PluginConfig {
        &self.config
    }

    pub fn index(&self) -> &PrefixIndex {
        &self.index
    }

    /// The pool currently routed to.
    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    /// Switches to another pool (a new aggregator snapshot, or back to the configured one).
    /// Endpoints outside `allowed_destinations`, and those beyond `max_endpoints`, are left
    /// out: the router never routes to them; they are returned, with why, for the caller to
    /// count and log. What the prefix index knows of an id is dropped when the id now names
    /// another address or its cache generation changed (the server dropped its cache).
    pub fn set_pool(&mut self, pool: Pool) -> &[RefusedEndpoint] {
        self.refused.clear();
        let pool = pool.admit(
            &self.config.allowed_destinations,
            self.config.max_endpoints,
            &mut self.refused,
        );
        let bound = self.pool.id_bound().max(pool.id_bound());
        for i in 0..bound {
            let id = EndpointId(i as u16);
            let same = match (self.pool.get(id), pool.get(id)) {
                (Some(a), Some(b)) => {
                    a.address == b.address && a.cache_generation == b.cache_generation
                }
                _ => false,
            };
            if !same {
                self.index.clear_endpoint(id);
            }
        }
        self.index.resize(pool.id_bound());
        self.disaggregated = pool.has_prefill_role();
        self.pool = pool;
        self.trim_to_server_caches();
        &self.refused
    }

    /// Cuts what the index believes of each endpoint down to what the server reports holding
    /// (with [`CACHED_KEYS_SLACK`] to spare, as the report lags and key spans only
    /// approximate tokens): when a server evicts under cache pressure, its least recently used
    /// prefixes stop attracting requests at the next snapshot, as they left its cache.
    fn trim_to_server_caches(&mut self) {
        let block_bytes = self.config.block_size.max(1) as f64;
        let budgets: Vec<(EndpointId, usize)> = self
            .pool
            .iter()
            .filter_map(|(id, e)| {
                let tokens = e.cached_tokens? as f64;
                let bytes_per_token = e
                    .models
                    .first()
                    .map_or(self.config.cost.bytes_per_token, |m| {
                        self.bytes_per_token(m)
                    });
                // A float above usize::MAX saturates in the cast.
                let keys = (tokens * bytes_per_token * CACHED_KEYS_SLACK / block_bytes).ceil();
                Some((id, keys as usize))
            })
            .collect();
        for (id, keys) in budgets {
            self.index.trim(id, keys);
        }
    }

    /// Prefix keys of the last request routed by [`Router::route_body`] (empty otherwise).
    pub fn last_keys(&self) -> &[BlockKey] {
        &self.keys
    }

    /// How this router keys prompts (its configuration's block schedule).
    pub fn key_schedule(&self) -> KeySchedule {
        self.hasher.schedule()
    }

    /// Where each of [`Router::last_keys`] ends in the prompt, in bytes.
    pub fn last_key_ends(&self) -> &[u32] {
        self.hasher.ends()
    }

    /// Scores of the last decision of the weighted scorer, in the order of
    /// [`Router::last_candidates`] (empty under the cost scorer).
    pub fn last_scores(&self) -> &[EndpointScore] {
        &self.scores
    }

    /// Cost terms of the last scored decision, in the order of [`Router::last_candidates`]
    /// (computed under either scorer).
    /// The model and prompt bytes of the last request routed by its body: what a caller
    /// passes to [`Router::observe_usage`] with the server's count for that request.
    pub fn last_prompt(&self) -> (&str, u64) {
        (&self.last_model, self.last_prompt_bytes)
    }

    pub fn last_costs(&self) -> &[CostTerms] {
        &self.costs
    }

    pub fn last_candidates(&self) -> &[Candidate] {
        &self.candidates
    }

    /// Writes to `out` the candidates (indices into [`Router::last_candidates`]) that the last
    /// successful decision chose among at random: one when the decision was determined (a
    /// followed pin, or one best cost or score), several when they tied (e.g. a prompt that
    /// matches nowhere, on idle endpoints). Meaningless after a [`RouteError`].
    pub fn last_ties(&self, out: &mut Vec<usize>) {
        out.clear();
        // A pin that did not break is followed, except by the weighted scorer's soft pin,
        // which only adds `weights.session` to its score.
        if let Some(i) = self.candidates.iter().position(|c| c.pinned) {
            if self.config.scorer == Scorer::Cost || self.config.session.hard {
                out.push(i);
                return;
            }
        }
        match self.config.scorer {
            // Passthrough and fallback decisions cost nothing: the least loaded.
            _ if self.costs.is_empty() => out.extend(score::least_loaded_ties(&self.candidates)),
            Scorer::Cost => out.extend(cost::cheapest(&self.costs)),
            Scorer::Weighted => out.extend(score::best_scored(&self.scores)),
        }
    }

    /// Applies a decision taken elsewhere (another worker) to the local index.
    pub fn apply_remote(&mut self, endpoint: EndpointId, keys: &[BlockKey]) {
        self.index.record(endpoint, keys);
    }

    /// Applies a confirmed removal (the aggregator saw `endpoint` evict the blocks these keys
    /// were linked to): the prefixes through them stop attracting requests there. Returns the
    /// keys the index forgot. It walks the endpoint's holdings: see [`LogReplay`] to apply
    /// many at once.
    pub fn apply_removal(&mut self, endpoint: EndpointId, keys: &[BlockKey]) -> usize {
        self.index.remove(endpoint, keys)
    }

    /// Applies a confirmed offload (the aggregator saw `endpoint` move the blocks these keys
    /// were linked to off its GPU, to `tier`): the prefixes through them count at that tier's
    /// credit there. Returns the keys moved down; a walk of the endpoint's holdings, as
    /// [`Router::apply_removal`].
    pub fn apply_demotion(&mut self, endpoint: EndpointId, keys: &[BlockKey], tier: Tier) -> usize {
        self.index.demote(endpoint, keys, tier)
    }

    fn fill_candidates(
        &mut self,
        outstanding: &[Outstanding],
        model_rate: f64,
        kv_capacity: Option<u32>,
        now: Duration,
    ) {
        self.index.matched_all(&self.keys, &mut self.matched);
        let ids = std::mem::take(&mut self.ids);
        let mut out = std::mem::take(&mut self.candidates);
        self.candidates_of(&ids, outstanding, model_rate, kv_capacity, now, &mut out);
        self.ids = ids;
        self.candidates = out;
    }

    /// The candidates `ids` (cleared into `out`), with the matches `self.matched` holds.
    fn candidates_of(
        &self,
        ids: &[EndpointId],
        outstanding: &[Outstanding],
        model_rate: f64,
        kv_capacity: Option<u32>,
        now: Duration,
        out: &mut Vec<Candidate>,
    ) {
        out.clear();
        let ends = self.hasher.ends();
        for &id in ids {
            let load = self.pool.get(id).map(|e| e.load).unwrap_or_default();
            let o = outstanding.get(id.index()).copied().unwrap_or_default();
            let matched = self.matched.get(id.index()).copied().unwrap_or_default();
            // Blocks the server offloaded count at their tier's credit.
            let matched_bytes = self.config.cost.credited_bytes(matched, ends);
            out.push(Candidate {
                id,
                matched: matched.keys() as u32,
                matched_bytes,
                inflight: o.requests,
                prefilling: o.prefilling.min(o.requests),
                prefill_tokens: u64::from(o.prefill_tokens),
                queued_tokens: o.queued_tokens_at(now),
                prompt_tokens: u64::from(o.prompt_tokens),
                kv_tokens: u64::from(o.kv_tokens),
                hold_s: f64::from(o.hold_s),
                kv_capacity_tokens: load.kv_capacity_tokens.or(kv_capacity),
                prefill_rate: load.prefill_tokens_per_s.unwrap_or(model_rate),
                load,
                pinned: false,
            });
        }
    }

    /// Routes an OpenAI request body. `outstanding` is what this proxy has outstanding per
    /// endpoint (by id), `now` the clock its entries were written with; server loads come
    /// from the pool.
    pub fn route_body(
        &mut self,
        api: Api,
        body: &[u8],
        outstanding: &[Outstanding],
        now: Duration,
    ) -> Result<Decision, RouteError> {
        self.route_pinned(api, body, outstanding, None, now)
    }

    /// [`Router::route_body`] for a request whose session is pinned to `pin` (an `ip:port`
    /// from `kvoy_session`, or a token): honoured only if it is a pool member serving the model
    /// among the healthiest candidates and, for a soft pin, not clearly overloaded.
    pub fn route_pinned(
        &mut self,
        api: Api,
        body: &[u8],
        outstanding: &[Outstanding],
        pin: Option<&str>,
        now: Duration,
    ) -> Result<Decision, RouteError> {
        let parsed = self.parse(api, body);
        self.route_parsed(parsed, outstanding, pin, now)
    }

    /// Parses `body` with this router's bounds (`max_body_bytes`, `max_prompt_segments`), for
    /// a caller that reads the request itself before routing it with [`Router::route_parsed`]
    /// (the combined filter: one parse serves the session keys and the route).
    pub fn parse<'b>(&self, api: Api, body: &'b [u8]) -> Result<ParsedRequest<'b>, RequestError> {
        request::parse_with(
            api,
            body,
            self.config.max_body_bytes,
            self.config.max_prompt_segments,
        )
    }

    /// [`Router::route_pinned`] for a body already parsed by [`Router::parse`].
    pub fn route_parsed(
        &mut self,
        parsed: Result<ParsedRequest<'_>, RequestError>,
        outstanding: &[Outstanding],
        pin: Option<&str>,
        now: Duration,
    ) -> Result<Decision, RouteError> {
        self.keys.clear();
        let req = match parsed {
            Ok(req) => req,
            // Bounds are never waved through, whatever `on_invalid_body` says.
            Err(e @ (RequestError::TooLarge { .. } | RequestError::TooManySegments { .. })) => {
                return Err(RouteError::BadRequest(e))
            }
            Err(e) => {
                return match self.config.on_invalid_body {
                    InvalidBodyPolicy::Reject => Err(RouteError::BadRequest(e)),
                    InvalidBodyPolicy::Fallback => {
                        self.least_loaded(outstanding, DecisionKind::Fallback)
                    }
                }
            }
        };
        self.pool.serving(&req.model, &mut self.ids);
        if self.ids.is_empty() {
            return Err(RouteError::UnknownModel(req.model.into_owned()));
        }
        let keys = self
            .hasher
            .hash(&req.model, req.cache_salt.as_deref(), &req.prompt);
        self.keys.extend_from_slice(keys);
        let bytes_per_token = self.bytes_per_token(&req.model);
        let prompt_tokens = req.prompt_len() as f64 / bytes_per_token;
        self.last_model.clear();
        self.last_model.push_str(&req.model);
        self.last_prompt_bytes = req.prompt_len() as u64;
        let model_rate = self.config.cost.model_rate(&req.model);
        let kv_capacity = self.config.cost.model_kv_capacity(&req.model);
        self.fill_candidates(outstanding, model_rate, kv_capacity, now);
        let mut session = match pin {
            None => SessionOutcome::None,
            Some(address) => self.apply_pin(address, &req.model),
        };
        let size = RequestSize {
            prompt_tokens,
            bytes_per_token,
            typical_tokens: self.typical_tokens.unwrap_or(prompt_tokens),
            output_tokens: self.output_tokens(&req.model),
        };
        let hard = self.config.session.hard;
        let pinned = self.candidates.iter().position(|c| c.pinned);
        let pressure = self.pressure.observe(
            cost::least_queued_requests(&self.candidates, &size).unwrap_or(0.0),
            now,
            self.config.cost.pressure_time_constant_s,
        );
        let weight = Pressure::weight(pressure, &self.config.cost);
        let params = &self.config.cost;
        self.scores.clear();
        let chosen = match (self.config.scorer, pinned) {
            (Scorer::Weighted, Some(i)) if hard => {
                cost::fill(&self.candidates, &size, params, weight, &mut self.costs);
                i
            }
            (Scorer::Weighted, _) => {
                cost::fill(&self.candidates, &size, params, weight, &mut self.costs);
                score::pick(
                    &self.candidates,
                    self.hasher.ends().last().map_or(0, |&e| u64::from(e)),
                    &self.config.weights,
                    &self.config.hotspot,
                    &mut self.rng,
                    &mut self.scores,
                )
                .ok_or(RouteError::NoEndpoint)?
            }
            // A pin that did not break is followed (a soft one broke above if overloaded).
            (Scorer::Cost, pinned) => {
                let cheapest = cost::pick(
                    &self.candidates,
                    &size,
                    params,
                    weight,
                    &mut self.rng,
                    &mut self.costs,
                )
                .ok_or(RouteError::NoEndpoint)?;
                pinned.unwrap_or(cheapest)
            }
        };
        if let Some(i) = pinned {
            session = if i == chosen {
                SessionOutcome::Honoured
            } else {
                SessionOutcome::Broken(BreakReason::Outscored)
            };
        }
        let chosen = match (self.config.scorer, pinned) {
            (Scorer::Cost, None) => self.decode_for_split(chosen, &size),
            _ => chosen,
        };
        let c = self.candidates[chosen];
        let longest_match = self.candidates.iter().map(|c| c.matched).max().unwrap_or(0);
        self.index.record(c.id, &self.keys);
        let (uncached, rate) = self
            .costs
            .get(chosen)
            .map_or((0.0, c.prefill_rate), |t| (t.uncached_tokens, t.rate));
        self.typical_tokens = Some(match self.typical_tokens {
            None => uncached,
            Some(t) => t + TYPICAL_ALPHA * (uncached - t),
        });
        let sent_us = u64::try_from(now.as_micros()).unwrap_or(u64::MAX).max(1);
        self.prefill_candidates.clear();
        self.prefill_costs.clear();
        let prefill =
            if self.disaggregated && self.config.disagg.splits(size.prompt_tokens, uncached) {
                let prefill_size = RequestSize {
                    // Its KV leaves with the transfer.
                    output_tokens: 0.0,
                    ..size
                };
                let model = std::mem::take(&mut self.last_model);
                let choice = self.pick_prefill(
                    &model,
                    c.id,
                    outstanding,
                    &prefill_size,
                    weight,
                    (model_rate, kv_capacity),
                    now,
                );
                self.last_model = model;
                choice.map(|(p, uncached_p, rate_p)| PrefillChoice {
                    endpoint: p.id,
                    matched_blocks: p.matched,
                    charge: Charge {
                        prefill_tokens: tokens(uncached_p),
                        prompt_tokens: tokens(size.prompt_tokens),
                        kv_tokens: tokens(uncached_p),
                        rate: rate_p as f32,
                        sent_us,
                    },
                })
            } else {
                None
            };
        // A split request's prompt is computed at the prefill endpoint: the decode endpoint
        // has none of it to do, only the blocks to hold.
        let decode_prefill = if prefill.is_some() { 0.0 } else { uncached };
        Ok(Decision {
            endpoint: c.id,
            matched_blocks: c.matched,
            request_blocks: self.keys.len() as u32,
            longest_match,
            kind: DecisionKind::Scored,
            session,
            charge: Charge {
                prefill_tokens: tokens(decode_prefill),
                prompt_tokens: tokens(size.prompt_tokens),
                kv_tokens: tokens(uncached + size.output_tokens),
                rate: rate as f32,
                sent_us,
            },
            prefill,
        })
    }

    /// The cheapest prefill endpoint for the request being routed to `decode` (by the cost
    /// model over the prefill endpoints serving `model`, `decode` itself left out), recorded in
    /// the index as holding the prompt's blocks; with its uncached tokens and rate. `None`
    /// when the pool has none: the request is served whole by `decode`, as llm-d does when its
    /// prefill profile finds no endpoint.
    #[allow(clippy::too_many_arguments)]
    fn pick_prefill(
        &mut self,
        model: &str,
        decode: EndpointId,
        outstanding: &[Outstanding],
        size: &RequestSize,
        weight: f64,
        (model_rate, kv_capacity): (f64, Option<u32>),
        now: Duration,
    ) -> Option<(Candidate, f64, f64)> {
        let mut ids = std::mem::take(&mut self.prefill_ids);
        self.pool.prefilling(model, &mut ids);
        ids.retain(|&id| id != decode);
        let mut candidates = std::mem::take(&mut self.prefill_candidates);
        self.candidates_of(
            &ids,
            outstanding,
            model_rate,
            kv_capacity,
            now,
            &mut candidates,
        );
        self.prefill_ids = ids;
        let picked = cost::pick(
            &candidates,
            size,
            &self.config.cost,
            weight * self.config.disagg.prefill_uncached_weight,
            &mut self.rng,
            &mut self.prefill_costs,
        );
        let chosen = picked.map(|i| {
            let t = self.prefill_costs[i];
            (candidates[i], t.uncached_tokens, t.rate)
        });
        self.prefill_candidates = candidates;
        if let Some((p, _, _)) = &chosen {
            self.index.record(p.id, &self.keys);
        }
        chosen
    }

    /// The decode candidate for the request `chosen` would serve whole: `chosen` itself unless
    /// the request splits there, then the candidate where the transfer of the blocks it lacks
    /// and its decode load cost least ([`cost::decode_terms`]; the prefill it would have run
    /// is another endpoint's), provided the request still splits there.
    fn decode_for_split(&mut self, chosen: usize, size: &RequestSize) -> usize {
        self.decode_costs.clear();
        let disagg = self.config.disagg;
        let uncached = |costs: &[CostTerms], i: usize| {
            costs
                .get(i)
                .map_or(size.prompt_tokens, |t| t.uncached_tokens)
        };
        if !self.disaggregated || !disagg.splits(size.prompt_tokens, uncached(&self.costs, chosen))
        {
            return chosen;
        }
        let params = &self.config.cost;
        self.decode_costs.extend(
            self.candidates
                .iter()
                .map(|c| cost::decode_terms(c, size, params, disagg.kv_transfer_tokens_per_s)),
        );
        let ties = cost::cheapest(&self.decode_costs).count();
        let nth = self.rng.below(ties.max(1));
        match cost::cheapest(&self.decode_costs).nth(nth) {
            Some(d) if disagg.splits(size.prompt_tokens, uncached(&self.costs, d)) => d,
            _ => chosen,
        }
    }

    /// The prefill candidates and their costs of the last request that was split (empty when
    /// it was not).
    pub fn last_prefill_costs(&self) -> (&[Candidate], &[CostTerms]) {
        (&self.prefill_candidates, &self.prefill_costs)
    }

    /// Marks the pinned candidate, or says why the pin breaks.
    fn apply_pin(&mut self, address: &str, model: &str) -> SessionOutcome {
        let Some(id) = self.pool.find(address) else {
            return SessionOutcome::Broken(BreakReason::NotInPool);
        };
        let Some(i) = self.candidates.iter().position(|c| c.id == id) else {
            let serves = self.pool.get(id).is_some_and(|e| e.serves(model));
            return SessionOutcome::Broken(if serves {
                BreakReason::Unhealthy
            } else {
                BreakReason::NotServing
            });
        };
        let pin = &self.config.session;
        if !pin.hard {
            let min = self
                .candidates
                .iter()
                .map(Candidate::guard_load)
                .min()
                .unwrap_or(0);
            let load = self.candidates[i].guard_load();
            if load >= min.saturating_add(u64::from(pin.break_abs))
                && load as f64 > pin.break_rel * min as f64
            {
                return SessionOutcome::Broken(BreakReason::Overloaded);
            }
        }
        self.candidates[i].pinned = true;
        SessionOutcome::None
    }

    /// Routes a request whose body kvoy does not read (any endpoint of the pool will do).
    pub fn route_passthrough(
        &mut self,
        outstanding: &[Outstanding],
    ) -> Result<Decision, RouteError> {
        self.keys.clear();
        self.least_loaded(outstanding, DecisionKind::Passthrough)
    }

    fn least_loaded(
        &mut self,
        outstanding: &[Outstanding],
        kind: DecisionKind,
    ) -> Result<Decision, RouteError> {
        self.pool.all(&mut self.ids);
        let rate = self.config.cost.prefill_tokens_per_s;
        // Least-loaded reads request counts only: no clock needed.
        self.fill_candidates(outstanding, rate, None, Duration::ZERO);
        self.scores.clear();
        self.costs.clear();
        let chosen =
            score::least_loaded(&self.candidates, &mut self.rng).ok_or(RouteError::NoEndpoint)?;
        Ok(Decision {
            endpoint: self.candidates[chosen].id,
            matched_blocks: 0,
            request_blocks: 0,
            longest_match: 0,
            kind,
            session: SessionOutcome::None,
            charge: Charge::default(),
            prefill: None,
        })
    }
}

/// A token estimate as the whole count the outstanding table keeps.
fn tokens(estimate: f64) -> u32 {
    estimate.round().clamp(0.0, f64::from(u32::MAX)) as u32
}

/// Applies the decision log's records ([`crate::shared_data::Logged`]) to a router in log order,
/// gathering each endpoint's removals and offloads so that one walk of its holdings applies
/// them all; a decision for an endpoint with some waiting applies after them, as logged.
/// (Among themselves their order does not matter: a key removed stays removed, whether it was
/// offloaded before or after.) Call [`LogReplay::finish`] after the last record.
#[derive(Debug, Default)]
pub struct LogReplay {
    /// Per endpoint and fate (`None`: removed; else offloaded to that tier), the keys.
    waiting: Vec<(EndpointId, Option<Tier>, Vec<BlockKey>)>,
    /// Decisions applied.
    pub routed: u64,
    /// Keys the removals made the index forget.
    pub removed_keys: u64,
    /// Keys the offloads moved down a tier.
    pub offloaded_keys: u64,
}

impl LogReplay {
    pub fn apply(&mut self, router: &mut Router, logged: crate::shared_data::Logged<'_>) {
        use crate::shared_data::Logged;
        let (endpoint, fate, keys) = match logged {
            Logged::Routed(endpoint, keys, _) => {
                self.flush(router, Some(endpoint));
                router.apply_remote(endpoint, keys);
                self.routed += 1;
                return;
            }
            Logged::Removed(endpoint, keys) => (endpoint, None, keys),
            Logged::Offloaded(endpoint, tier, keys) => (endpoint, Some(tier), keys),
        };
        match self
            .waiting
            .iter_mut()
            .find(|(e, f, _)| *e == endpoint && *f == fate)
        {
            Some((_, _, all)) => all.extend_from_slice(keys),
            None => self.waiting.push((endpoint, fate, keys.to_vec())),
        }
    }

    /// Applies the removals and offloads still waiting.
    pub fn finish(&mut self, router: &mut Router) {
        self.flush(router, None);
    }

    fn flush(&mut self, router: &mut Router, only: Option<EndpointId>) {
        let (removed, offloaded) = (&mut self.removed_keys, &mut self.offloaded_keys);
        self.waiting.retain(|(e, fate, keys)| {
            if only.is_some_and(|o| o != *e) {
                return true;
            }
            match fate {
                None => *removed += router.apply_removal(*e, keys) as u64,
                Some(tier) => *offloaded += router.apply_demotion(*e, keys, *tier) as u64,
            }
            false
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn router(extra: &str) -> Router {
        let cfg = format!(
            r#"{{"endpoints":[
                {{"address":"10.0.0.1:8000","models":["a"]}},
                {{"address":"10.0.0.2:8000","models":["a","b"]}},
                {{"address":"10.0.0.3:8000","models":["a"]}}]{extra}}}"#
        );
        Router::new(PluginConfig::from_json(cfg.as_bytes()).unwrap(), 42)
    }

    fn chat(model: &str, system: &str, user: &str) -> Vec<u8> {
        serde_json::json!({"model": model, "messages": [
            {"role": "system", "content": system}, {"role": "user", "content": user}]})
        .to_string()
        .into_bytes()
    }

    /// A chat completion routed at time zero with nothing outstanding.
    fn idle_route(r: &mut Router, body: &[u8]) -> Decision {
        r.route_body(
            Api::ChatCompletions,
            body,
            &[Outstanding::default(); 3],
            Duration::ZERO,
        )
        .unwrap()
    }

    /// A chat completion routed at time zero with the session pin `pin`.
    fn pinned(r: &mut Router, body: &[u8], loads: &[Outstanding], pin: Option<&str>) -> Decision {
        r.route_pinned(Api::ChatCompletions, body, loads, pin, Duration::ZERO)
            .unwrap()
    }

    #[test]
    fn expected_output_tokens_are_learned_else_configured() {
        let mut r =
            router(r#","cost":{"learn_output_tokens":true,"models":{"b":{"output_tokens":64}}}"#);
        assert_eq!((r.output_tokens("a"), r.output_tokens("b")), (256.0, 64.0));
        for _ in 0..16 {
            r.observe_output("b", 900);
        }
        assert_eq!((r.output_tokens("a"), r.output_tokens("b")), (256.0, 900.0));
        // off by default
        let mut off = router(r#","cost":{"output_tokens":10}"#);
        for _ in 0..16 {
            off.observe_output("a", 900);
        }
        assert_eq!(off.output_tokens("a"), 10.0);
    }

    #[test]
    fn shared_prefix_sticks() {
        let mut r = router("");
        let system = "You are a helpful assistant. ".repeat(40);
        let first = r
            .route_body(
                Api::ChatCompletions,
                &chat("a", &system, "q0"),
                &[Outstanding::default(); 3],
                Duration::ZERO,
            )
            .unwrap();
        for i in 1..20 {
            let d = r
                .route_body(
                    Api::ChatCompletions,
                    &chat("a", &system, &format!("q{i}")),
                    &[Outstanding::default(); 3],
                    Duration::ZERO,
                )
                .unwrap();
            assert_eq!(d.endpoint, first.endpoint);
            assert!(d.matched_blocks > 10 && d.matched_blocks <= d.request_blocks);
        }
    }

    #[test]
    fn a_request_sent_off_its_prefix_holder_for_load_is_a_spill() {
        let mut r = router("");
        let system = "You are a helpful assistant. ".repeat(40);
        let first = idle_route(&mut r, &chat("a", &system, "q0"));
        assert_eq!(first.longest_match, 0);
        let again = idle_route(&mut r, &chat("a", &system, "q1"));
        assert_eq!(again.endpoint, first.endpoint);
        assert_eq!(again.longest_match, again.matched_blocks);
        // The holder has a million tokens queued: recomputing the prefix elsewhere wins.
        let mut loads = [Outstanding::default(); 3];
        loads[first.endpoint.0 as usize] = Outstanding {
            requests: 100,
            prefilling: 100,
            prefill_tokens: 1_000_000,
            ..Outstanding::default()
        };
        let spilled = r
            .route_body(
                Api::ChatCompletions,
                &chat("a", &system, "q2"),
                &loads,
                Duration::ZERO,
            )
            .unwrap();
        assert_ne!(spilled.endpoint, first.endpoint);
        assert_eq!(spilled.matched_blocks, 0);
        assert_eq!(spilled.longest_match, again.matched_blocks);
    }

    #[test]
    fn last_ties_name_what_the_random_tie_break_chose_among() {
        let mut r = router("");
        let outstanding = [Outstanding::default(); 3];
        let mut ties = Vec::new();
        // Nothing matches anywhere and every endpoint is idle: a three-way tie.
        let body = chat("a", &"z".repeat(1000), "u");
        let cold = r
            .route_body(Api::ChatCompletions, &body, &outstanding, Duration::ZERO)
            .unwrap();
        r.last_ties(&mut ties);
        assert_eq!(ties, [0, 1, 2]);
        assert!(ties.contains(
            &r.last_candidates()
                .iter()
                .position(|c| c.id == cold.endpoint)
                .unwrap()
        ));
        // The same prompt again: only its holder.
        let warm = r
            .route_body(Api::ChatCompletions, &body, &outstanding, Duration::ZERO)
            .unwrap();
        r.last_ties(&mut ties);
        assert_eq!(ties.len(), 1);
        assert_eq!(r.last_candidates()[ties[0]].id, warm.endpoint);
        assert_eq!(warm.endpoint, cold.endpoint);
        // A followed pin decides alone.
        let pinned = r
            .route_pinned(
                Api::ChatCompletions,
                &body,
                &outstanding,
                Some("10.0.0.3:8000"),
                Duration::ZERO,
            )
            .unwrap();
        r.last_ties(&mut ties);
        assert_eq!(
            (pinned.endpoint, ties.as_slice()),
            (EndpointId(2), [2].as_slice())
        );
        // Under the weighted scorer, from its scores.
        let mut w = router(r#","scorer":"weighted""#);
        w.route_body(Api::ChatCompletions, &body, &outstanding, Duration::ZERO)
            .unwrap();
        w.last_ties(&mut ties);
        assert_eq!(ties, [0, 1, 2]);
        // A passthrough: the least loaded.
        r.route_passthrough(&[4, 2, 2].map(Outstanding::requests))
            .unwrap();
        r.last_ties(&mut ties);
        assert_eq!(ties, [1, 2]);
    }

    #[test]
    fn model_restricts_candidates() {
        let mut r = router("");
        for i in 0..10 {
            let d = r
                .route_body(
                    Api::ChatCompletions,
                    &chat("b", "s", &format!("{i}")),
                    &[Outstanding::default(); 3],
                    Duration::ZERO,
                )
                .unwrap();
            assert_eq!(d.endpoint, EndpointId(1));
        }
        let e = r
            .route_body(
                Api::ChatCompletions,
                &chat("zzz", "s", "u"),
                &[Outstanding::default(); 3],
                Duration::ZERO,
            )
            .unwrap_err();
        assert_eq!(e.status(), 404);
        assert!(e.body().contains("model_not_found"));
    }

    #[test]
    fn bad_bodies_per_policy() {
        let mut r = router("");
        let e = r
            .route_body(
                Api::ChatCompletions,
                b"{nope",
                &[Outstanding::default(); 3],
                Duration::ZERO,
            )
            .unwrap_err();
        assert_eq!(e.status(), 400);
        let v: serde_json::Value = serde_json::from_str(&e.body()).unwrap();
        assert_eq!(v["error"]["type"], "invalid_request_error");
        let mut r = router(r#","on_invalid_body":"fallback","max_body_bytes":100"#);
        let d = r
            .route_body(
                Api::ChatCompletions,
                b"{nope",
                &[3, 0, 5].map(Outstanding::requests),
                Duration::ZERO,
            )
            .unwrap();
        assert_eq!(d.kind, DecisionKind::Fallback);
        assert_eq!(d.endpoint, EndpointId(1));
        // too large is never a fallback
        let e = r
            .route_body(
                Api::ChatCompletions,
                &[b' '; 101],
                &[Outstanding::default(); 3],
                Duration::ZERO,
            )
            .unwrap_err();
        assert_eq!(e.status(), 413);
    }

    #[test]
    fn passthrough_is_least_loaded() {
        let mut r = router("");
        let d = r
            .route_passthrough(&[4, 2, 9].map(Outstanding::requests))
            .unwrap();
        assert_eq!(
            (d.endpoint, d.kind),
            (EndpointId(1), DecisionKind::Passthrough)
        );
    }

    #[test]
    fn remote_decisions_count() {
        let mut a = router("");
        let mut b = router("");
        let body = chat("a", &"x".repeat(2000), "u");
        let d = idle_route(&mut a, &body);
        b.apply_remote(d.endpoint, a.last_keys());
        for _ in 0..5 {
            let e = idle_route(&mut b, &body);
            assert_eq!(e.endpoint, d.endpoint);
            assert_eq!(e.matched_blocks, e.request_blocks);
        }
    }

    #[test]
    fn session_pins_are_honoured_validated_and_broken() {
        let mut r = router("");
        let system = "A long shared system prompt. ".repeat(40);
        let body = chat("a", &system, "q");
        let holder = idle_route(&mut r, &body).endpoint;
        let other = if holder == EndpointId(0) {
            "10.0.0.2:8000"
        } else {
            "10.0.0.1:8000"
        };
        // A soft pin beats the prefix holder.
        let d = pinned(&mut r, &body, &[Outstanding::default(); 3], Some(other));
        assert_eq!(r.pool().get(d.endpoint).unwrap().address_text, other);
        assert_eq!(d.session, SessionOutcome::Honoured);
        // Outside the pool: ignored, routed as usual.
        let d = pinned(
            &mut r,
            &body,
            &[Outstanding::default(); 3],
            Some("10.9.9.9:1"),
        );
        assert_eq!(d.session, SessionOutcome::Broken(BreakReason::NotInPool));
        assert_eq!(
            d.matched_blocks, d.request_blocks,
            "to a prefix holder, as without a pin"
        );
        let d = pinned(&mut r, &body, &[Outstanding::default(); 3], Some("garbage"));
        assert_eq!(d.session, SessionOutcome::Broken(BreakReason::NotInPool));
        // Model b is only on endpoint 1.
        let d = r
            .route_pinned(
                Api::ChatCompletions,
                &chat("b", "s", "u"),
                &[Outstanding::default(); 3],
                Some("10.0.0.1:8000"),
                Duration::ZERO,
            )
            .unwrap();
        assert_eq!(d.session, SessionOutcome::Broken(BreakReason::NotServing));
        // Overloaded (20 in flight vs 0): broken, unless hard.
        let d = pinned(
            &mut r,
            &body,
            &[
                Outstanding::requests(20),
                Outstanding::default(),
                Outstanding::default(),
            ],
            Some("10.0.0.1:8000"),
        );
        assert_eq!(d.session, SessionOutcome::Broken(BreakReason::Overloaded));
        assert_ne!(d.endpoint, EndpointId(0));
        let mut hard = router(r#","session":{"hard":true}"#);
        let d = pinned(
            &mut hard,
            &body,
            &[
                Outstanding::requests(20),
                Outstanding::default(),
                Outstanding::default(),
            ],
            Some("10.0.0.1:8000"),
        );
        assert_eq!(
            (d.endpoint, d.session),
            (EndpointId(0), SessionOutcome::Honoured)
        );
        // Unhealthy: a stale pinned endpoint while others are ready.
        let mut pool: Vec<(EndpointId, crate::Endpoint)> =
            r.pool().iter().map(|(id, e)| (id, e.clone())).collect();
        pool[0].1.health = crate::Health::Stale;
        r.set_pool(Pool::with_ids(pool));
        let d = pinned(
            &mut r,
            &body,
            &[Outstanding::default(); 3],
            Some("10.0.0.1:8000"),
        );
        assert_eq!(d.session, SessionOutcome::Broken(BreakReason::Unhealthy));
        assert_ne!(d.endpoint, EndpointId(0));
    }

    #[test]
    fn a_replay_applies_removals_in_log_order_one_walk_per_endpoint() {
        use crate::shared_data::Logged;
        let mut r = router("");
        let k = |v: &[u64]| v.iter().copied().map(BlockKey).collect::<Vec<_>>();
        let (a, b) = (EndpointId(0), EndpointId(1));
        let mut replay = LogReplay::default();
        replay.apply(&mut r, Logged::Routed(a, &k(&[1, 2, 3]), 0));
        replay.apply(&mut r, Logged::Routed(b, &k(&[1, 2, 3]), 0));
        replay.apply(&mut r, Logged::Removed(a, &k(&[2])));
        replay.apply(&mut r, Logged::Removed(b, &k(&[3])));
        // Removals wait for the end of the replay...
        assert_eq!(r.index().matched(a, &k(&[1, 2, 3])), 3);
        // ...unless a decision for that endpoint comes after them: then they go first.
        replay.apply(&mut r, Logged::Routed(b, &k(&[1, 2, 3, 4]), 0));
        assert_eq!(r.index().matched(b, &k(&[1, 2, 3, 4])), 4);
        replay.finish(&mut r);
        assert_eq!(r.index().matched(a, &k(&[1, 2, 3])), 1);
        assert_eq!(r.index().matched(b, &k(&[1, 2, 3, 4])), 4);
        assert_eq!((replay.routed, replay.removed_keys), (3, 3));
    }

    #[test]
    fn a_new_cache_generation_forgets_the_endpoint() {
        let mut r = router("");
        let body = chat("a", &"x".repeat(2000), "u");
        let d = idle_route(&mut r, &body);
        assert!(r.index().blocks(d.endpoint) > 0);
        let same: Vec<_> = r.pool().iter().map(|(id, e)| (id, e.clone())).collect();
        r.set_pool(Pool::with_ids(same.clone()));
        assert!(r.index().blocks(d.endpoint) > 0, "same pool: kept");
        let mut bumped = same;
        bumped[d.endpoint.index()].1.cache_generation += 1;
        r.set_pool(Pool::with_ids(bumped));
        assert_eq!(
            r.index().blocks(d.endpoint),
            0,
            "the server dropped its cache"
        );
    }

    #[test]
    fn a_server_holding_less_than_the_index_believes_trims_it() {
        let mut r = router("");
        let route = |r: &mut Router, user: &str| {
            let body = chat("a", &user.repeat(2000), "u");
            idle_route(r, &body)
        };
        let old = route(&mut r, "x");
        let same: Vec<_> = r.pool().iter().map(|(id, e)| (id, e.clone())).collect();
        let held = r.index().blocks(old.endpoint);
        assert!(held > 8, "{held}");
        // Nobody counts the server's blocks: the index keeps what it learned.
        r.set_pool(Pool::with_ids(same.clone()));
        assert_eq!(r.index().blocks(old.endpoint), held);
        // The server reports room for half of it (tokens at the default 4 bytes per token,
        // 64-byte blocks): the index keeps that, with its slack.
        let mut reported = same;
        let tokens = (held as u64 * 64 / 4) / 2;
        reported[old.endpoint.index()].1.cached_tokens = Some(tokens);
        r.set_pool(Pool::with_ids(reported.clone()));
        let want = (tokens as f64 * 4.0 * CACHED_KEYS_SLACK / 64.0).ceil() as usize;
        assert_eq!(r.index().blocks(old.endpoint), want);
        assert!(want < held);
        // The longest match left is the prompt's head: the tail went first.
        let keys = r.last_keys().to_vec();
        assert_eq!(r.index().matched(old.endpoint, &keys), want);
    }

    #[test]
    fn an_offloaded_prefix_counts_at_its_tiers_credit() {
        let outstanding = [Outstanding::default(); 3];
        let system = "z".repeat(6000);
        let route = |r: &mut Router, user: &str| {
            r.route_body(
                Api::ChatCompletions,
                &chat("a", &system, user),
                &outstanding,
                Duration::ZERO,
            )
            .unwrap()
        };
        let credit_of = |r: &Router, id: EndpointId| {
            r.last_candidates()
                .iter()
                .find(|c| c.id == id)
                .map(|c| (c.matched, c.matched_bytes))
                .unwrap()
        };
        let mut r = router("");
        let holder = route(&mut r, "first").endpoint;
        let keys = r.last_keys().to_vec();
        // The whole prompt went to the holder's CPU memory (its first key and every key after).
        let moved = r.apply_demotion(holder, &keys[..1], Tier::Cpu);
        assert_eq!(moved, keys.len());
        // The next turn: still the holder, against idle endpoints with nothing, matched whole
        // and credited at 0.8 (the default), up to where the first prompt's keys end.
        let next = route(&mut r, "second");
        assert_eq!(next.endpoint, holder);
        let (matched, bytes) = credit_of(&r, holder);
        let full = u64::from(r.last_key_ends()[matched as usize - 1]);
        assert!(matched > 10, "{matched}");
        assert_eq!(bytes, (full as f64 * 0.8).round() as u64);
        // Routing it recorded the prompt again, back on the GPU: full credit.
        route(&mut r, "second");
        let (_, bytes) = credit_of(&r, holder);
        assert!(bytes > full, "{bytes} > {full}");
        // A prefix on storage against the same prefix on another endpoint's GPU: the GPU wins.
        let mut r = router("");
        let holder = route(&mut r, "first").endpoint;
        let keys = r.last_keys().to_vec();
        let other = EndpointId((holder.0 + 1) % 3);
        r.apply_remote(other, &keys);
        assert_eq!(
            r.apply_demotion(holder, &keys[..1], Tier::Storage),
            keys.len()
        );
        assert_eq!(route(&mut r, "second").endpoint, other);
        let (_, bytes) = credit_of(&r, holder);
        assert_eq!(bytes, (full as f64 * 0.3).round() as u64);
        // With no credit for the CPU tier, an offloaded prefix counts for nothing.
        let mut r = router(r#","cost":{"tier_credit":{"cpu":0,"storage":0}}"#);
        let holder = route(&mut r, "first").endpoint;
        let keys = r.last_keys().to_vec();
        r.apply_demotion(holder, &keys[..1], Tier::Cpu);
        route(&mut r, "second");
        assert_eq!(credit_of(&r, holder).1, 0);
    }

    #[test]
    fn a_prefix_offloaded_to_the_cpu_tier_still_attracts_its_requests() {
        use crate::snapshot::{EndpointStatus, SnapshotHistory};
        use crate::snapshot_board::live_pool;
        let mut r = router("");
        let system = "y".repeat(4000);
        let outstanding = [Outstanding::default(); 3];
        let first = r
            .route_body(
                Api::ChatCompletions,
                &chat("a", &system, "u1"),
                &outstanding,
                Duration::ZERO,
            )
            .unwrap();
        let held = r.index().blocks(first.endpoint);
        // The aggregator's view: the holder's blocks moved to its CPU tier but one (enough of
        // them for what the index holds), the others empty.
        let status = |slot: u16, cached_blocks: [u32; 3]| EndpointStatus {
            kv_cache_usage: 0.1,
            block_size: 16,
            capacity_blocks: 10_000,
            cached_blocks,
            ..EndpointStatus::ready(slot, ([10, 0, 0, slot as u8 + 1], 8000).into(), &["a"])
        };
        let view = |holder: [u32; 3]| {
            let mut history = SnapshotHistory::new(1);
            history.update(
                (0..3)
                    .map(|s| {
                        let mine = usize::from(s) == first.endpoint.index();
                        status(s, if mine { holder } else { [0; 3] })
                    })
                    .collect(),
            );
            live_pool(&history.snapshot(), true)
        };
        let offloaded = (held * 64 / 4 / 16) as u32 + 1;
        r.set_pool(view([1, offloaded, 0]));
        assert_eq!(r.index().blocks(first.endpoint), held, "every tier counts");
        let next = r
            .route_body(
                Api::ChatCompletions,
                &chat("a", &system, "u2"),
                &outstanding,
                Duration::ZERO,
            )
            .unwrap();
        assert_eq!(
            next.endpoint, first.endpoint,
            "the offloaded prefix wins over cold endpoints"
        );
        assert!(next.matched_blocks > 0);
        // Had it been evicted (one GPU block left, nothing offloaded), the index would keep
        // only what one block of tokens covers.
        r.set_pool(view([1, 0, 0]));
        assert_eq!(
            r.index().blocks(first.endpoint),
            (16.0 * 4.0 * CACHED_KEYS_SLACK / 64.0_f64).ceil() as usize
        );
    }

    #[test]
    fn a_pool_never_leaves_allowed_destinations() {
        use crate::allow::Refusal;
        use crate::endpoint::Endpoint;
        let mut r = router(
            r#","allowed_destinations":[{"cidr":"10.0.0.0/24","ports":[8000]}],"max_endpoints":3"#,
        );
        let ep = |a: &str| Endpoint::new(a.parse().unwrap(), vec!["a".into()]);
        // A snapshot naming the proxy's admin port, a metadata address and one too many.
        let pool = Pool::with_ids([
            (EndpointId(0), ep("10.0.0.1:8000")),
            (EndpointId(1), ep("10.0.0.1:9901")),
            (EndpointId(2), ep("169.254.169.254:80")),
            (EndpointId(3), ep("10.0.0.2:8000")),
            (EndpointId(4), ep("10.0.0.3:8000")),
            (EndpointId(5), ep("10.0.0.4:8000")),
        ]);
        let refused: Vec<_> = r
            .set_pool(pool)
            .iter()
            .map(|x| (x.address.to_string(), x.reason))
            .collect();
        assert_eq!(
            refused,
            [
                ("10.0.0.1:9901".to_owned(), Refusal::Port),
                ("169.254.169.254:80".to_owned(), Refusal::Address),
                ("10.0.0.4:8000".to_owned(), Refusal::TooMany),
            ]
        );
        assert_eq!((r.pool().len(), r.pool().id_bound()), (3, 5));
        let outstanding = [Outstanding::default(); 5];
        for i in 0..30 {
            let d = r
                .route_body(
                    Api::ChatCompletions,
                    &chat("a", "s", &format!("q{i}")),
                    &outstanding,
                    Duration::ZERO,
                )
                .unwrap();
            let addr = r.pool().get(d.endpoint).unwrap().address.to_string();
            assert!(
                ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"].contains(&addr.as_str()),
                "{addr}"
            );
        }
        assert_eq!(r.pool().find("169.254.169.254:80"), None);
    }
}
