//! Following kvoy-aggregator's snapshot from a filter (see [`kvoy_shared::snapshot_board`]): every VM
//! reads the snapshot from the shared-data board; the VM holding the lease polls the
//! aggregator with `dispatch_http_call` from its root context's tick and publishes the answer.

use std::time::Duration;

use log::{debug, warn};
use proxy_wasm::hostcalls;

use kvoy_shared::snapshot::Snapshot;
use kvoy_shared::snapshot_board::{
    self, BoardMeta, PollError, PoolChoice, Renumber, SnapshotBoard,
};
use kvoy_shared::{AggregatorSettings, LogOnce};

use kvoy_shared::shared_data::SharedStore;

use crate::HostStore;

/// What a poll attempt did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PollStart {
    /// Not this VM's turn (no lease, or a poll is in flight).
    Skipped,
    Started,
    /// `dispatch_http_call` failed (e.g. no such cluster).
    Failed,
}

/// One VM's view of the aggregator's snapshot.
pub struct LiveSnapshot {
    settings: AggregatorSettings,
    board: SnapshotBoard,
    /// The latest snapshot this VM knows (epoch 0: none yet), in the proxy's numbering (what
    /// the board holds and the router's pool is built from).
    snapshot: Snapshot,
    /// The replica this VM polls (an index into [`AggregatorSettings::clusters`]): the same
    /// one until it fails or answers something unusable, then the next.
    primary: usize,
    /// The primary's snapshot in its own numbering, which its changes refer to (epoch 0: none;
    /// the next poll asks for everything).
    upstream: Snapshot,
    renumber: Renumber,
    meta: Option<BoardMeta>,
    /// The poll in flight, with when it started.
    poll: Option<(u32, u64)>,
    /// When this VM's last poll started: the VM ticks more often than it polls when it relays.
    last_poll_ms: Option<u64>,
    want_full: bool,
    failures_logged: u32,
    /// Each kind of poll failure is logged once (and counted every time by the filter).
    logged: LogOnce,
    /// `Bearer <token>`, when the configuration has a token.
    authorization: Option<String>,
    /// Where the proxy's id for its polls' reports is kept (one for all its workers).
    proxy_key: String,
    owner: u64,
}

impl LiveSnapshot {
    /// `namespace` keys the board (per filter configuration); `owner` is this VM's id.
    pub fn new(settings: AggregatorSettings, namespace: &str, owner: u64) -> Self {
        let authorization = settings
            .token
            .as_ref()
            .map(|t| format!("Bearer {}", t.as_str()));
        LiveSnapshot {
            proxy_key: format!("{namespace}.proxy"),
            owner,
            authorization,
            settings,
            board: SnapshotBoard::new(namespace, owner),
            snapshot: Snapshot::default(),
            primary: 0,
            upstream: Snapshot::default(),
            renumber: Renumber::default(),
            meta: None,
            poll: None,
            last_poll_ms: None,
            want_full: false,
            failures_logged: 0,
            logged: LogOnce::new(16),
        }
    }

    pub fn settings(&self) -> &AggregatorSettings {
        &self.settings
    }

    /// The `authorization` header value of calls to the aggregator, when a token is set.
    pub fn authorization(&self) -> Option<&str> {
        self.authorization.as_deref()
    }

    /// How often to tick: once per poll interval.
    pub fn tick_period(&self) -> Duration {
        Duration::from_millis(self.settings.poll_interval_ms)
    }

    /// The latest snapshot (epoch 0 when there is none yet).
    pub fn snapshot(&self) -> &Snapshot {
        &self.snapshot
    }

    /// The replica this VM polls now (an index into [`AggregatorSettings::clusters`]).
    pub fn primary(&self) -> usize {
        self.primary
    }

    /// [`LiveSnapshot::fail_over`] if `replica` is still the one followed (the relay saw it
    /// fail).
    pub fn fail_over_from(&mut self, replica: usize) {
        if self.primary == replica {
            self.fail_over();
        }
    }

    /// After a failed or unusable answer: the next replica, from scratch (its slots and
    /// versions are its own). With one replica, nothing changes.
    fn fail_over(&mut self) {
        let n = self.settings.replicas();
        if n > 1 {
            self.primary = (self.primary + 1) % n;
            self.upstream = Snapshot::default();
            self.want_full = true;
            // A poll still in flight at the old one is not waited for (its answer is ignored).
            self.poll = None;
            self.last_poll_ms = None;
        }
    }

    /// Reads the board's small version key, and the snapshot if it changed.
    pub fn refresh(&mut self) {
        self.meta = self.board.read_meta(&HostStore);
        if let Some(m) = self.meta {
            if (m.epoch, m.version) != (self.snapshot.epoch, self.snapshot.version) {
                if let Some(s) = self.board.read_snapshot(&HostStore) {
                    self.snapshot = s;
                }
            }
        }
    }

