//! Configuring a plugin and starting its VMs.

use std::collections::{HashMap, HashSet, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use super::clock::{Clock, DEFAULT_START};
use super::foreign::ForeignFunction;
use super::logs::LogBuffer;
use super::metrics::Metrics;
use super::queues::SharedQueues;
use super::shared::{property_key, PluginConfig, Shared, SharedState};
use super::shared_data::SharedData;
use super::Plugin;
use crate::error::{Error, Result};
use crate::types::{LogLevel, Status};
use crate::vm::host::HostInner;
use crate::vm::VmInstance;

/// Configures and starts a [`Plugin`]; from [`crate::Host::plugin`].
pub struct PluginBuilder {
    host: Arc<HostInner>,
    config: PluginConfig,
    vms: usize,
    start_time: u64,
    max_log_entries: usize,
    properties: HashMap<Vec<u8>, Vec<u8>>,
    foreign: HashMap<String, ForeignFunction>,
    /// Shared data the plugin starts with (see [`PluginBuilder::shared_data_of`]).
    data: Option<SharedData>,
}

impl PluginBuilder {
    pub(crate) fn new(host: Arc<HostInner>) -> PluginBuilder {
        PluginBuilder {
            host,
            config: PluginConfig {
                name: "kvoy".into(),
                root_id: String::new(),
                vm_id: String::new(),
                configuration: Vec::new(),
                vm_configuration: Vec::new(),
                env: Vec::new(),
                log_level: LogLevel::Info,
                clusters: None,
                upstreams: HashMap::new(),
                seed: 0x6b76_6f79,
            },
            data: None,
            vms: 1,
            start_time: DEFAULT_START,
            max_log_entries: 100_000,
            properties: HashMap::new(),
            foreign: HashMap::new(),
        }
    }

    /// The plugin configuration (`configuration` in Envoy's `PluginConfig`), read by the guest
    /// in `proxy_on_configure`.
    pub fn configuration(mut self, configuration: impl Into<Vec<u8>>) -> Self {
        self.config.configuration = configuration.into();
        self
    }

    /// The VM configuration (`vm_config.configuration`), read in `proxy_on_vm_start`.
    pub fn vm_configuration(mut self, configuration: impl Into<Vec<u8>>) -> Self {
        self.config.vm_configuration = configuration.into();
        self
    }

    /// Number of VMs (Envoy worker threads); default 1. Envoy with `--concurrency N` runs N
    /// worker VMs plus one on the main thread.
    pub fn vms(mut self, count: usize) -> Self {
        self.vms = count;
        self
    }

    /// The plugin name (property `plugin_name`); default "kvoy".
    pub fn name(mut self, name: &str) -> Self {
        name.clone_into(&mut self.config.name);
        self
    }

    /// The root id (property `plugin_root_id`); default "".
    pub fn root_id(mut self, root_id: &str) -> Self {
        root_id.clone_into(&mut self.config.root_id);
        self
    }

    /// The vm_id, which scopes shared queue names; default "".
    pub fn vm_id(mut self, vm_id: &str) -> Self {
        vm_id.clone_into(&mut self.config.vm_id);
        self
    }

    /// What `proxy_get_log_level` reports; default `Info` (Envoy's default). Every line the
    /// guest logs is captured regardless.
    pub fn log_level(mut self, level: LogLevel) -> Self {
        self.config.log_level = level;
        self
    }

    /// Seed of WASI `random_get` (each VM derives its own stream from it).
    pub fn seed(mut self, seed: u64) -> Self {
        self.config.seed = seed;
        self
    }

    /// Start of the virtual clock; default 2026-01-01T00:00:00Z.
    pub fn start_time(mut self, start: SystemTime) -> Self {
        let since_epoch = start.duration_since(UNIX_EPOCH).unwrap_or_default();
        self.start_time = u64::try_from(since_epoch.as_nanos()).unwrap_or(u64::MAX);
        self
    }

    /// An environment variable the guest sees through WASI (Envoy's `environment_variables`).
    pub fn env(mut self, key: &str, value: &str) -> Self {
        self.config.env.push((key.to_owned(), value.to_owned()));
        self
    }

    /// A plugin-wide property, e.g. `(&["node", "id"], "proxy-1")`.
    pub fn property(mut self, path: &[&str], value: impl Into<Vec<u8>>) -> Self {
        self.properties.insert(property_key(path), value.into());
        self
    }

    /// Implements a foreign function for `proxy_call_foreign_function`; calls to names without
    /// one return `NotFound`. Every call is recorded either way.
    pub fn foreign_function(
        mut self,
        name: &str,
        function: impl FnMut(&[u8]) -> std::result::Result<Vec<u8>, Status> + Send + 'static,
    ) -> Self {
        self.foreign.insert(name.to_owned(), Box::new(function));
        self
    }

    /// Limits `proxy_http_call` to these cluster names (others get `BadArgument`, as Envoy does
    /// for clusters it does not know); by default any name is accepted.
    pub fn clusters<S: Into<String>>(mut self, names: impl IntoIterator<Item = S>) -> Self {
        let mut known = names.into_iter().map(Into::into).collect::<HashSet<_>>();
        known.extend(self.config.upstreams.keys().cloned());
        self.config.clusters = Some(known);
        self
    }

    /// Sends `proxy_http_call`s to the cluster `name` to a real address: the harness opens an
    /// HTTP/1.1 connection to `address` on a thread of its own, and
    /// [`Plugin::deliver_http_responses`] (or [`Plugin::wait_http_responses`]) hands the answer
    /// to the VM that made the call. Connection failures and timeouts come back as Envoy's
    /// local `503` / `504`; a connection lost after the headers as a failed call. Such calls
    /// are not listed by [`Plugin::http_calls`]. If [`PluginBuilder::clusters`] is used, `name`
    /// is added to it.
    pub fn upstream(mut self, name: &str, address: SocketAddr) -> Self {
        self.config.upstreams.insert(name.to_owned(), address);
        if let Some(known) = &mut self.config.clusters {
            known.insert(name.to_owned());
        }
        self
    }

    /// How many log lines to keep (oldest dropped first); default 100,000.
    pub fn max_log_entries(mut self, count: usize) -> Self {
        self.max_log_entries = count;
        self
    }

    /// Instantiates and starts every VM (see [`crate::Host`] for the sequence). A guest that
    /// traps or returns false from `proxy_on_vm_start` / `proxy_on_configure` fails the start.
    /// Starts with a copy of `plugin`'s shared data, as Envoy keeps shared data (per `vm_id`,
    /// process-wide) when a new filter configuration replaces the old one: the new plugin's
    /// VMs find what the old configuration's VMs wrote.
    pub fn shared_data_of(mut self, plugin: &Plugin) -> Self {
        self.data = Some(plugin.shared.lock().data.clone());
        self
    }

    pub fn start(self) -> Result<Plugin> {
        if self.vms == 0 {
            return Err(Error::NoVms);
        }
        let state = SharedState {
            clock: Clock::new(self.start_time, self.vms),
            data: self.data.unwrap_or_default(),
            queues: SharedQueues::default(),
            metrics: Metrics::default(),
            logs: LogBuffer::new(self.max_log_entries, LogBuffer::echo_from_env()),
            queue_ready: VecDeque::new(),
            http_calls: Vec::new(),
            real_calls: Vec::new(),
            foreign_calls: Vec::new(),
            grpc_calls: Vec::new(),
            grpc_streams: Vec::new(),
            properties: self.properties,
        };
        let (finished_tx, finished_rx) = std::sync::mpsc::channel();
        let shared = Arc::new(Shared::new(self.config, state, self.foreign, finished_tx));
        let mut vms = Vec::with_capacity(self.vms);
        for vm in 0..self.vms {
            vms.push(Mutex::new(VmInstance::start(
                &self.host,
                shared.clone(),
                vm,
            )?));
        }
        let plugin = Plugin {
            shared,
            vms: vms.into(),
            finished: Arc::new(Mutex::new(finished_rx)),
        };
        plugin.deliver_queue_ready()?;
        Ok(plugin)
    }
}
