//! The pool actor: one task owns the endpoint set and the snapshot history. It reloads the
//! endpoint source, starts and stops each endpoint's scrape task and KV-event follower, and
//! every half scrape interval turns what they observed into endpoint statuses, a new snapshot
//! version when anything changed, and a [`PoolView`] that the HTTP API reads.

use std::collections::{BTreeMap, HashMap};

use fnv::FnvHashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use log::{error, info, warn};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::MissedTickBehavior;

use kvoy_kvevents::ZmqContext;
use kvoy_shared::snapshot::{EndpointStatus, SnapshotHistory};
use kvoy_shared::MAX_ENDPOINTS;

use crate::config::{EndpointSpec, Limits};
use crate::follow::{Follower, KvCounters, KvSummary};
use crate::kv_link::Linker;
use crate::prefill::PrefillReport;
use crate::reject::Rejections;
use crate::scrape::Scraper;
use crate::source::EndpointSource;
use crate::status::{self, PoolGauges, ScrapeState, Thresholds};

/// Settings the pool runs with (from the configuration file).
#[derive(Clone, Copy, Debug)]
pub struct PoolSettings {
    pub scrape_interval: Duration,
    pub scrape_timeout: Duration,
    pub reload_interval: Duration,
    pub thresholds: Thresholds,
    pub limits: Limits,
}

/// Scrape counters of one endpoint.
#[derive(Debug, Default)]
pub struct ScrapeCounters {
    pub scrapes: AtomicU64,
    pub failures: AtomicU64,
}

/// One endpoint as the HTTP API shows it.
#[derive(Clone)]
pub struct EndpointView {
    pub status: EndpointStatus,
    pub spec: EndpointSpec,
    pub last_error: Option<String>,
    /// Milliseconds since the last successful scrape.
    pub metrics_age_ms: Option<u64>,
    pub scrape_counters: Arc<ScrapeCounters>,
    pub kv: Option<(KvSummary, Arc<KvCounters>)>,
    /// What the KV-event follower refused, by reason.
    pub kv_rejections: Option<Arc<Rejections>>,
    /// What the prefill-rate estimator has seen.
    pub prefill: PrefillReport,
    /// The server's prefix-cache hits and queries (tokens, cumulative), as last scraped.
    pub prefix_cache: Option<(f64, f64)>,
}

/// Everything the HTTP API reads, replaced as a whole at every pool tick.
#[derive(Clone)]
pub struct PoolView {
    pub history: SnapshotHistory,
    pub endpoints: Vec<EndpointView>,
    pub gauges: PoolGauges,
    /// Whether the endpoint source has been read successfully at least once.
    pub loaded: bool,
    /// Loaded, every endpoint of the first pool scraped once (successfully or not), and every
    /// KV follower of the first endpoints has asked its server's replay socket for what it
    /// buffered: until then the snapshot API answers 503 `catching-up`
    /// (another replica, caught up, serves the proxies). It stays true once it is.
    pub caught_up: bool,
    pub source_reloads: u64,
    pub source_errors: u64,
}

impl PoolView {
    pub fn new(epoch: u64) -> Self {
        PoolView {
            history: SnapshotHistory::new(epoch),
            endpoints: Vec::new(),
            gauges: status::pool_gauges(&[]),
            loaded: false,
            caught_up: false,
            source_reloads: 0,
            source_errors: 0,
        }
    }
}

/// Aborts the task when dropped.
struct TaskGuard(JoinHandle<()>);

impl Drop for TaskGuard {
    fn drop(&mut self) {
        self.0.abort();
    }
}

struct EndpointRuntime {
    spec: EndpointSpec,
    slot: u16,
    scrape: watch::Receiver<ScrapeState>,
    scrape_counters: Arc<ScrapeCounters>,
    follower: Option<Follower>,
    _task: TaskGuard,
}

/// Stable slot numbers: an address keeps its slot while the aggregator runs (also across a
/// removal and re-add); slots of removed endpoints are reused only when all are taken.
#[derive(Default)]
struct Slots {
    by_address: FnvHashMap<SocketAddr, u16>,
    retired: BTreeMap<u16, SocketAddr>,
    next: usize,
}

