//! The discrete-event simulation: N `kvoy_sim` engines (each with its own profile, see
//! [`crate::fleet`]), one proxy running a [`Policy`], one virtual clock.
//!
//! Events are arrivals, engine step ends and metrics scrapes. An idle engine that receives a
//! request starts a step at once: [`Engine::step`] decides the batch at the step's start and
//! returns its duration; its outputs (first tokens, tokens, completions) take effect at the
//! step's end, where the next step starts if work remains. So every engine runs on its own
//! timeline, all of them interleaved in time order. A request is routed at its arrival (routing
//! costs no virtual time), counted in flight at its endpoint until its completion, and its next
//! turn (if any) arrives `delay` after it completes. Every `scrape_interval` the engines' figures
//! are read as a metrics scrape would, and the policy is told. The KV events each step emits
//! reach the policy as they happen ([`Policy::on_kv_events`]), as a router subscribed to them.
//!
//! Prefill/decode disaggregation ([`SimConfig::roles`]): a request the policy splits
//! ([`Policy::pick_pd`]) is first sent to its prefill engine with `max_tokens` 1 (as llm-d's
//! sidecar asks); when that finishes, its KV travels to the decode engine (the prompt tokens
//! the decode engine does not hold, at [`SimConfig::kv_transfer_tokens_per_s`]), which then
//! decodes it with those blocks cached ([`Engine::submit_transferred`]). Its TTFT and E2E count
//! from its arrival; its hit tokens are the prefill engine's.

mod mirror;
mod queue;

use std::time::Duration;

use kvoy_sim_engine::{tokenizer, Engine, EngineRequest, OutputKind, Profile, ProfileError};

use crate::admission::{Gate, Gated};
use crate::ideal::IdealCache;
use crate::metrics::{Recorder, Served};
use crate::policy::{EndpointMetrics, Policy, PrefillTotals, Prefilled, RouteRequest, View};
use crate::workload::text::render_all;
use crate::workload::Plan;
pub use mirror::{block_hashes, block_hashes_into, CacheMirror};
use queue::{Event, Queue};

/// The fleet.
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// The engine profile of each replica, by endpoint index (see [`crate::fleet`]); they may
    /// differ in speed but must share the KV block size.
    pub profiles: Vec<Profile>,
    /// How often metrics are scraped (the reference picker and kvoy-aggregator: 50 ms).
    pub scrape_interval: Duration,
    /// Count the ideal hit rate as requests arrive. Open-loop plans (whose requests do not
    /// depend on the routing) can have it computed once instead, with `saturation::measure`.
    pub track_ideal: bool,
    /// Each replica's role in prefill/decode disaggregation (empty: every one serves whole
    /// requests). Only a policy that splits requests uses prefill replicas.
    pub roles: Vec<kvoy_shared::Role>,
    /// KV transfer rate from a prefill to a decode engine, prompt tokens per second.
    pub kv_transfer_tokens_per_s: f64,
}

impl SimConfig {
    /// A uniform fleet: `replicas` engines of `profile`.
    pub fn new(profile: Profile, replicas: usize) -> Self {
        Self::with_profiles(vec![profile; replicas])
    }

    /// One engine per profile.
    pub fn with_profiles(profiles: Vec<Profile>) -> Self {
        SimConfig {
            profiles,
            scrape_interval: Duration::from_millis(50),
            track_ideal: true,
            roles: Vec::new(),
            // About 25 GB/s at 128 KiB of KV per token (an 8B model in bf16).
            kv_transfer_tokens_per_s: 200_000.0,
        }
    }

    pub fn replicas(&self) -> usize {
        self.profiles.len()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error("invalid engine profile: {0}")]
    Profile(#[from] ProfileError),
    #[error("the fleet needs at least one replica and at most 4096, got {0}")]
    Replicas(usize),
    #[error(
        "replica {replica}'s profile has KV blocks of {got} tokens, replica 0's of {expected}: \
         a fleet shares one block size"
    )]
    BlockSize {
        replica: usize,
        expected: u32,
        got: u32,
    },
    #[error("the scrape interval must be above zero")]
    ScrapeInterval,
    #[error("the policy chose endpoint {chosen} of {replicas}")]
    BadPick { chosen: usize, replicas: usize },
    #[error("the policy split a request to prefill endpoint {prefill} for decode endpoint {decode}: not a prefill endpoint, or the same")]
    BadPrefill { prefill: usize, decode: usize },
    #[error("{0} requests never finished (an engine stalled)")]
    Unfinished(usize),
}