    /// Live or static pool at `now_ms` (see [`snapshot_board::choose`]), as of the last refresh.
    pub fn choose(&self, now_ms: u64, static_pool_empty: bool) -> PoolChoice {
        snapshot_board::choose(
            self.meta,
            self.snapshot.epoch != 0,
            now_ms,
            &self.settings,
            static_pool_empty,
        )
    }

    /// Takes or renews this proxy's poller lease: true when this VM is the one that talks to
    /// the aggregator (polls, relays decisions).
    pub fn holds_lease(&self, now_ms: u64) -> bool {
        let ttl = self
            .settings
            .poll_interval_ms
            .saturating_mul(3)
            .max(self.settings.timeout_ms);
        self.board.try_lease(&HostStore, now_ms, ttl)
    }

    /// Polls the aggregator if this VM holds (or takes) the lease, no poll is in flight and
    /// the last began a poll interval ago.
    pub fn poll(&mut self, now_ms: u64) -> PollStart {
        self.poll_reporting(now_ms, || None)
    }

    /// [`LiveSnapshot::poll`], telling the aggregator the requests the proxy's admission stage
    /// holds (`held`, asked only when a poll starts).
    pub fn poll_reporting(&mut self, now_ms: u64, held: impl FnOnce() -> Option<u64>) -> PollStart {
        if let Some((_, started)) = self.poll {
            // A lost callback must not stop polling forever.
            if now_ms.saturating_sub(started) <= self.settings.timeout_ms.saturating_mul(2) {
                return PollStart::Skipped;
            }
            self.poll = None;
        }
        // A tenth of slack: a tick a little early must not skip a whole interval.
        let interval = self.settings.poll_interval_ms - self.settings.poll_interval_ms / 10;
        if self
            .last_poll_ms
            .is_some_and(|last| now_ms.saturating_sub(last) < interval)
        {
            return PollStart::Skipped;
        }
        if !self.holds_lease(now_ms) {
            return PollStart::Skipped;
        }
        self.last_poll_ms = Some(now_ms);
        let report = held().map(|held| snapshot_board::PollReport {
            proxy: self.proxy(),
            held,
        });
        let path =
            snapshot_board::poll_path(&self.settings, &self.upstream, self.want_full, report);
        match call_aggregator(
            &self.settings,
            self.settings.cluster_of(self.primary),
            self.authorization.as_deref(),
            "GET",
            &path,
            None,
            self.settings.timeout_ms,
        ) {
            Ok(token) => {
                self.poll = Some((token, now_ms));
                PollStart::Started
            }
            Err(status) => {
                if self.failures_logged < 3 {
                    self.failures_logged += 1;
                    warn!(
                        "cannot call the aggregator cluster {:?}: {status:?}",
                        self.settings.cluster_of(self.primary)
                    );
                }
                self.fail_over();
                PollStart::Failed
            }
        }
    }

    /// The proxy's id: whichever worker wrote it (the first to poll with a report writes its
    /// own); they all read the same one, so the aggregator counts the proxy once whichever
    /// worker holds the lease. Read per poll, off the request path.
    fn proxy(&self) -> u64 {
        let read = || {
            HostStore
                .get(&self.proxy_key)
                .and_then(|(b, _)| b.get(..8).and_then(|b| b.try_into().ok()))
                .map(u64::from_le_bytes)
        };
        read().unwrap_or_else(|| {
            let _ = HostStore.set(&self.proxy_key, &self.owner.to_le_bytes(), 0);
            read().unwrap_or(self.owner)
        })
    }

    /// Whether `token` is this VM's poll in flight (an HTTP call answer is for it).
    pub fn owns(&self, token: u32) -> bool {
        self.poll.is_some_and(|(t, _)| t == token)
    }

