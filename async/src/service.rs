//! The running service: one loop that reads the lanes, decodes at the edge, schedules, sends
//! jobs through the proxy within the gate's limit, and hands each outcome to a task that
//! writes it (retrying while Redis is away) before the job is acknowledged.
//!
//! A job is in one of four places, and in every one its stream entry stays pending in Redis
//! and is kept alive by this consumer: waiting (the scheduler), running (its request), being
//! finished (its outcome's write), or parked (a second delivery of an id in hand, acknowledged
//! once the first is finished).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use fnv::{FnvHashMap, FnvHashSet};
use tokio::sync::{mpsc, watch};

use crate::config::Config;
use crate::gate::{allowed_inflight, read_pool, seat_limit, PoolReading};
use crate::job::{decode, DeadReason, Job, Limits};
use crate::queue::{DeadLetter, Delivery, Finish, JobResult, Outcome, Queue};
use crate::schedule::Scheduler;
use crate::send::{post_json, Reply};
use crate::status::{LaneStatus, Status};

/// The header naming a job's admission objective (its lane's band).
pub const OBJECTIVE_HEADER: &str = "x-gateway-inference-objective";
/// The header naming a job's flow for the proxy's fairness (its tenant).
pub const FAIRNESS_HEADER: &str = "x-gateway-inference-fairness-id";
/// The header carrying the job id to the proxy's and servers' logs.
pub const JOB_HEADER: &str = "x-kvoy-async-job";

/// A tenant with fewer jobs than this waiting in a lane, having run one there within
/// [`STARVED_RECENT_MS`], makes the lane read further ahead (up to `max_read_ahead`).
const STARVED_BELOW: usize = 8;
const STARVED_RECENT_MS: u64 = 5_000;

/// A job in hand.
struct Held {
    delivery: Delivery,
    job: Job,
    /// Failures so far (429 and 503 are not failures: the pool said "later").
    failures: u32,
    /// Times put back, for the backoff.
    retries: u32,
    last_error: String,
    /// When its latest attempt was sent (Unix ms).
    started_ms: u64,
}

enum Event {
    Answered {
        held: Box<Held>,
        lane: usize,
        charged: u64,
        reply: anyhow::Result<Reply>,
    },
    Finished {
        delivery: Delivery,
        id: Option<String>,
        tenant: Option<String>,
        kind: Kind,
        written: Finish,
    },
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Done,
    Dead(&'static str),
    Duplicate,
}

/// What the loop shares with the status server.
pub type SharedStatus = Arc<Mutex<Status>>;

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// The tokens an answer reports (`usage.total_tokens`, else prompt + completion).
fn used_tokens(body: &[u8]) -> Option<u64> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    let usage = v.get("usage")?;
    usage
        .get("total_tokens")
        .and_then(|t| t.as_u64())
        .or_else(|| {
            Some(usage.get("prompt_tokens")?.as_u64()? + usage.get("completion_tokens")?.as_u64()?)
        })
}

struct Service<Q> {
    config: Arc<Config>,
    queue: Arc<Q>,
    scheduler: Scheduler<Held>,
    /// Entries running or being finished, per lane.
    busy: Vec<FnvHashSet<String>>,
    /// Job ids waiting, running or being finished.
    ids: FnvHashSet<String>,
    /// Second deliveries of an id in hand.
    parked: FnvHashMap<String, Vec<Delivery>>,
    /// Running per (lane, tenant).
    running: BTreeMap<(usize, String), u64>,
    inflight: u32,
    events_tx: mpsc::UnboundedSender<Event>,
    status: SharedStatus,
    started: Instant,
    pool: watch::Receiver<Option<(PoolReading, Instant)>>,
    /// When the last pool reading came, and the jobs in flight then.
    seat_base: Option<(Instant, u32)>,
}

