//! Process-wide state every VM of a plugin sees: the clock, shared data and queues, metrics,
//! logs, pending callouts. Host calls lock it briefly; it never stays locked across a guest call.

use std::collections::{HashMap, HashSet, VecDeque};
use std::net::SocketAddr;
use std::sync::mpsc::Sender;
use std::sync::{Mutex, MutexGuard, PoisonError};

use crate::grpc::{GrpcCall, GrpcStream};
use crate::http::callouts::HttpCall;
use crate::http::upstream::Finished;
use crate::plugin::clock::Clock;
use crate::plugin::foreign::{ForeignCall, ForeignFunction};
use crate::plugin::logs::{LogBuffer, LogEntry};
use crate::plugin::metrics::Metrics;
use crate::plugin::queues::{QueueOwner, SharedQueues};
use crate::plugin::shared_data::SharedData;
use crate::types::LogLevel;

/// The plugin's fixed settings, from the builder.
#[derive(Debug, Clone)]
pub(crate) struct PluginConfig {
    pub name: String,
    pub root_id: String,
    pub vm_id: String,
    pub configuration: Vec<u8>,
    pub vm_configuration: Vec<u8>,
    pub env: Vec<(String, String)>,
    pub log_level: LogLevel,
    /// Upstream clusters `proxy_http_call` accepts; `None` accepts any name.
    pub clusters: Option<HashSet<String>>,
    /// Clusters whose callouts go to a real address (see `upstream.rs`).
    pub upstreams: HashMap<String, SocketAddr>,
    pub seed: u64,
}

/// Mutable process-wide state.
pub(crate) struct SharedState {
    pub clock: Clock,
    pub data: SharedData,
    pub queues: SharedQueues,
    pub metrics: Metrics,
    pub logs: LogBuffer,
    /// `proxy_on_queue_ready` notifications not yet delivered.
    pub queue_ready: VecDeque<(QueueOwner, u32)>,
    pub http_calls: Vec<HttpCall>,
    /// Real callouts in flight.
    pub real_calls: Vec<HttpCall>,
    pub foreign_calls: Vec<ForeignCall>,
    /// Unary gRPC calls waiting for the test, and open gRPC streams.
    pub grpc_calls: Vec<GrpcCall>,
    pub grpc_streams: Vec<GrpcStream>,
    /// Plugin-wide properties, keyed by the \0-joined path.
    pub properties: HashMap<Vec<u8>, Vec<u8>>,
}

/// Everything a VM's host calls reach besides its own store.
pub(crate) struct Shared {
    pub config: PluginConfig,
    state: Mutex<SharedState>,
    foreign: Mutex<HashMap<String, ForeignFunction>>,
    /// Where real callouts report.
    finished: Mutex<Sender<Finished>>,
}

impl Shared {
    pub fn new(
        config: PluginConfig,
        state: SharedState,
        foreign: HashMap<String, ForeignFunction>,
        finished: Sender<Finished>,
    ) -> Shared {
        Shared {
            config,
            state: Mutex::new(state),
            foreign: Mutex::new(foreign),
            finished: Mutex::new(finished),
        }
    }

    /// A sender for a real callout's thread.
    pub fn finished_sender(&self) -> Sender<Finished> {
        self.finished
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Locks the process state. A panic in a test's foreign function cannot leave it half
    /// updated (no host code panics while holding it), so poisoning is ignored.
    pub fn lock(&self) -> MutexGuard<'_, SharedState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Locks the foreign-function table.
    pub fn foreign(&self) -> MutexGuard<'_, HashMap<String, ForeignFunction>> {
        self.foreign.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Appends a log line.
    pub fn log(&self, entry: LogEntry) {
        self.lock().logs.push(entry);
    }
}

/// Joins a property path the way the SDK serializes it.
pub(crate) fn property_key(path: &[&str]) -> Vec<u8> {
    path.join("\0").into_bytes()
}
