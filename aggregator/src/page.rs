//! The pool view: `GET /` serves a page (HTML, script and style embedded in the binary, no
//! request leaves the aggregator) that polls `GET /v1/pool` every second and draws the live
//! pool: per endpoint its state, queue, running requests, KV-cache use over time, cached blocks
//! per tier and the decisions the proxies relayed for it; the pool's saturation, queue depth
//! and prefix-cache hit rate over time.
//!
//! kvoy-async workers report their lanes here (`POST /v1/async?worker=NAME`, [`AsyncReport`]);
//! the page shows the fresh reports as a table of lanes and tenants.
//!
//! The history is kept here, not in the browser, so that a page opened now draws the last
//! minutes at once: [`sample`] records the current [`PoolView`] into a [`Timeline`] every
//! [`TIMELINE_INTERVAL`].

use fnv::FnvHashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use serde_json::json;
use std::collections::BTreeMap;
use tokio::sync::watch;

use crate::pool::PoolView;
use crate::timeline::{EndpointReading, Reading, Timeline};

/// How often the history takes a sample.
pub const TIMELINE_INTERVAL: Duration = Duration::from_secs(1);
/// Samples kept: five minutes.
pub const TIMELINE_SAMPLES: usize = 300;

/// The explain panel's module, when it was built (`make explain`; see `build.rs`).
mod explain_assets {
    include!(concat!(env!("OUT_DIR"), "/explain_assets.rs"));
}

/// Whether the explain panel's WebAssembly module is in this binary.
pub const EXPLAIN_BUILT: bool = explain_assets::BUILT;

const JS: &str = "text/javascript; charset=utf-8";

/// The page's files: (path, content type, bytes).
const ASSETS: [(&str, &str, &[u8]); 4] = [
    (
        "/",
        "text/html; charset=utf-8",
        include_bytes!("page/index.html"),
    ),
    ("/pool.js", JS, include_bytes!("page/pool.js")),
    (
        "/pool.css",
        "text/css; charset=utf-8",
        include_bytes!("page/pool.css"),
    ),
    // The explain panel's own script; it loads the two below, or says that they were not
    // built.
    ("/explain.js", JS, include_bytes!("page/explain.js")),
];

/// The explain panel's generated files (`wasm-bindgen --target web`): kvoy-shared's router
/// compiled to WebAssembly, and its glue.
const EXPLAIN_ASSETS: [(&str, &str, &[u8]); 2] = [
    ("/explain/kvoy_explain.js", JS, explain_assets::SCRIPT),
    (
        "/explain/kvoy_explain_bg.wasm",
        "application/wasm",
        explain_assets::MODULE,
    ),
];

/// The page's file at `path`: (content type, body).
pub fn asset(path: &str) -> Option<(&'static str, &'static [u8])> {
    let built: &[(&str, &str, &[u8])] = if EXPLAIN_BUILT { &EXPLAIN_ASSETS } else { &[] };
    ASSETS
        .iter()
        .chain(built)
        .find(|(p, _, _)| *p == path)
        .map(|(_, content_type, body)| (*content_type, *body))
}

/// What the page shows beyond the pool view: the history and the relayed decisions per
/// endpoint.
#[derive(Debug)]
pub struct PoolPage {
    started: Instant,
    timeline: Mutex<Timeline>,
    /// Routing decisions the proxies relayed (`POST /v1/decisions`), per endpoint, since the
    /// aggregator started.
    routed: Mutex<FnvHashMap<SocketAddr, u64>>,
    /// The requests each proxy's admission stage holds, as its last snapshot poll said
    /// (`&proxy=ID&held=N`), and when.
    admission: Mutex<FnvHashMap<u64, (u64, Instant)>>,
    /// The kvoy-async workers' last reports, and when.
    async_workers: Mutex<BTreeMap<String, (AsyncReport, Instant)>>,
}

/// One tenant of one lane, as a kvoy-async worker reports it (its `/v1/status` shape).
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
pub struct AsyncTenant {
    #[serde(default)]
    pub queued: u64,
    #[serde(default)]
    pub running: u64,
    #[serde(default)]
    pub done: u64,
    #[serde(default)]
    pub dead_lettered: u64,
    #[serde(default)]
    pub retried: u64,
    #[serde(default)]
    pub tokens: u64,
}

