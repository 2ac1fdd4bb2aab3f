//! kvoy-aggregator: one process per pool that follows every model server's KV events (ZMQ)
//! and metrics (`/metrics`), and serves what the filters need as a small, versioned,
//! incremental snapshot.
//!
//! It depends on kvoy-shared (the snapshot and relay formats it serves) and kvoy-kvevents; never on
//! the filters, the harness or a test crate.
//!
//! - [`config`]: the configuration file; [`source`]: where endpoints come from (a file,
//!   reloaded when it changes, or [`k8s`]: an InferencePool's Ready pods from the Kubernetes
//!   API server).
//! - [`prom`]: Prometheus text and the vLLM / SGLang metric names; [`scrape`]: the scraper.
//! - [`kv_index`]: per endpoint and medium, the blocks cached, keyed by the aggregator's own
//!   hash of token ids; [`follow`]: the thread that feeds it from the ZMQ stream, with gap
//!   recovery through the replay socket.
//! - [`kv_link`]: relayed routing decisions (text keys) linked to the server blocks their
//!   prefill stored, by causal correlation (pure), so that a `BlockRemoved` names the text keys
//!   it removes.
//! - [`prefill`]: each endpoint's prefill rate, estimated online from its metrics (pure);
//!   [`calibrate`]: the `calibrate` command, which measures it on a live server.
//! - [`reject`]: refused input, counted by reason and logged once per reason.
//! - [`status`]: statuses and pool gauges (pure); [`pool`]: the actor that owns the endpoints
//!   and the snapshot history; [`http`]: the API (`http_client`: what its HTTP exchanges
//!   share).
//! - [`page`]: the pool view, a page at `GET /` drawing the live pool from `GET /v1/pool`,
//!   with a short history ([`timeline`], pure).
//! - [`local`]: an aggregator in another program's process, on a runtime of its own
//!   (`kvoy-stack`, the end-to-end tests, kvoy-bench).
//!
//! ```no_run
//! # async fn demo() -> std::io::Result<()> {
//! use kvoy_aggregator::{config::AggregatorConfig, source::StaticSource, Aggregator};
//! let cfg = AggregatorConfig::from_yaml("endpoints: [{address: '127.0.0.1:8000', models: [m]}]")
//!     .map_err(std::io::Error::other)?;
//! let source = StaticSource::new(cfg.endpoints.clone());
//! let running = Aggregator::start(&cfg, Box::new(source), "127.0.0.1:0".parse().unwrap()).await?;
//! println!("snapshot at http://{}/v1/snapshot", running.local_addr());
//! running.shutdown().await;
//! # Ok(()) }
//! ```

#[cfg(feature = "service")]
pub mod calibrate;
pub mod config;
#[cfg(feature = "service")]
pub mod follow;
#[cfg(feature = "service")]
pub mod http;
#[cfg(feature = "service")]
mod http_client;
pub mod k8s;
pub mod kv_index;
pub mod kv_link;
#[cfg(feature = "service")]
pub mod local;
#[cfg(feature = "service")]
pub mod page;
#[cfg(feature = "service")]
pub mod peers;
#[cfg(feature = "service")]
pub mod pool;
pub mod prefill;
pub mod prom;
pub mod reject;
#[cfg(feature = "service")]
pub mod scrape;
pub mod source;
#[cfg(feature = "service")]
pub mod status;
pub mod timeline;

#[cfg(feature = "service")]
use {
    crate::config::AggregatorConfig,
    crate::pool::{Pool, PoolSettings, PoolView},
    crate::source::EndpointSource,
    crate::status::Thresholds,
    std::net::SocketAddr,
    std::sync::Arc,
    tokio::sync::watch,
    tokio::task::JoinHandle,
};

/// A running aggregator (pool actor + HTTP API) on the current tokio runtime.
#[cfg(feature = "service")]
pub struct Aggregator {
    addr: SocketAddr,
    shutdown: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
}

/// A random epoch: a restarted aggregator numbers its versions afresh, and a filter that
/// sends the old epoch gets a full snapshot.
#[cfg(feature = "service")]
fn new_epoch() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    h.write_u64(nanos);
    // Never 0, so that a filter's "no snapshot yet" can be 0.
    h.finish().max(1)
}

#[cfg(feature = "service")]
impl Aggregator {
    /// Reads the API token (if any), binds `listen` and starts the pool actor and the API.
    pub async fn start(
        config: &AggregatorConfig,
        source: Box<dyn EndpointSource>,
        listen: SocketAddr,
    ) -> std::io::Result<Aggregator> {
        let token = match (&config.api_token, &config.api_token_file) {
            (Some(t), _) => Some(t.clone()),
            (None, Some(path)) => {
                Some(config::ApiToken::from_file(path).map_err(std::io::Error::other)?)
            }
            (None, None) => None,
        };
        let listener = tokio::net::TcpListener::bind(listen).await?;
        let addr = listener.local_addr()?;
        let settings = PoolSettings {
            scrape_interval: config.scrape_interval,
            scrape_timeout: config.scrape_timeout,
            reload_interval: config.reload_interval,
            thresholds: Thresholds {
                stale_after: config.stale_after,
                unready_after_failures: config.unready_after_failures,
            },
            limits: config.limits,
        };
        let epoch = new_epoch();
        let (shutdown, stop) = watch::channel(false);
        let (views_tx, views) = watch::channel(Arc::new(PoolView::new(epoch)));
        let api = http::Api::new(views, token.clone(), config.limits, config.links);
        let pool = Pool::new(
            settings,
            source,
            kvoy_kvevents::ZmqContext::new(),
            epoch,
            api.links.clone(),
        );
        // A replica that starts reads the decisions the other replicas hold before it reports
        // ready (its KV followers catch up meanwhile).
        let peers = config.peers.clone();
        if !peers.is_empty() {
            api.peers_read
                .store(false, std::sync::atomic::Ordering::Relaxed);
        }
        let seeding = api.clone();
        let peer_token = token.clone();
        let tasks = vec![
            tokio::spawn(async move {
                for peer in &peers {
                    match peers::decisions(peer, peer_token.as_ref()).await {
                        Ok(d) => {
                            log::info!(
                                "kvoy-aggregator: {} relayed decisions read from the replica {peer}",
                                d.len()
                            );
                            seeding.seed_decisions(d);
                        }
                        Err(e) => log::warn!(
                            "kvoy-aggregator: the replica's decisions could not be read: {e}"
                        ),
                    }
                }
                seeding
                    .peers_read
                    .store(true, std::sync::atomic::Ordering::Relaxed);
            }),
            tokio::spawn(pool.run(views_tx, stop.clone())),
            tokio::spawn(page::sample(
                api.views.clone(),
                api.page.clone(),
                stop.clone(),
            )),
            tokio::spawn(http::serve(listener, api, stop)),
        ];
        Ok(Aggregator {
            addr,
            shutdown,
            tasks,
        })
    }

    /// Where the API listens.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops the API and the pool (endpoint tasks and followers stop with it).
    pub async fn shutdown(self) {
        let _ = self.shutdown.send(true);
        for t in self.tasks {
            let _ = t.await;
        }
    }
}