impl Slots {
    fn assign(&mut self, address: SocketAddr) -> Option<u16> {
        if let Some(&slot) = self.by_address.get(&address) {
            self.retired.remove(&slot);
            return Some(slot);
        }
        let slot = if self.next < MAX_ENDPOINTS {
            let slot = u16::try_from(self.next).ok()?;
            self.next += 1;
            slot
        } else {
            let (slot, old) = self.retired.pop_first()?;
            self.by_address.remove(&old);
            slot
        };
        self.by_address.insert(address, slot);
        Some(slot)
    }

    fn retire(&mut self, address: SocketAddr) {
        if let Some(&slot) = self.by_address.get(&address) {
            self.retired.insert(slot, address);
        }
    }
}

async fn scrape_loop(
    spec: EndpointSpec,
    settings: PoolSettings,
    state: watch::Sender<ScrapeState>,
    counters: Arc<ScrapeCounters>,
) {
    let mut scraper = Scraper::new(spec.address, &spec.metrics_path);
    let mut tick = tokio::time::interval(settings.scrape_interval);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        counters.scrapes.fetch_add(1, Ordering::Relaxed);
        match scraper.scrape(settings.scrape_timeout).await {
            Ok(metrics) => state.send_modify(|s| s.record(metrics, Instant::now())),
            Err(e) => {
                counters.failures.fetch_add(1, Ordering::Relaxed);
                state.send_modify(|s| {
                    s.consecutive_failures = s.consecutive_failures.saturating_add(1);
                    s.last_error = Some(e.to_string());
                });
            }
        }
    }
}

/// The pool actor's state.
pub struct Pool {
    settings: PoolSettings,
    source: Box<dyn EndpointSource>,
    zmq: ZmqContext,
    slots: Slots,
    runtimes: Vec<EndpointRuntime>,
    view: PoolView,
    statuses: Vec<EndpointStatus>,
    /// Relayed decisions linked to the servers' blocks (shared with the API and followers).
    links: Arc<Mutex<Linker>>,
}

impl Pool {
    pub fn new(
        settings: PoolSettings,
        source: Box<dyn EndpointSource>,
        zmq: ZmqContext,
        epoch: u64,
        links: Arc<Mutex<Linker>>,
    ) -> Self {
        Pool {
            links,
            settings,
            source,
            zmq,
            slots: Slots::default(),
            runtimes: Vec::new(),
            view: PoolView::new(epoch),
            statuses: Vec::new(),
        }
    }