/// One lane of a kvoy-async worker.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
pub struct AsyncLane {
    pub name: String,
    #[serde(default)]
    pub backlog: Option<u64>,
    #[serde(default)]
    pub tenants: BTreeMap<String, AsyncTenant>,
}

/// What a kvoy-async worker reports (fields it may add later are ignored).
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
pub struct AsyncReport {
    #[serde(default)]
    pub saturation: Option<f64>,
    #[serde(default)]
    pub inflight: u64,
    #[serde(default)]
    pub inflight_limit: u64,
    #[serde(default)]
    pub lanes: Vec<AsyncLane>,
}

/// A kvoy-async worker's report is shown this long after it came (workers report every second).
pub const ASYNC_REPORT_TTL: Duration = Duration::from_secs(10);
/// Workers whose reports are kept at most.
pub const MAX_ASYNC_WORKERS: usize = 64;
/// Longest report body, and longest worker name.
pub const MAX_ASYNC_REPORT_BYTES: usize = 256 << 10;
pub const MAX_ASYNC_WORKER_NAME: usize = 128;

/// A proxy's admission report counts this long after its last poll (polls come every poll
/// interval, 100 ms by default; a proxy that stopped is gone from the sum after this).
pub const ADMISSION_REPORT_TTL: Duration = Duration::from_secs(5);
/// Proxies whose reports are kept at most (the rest are not counted).
pub const MAX_REPORTING_PROXIES: usize = 4096;

impl Default for PoolPage {
    fn default() -> Self {
        PoolPage {
            started: Instant::now(),
            timeline: Mutex::new(Timeline::new(TIMELINE_SAMPLES)),
            routed: Mutex::new(FnvHashMap::default()),
            admission: Mutex::new(FnvHashMap::default()),
            async_workers: Mutex::new(BTreeMap::new()),
        }
    }
}

impl PoolPage {
    /// Counts one relayed decision per address.
    pub fn count_routed(&self, endpoints: impl Iterator<Item = SocketAddr>) {
        if let Ok(mut routed) = self.routed.lock() {
            for e in endpoints {
                *routed.entry(e).or_insert(0) += 1;
            }
        }
    }

    /// Records proxy `proxy`'s report that its admission stage holds `held` requests.
    pub fn report_admission(&self, proxy: u64, held: u64, now: Instant) {
        if let Ok(mut reports) = self.admission.lock() {
            if reports.len() >= MAX_REPORTING_PROXIES && !reports.contains_key(&proxy) {
                reports
                    .retain(|_, (_, at)| now.saturating_duration_since(*at) < ADMISSION_REPORT_TTL);
                if reports.len() >= MAX_REPORTING_PROXIES {
                    return;
                }
            }
            reports.insert(proxy, (held, now));
        }
    }

    /// The admission queue of the pool: the requests the reporting proxies hold, and how many
    /// proxies reported within [`ADMISSION_REPORT_TTL`] of `now`.
    pub fn admission(&self, now: Instant) -> (u64, usize) {
        let Ok(reports) = self.admission.lock() else {
            return (0, 0);
        };
        reports
            .values()
            .filter(|(_, at)| now.saturating_duration_since(*at) < ADMISSION_REPORT_TTL)
            .fold((0, 0), |(held, n), (h, _)| (held + h, n + 1))
    }

    /// Records kvoy-async worker `worker`'s report; false when it is not kept (too many
    /// workers reporting).
    pub fn report_async(&self, worker: &str, report: AsyncReport, now: Instant) -> bool {
        let Ok(mut workers) = self.async_workers.lock() else {
            return false;
        };
        workers.retain(|_, (_, at)| now.saturating_duration_since(*at) < ASYNC_REPORT_TTL);
        if workers.len() >= MAX_ASYNC_WORKERS && !workers.contains_key(worker) {
            return false;
        }
        workers.insert(worker.to_owned(), (report, now));
        true
    }

