//! The data each VM's wasmtime store carries: what host calls need besides guest memory.

use std::collections::HashMap;
use std::sync::Arc;

use wasmtime::{Memory, TypedFunc};

use crate::http::callouts::HttpResponse;
use crate::http::headers::HeaderMap;
use crate::http::state::StreamState;
use crate::net::state::ConnectionState;
use crate::plugin::logs::{LineSplitter, LogEntry, LogSource};
use crate::plugin::shared::Shared;
use crate::types::LogLevel;
use crate::vm::callout_ids::{CalloutIds, CalloutKind};
use crate::vm::counts::{CallCounts, HostCallNames};

/// At most this many warning-or-worse lines are kept per guest call for error messages.
const CALL_LOG_LINES: usize = 40;

/// A deterministic random source for WASI `random_get`.
#[derive(Debug, Clone)]
pub(crate) struct Rng(kvoy_shared::Rng);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(kvoy_shared::Rng::new(seed))
    }

    pub fn fill(&mut self, out: &mut [u8]) {
        for chunk in out.chunks_mut(8) {
            chunk.copy_from_slice(&self.0.next_u64().to_le_bytes()[..chunk.len()]);
        }
    }
}

/// Store data of one VM.
pub(crate) struct VmState {
    pub vm: usize,
    /// Host calls, shared-data operations and VM entries so far.
    pub counts: CallCounts,
    /// The host calls in `counts` by import name (see [`crate::HostCallNames`]).
    pub call_names: HostCallNames,
    pub shared: Arc<Shared>,
    pub memory: Option<Memory>,
    pub allocate: Option<TypedFunc<u32, u32>>,
    pub root_id: u32,
    /// The context host calls act on (`proxy_set_effective_context` changes it).
    pub effective: u32,
    /// Inside `proxy_on_configure`: only then is the plugin configuration readable (as in Envoy).
    pub configuring: bool,
    pub streams: HashMap<u32, StreamState>,
    /// Network (TCP) filter contexts; a finished one stays until its handle is dropped.
    pub connections: HashMap<u32, ConnectionState>,
    /// Connections that asked for a continue or close during the current guest call.
    pub connection_actions: Vec<u32>,
    /// The response being delivered to `proxy_on_http_call_response`.
    pub http_response: Option<HttpResponse>,
    /// What `proxy_get_status` reports during a callout callback.
    pub call_status: (u32, String),
    pub callout_ids: CalloutIds,
    /// The message being delivered to `proxy_on_grpc_receive` (`GrpcReceiveBuffer`).
    pub grpc_receive: Option<Vec<u8>>,
    /// The arguments of the `proxy_on_foreign_function` being delivered (`CallData`).
    pub call_data: Option<Vec<u8>>,
    /// The metadata being delivered to `proxy_on_grpc_receive_{initial,trailing}_metadata`.
    pub grpc_initial_metadata: Option<HeaderMap>,
    pub grpc_trailing_metadata: Option<HeaderMap>,
    /// Streams that sent a local reply during the current guest call.
    pub local_replies: Vec<u32>,
    pub stdout: LineSplitter,
    pub stderr: LineSplitter,
    /// Warning-or-worse lines logged during the current top-level call.
    pub call_log: Vec<String>,
    pub rng: Rng,
}

impl VmState {
    /// Counts one call of the host function `name` (the call hook counts it in `counts`).
    /// One call of the import `name` (every import the host serves notes itself here).
    pub fn note_host_call(&mut self, name: &'static str) {
        self.counts.host_calls += 1;
        *self.call_names.0.entry(name).or_insert(0) += 1;
    }

    pub fn new(vm: usize, shared: Arc<Shared>) -> VmState {
        let seed = shared.config.seed ^ (vm as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        VmState {
            vm,
            counts: CallCounts::default(),
            call_names: HostCallNames::default(),
            shared,
            memory: None,
            allocate: None,
            root_id: 1,
            effective: 1,
            configuring: false,
            streams: HashMap::new(),
            connections: HashMap::new(),
            connection_actions: Vec::new(),
            http_response: None,
            call_status: (0, String::new()),
            callout_ids: CalloutIds::default(),
            grpc_receive: None,
            call_data: None,
            grpc_initial_metadata: None,
            grpc_trailing_metadata: None,
            local_replies: Vec::new(),
            stdout: LineSplitter::default(),
            stderr: LineSplitter::default(),
            call_log: Vec::new(),
            rng: Rng::new(seed),
        }
    }

    /// Records a log line from this VM.
    pub fn log(&mut self, level: LogLevel, source: LogSource, message: String) {
        if level >= LogLevel::Warn || source == LogSource::Stderr {
            if self.call_log.len() == CALL_LOG_LINES {
                self.call_log.remove(0);
            }
            self.call_log.push(message.clone());
        }
        self.shared.log(LogEntry {
            vm: self.vm,
            level,
            source,
            message,
        });
    }

    /// Pushes out partial stdout/stderr lines (at the end of every guest call).
    pub fn flush_output(&mut self) {
        if let Some(line) = self.stdout.flush() {
            self.log(LogLevel::Info, LogSource::Stdout, line);
        }
        if let Some(line) = self.stderr.flush() {
            self.log(LogLevel::Error, LogSource::Stderr, line);
        }
    }

    /// The stream the effective context names, if it is a live HTTP stream.
    pub fn stream(&self) -> Option<&StreamState> {
        self.streams.get(&self.effective).filter(|s| !s.finished)
    }

    /// Mutable [`VmState::stream`].
    pub fn stream_mut(&mut self) -> Option<&mut StreamState> {
        self.streams
            .get_mut(&self.effective)
            .filter(|s| !s.finished)
    }

    /// The connection the effective context names, if it is a live network context.
    pub fn connection(&self) -> Option<&ConnectionState> {
        self.connections
            .get(&self.effective)
            .filter(|c| c.created && !c.finished)
    }

    /// Mutable [`VmState::connection`].
    pub fn connection_mut(&mut self) -> Option<&mut ConnectionState> {
        self.connections
            .get_mut(&self.effective)
            .filter(|c| c.created && !c.finished)
    }

    /// Whether a context id names the root context, a live stream or a live connection.
    pub fn is_live_context(&self, context_id: u32) -> bool {
        context_id == self.root_id
            || self.streams.get(&context_id).is_some_and(|s| !s.finished)
            || self
                .connections
                .get(&context_id)
                .is_some_and(|c| c.created && !c.finished)
    }

    /// A fresh callout token of a kind (per VM, Envoy's sequences).
    pub fn take_token(&mut self, kind: CalloutKind) -> u32 {
        self.callout_ids.next(kind)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rng_is_deterministic_and_fills_odd_lengths() {
        let (mut a, mut b) = (Rng::new(7), Rng::new(7));
        let (mut x, mut y) = ([0u8; 13], [0u8; 13]);
        a.fill(&mut x);
        b.fill(&mut y);
        assert_eq!(x, y);
        assert_ne!(x, [0u8; 13]);
        let mut c = Rng::new(8);
        let mut z = [0u8; 13];
        c.fill(&mut z);
        assert_ne!(x, z);
    }
}