    /// Runs until `shutdown` turns true, publishing a view at every tick.
    pub async fn run(
        mut self,
        views: watch::Sender<Arc<PoolView>>,
        mut shutdown: watch::Receiver<bool>,
    ) {
        let period = (self.settings.scrape_interval / 2).max(Duration::from_millis(5));
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut next_reload = Instant::now();
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = shutdown.changed() => {}
            }
            if *shutdown.borrow() {
                break;
            }
            let now = Instant::now();
            if now >= next_reload {
                self.reload();
                next_reload = now + self.settings.reload_interval;
            }
            self.refresh(Instant::now());
            views.send_replace(Arc::new(self.view.clone()));
        }
        info!("kvoy-aggregator: pool stopped");
    }

    fn reload(&mut self) {
        match self.source.poll() {
            Ok(Some(specs)) => {
                self.view.loaded = true;
                self.view.source_reloads += 1;
                self.reconcile(specs);
            }
            Ok(None) => {}
            Err(e) => {
                self.view.source_errors += 1;
                error!("kvoy-aggregator: endpoint source: {e}; keeping the current endpoints");
            }
        }
    }

    /// Brings the running endpoints in line with `specs`, keeping unchanged ones untouched.
    fn reconcile(&mut self, specs: Vec<EndpointSpec>) {
        let mut old: HashMap<SocketAddr, EndpointRuntime> = self
            .runtimes
            .drain(..)
            .map(|r| (r.spec.address, r))
            .collect();
        let mut next = Vec::with_capacity(specs.len());
        for spec in specs {
            match old.remove(&spec.address) {
                Some(rt) if rt.spec == spec => next.push(rt),
                previous => {
                    drop(previous);
                    let Some(slot) = self.slots.assign(spec.address) else {
                        warn!("kvoy-aggregator: no slot left for {}", spec.address);
                        continue;
                    };
                    match self.start_endpoint(spec, slot) {
                        Ok(rt) => next.push(rt),
                        Err(e) => error!("kvoy-aggregator: cannot start an endpoint: {e}"),
                    }
                }
            }
        }
        for (address, _) in old {
            info!("kvoy-aggregator: endpoint {address} removed");
            self.slots.retire(address);
            if let Ok(mut l) = self.links.lock() {
                l.forget(address);
            }
        }
        next.sort_by_key(|r| r.slot);
        info!(
            "kvoy-aggregator: {} endpoints: {}",
            next.len(),
            next.iter()
                .map(|r| format!("#{} {}", r.slot, r.spec.address))
                .collect::<Vec<_>>()
                .join(", ")
        );
        self.runtimes = next;
    }

    fn start_endpoint(&self, spec: EndpointSpec, slot: u16) -> std::io::Result<EndpointRuntime> {
        let follower = match &spec.kv_events {
            Some(source) => Some(Follower::spawn(
                &self.zmq,
                source,
                &spec.address.to_string(),
                self.settings.limits,
                Some((self.links.clone(), spec.address)),
            )?),
            None => None,
        };
        let (tx, scrape) = watch::channel(ScrapeState::default());
        let scrape_counters = Arc::new(ScrapeCounters::default());
        let task = tokio::spawn(scrape_loop(
            spec.clone(),
            self.settings,
            tx,
            scrape_counters.clone(),
        ));
        Ok(EndpointRuntime {
            spec,
            slot,
            scrape,
            scrape_counters,
            follower,
            _task: TaskGuard(task),
        })
    }

    fn refresh(&mut self, now: Instant) {
        // Ages out and settles links also while no decision or event arrives.
        if let Ok(mut l) = self.links.lock() {
            l.tick(now);
        }
        self.statuses.clear();
        self.view.endpoints.clear();
        // From the same summaries as the statuses: caught up means this snapshot has it all.
        let mut caught_up = self.view.loaded;
        for rt in &self.runtimes {
            let scrape = rt.scrape.borrow().clone();
            if let Some(f) = &rt.follower {
                f.server_restarted(scrape.restarts);
                if let Some(blocks) = scrape.metrics.as_ref().and_then(|m| m.num_gpu_blocks) {
                    f.set_capacity(blocks);
                }
            }
            let kv = rt.follower.as_ref().map(|f| f.summary());
            caught_up &= kv.is_none_or(|k| k.caught_up);
            // Until its first scrape ends a server reads as not ready: a replica answering then
            // would send every proxy that fails over to it off a healthy server.
            caught_up &= scrape.attempted();
            let status = status::endpoint_status(
                rt.slot,
                &rt.spec,
                &scrape,
                kv,
                now,
                self.settings.thresholds,
            );
            self.statuses.push(status.clone());
            self.view.endpoints.push(EndpointView {
                status,
                spec: rt.spec.clone(),
                last_error: scrape.last_error,
                metrics_age_ms: scrape.last_success.map(|t| {
                    u64::try_from(now.saturating_duration_since(t).as_millis()).unwrap_or(u64::MAX)
                }),
                scrape_counters: rt.scrape_counters.clone(),
                kv: rt.follower.as_ref().map(|f| (f.summary(), f.counters())),
                kv_rejections: rt.follower.as_ref().map(Follower::rejections),
                prefill: scrape.prefill.report(),
                prefix_cache: scrape
                    .metrics
                    .as_ref()
                    .and_then(|m| m.prefix_cache_hits.zip(m.prefix_cache_queries)),
            });
        }
        self.view.gauges = status::pool_gauges(&self.statuses);
        self.view.history.update(self.statuses.clone());
        self.view.caught_up |= caught_up;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_stable_and_reused_last() {
        let a: SocketAddr = "10.0.0.1:1".parse().unwrap();
        let b: SocketAddr = "10.0.0.2:1".parse().unwrap();
        let mut s = Slots::default();
        assert_eq!(s.assign(a), Some(0));
        assert_eq!(s.assign(b), Some(1));
        s.retire(a);
        assert_eq!(s.assign(a), Some(0), "re-added keeps its slot");
        s.retire(b);
        s.next = MAX_ENDPOINTS;
        let c: SocketAddr = "10.0.0.3:1".parse().unwrap();
        assert_eq!(s.assign(c), Some(1), "a retired slot when all are taken");
        assert_eq!(s.assign(b), None);
    }
}