    /// The fresh kvoy-async reports, by worker.
    pub fn async_json(&self, now: Instant) -> serde_json::Value {
        let Ok(workers) = self.async_workers.lock() else {
            return serde_json::Value::Null;
        };
        let fresh: Vec<_> = workers
            .iter()
            .filter(|(_, (_, at))| now.saturating_duration_since(*at) < ASYNC_REPORT_TTL)
            .map(|(name, (report, _))| json!({"worker": name, "report": report}))
            .collect();
        if fresh.is_empty() {
            serde_json::Value::Null
        } else {
            json!(fresh)
        }
    }

    fn millis(&self, now: Instant) -> u64 {
        u64::try_from(now.saturating_duration_since(self.started).as_millis()).unwrap_or(u64::MAX)
    }

    /// Records `view` as the sample of `now`.
    pub fn record(&self, view: &PoolView, now: Instant) {
        let reading = Reading {
            saturation: view.gauges.saturation,
            queue_depth: view.gauges.waiting,
            running: view.gauges.running,
            endpoints: view
                .endpoints
                .iter()
                .map(|e| EndpointReading {
                    address: e.status.address,
                    kv_cache_usage: e.status.kv_cache_usage,
                    // A server scraped without the series has counted nothing yet (vLLM
                    // and kvoy-sim write them from the first prompt on): zero, so that the
                    // interval of its first prompts counts.
                    prefix_cache: e.prefix_cache.or(e.metrics_age_ms.map(|_| (0.0, 0.0))),
                })
                .collect(),
        };
        let at = self.millis(now);
        if let Ok(mut t) = self.timeline.lock() {
            t.record(at, &reading);
        }
    }

    /// The JSON of `GET /v1/pool`.
    pub fn json(&self, view: &PoolView, now: Instant) -> serde_json::Value {
        let routed = self.routed.lock().map(|r| r.clone()).unwrap_or_default();
        let endpoints: Vec<_> = view
            .endpoints
            .iter()
            .map(|e| {
                let routed = routed.get(&e.status.address).copied().unwrap_or(0);
                crate::http::endpoint_json(
                    e,
                    json!({"kv_events": e.kv.is_some(), "routed": routed}),
                )
            })
            .collect();
        let history: Vec<_> = match self.timeline.lock() {
            Ok(t) => t
                .samples()
                .map(|s| {
                    let kv: serde_json::Map<String, serde_json::Value> = s
                        .kv_cache_usage
                        .iter()
                        .map(|(a, u)| (a.to_string(), json!(u)))
                        .collect();
                    json!({
                        "t_ms": s.at_ms,
                        "saturation": s.saturation,
                        "queue_depth": s.queue_depth,
                        "running": s.running,
                        "hit_rate": s.hit_rate,
                        "kv": kv,
                    })
                })
                .collect(),
            Err(_) => Vec::new(),
        };
        let (held, proxies) = self.admission(now);
        json!({
            "loaded": view.loaded,
            "now_ms": self.millis(now),
            "interval_ms": TIMELINE_INTERVAL.as_millis() as u64,
            "pool": crate::http::pool_gauges_json(view),
            // The proxies' own admission queues (null: no proxy with an admission stage
            // reported in its polls).
            "admission": (proxies > 0).then(|| json!({"held": held, "proxies": proxies})),
            "endpoints": endpoints,
            "history": history,
            // kvoy-async's lanes (null: no worker reported lately).
            "async": self.async_json(now),
        })
    }
}