/// A request between its arrival and its completion (a session has one at a time).
#[derive(Clone, Copy)]
struct Live {
    id: u64,
    endpoint: u32,
    last_token: Duration,
    /// Prompt tokens the endpoint held at the arrival (from its KV events).
    arrival_hit: u32,
    first_token: bool,
    /// Preempted before its first token: the engine then reports the hits of its re-admission,
    /// which include the request's own blocks.
    preempted_early: bool,
    /// First scheduling to first token, as the engine reported it.
    prefill_time: Duration,
    /// Its entry in `Recorder::served`, once its first token is out.
    served: Option<usize>,
    /// How long the admission stage held it before it was routed, and a split request's
    /// prefill and KV transfer (both counted in its TTFT).
    held: Duration,
    /// A split request: the prompt tokens its prefill engine had cached (its hit tokens).
    prefill_hit: Option<u32>,
}

/// A split request between its routing and its arrival at the decode engine.
struct Transfer {
    session: u32,
    decode: usize,
    prompt: Vec<u32>,
    /// The prompt's block hashes (up to its last token), for what the decode engine holds.
    hashes: Vec<u64>,
    max_tokens: u32,
    arrived: Duration,
    /// The prefill engine's figures, once its answer is out.
    prefill_time: Duration,
    cached_tokens: u32,
}

/// Marks the id of a request's prefill half (request ids stay far below it).
const PREFILL_HALF: u64 = 1 << 63;

/// A request the admission stage holds: its session, turn and arrival.
#[derive(Clone, Copy)]
struct Held {
    session: u32,
    turn: u32,
    arrived: Duration,
}

struct Sim<'a, 'g> {
    plan: &'a Plan,
    engines: Vec<Engine>,
    busy: Vec<bool>,
    /// Outputs of each engine's step in progress.
    pending: Vec<Vec<kvoy_sim_engine::Output>>,
    inflight: Vec<u32>,
    metrics: Vec<EndpointMetrics>,
    /// Per engine, what its prefill metrics have counted.
    prefill: Vec<PrefillTotals>,
    prefilled: Vec<Prefilled>,
    /// The open request of each session, by session index.
    live: Vec<Option<Live>>,
    open: usize,
    /// Context of multi-turn sessions between turns.
    contexts: Vec<String>,
    text: String,
    body: Vec<u8>,
    ideal: Option<IdealCache>,
    mirrors: Vec<CacheMirror>,
    hashes: Vec<u64>,
    block_size: usize,
    queue: Queue,
    rec: Recorder,
    done: u64,
    total: u64,
    gate: Option<&'g mut dyn Gate>,
    held: std::collections::HashMap<u64, Held>,
    /// A gate tick is queued.
    ticking: bool,
    resume: Vec<u64>,
    expired: Vec<u64>,
    roles: &'a [kvoy_shared::Role],
    kv_transfer_tokens_per_s: f64,
    /// Split requests by their prefill half's id.
    transfers: std::collections::HashMap<u64, Transfer>,
}