/// Runs kvoy-async until `stop` resolves. Returns an error only if Redis cannot be prepared at
/// start; later Redis failures are retried.
pub async fn run<Q: Queue + 'static>(
    config: Config,
    queue: Q,
    status: SharedStatus,
    stop: impl std::future::Future<Output = ()>,
) -> anyhow::Result<()> {
    let config = Arc::new(config);
    let queue = Arc::new(queue);
    queue.prepare().await?;
    {
        let mut s = status
            .lock()
            .map_err(|_| anyhow::anyhow!("status lock poisoned"))?;
        s.saturation_level = config.saturation_level;
        s.lanes = config
            .lanes
            .iter()
            .map(|l| LaneStatus {
                name: l.name.clone(),
                ..Default::default()
            })
            .collect();
    }
    let (pool_tx, pool_rx) = watch::channel(None);
    let gate_task = config.aggregator.map(|address| {
        let every = config.gate_poll;
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                match read_pool(address, Duration::from_secs(2)).await {
                    Ok(r) => {
                        let _ = pool_tx.send(Some((r, Instant::now())));
                    }
                    Err(e) => log::warn!("reading the pool from the aggregator {address}: {e}"),
                }
            }
        })
    });
    let report_task = config.aggregator.map(|address| {
        let status = status.clone();
        let worker: String = config
            .consumer
            .as_deref()
            .unwrap_or("kvoy-async")
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || "-_.:".contains(c) {
                    c
                } else {
                    '_'
                }
            })
            .take(128)
            .collect();
        tokio::spawn(async move {
            // The pool view's table (the aggregator's `POST /v1/async`), every second.
            let path = format!("/v1/async?worker={worker}");
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let body = match status.lock() {
                    Ok(s) => serde_json::to_vec(&*s).unwrap_or_default(),
                    Err(_) => break,
                };
                if let Err(e) = post_json(
                    address,
                    &path,
                    &[],
                    Bytes::from(body),
                    Duration::from_secs(2),
                )
                .await
                {
                    log::debug!("reporting to the aggregator {address}: {e}");
                }
            }
        })
    });
    let (events_tx, mut events_rx) = mpsc::unbounded_channel();
    let mut service = Service {
        scheduler: Scheduler::new(config.lanes.len()),
        busy: vec![FnvHashSet::default(); config.lanes.len()],
        ids: FnvHashSet::default(),
        parked: FnvHashMap::default(),
        running: BTreeMap::new(),
        inflight: 0,
        events_tx,
        status,
        started: Instant::now(),
        pool: pool_rx,
        seat_base: None,
        config: config.clone(),
        queue,
    };
    let keep_alive_every = config.claim_idle / 3;
    let mut last_keep_alive = Instant::now();
    // The first reclaim runs at once: a restart picks up what its predecessor held.
    let mut last_reclaim: Option<Instant> = None;
    let mut last_backlog = Instant::now() - Duration::from_secs(10);
    tokio::pin!(stop);
    loop {
        if last_reclaim.is_none_or(|t| t.elapsed() >= config.claim_idle / 2) {
            service.reclaim().await;
            last_reclaim = Some(Instant::now());
        }
        service.read().await;
        if last_keep_alive.elapsed() >= keep_alive_every {
            service.keep_alive().await;
            last_keep_alive = Instant::now();
        }
        if last_backlog.elapsed() >= Duration::from_secs(1) {
            service.backlog().await;
            last_backlog = Instant::now();
        }
        service.dispatch();
        service.publish();
        tokio::select! {
            () = &mut stop => break,
            event = events_rx.recv() => {
                if let Some(event) = event {
                    service.handle(event);
                }
                while let Ok(event) = events_rx.try_recv() {
                    service.handle(event);
                }
            }
            () = tokio::time::sleep(config.poll) => {}
        }
    }
    for task in [gate_task, report_task].into_iter().flatten() {
        task.abort();
    }
    Ok(())
}