/// Records the latest view every [`TIMELINE_INTERVAL`] until `shutdown` turns true.
pub async fn sample(
    views: watch::Receiver<Arc<PoolView>>,
    page: Arc<PoolPage>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut tick = tokio::time::interval(TIMELINE_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = shutdown.changed() => return,
        }
        let view = views.borrow().clone();
        page.record(&view, Instant::now());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_assets_are_embedded_and_local() {
        let (kind, html) = asset("/").unwrap();
        let html = std::str::from_utf8(html).unwrap();
        assert!(kind.starts_with("text/html"));
        assert!(html.contains("/pool.js") && html.contains("/pool.css"));
        assert!(html.contains("/explain.js"));
        assert!(asset("/pool.js").is_some() && asset("/pool.css").is_some());
        assert!(asset("/explain.js").is_some());
        assert!(asset("/nope").is_none());
        // Nothing is fetched from elsewhere at run time: the only URL is SVG's namespace name.
        let scripts = ASSETS.iter().chain(EXPLAIN_ASSETS.iter().take(1));
        for (path, _, body) in scripts {
            let rest = std::str::from_utf8(body)
                .unwrap()
                .replace("\"http://www.w3.org/2000/svg\"", "");
            assert!(!rest.contains("://"), "{path} names another host");
        }
    }

    #[test]
    fn the_explain_module_is_served_only_when_built() {
        let module = asset("/explain/kvoy_explain_bg.wasm");
        let script = asset("/explain/kvoy_explain.js");
        if EXPLAIN_BUILT {
            let (kind, wasm) = module.unwrap();
            assert_eq!(kind, "application/wasm");
            assert!(wasm.starts_with(b"\0asm"), "not a WebAssembly module");
            let glue = std::str::from_utf8(script.unwrap().1).unwrap();
            assert!(
                glue.contains("kvoy_explain_bg.wasm"),
                "not wasm-bindgen's glue"
            );
        } else {
            // Not built: nothing pretends to be the module; the page says how to build it.
            assert!(module.is_none() && script.is_none());
        }
    }

    #[test]
    fn the_admission_queue_adds_the_proxies_that_reported_lately() {
        let page = PoolPage::default();
        let t0 = Instant::now();
        assert_eq!(page.admission(t0), (0, 0));
        assert_eq!(page.json(&PoolView::new(1), t0)["admission"], json!(null));
        page.report_admission(1, 5, t0);
        page.report_admission(2, 3, t0);
        page.report_admission(1, 4, t0 + Duration::from_secs(1));
        assert_eq!(page.admission(t0 + Duration::from_secs(1)), (7, 2));
        assert_eq!(
            page.json(&PoolView::new(1), t0 + Duration::from_secs(1))["admission"],
            json!({"held": 7, "proxies": 2})
        );
        // Proxy 2 stopped reporting: it is not counted after the TTL.
        let later = t0 + ADMISSION_REPORT_TTL + Duration::from_millis(500);
        assert_eq!(page.admission(later), (4, 1));
    }

    #[test]
    fn async_reports_are_shown_while_fresh_and_bounded() {
        let page = PoolPage::default();
        let now = Instant::now();
        assert!(page.async_json(now).is_null());
        let report: AsyncReport = serde_json::from_str(
            r#"{"saturation":0.2,"inflight":3,"inflight_limit":8,"future_field":1,
                "lanes":[{"name":"batch","tenants":{"t":{"done":5,"queued":2}}}]}"#,
        )
        .unwrap();
        assert!(page.report_async("w1", report.clone(), now));
        let json = page.async_json(now);
        assert_eq!(json[0]["worker"], "w1");
        assert_eq!(json[0]["report"]["lanes"][0]["tenants"]["t"]["done"], 5);
        for i in 1..MAX_ASYNC_WORKERS {
            assert!(page.report_async(&format!("x{i}"), report.clone(), now));
        }
        assert!(!page.report_async("one-too-many", report.clone(), now));
        // A stale worker is dropped, making room.
        assert!(page.async_json(now + ASYNC_REPORT_TTL).is_null());
        assert!(page.report_async("late", report, now + ASYNC_REPORT_TTL));
    }

    #[test]
    fn routed_decisions_are_counted_per_endpoint() {
        let page = PoolPage::default();
        let a: SocketAddr = "10.0.0.1:8000".parse().unwrap();
        let b: SocketAddr = "10.0.0.2:8000".parse().unwrap();
        page.count_routed([a, b, a].into_iter());
        let routed = page.routed.lock().unwrap().clone();
        assert_eq!((routed[&a], routed[&b]), (2, 1));
        let json = page.json(&PoolView::new(1), Instant::now());
        assert_eq!(json["loaded"], false);
        assert_eq!(json["endpoints"].as_array().unwrap().len(), 0);
    }
}