/// Runs `plan` through `policy` on the fleet; `progress(done, total)` is called as requests
/// finish. Deterministic: the same inputs give the same record.
pub fn run(
    plan: &Plan,
    policy: &mut dyn Policy,
    cfg: &SimConfig,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<Recorder, SimError> {
    run_gated(plan, policy, None, cfg, progress)
}

/// [`run`] with an admission stage in front of the policy: each request meets `gate` at its
/// arrival, before it is routed; a held one is routed when a release (on the gate's tick, or
/// at a completion) lets it go, and its TTFT counts the wait.
pub fn run_gated(
    plan: &Plan,
    policy: &mut dyn Policy,
    gate: Option<&mut dyn Gate>,
    cfg: &SimConfig,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<Recorder, SimError> {
    let n = cfg.replicas();
    let Some(first) = cfg
        .profiles
        .first()
        .filter(|_| n <= kvoy_shared::MAX_ENDPOINTS)
    else {
        return Err(SimError::Replicas(n));
    };
    let block_size = first.block_size;
    if let Some((replica, p)) = cfg
        .profiles
        .iter()
        .enumerate()
        .find(|(_, p)| p.block_size != block_size)
    {
        return Err(SimError::BlockSize {
            replica,
            expected: block_size,
            got: p.block_size,
        });
    }
    if cfg.scrape_interval.is_zero() {
        return Err(SimError::ScrapeInterval);
    }
    let engines = cfg
        .profiles
        .iter()
        .map(Engine::new)
        .collect::<Result<Vec<_>, _>>()?;
    let mut sim = Sim {
        plan,
        engines,
        busy: vec![false; n],
        pending: vec![Vec::new(); n],
        inflight: vec![0; n],
        metrics: vec![EndpointMetrics::default(); n],
        prefill: vec![PrefillTotals::default(); n],
        prefilled: Vec::new(),
        live: vec![None; plan.sessions.len()],
        open: 0,
        contexts: vec![String::new(); plan.sessions.len()],
        text: String::new(),
        body: Vec::new(),
        ideal: cfg.track_ideal.then(|| IdealCache::new(block_size)),
        mirrors: (0..n).map(|_| CacheMirror::default()).collect(),
        hashes: Vec::new(),
        block_size: block_size as usize,
        queue: Queue::default(),
        rec: Recorder::new(n),
        done: 0,
        total: plan.requests() as u64,
        gate,
        held: std::collections::HashMap::new(),
        ticking: false,
        resume: Vec::new(),
        expired: Vec::new(),
        roles: &cfg.roles,
        kv_transfer_tokens_per_s: cfg.kv_transfer_tokens_per_s,
        transfers: std::collections::HashMap::new(),
    };
    for (i, s) in plan.sessions.iter().enumerate() {
        if !s.turns.is_empty() {
            sim.queue.push(
                s.start,
                Event::Arrival {
                    session: i as u32,
                    turn: 0,
                },
            );
        }
    }
    sim.rec.window_end = plan
        .sessions
        .iter()
        .map(|s| s.start)
        .max()
        .unwrap_or_default();
    sim.queue.push(Duration::ZERO, Event::Scrape);
    while let Some((now, event)) = sim.queue.pop() {
        match event {
            Event::Arrival { session, turn } => sim.arrival(now, session, turn, policy)?,
            Event::StepEnd { engine } => {
                sim.step_end(now, engine as usize, policy)?;
                progress(sim.done, sim.total);
            }
            Event::Transferred { id } => sim.transferred(now, id, policy),
            Event::Tick => {
                sim.ticking = false;
                sim.release(now, policy)?;
                progress(sim.done, sim.total);
            }
            Event::Scrape => {
                sim.scrape(now, policy);
                if sim.queue.has_work() {
                    sim.queue.push(now + cfg.scrape_interval, Event::Scrape);
                }
            }
        }
    }
    if sim.open > 0 || !sim.held.is_empty() {
        return Err(SimError::Unfinished(sim.open + sim.held.len()));
    }
    Ok(sim.finish())
}

impl Sim<'_, '_> {
    fn finish(mut self) -> Recorder {
        if let Some(ideal) = &self.ideal {
            (self.rec.ideal_hit_tokens, self.rec.ideal_prompt_tokens) = ideal.totals();
        }
        self.rec
    }

    fn arrival(
        &mut self,
        now: Duration,
        si: u32,
        ti: u32,
        policy: &mut dyn Policy,
    ) -> Result<(), SimError> {
        let plan = self.plan;
        let Some(session) = plan.sessions.get(si as usize) else {
            return Ok(());
        };
        let Some(turn) = session.turns.get(ti as usize) else {
            return Ok(());
        };
        self.rec.first_arrival.get_or_insert(now);
        let gated = match self.gate.as_deref_mut() {
            None => Gated::Admit,
            Some(gate) => {
                let view = View {
                    now,
                    inflight: &self.inflight,
                    metrics: &self.metrics,
                };
                gate.arrive(turn.id, session.sheddable, &view)
            }
        };
        match gated {
            Gated::Admit => self.dispatch(now, si, ti, Duration::ZERO, policy),
            Gated::Held => {
                self.rec.held += 1;
                self.held.insert(
                    turn.id,
                    Held {
                        session: si,
                        turn: ti,
                        arrived: now,
                    },
                );
                self.schedule_tick(now);
                Ok(())
            }
            Gated::Shed => {
                self.rec.shed += 1;
                self.refuse(now, si, turn.id);
                Ok(())
            }
        }
    }

    /// Request `id` of session `si` is answered without being served (shed, expired or refused
    /// by its engine): it misses any SLO, and the session's next turn follows.
    fn refuse(&mut self, now: Duration, si: u32, id: u64) {
        let class = self.plan.sessions[si as usize].class;
        self.rec.rejected += 1;
        *self.rec.class_rejected.entry(class).or_default() += 1;
        self.rec.refused.push(id);
        self.done += 1;
        self.next_turn(now, si, id);
    }

    fn schedule_tick(&mut self, now: Duration) {
        if let Some(gate) = self.gate.as_deref() {
            if !self.ticking {
                self.ticking = true;
                self.queue.push(now + gate.tick(), Event::Tick);
            }
        }
    }

    /// What the gate lets go now is routed; what waited too long is answered 429.
    fn release(&mut self, now: Duration, policy: &mut dyn Policy) -> Result<(), SimError> {
        let Some(gate) = self.gate.as_deref_mut() else {
            return Ok(());
        };
        if !gate.holds_any() {
            return Ok(());
        }
        let view = View {
            now,
            inflight: &self.inflight,
            metrics: &self.metrics,
        };
        gate.release(&view, &mut self.resume, &mut self.expired);
        let holds = gate.holds_any();
        let (resume, expired) = (
            std::mem::take(&mut self.resume),
            std::mem::take(&mut self.expired),
        );
        for &id in &expired {
            if let Some(h) = self.held.remove(&id) {
                self.rec.expired += 1;
                self.refuse(now, h.session, id);
            }
        }
        for &id in &resume {
            if let Some(h) = self.held.remove(&id) {
                let waited = now.saturating_sub(h.arrived);
                self.rec.held_s += waited.as_secs_f64();
                self.dispatch(now, h.session, h.turn, waited, policy)?;
            }
        }
        (self.resume, self.expired) = (resume, expired);
        if holds {
            self.schedule_tick(now);
        }
        Ok(())
    }

    /// Routes turn `ti` of session `si` and submits it to the chosen engine; `held`: how long
    /// the admission stage held it.
    fn dispatch(
        &mut self,
        now: Duration,
        si: u32,
        ti: u32,
        held: Duration,
        policy: &mut dyn Policy,
    ) -> Result<(), SimError> {
        let plan = self.plan;
        let Some(session) = plan.sessions.get(si as usize) else {
            return Ok(());
        };
        let Some(turn) = session.turns.get(ti as usize) else {
            return Ok(());
        };
        // The prompt: the session's context so far plus this turn's parts.
        self.text.clear();
        std::mem::swap(&mut self.text, &mut self.contexts[si as usize]);
        render_all(&turn.append, &mut self.text);
        if let Some(ideal) = &mut self.ideal {
            ideal.observe(&self.text, turn.id, turn.max_tokens);
        }
        build_body(&self.text, &mut self.body);
        let view = View {
            now,
            inflight: &self.inflight,
            metrics: &self.metrics,
        };
        let prompt = tokenizer::tokenize(&self.text);
        let request = RouteRequest {
            id: turn.id,
            text: &self.text,
            body: &self.body,
            prompt_tokens: u32::try_from(prompt.len()).unwrap_or(u32::MAX),
        };
        let pick = policy.pick_pd(&request, &view);
        let e = pick.decode;
        if e >= self.engines.len() {
            return Err(SimError::BadPick {
                chosen: e,
                replicas: self.engines.len(),
            });
        }
        if let Some(p) = pick.prefill {
            let prefills = self.roles.get(p).is_some_and(|r| r.prefills());
            if !prefills || p == e {
                return Err(SimError::BadPrefill {
                    prefill: p,
                    decode: e,
                });
            }
        }
        let max_hit_blocks = prompt.len().saturating_sub(1) / self.block_size;
        block_hashes(&prompt, self.block_size, max_hit_blocks, &mut self.hashes);
        // A split request's hits are its prefill engine's.
        let hit_at = pick.prefill.unwrap_or(e);
        let arrival_hit = (self.mirrors[hit_at].matched(&self.hashes) * self.block_size) as u32;
        let submitted = match pick.prefill {
            // The prefill half first; the request reaches its decode engine after it.
            Some(p) => {
                let prefilled = self.engines[p].submit(
                    EngineRequest {
                        id: turn.id | PREFILL_HALF,
                        prompt: prompt.clone(),
                        max_tokens: 1,
                    },
                    now,
                );
                if prefilled.is_ok() {
                    self.inflight[p] += 1;
                    self.rec.disaggregated += 1;
                    self.transfers.insert(
                        turn.id | PREFILL_HALF,
                        Transfer {
                            session: si,
                            decode: e,
                            prompt,
                            hashes: self.hashes.clone(),
                            max_tokens: turn.max_tokens,
                            arrived: now,
                            prefill_time: Duration::ZERO,
                            cached_tokens: 0,
                        },
                    );
                    if !self.busy[p] {
                        self.start_step(now, p, policy);
                    }
                }
                prefilled
            }
            None => self.engines[e].submit(
                EngineRequest {
                    id: turn.id,
                    prompt,
                    max_tokens: turn.max_tokens,
                },
                now,
            ),
        };
        self.rec.per_endpoint[e] += 1;
        if ti as usize + 1 < session.turns.len() {
            std::mem::swap(&mut self.text, &mut self.contexts[si as usize]);
        }
        match submitted {
            Ok(()) => {
                self.inflight[e] += 1;
                self.live[si as usize] = Some(Live {
                    id: turn.id,
                    endpoint: e as u32,
                    last_token: now,
                    arrival_hit,
                    first_token: false,
                    preempted_early: false,
                    prefill_time: Duration::ZERO,
                    served: None,
                    held,
                    prefill_hit: None,
                });
                self.open += 1;
                if pick.prefill.is_none() && !self.busy[e] {
                    self.start_step(now, e, policy);
                }
            }
            Err(err) => {
                log::debug!("request {} refused by the engine: {err}", turn.id);
                policy.on_finished(turn.id, e, now);
                self.refuse(now, si, turn.id);
            }
        }
        Ok(())
    }

    /// A split request's prefill half produced its token (and finished) on engine `p`: its KV
    /// leaves for the decode engine, minus the blocks that one already holds.
    fn prefill_output(
        &mut self,
        now: Duration,
        p: usize,
        id: u64,
        kind: &OutputKind,
        policy: &mut dyn Policy,
    ) {
        match *kind {
            OutputKind::FirstToken {
                prefill_time,
                cached_tokens,
                ..
            } => {
                if let Some(t) = self.transfers.get_mut(&id) {
                    t.prefill_time = prefill_time;
                    t.cached_tokens = cached_tokens;
                }
                policy.on_prefilled(id & !PREFILL_HALF, p, now);
            }
            OutputKind::Finished { usage, .. } => {
                self.inflight[p] = self.inflight[p].saturating_sub(1);
                let Some(t) = self.transfers.get(&id) else {
                    return;
                };
                self.prefill[p].observe(t.prefill_time, &usage);
                let held = self.mirrors[t.decode].matched(&t.hashes) * self.block_size;
                let moved = t.prompt.len().saturating_sub(held) as f64;
                let rate = self.kv_transfer_tokens_per_s;
                let wait = if rate.is_finite() && rate > 0.0 {
                    Duration::from_secs_f64(moved / rate)
                } else {
                    Duration::ZERO
                };
                self.queue.push(now + wait, Event::Transferred { id });
            }
            OutputKind::Token { .. } | OutputKind::Preempted => {}
        }
    }

    /// A split request's KV reached its decode engine: it is submitted there.
    fn transferred(&mut self, now: Duration, id: u64, policy: &mut dyn Policy) {
        let Some(t) = self.transfers.remove(&id) else {
            return;
        };
        let request = id & !PREFILL_HALF;
        let e = t.decode;
        let si = t.session as usize;
        let submitted = self.engines[e].submit_transferred(
            EngineRequest {
                id: request,
                prompt: t.prompt,
                max_tokens: t.max_tokens,
            },
            None,
            now,
        );
        let Some(live) = self
            .live
            .get_mut(si)
            .and_then(|l| l.as_mut())
            .filter(|l| l.id == request)
        else {
            return;
        };
        match submitted {
            Ok(()) => {
                // TTFT and E2E count from the request's arrival.
                live.held += now.saturating_sub(t.arrived);
                live.prefill_hit = Some(t.cached_tokens);
                if !self.busy[e] {
                    self.start_step(now, e, policy);
                }
            }
            Err(err) => {
                log::debug!("request {request} refused by its decode engine: {err}");
                self.live[si] = None;
                self.open -= 1;
                self.inflight[e] = self.inflight[e].saturating_sub(1);
                policy.on_finished(request, e, now);
                self.refuse(now, si as u32, request);
            }
        }
    }

    /// Schedules the turn after request `id` of session `si`, if there is one.
    fn next_turn(&mut self, now: Duration, si: u32, id: u64) {
        let ti = (id % crate::workload::TURN_SLOTS) as u32 + 1;
        if let Some(turn) = self
            .plan
            .sessions
            .get(si as usize)
            .and_then(|s| s.turns.get(ti as usize))
        {
            self.queue.push(
                now + turn.delay,
                Event::Arrival {
                    session: si,
                    turn: ti,
                },
            );
        }
    }

    fn start_step(&mut self, now: Duration, e: usize, policy: &mut dyn Policy) {
        let step = self.engines[e].step(now);
        self.mirrors[e].apply(&step.events);
        if !step.events.is_empty() {
            policy.on_kv_events(e, &step.events, now);
        }
        if step.outputs.is_empty() && step.duration.is_zero() {
            // Nothing could be scheduled: the engine waits for the next submission.
            self.busy[e] = false;
            return;
        }
        self.busy[e] = true;
        self.pending[e] = step.outputs;
        self.queue
            .push(now + step.duration, Event::StepEnd { engine: e as u32 });
    }

    fn step_end(
        &mut self,
        now: Duration,
        e: usize,
        policy: &mut dyn Policy,
    ) -> Result<(), SimError> {
        let outputs = std::mem::take(&mut self.pending[e]);
        let mut completed = false;
        let in_window = now <= self.rec.window_end;
        for out in outputs {
            let id = out.id;
            if id & PREFILL_HALF != 0 {
                self.prefill_output(now, e, id, &out.kind, policy);
                continue;
            }
            let si = (id / crate::workload::TURN_SLOTS) as usize;
            let Some(live) = self
                .live
                .get_mut(si)
                .and_then(|l| l.as_mut())
                .filter(|l| l.id == id)
            else {
                continue;
            };
            if in_window
                && matches!(
                    out.kind,
                    OutputKind::FirstToken { .. } | OutputKind::Token { .. }
                )
            {
                self.rec.window_output_tokens += 1;
            }
            match out.kind {
                OutputKind::FirstToken {
                    ttft, prefill_time, ..
                } => {
                    let ttft = ttft + live.held;
                    live.prefill_time = prefill_time;
                    live.last_token = now;
                    live.first_token = true;
                    let class = self.plan.sessions[si].class;
                    live.served = Some(self.rec.served.len());
                    self.rec.served.push(Served {
                        class,
                        ttft_s: ttft.as_secs_f64(),
                        output_tokens: 1,
                        window_output_tokens: u64::from(in_window),
                    });
                    self.rec.ttft.push(ttft.as_secs_f64());
                    self.rec
                        .class_ttft
                        .entry(class)
                        .or_default()
                        .push(ttft.as_secs_f64());
                    self.prefilled.push(Prefilled {
                        endpoint: e,
                        request: id,
                    });
                    policy.on_first_token(id, e, now);
                }
                OutputKind::Token { .. } => {
                    let gap = now.saturating_sub(live.last_token);
                    self.rec.itl.push(gap.as_secs_f32());
                    if let Some(served) = live.served.and_then(|i| self.rec.served.get_mut(i)) {
                        served.output_tokens += 1;
                        served.window_output_tokens += u64::from(in_window);
                    }
                    live.last_token = now;
                }
                OutputKind::Finished { usage, latency } => {
                    let live = *live;
                    let endpoint = live.endpoint as usize;
                    self.live[si] = None;
                    self.open -= 1;
                    self.inflight[endpoint] = self.inflight[endpoint].saturating_sub(1);
                    policy.on_output(id, usage.completion_tokens);
                    policy.on_finished(id, endpoint, now);
                    self.prefill[endpoint].observe(live.prefill_time, &usage);
                    self.rec.e2e.push((latency + live.held).as_secs_f64());
                    completed = true;
                    self.rec.prompt_tokens += u64::from(usage.prompt_tokens);
                    let cached = if let Some(hit) = live.prefill_hit {
                        hit
                    } else if live.preempted_early {
                        self.rec.estimated_hit_requests += 1;
                        live.arrival_hit.min(usage.prompt_tokens)
                    } else {
                        usage.cached_tokens
                    };
                    self.rec.cached_tokens += u64::from(cached);
                    self.rec.reported_cached_tokens += u64::from(usage.cached_tokens);
                    self.rec.arrival_cached_tokens += u64::from(live.arrival_hit);
                    self.rec.output_tokens += u64::from(usage.completion_tokens);
                    self.rec.completed += 1;
                    self.rec.finished.push(id);
                    if in_window {
                        self.rec.window_completed += 1;
                    }
                    self.rec.last_completion = now;
                    self.done += 1;
                    self.next_turn(now, si as u32, id);
                }
                OutputKind::Preempted => {
                    self.rec.preemptions += 1;
                    if !live.first_token {
                        live.preempted_early = true;
                    }
                }
            }
        }
        if self.engines[e].has_work() {
            self.start_step(now, e, policy);
        } else {
            self.busy[e] = false;
        }
        if completed {
            // The filter looks at its held requests whenever one of its requests completes.
            self.release(now, policy)?;
        }
        Ok(())
    }

    fn scrape(&mut self, now: Duration, policy: &mut dyn Policy) {
        for ((m, engine), prefill) in self
            .metrics
            .iter_mut()
            .zip(&self.engines)
            .zip(&self.prefill)
        {
            let s = engine.stats();
            *m = EndpointMetrics {
                waiting: s.waiting as u32,
                running: s.running as u32,
                kv_cache_usage: s.kv_cache_usage,
                cached_blocks: s.num_cached_blocks as u32,
                num_gpu_blocks: s.num_gpu_blocks,
                block_size: s.block_size,
                prefix_hit_rate: (s.prefix_cache_queries > 0)
                    .then(|| s.prefix_cache_hits as f64 / s.prefix_cache_queries as f64),
                prefill: *prefill,
            };
        }
        let view = View {
            now,
            inflight: &self.inflight,
            metrics: &self.metrics,
        };
        policy.on_scrape(&view, &self.prefilled);
        self.prefilled.clear();
    }
}

/// The `/v1/completions` body of a prompt.
fn build_body(text: &str, out: &mut Vec<u8>) {
    out.clear();
    out.extend_from_slice(br#"{"model":""#);
    out.extend_from_slice(crate::policy::kvoy::MODEL.as_bytes());
    out.extend_from_slice(br#"","prompt":"#);
    let plain = text
        .bytes()
        .all(|b| b >= 0x20 && b != b'"' && b != b'\\' && b < 0x7f);
    if plain {
        out.push(b'"');
        out.extend_from_slice(text.as_bytes());
        out.push(b'"');
    } else {
        out.extend_from_slice(serde_json::Value::from(text).to_string().as_bytes());
    }
    out.push(b'}');
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_are_valid_json() {
        let mut b = Vec::new();
        build_body("plain text ", &mut b);
        let v: serde_json::Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(v["prompt"], "plain text ");
        build_body("quote \" and \\ and \n", &mut b);
        let v: serde_json::Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(v["prompt"], "quote \" and \\ and \n");
    }
}