    /// The answer to this VM's poll: applied, published on the board and kept. `None` when
    /// `token` is not our poll; `Some(Ok(changed))` or the error otherwise.
    pub fn on_response(
        &mut self,
        token: u32,
        status: Option<u32>,
        body: &CallBody,
        now_ms: u64,
    ) -> Option<Result<(), PollError>> {
        if self.poll.map(|(t, _)| t) != Some(token) {
            return None;
        }
        self.poll = None;
        let mut next = self.upstream.clone();
        let applied = match body {
            CallBody::Read(body) => snapshot_board::apply_poll(&mut next, status, body),
            CallBody::TooLarge(size) if status == Some(200) => Err(PollError::TooLarge {
                size: *size,
                limit: self.settings.max_snapshot_bytes,
            }),
            CallBody::TooLarge(_) => snapshot_board::apply_poll(&mut next, status, b""),
        };
        // A replica that lost its pool (restarted and not caught up, or pointed elsewhere)
        // while the proxy routes on one is not followed when another replica can be asked.
        let applied = applied.and_then(|changed| {
            let had = self.snapshot.endpoints.len();
            if next.endpoints.is_empty() && had > 0 && self.settings.replicas() > 1 {
                Err(PollError::Empty { had })
            } else {
                Ok(changed)
            }
        });
        let result = match applied {
            Ok(changed) => {
                self.want_full = false;
                // The board's numbering is the proxy's: the same server keeps its id and its
                // cache generation whichever replica describes it.
                let local = if changed
                    || (next.epoch, next.version) != (self.snapshot.epoch, self.snapshot.version)
                {
                    self.renumber.local(self.primary, &next, &self.snapshot)
                } else {
                    self.snapshot.clone()
                };
                let published = if changed {
                    self.board.publish(&HostStore, &local, now_ms)
                } else {
                    self.board.touch(&HostStore, &local, now_ms)
                };
                if let Err(e) = published {
                    debug!("cannot publish the snapshot: {e}");
                }
                self.upstream = next;
                self.snapshot = local;
                Ok(())
            }
            Err(e) => {
                if matches!(e, PollError::Mismatch(_)) {
                    self.want_full = true;
                }
                let unauthorized = matches!(e, PollError::Status(401 | 403));
                let kind = if unauthorized {
                    "unauthorized"
                } else {
                    e.label()
                };
                if self.logged.first(kind) {
                    let hint = if unauthorized {
                        " (check `aggregator.token` against the aggregator's --token-file)"
                    } else {
                        ""
                    };
                    warn!(
                        "aggregator snapshot from cluster {:?} refused: {e}{hint} (logged once; counted in the snapshot poll metrics)",
                        self.settings.cluster_of(self.primary)
                    );
                } else {
                    // 503 "not loaded yet" included: the last snapshot (or the static pool)
                    // stays in use.
                    debug!("snapshot poll: {e}");
                }
                // Another replica, if there is one, answers the next poll. (A mismatch is
                // the primary's own: it answers a full snapshot next.)
                if !matches!(e, PollError::Mismatch(_)) {
                    self.fail_over();
                }
                Err(e)
            }
        };
        self.refresh();
        Some(result)
    }
}

/// Calls the kvoy-aggregator replica behind Envoy cluster `cluster` (with `settings.authority`,
/// by default the cluster's name, and the bearer token when there is one) with a timeout of
/// `timeout_ms`; `body` is `(content type, bytes)`. The call's token, or
/// the host's refusal (e.g. no such cluster).
pub fn call_aggregator(
    settings: &AggregatorSettings,
    cluster: &str,
    authorization: Option<&str>,
    method: &str,
    path: &str,
    body: Option<(&str, &[u8])>,
    timeout_ms: u64,
) -> Result<u32, proxy_wasm::types::Status> {
    let authority = settings.authority.as_deref().unwrap_or(cluster);
    let mut headers = vec![
        (":method", method),
        (":path", path),
        (":authority", authority),
    ];
    if let Some((content_type, _)) = body {
        headers.push(("content-type", content_type));
    }
    if let Some(auth) = authorization {
        headers.push(("authorization", auth));
    }
    hostcalls::dispatch_http_call(
        cluster,
        headers,
        body.map(|(_, b)| b),
        vec![],
        Duration::from_millis(timeout_ms),
    )
}

/// The body of an HTTP call's response, as far as it was read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CallBody {
    Read(Vec<u8>),
    /// Larger than the caller's limit: not copied into the VM. Its size.
    TooLarge(usize),
}

/// The `:status` and body of an HTTP call's response, read safely: a failed call (reset,
/// timeout) has no header map (Envoy answers BadArgument, on which the SDK panics), so the
/// maps are only read when there are headers; a body over `limit` bytes is not copied in.
pub fn call_response(
    num_headers: usize,
    body_size: usize,
    limit: usize,
) -> (Option<u32>, CallBody) {
    if num_headers == 0 {
        return (None, CallBody::Read(Vec::new()));
    }
    let status = crate::header(
        proxy_wasm::types::MapType::HttpCallResponseHeaders,
        ":status",
    )
    .and_then(|s| s.trim().parse::<u32>().ok());
    if body_size > limit {
        return (status, CallBody::TooLarge(body_size));
    }
    let body = if status.is_some() && body_size > 0 {
        hostcalls::get_buffer(
            proxy_wasm::types::BufferType::HttpCallResponseBody,
            0,
            body_size,
        )
        .ok()
        .flatten()
        .unwrap_or_default()
    } else {
        Vec::new()
    };
    (status, CallBody::Read(body))
}