impl<Q: Queue + 'static> Service<Q> {
    fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    fn limits(&self) -> Limits<'_> {
        Limits {
            max_job_bytes: self.config.max_job_bytes,
            tenant_metadata_key: &self.config.tenant_metadata_key,
        }
    }

    fn lane_name(&self, lane: usize) -> String {
        self.config
            .lanes
            .get(lane)
            .map_or_else(String::new, |l| l.name.clone())
    }

    async fn read(&mut self) {
        let now = self.now_ms();
        for lane in 0..self.config.lanes.len() {
            let waiting = self.scheduler.lane_len(lane);
            let read_ahead = self.config.read_ahead as usize;
            let most = self.config.max_read_ahead as usize;
            let room = if waiting < read_ahead {
                read_ahead - waiting
            } else if waiting < most
                && self
                    .scheduler
                    .starved(lane, STARVED_BELOW, STARVED_RECENT_MS, now)
            {
                (most - waiting).min(read_ahead)
            } else {
                0
            };
            if room == 0 {
                continue;
            }
            if let Err(e) = self.queue.bridge(lane, room).await {
                log::warn!(
                    "moving lane {}'s sorted set into its stream: {e}",
                    self.lane_name(lane)
                );
            }
            match self.queue.read(lane, room).await {
                Ok(deliveries) => {
                    for d in deliveries {
                        self.take(d).await;
                    }
                }
                Err(e) => log::warn!("reading lane {}: {e}", self.lane_name(lane)),
            }
        }
    }

    async fn reclaim(&mut self) {
        for lane in 0..self.config.lanes.len() {
            match self
                .queue
                .reclaim(
                    lane,
                    self.config.claim_idle,
                    self.config.read_ahead as usize,
                )
                .await
            {
                Ok(deliveries) => {
                    if !deliveries.is_empty() {
                        log::info!(
                            "lane {}: reclaimed {} jobs another worker left pending",
                            self.lane_name(lane),
                            deliveries.len()
                        );
                    }
                    for d in deliveries {
                        self.take(d).await;
                    }
                }
                Err(e) => log::warn!("reclaiming lane {}: {e}", self.lane_name(lane)),
            }
        }
    }

    /// A delivery, decoded at the edge: into the scheduler, or straight to its outcome.
    async fn take(&mut self, delivery: Delivery) {
        let lane = delivery.lane;
        if self.busy[lane].contains(&delivery.entry)
            || self
                .scheduler
                .items()
                .any(|(l, h)| l == lane && h.delivery.entry == delivery.entry)
        {
            // Our own entry, reclaimed because a keep-alive was late: already in hand.
            return;
        }
        if delivery.deliveries > self.config.max_deliveries {
            let id = decode(&delivery.job, &self.limits()).ok().map(|j| j.id);
            let reason = DeadReason::Redelivered(delivery.deliveries);
            self.dead(delivery, id, None, reason);
            return;
        }
        if delivery.job.is_empty() {
            let reason = DeadReason::Malformed("the stream entry has no `job` field".into());
            self.dead(delivery, None, None, reason);
            return;
        }
        let job = match decode(&delivery.job, &self.limits()) {
            Ok(job) => job,
            Err(rejected) => {
                self.dead(delivery, rejected.id, None, rejected.reason);
                return;
            }
        };
        if self.ids.contains(&job.id) {
            self.parked.entry(job.id).or_default().push(delivery);
            return;
        }
        match self.queue.is_done(&job.id).await {
            Ok(true) => {
                self.acknowledge_duplicate(delivery, job.id, Some(job.tenant));
                return;
            }
            Ok(false) => {}
            // Unknown: run it; the finish is once per id whatever happens.
            Err(e) => log::warn!("checking job {}: {e}", job.id),
        }
        self.ids.insert(job.id.clone());
        let (tokens, tenant) = (self.estimate(&job), job.tenant.clone());
        let now = self.now_ms();
        self.scheduler.push(
            lane,
            &tenant,
            tokens,
            now,
            Held {
                delivery,
                job,
                failures: 0,
                retries: 0,
                last_error: String::new(),
                started_ms: 0,
            },
        );
    }

    fn estimate(&self, job: &Job) -> u64 {
        let has_limit = job.estimated_tokens > job.body.len() as u64 / 4;
        if has_limit {
            job.estimated_tokens
        } else {
            job.estimated_tokens + u64::from(self.config.default_output_tokens)
        }
    }

    async fn keep_alive(&mut self) {
        for lane in 0..self.config.lanes.len() {
            let mut entries: Vec<String> = self.busy[lane].iter().cloned().collect();
            entries.extend(
                self.scheduler
                    .items()
                    .filter(|(l, _)| *l == lane)
                    .map(|(_, h)| h.delivery.entry.clone()),
            );
            entries.extend(
                self.parked
                    .values()
                    .flatten()
                    .filter(|d| d.lane == lane)
                    .map(|d| d.entry.clone()),
            );
            if let Err(e) = self.queue.keep_alive(lane, &entries).await {
                log::warn!("keeping lane {}'s jobs alive: {e}", self.lane_name(lane));
            }
        }
    }

    async fn backlog(&mut self) {
        for lane in 0..self.config.lanes.len() {
            let backlog = self.queue.backlog(lane).await.ok().flatten();
            if let Ok(mut s) = self.status.lock() {
                if let Some(l) = s.lanes.get_mut(lane) {
                    l.backlog = backlog;
                }
            }
        }
    }

    /// The pool reading, if fresh: older than three polls and a second counts as none.
    fn reading(&mut self) -> Option<PoolReading> {
        let fresh = self.config.gate_poll * 3 + Duration::from_secs(1);
        let (reading, at) = self
            .pool
            .borrow()
            .as_ref()
            .filter(|(_, at)| at.elapsed() <= fresh)
            .cloned()?;
        if self.seat_base.is_none_or(|(seen, _)| seen != at) {
            // The servers' counts include the jobs in flight about now, not the ones sent
            // after: the seat limit is counted from this many until the next reading.
            self.seat_base = Some((at, self.inflight));
        }
        Some(reading)
    }

    fn limit(&self, reading: Option<&PoolReading>) -> u32 {
        match (self.config.aggregator, reading) {
            (None, _) => self.config.max_inflight,
            // An aggregator that cannot be read is a saturated pool: the gate closes.
            (Some(_), None) => 0,
            (Some(_), Some(r)) => {
                let by_saturation = allowed_inflight(
                    self.config.max_inflight,
                    r.saturation,
                    self.config.saturation_level,
                );
                match self.config.seats_per_endpoint {
                    Some(seats) => by_saturation.min(seat_limit(
                        self.seat_base.map_or(self.inflight, |(_, n)| n),
                        &r.endpoints,
                        seats,
                        self.config.reserve_seats,
                    )),
                    None => by_saturation,
                }
            }
        }
    }

    fn dispatch(&mut self) {
        let reading = self.reading();
        let limit = self.limit(reading.as_ref());
        let models: Option<&std::collections::BTreeSet<String>> = reading
            .as_ref()
            .map(|r| &r.models)
            .filter(|m| !m.is_empty());
        let now = self.now_ms();
        let unix = unix_now();
        while self.inflight < limit {
            let config = self.config.clone();
            let Some(d) = self.scheduler.next(now, |t| config.tenant(t)) else {
                break;
            };
            let mut held = d.item;
            let known = match models {
                Some(m) => m.contains(&held.job.model),
                None => config.models.is_empty() || config.models.contains(&held.job.model),
            };
            let reason = if held.job.deadline.is_some_and(|dl| dl < unix) {
                Some(DeadReason::DeadlineExceeded)
            } else if !known {
                Some(DeadReason::UnknownModel(held.job.model.clone()))
            } else {
                None
            };
            if let Some(reason) = reason {
                let weight = config.tenant(&d.tenant).weight;
                self.scheduler
                    .finished(d.lane, &d.tenant, d.tokens, Some(0), weight, now);
                let (id, tenant) = (held.job.id.clone(), held.job.tenant.clone());
                self.dead(held.delivery, Some(id), Some(tenant), reason);
                continue;
            }
            self.inflight += 1;
            *self.running.entry((d.lane, d.tenant.clone())).or_default() += 1;
            self.busy[d.lane].insert(held.delivery.entry.clone());
            held.started_ms = (unix_now() * 1000.0) as u64;
            let lane = &config.lanes[d.lane];
            let mut headers = vec![
                (OBJECTIVE_HEADER.to_owned(), lane.objective.clone()),
                (FAIRNESS_HEADER.to_owned(), held.job.tenant.clone()),
                (JOB_HEADER.to_owned(), held.job.id.clone()),
            ];
            headers.extend(held.job.headers.iter().cloned());
            let timeout = match held.job.deadline {
                Some(dl) => config
                    .request_timeout
                    .min(Duration::from_secs_f64((dl - unix).max(0.001))),
                None => config.request_timeout,
            };
            let tx = self.events_tx.clone();
            let body = Bytes::from(held.job.body.clone());
            let (lane_index, charged) = (d.lane, d.tokens);
            tokio::spawn(async move {
                let reply = post_json(config.proxy, held.job.path, &headers, body, timeout).await;
                let _ = tx.send(Event::Answered {
                    held: Box::new(held),
                    lane: lane_index,
                    charged,
                    reply,
                });
            });
        }
        if let Ok(mut s) = self.status.lock() {
            s.inflight_limit = limit;
            s.saturation = reading.map(|r| r.saturation);
        }
    }

    fn handle(&mut self, event: Event) {
        match event {
            Event::Answered {
                held,
                lane,
                charged,
                reply,
            } => self.answered(*held, lane, charged, reply),
            Event::Finished {
                delivery,
                id,
                tenant,
                kind,
                written,
            } => {
                self.busy[delivery.lane].remove(&delivery.entry);
                let lane = delivery.lane;
                if let Ok(mut s) = self.status.lock() {
                    let counts = match (kind, written) {
                        (_, Finish::Duplicate) | (Kind::Duplicate, _) => {
                            if let Some(l) = s.lanes.get_mut(lane) {
                                l.duplicates += 1;
                            }
                            None
                        }
                        (Kind::Done, Finish::Written) => Some(None),
                        (Kind::Dead(reason), Finish::Written) => {
                            if let Some(l) = s.lanes.get_mut(lane) {
                                *l.dead_lettered.entry(reason).or_default() += 1;
                            }
                            Some(Some(reason))
                        }
                    };
                    if let (Some(dead), Some(tenant)) = (counts, tenant.as_deref()) {
                        if let Some(c) = s.tenant_mut(lane, tenant) {
                            if dead.is_some() {
                                c.dead_lettered += 1;
                            } else {
                                c.done += 1;
                            }
                        }
                    }
                }
                if let Some(id) = id {
                    if kind != Kind::Duplicate {
                        self.ids.remove(&id);
                    }
                    // Its other deliveries: the id has its result now.
                    for d in self.parked.remove(&id).unwrap_or_default() {
                        self.acknowledge_duplicate(d, id.clone(), None);
                    }
                }
            }
        }
    }

    fn answered(
        &mut self,
        mut held: Held,
        lane: usize,
        charged: u64,
        reply: anyhow::Result<Reply>,
    ) {
        self.inflight = self.inflight.saturating_sub(1);
        let tenant = held.job.tenant.clone();
        if let Some(n) = self.running.get_mut(&(lane, tenant.clone())) {
            *n = n.saturating_sub(1);
        }
        self.busy[lane].remove(&held.delivery.entry);
        let weight = self.config.tenant(&tenant).weight;
        let now = self.now_ms();
        enum Next {
            Result(JobResult),
            Retry(Option<u64>),
            Fail(String),
            Dead(DeadReason),
        }
        let (next, used) = match &reply {
            Ok(r) if (200..300).contains(&r.status) => {
                let used = used_tokens(&r.body);
                (
                    Next::Result(JobResult {
                        id: held.job.id.clone(),
                        tenant: tenant.clone(),
                        status_code: r.status,
                        payload: String::from_utf8_lossy(&r.body).into_owned(),
                        error_code: None,
                        error_message: None,
                        attempts: held.failures + held.retries + 1,
                        started_ms: held.started_ms,
                        format: held.job.format,
                    }),
                    used,
                )
            }
            Ok(r) if r.status == 429 || r.status == 503 => (Next::Retry(r.retry_after), Some(0)),
            Ok(r) if r.status == 404 => (
                Next::Dead(DeadReason::UnknownModel(format!(
                    "{} (the proxy answered 404: {})",
                    held.job.model,
                    String::from_utf8_lossy(&r.body[..r.body.len().min(200)])
                ))),
                Some(0),
            ),
            Ok(r) if (400..500).contains(&r.status) => (
                // The request itself is wrong: that answer is its result.
                Next::Result(JobResult {
                    id: held.job.id.clone(),
                    tenant: tenant.clone(),
                    status_code: r.status,
                    payload: String::from_utf8_lossy(&r.body).into_owned(),
                    error_code: None,
                    error_message: None,
                    attempts: held.failures + held.retries + 1,
                    started_ms: held.started_ms,
                    format: held.job.format,
                }),
                Some(0),
            ),
            Ok(r) => (
                Next::Fail(format!(
                    "HTTP {}: {}",
                    r.status,
                    String::from_utf8_lossy(&r.body[..r.body.len().min(200)])
                )),
                Some(0),
            ),
            Err(e) => (Next::Fail(e.to_string()), Some(0)),
        };
        self.scheduler
            .finished(lane, &tenant, charged, used, weight, now);
        if let Ok(mut s) = self.status.lock() {
            if let (Some(c), Some(u)) = (s.tenant_mut(lane, &tenant), used) {
                c.tokens += u;
            }
        }
        let next = match next {
            Next::Fail(error) => {
                held.failures += 1;
                held.last_error = error;
                if held.failures >= self.config.max_attempts {
                    Next::Dead(DeadReason::Failed {
                        attempts: held.failures,
                        last: held.last_error.clone(),
                    })
                } else {
                    Next::Retry(None)
                }
            }
            other => other,
        };
        match next {
            Next::Result(result) => {
                let id = held.job.id.clone();
                self.busy[lane].insert(held.delivery.entry.clone());
                self.spawn_finish(
                    held.delivery,
                    Some(id),
                    Some(tenant),
                    Outcome::Result(result),
                    Kind::Done,
                );
            }
            Next::Dead(reason) => {
                let id = held.job.id.clone();
                self.dead(held.delivery, Some(id), Some(tenant), reason);
            }
            Next::Retry(retry_after) => {
                held.retries += 1;
                let exponent = held.retries.saturating_sub(1).min(16);
                let backoff =
                    (self.config.backoff * 2u32.pow(exponent)).min(self.config.max_backoff);
                let wait = retry_after
                    .map(|s| Duration::from_secs(s).min(self.config.max_backoff))
                    .unwrap_or(backoff);
                if let Ok(mut s) = self.status.lock() {
                    if let Some(c) = s.tenant_mut(lane, &tenant) {
                        c.retried += 1;
                    }
                }
                let tokens = self.estimate(&held.job);
                self.scheduler
                    .push(lane, &tenant, tokens, now + wait.as_millis() as u64, held);
            }
            Next::Fail(_) => {}
        }
    }

    /// A dead-letter entry for `delivery`.
    fn dead(
        &mut self,
        delivery: Delivery,
        id: Option<String>,
        tenant: Option<String>,
        reason: DeadReason,
    ) {
        log::info!(
            "lane {}: job {} dead-lettered: {}",
            self.lane_name(delivery.lane),
            id.as_deref().unwrap_or("(no id)"),
            reason.detail()
        );
        let outcome = Outcome::Dead(DeadLetter {
            id: id.clone(),
            tenant: tenant.clone(),
            reason: reason.code(),
            detail: reason.detail(),
            job: delivery.job.clone(),
        });
        self.busy[delivery.lane].insert(delivery.entry.clone());
        self.spawn_finish(delivery, id, tenant, outcome, Kind::Dead(reason.code()));
    }

    /// Acknowledges a duplicate delivery of `id` (its result exists).
    fn acknowledge_duplicate(&mut self, delivery: Delivery, id: String, tenant: Option<String>) {
        let id = Some(id);
        self.busy[delivery.lane].insert(delivery.entry.clone());
        let outcome = Outcome::Result(JobResult {
            id: id.clone().unwrap_or_default(),
            tenant: tenant.clone().unwrap_or_default(),
            status_code: 0,
            payload: String::new(),
            error_code: None,
            error_message: None,
            attempts: 0,
            started_ms: 0,
            format: crate::job::Format::Kvoy,
        });
        // The id's key exists, so the script writes nothing and only acknowledges.
        self.spawn_finish(delivery, id, tenant, outcome, Kind::Duplicate);
    }

    fn spawn_finish(
        &self,
        delivery: Delivery,
        id: Option<String>,
        tenant: Option<String>,
        outcome: Outcome,
        kind: Kind,
    ) {
        let queue = self.queue.clone();
        let tx = self.events_tx.clone();
        let lane_name = self.lane_name(delivery.lane);
        tokio::spawn(async move {
            let mut wait = Duration::from_millis(50);
            // Until Redis takes it: the job stays pending (and alive) meanwhile, so giving up
            // would only delay it to another worker's reclaim.
            let written = loop {
                match queue.finish(&delivery, &lane_name, &outcome).await {
                    Ok(written) => break written,
                    Err(e) => {
                        log::warn!(
                            "writing the outcome of entry {}: {e}; retrying",
                            delivery.entry
                        );
                        tokio::time::sleep(wait).await;
                        wait = (wait * 2).min(Duration::from_secs(2));
                    }
                }
            };
            let _ = tx.send(Event::Finished {
                delivery,
                id,
                tenant,
                kind,
                written,
            });
        });
    }

    fn publish(&self) {
        let Ok(mut s) = self.status.lock() else {
            return;
        };
        s.inflight = self.inflight;
        for (lane, status) in s.lanes.iter_mut().enumerate() {
            for counts in status.tenants.values_mut() {
                counts.queued = 0;
                counts.running = 0;
            }
            for (tenant, n) in self.scheduler.waiting(lane) {
                status.tenants.entry(tenant.to_owned()).or_default().queued = n as u64;
            }
        }
        for ((lane, tenant), n) in &self.running {
            if let Some(c) = s.tenant_mut(*lane, tenant) {
                c.running = *n;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_gives_the_tokens() {
        assert_eq!(used_tokens(br#"{"usage":{"total_tokens":12}}"#), Some(12));
        assert_eq!(
            used_tokens(br#"{"usage":{"prompt_tokens":5,"completion_tokens":3}}"#),
            Some(8)
        );
        assert_eq!(used_tokens(b"data: {}\n\n"), None);
    }
}
