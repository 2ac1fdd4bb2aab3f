//! A plugin: one configuration running in N VMs that share process-wide state, like one
//! `envoy.filters.http.wasm` config on an Envoy with N worker threads.

mod builder;
pub(crate) mod clock;
pub(crate) mod foreign;
pub(crate) mod logs;
pub(crate) mod metrics;
pub(crate) mod queues;
pub(crate) mod shared;
pub(crate) mod shared_data;

pub use builder::PluginBuilder;

use std::sync::mpsc::Receiver;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, SystemTime};

use crate::error::{Error, Result};
use crate::http::stream::HttpStream;
use crate::http::upstream::Finished;
use crate::net::connection::Connection;
use crate::plugin::foreign::ForeignCall;
use crate::plugin::logs::LogEntry;
use crate::plugin::metrics::Metric;
use crate::plugin::queues::SharedQueues;
use crate::plugin::shared::{property_key, Shared};
use crate::types::{MetricType, Status};
use crate::vm::counts::{CallCounts, HostCallNames};
use crate::vm::state::VmState;
use crate::vm::VmInstance;

/// Deferred notifications delivered in one go before the harness gives up (a queue handler
/// that enqueues to itself forever).
const MAX_ROUNDS: usize = 100_000;

/// A running plugin: N VMs of one filter configuration sharing shared data, queues, metrics,
/// logs and a virtual clock. Cheap to clone (a handle); usable from several threads, each VM
/// serializing its own calls.
#[derive(Clone)]
pub struct Plugin {
    shared: Arc<Shared>,
    vms: Arc<[Mutex<VmInstance>]>,
    /// Answers of real callouts (see [`PluginBuilder::upstream`]).
    finished: Arc<Mutex<Receiver<Finished>>>,
}

/// One VM of a plugin; from [`Plugin::vm`].
pub struct VmRef<'a> {
    plugin: &'a Plugin,
    index: usize,
}

impl VmRef<'_> {
    /// Starts a new HTTP stream (a new context) on this VM.
    pub fn http_stream(&self) -> Result<HttpStream> {
        self.plugin.http_stream(self.index)
    }

    /// A new TCP connection through this VM's network filter (see [`Connection`]).
    pub fn connection(&self) -> Result<Connection> {
        self.plugin.connection(self.index)
    }

    /// Calls `proxy_on_tick` now, whatever the schedule.
    pub fn tick(&self) -> Result<()> {
        self.plugin.with_vm(self.index, VmInstance::tick)
    }

    /// Calls `proxy_on_foreign_function` on the root context, as a host extension calling back
    /// into the plugin does; `arguments` is the `CallData` buffer during the call.
    pub fn foreign_function(&self, function_id: u32, arguments: &[u8]) -> Result<()> {
        self.plugin
            .with_vm(self.index, |vm| vm.foreign_function(function_id, arguments))
    }

    /// The tick period this VM asked for.
    pub fn tick_period(&self) -> Option<Duration> {
        self.plugin.shared.lock().clock.tick_period(self.index)
    }

    /// Whether the VM trapped earlier (then it takes no more calls).
    pub fn is_failed(&self) -> bool {
        self.plugin.lock_vm(self.index).is_ok_and(|vm| vm.failed)
    }

    /// The VM's index.
    pub fn index(&self) -> usize {
        self.index
    }
}

impl Plugin {
    /// Number of VMs.
    pub fn vm_count(&self) -> usize {
        self.vms.len()
    }

    /// Host calls, shared-data operations and VM entries of all this plugin's VMs since they
    /// were created (startup included); subtract two readings for what lay between them.
    pub fn call_counts(&self) -> CallCounts {
        self.vms
            .iter()
            .map(|vm| {
                vm.lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .store
                    .data()
                    .counts
            })
            .fold(CallCounts::default(), |a, b| a + b)
    }

    /// The host calls of [`Plugin::call_counts`] by import name, over all this plugin's VMs.
    pub fn host_call_names(&self) -> HostCallNames {
        let mut names = HostCallNames::default();
        for vm in self.vms.iter() {
            names.merge(
                &vm.lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .store
                    .data()
                    .call_names,
            );
        }
        names
    }

    /// A handle on VM `index` (errors surface when it is used, if there is no such VM).
    pub fn vm(&self, index: usize) -> VmRef<'_> {
        VmRef {
            plugin: self,
            index,
        }
    }

    /// Starts a new HTTP stream on VM `vm`.
    pub fn http_stream(&self, vm: usize) -> Result<HttpStream> {
        let context_id = self.with_vm(vm, VmInstance::create_stream)?;
        Ok(HttpStream::new(self.clone(), vm, context_id))
    }

    /// A new TCP connection through the network filter on VM `vm`: the context is created by
    /// [`Connection::new_connection`], as Envoy's `onNewConnection`.
    pub fn connection(&self, vm: usize) -> Result<Connection> {
        let context_id = self.with_vm(vm, |vm| Ok(vm.create_connection()))?;
        Ok(Connection::new(self.clone(), vm, context_id))
    }

    /// Moves the virtual clock forward, firing every `proxy_on_tick` that falls due on the way,
    /// in time order.
    pub fn advance(&self, by: Duration) -> Result<()> {
        let deadline = {
            let clock = &self.shared.lock().clock;
            clock
                .now()
                .saturating_add(u64::try_from(by.as_nanos()).unwrap_or(u64::MAX))
        };
        loop {
            let next = self.shared.lock().clock.next_tick_until(deadline);
            let Some(vm) = next else { break };
            if self.lock_vm(vm)?.failed {
                continue;
            }
            self.with_vm(vm, VmInstance::tick)?;
        }
        self.shared.lock().clock.advance_to(deadline);
        Ok(())
    }

    /// The virtual wall-clock time.
    pub fn now(&self) -> SystemTime {
        self.shared.lock().clock.system_time()
    }

    /// A shared-data value and its CAS.
    pub fn shared_data(&self, key: &str) -> Option<(Vec<u8>, u32)> {
        self.shared
            .lock()
            .data
            .get(key)
            .map(|(value, cas)| (value.to_vec(), cas))
    }

    /// Sets shared data as a guest would (CAS 0 is unconditional).
    pub fn set_shared_data(
        &self,
        key: &str,
        value: &[u8],
        cas: u32,
    ) -> std::result::Result<(), Status> {
        self.shared.lock().data.set(key, value, cas)
    }

    /// Number of shared-data keys and their total size in bytes.
    pub fn shared_data_size(&self) -> (usize, usize) {
        let state = self.shared.lock();
        (state.data.len(), state.data.byte_size())
    }

    /// Enqueues an item on a registered queue (of this plugin's vm_id) and delivers
    /// `proxy_on_queue_ready` to its owner.
    pub fn enqueue(&self, name: &str, item: &[u8]) -> Result<()> {
        {
            let mut state = self.shared.lock();
            let token = self.queue_token(&state.queues, name)?;
            let owner = state
                .queues
                .enqueue(token, item)
                .map_err(|_| self.unknown_queue(name))?;
            state.queue_ready.push_back((owner, token));
        }
        self.deliver_queue_ready()
    }

    /// Takes the oldest item of a queue, as a guest would.
    pub fn dequeue(&self, name: &str) -> Result<Option<Vec<u8>>> {
        let mut state = self.shared.lock();
        let token = self.queue_token(&state.queues, name)?;
        Ok(state.queues.dequeue(token).ok())
    }

    /// Number of items waiting in a queue.
    pub fn queue_len(&self, name: &str) -> Result<usize> {
        let state = self.shared.lock();
        let token = self.queue_token(&state.queues, name)?;
        Ok(state.queues.len(token).unwrap_or(0))
    }

    /// A counter's total.
    pub fn counter(&self, name: &str) -> Option<u64> {
        let state = self.shared.lock();
        state
            .metrics
            .find(MetricType::Counter, name)
            .map(|m| m.value.max(0) as u64)
    }

    /// A gauge's value.
    pub fn gauge(&self, name: &str) -> Option<i64> {
        self.shared
            .lock()
            .metrics
            .find(MetricType::Gauge, name)
            .map(|m| m.value)
    }

    /// Every value recorded into a histogram.
    pub fn histogram(&self, name: &str) -> Option<Vec<u64>> {
        self.shared
            .lock()
            .metrics
            .find(MetricType::Histogram, name)
            .map(|m| m.samples.clone())
    }

    /// All metrics, in definition order.
    pub fn metrics(&self) -> Vec<Metric> {
        self.shared.lock().metrics.all().to_vec()
    }

    /// The captured log lines, oldest first.
    pub fn logs(&self) -> Vec<LogEntry> {
        self.shared.lock().logs.entries().cloned().collect()
    }

    /// Whether any captured line contains `text`.
    pub fn logged(&self, text: &str) -> bool {
        self.shared
            .lock()
            .logs
            .entries()
            .any(|e| e.message.contains(text))
    }

    /// How many old lines were dropped to respect [`PluginBuilder::max_log_entries`].
    pub fn dropped_logs(&self) -> usize {
        self.shared.lock().logs.dropped()
    }

    /// Forgets the captured lines.
    pub fn clear_logs(&self) {
        self.shared.lock().logs.clear();
    }

    /// The answers of real callouts, as they arrive (for `http/callouts.rs`).
    pub(crate) fn finished_calls(&self) -> MutexGuard<'_, Receiver<Finished>> {
        self.finished.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The process-wide state (for the drivers in other modules).
    pub(crate) fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// Every `proxy_call_foreign_function` call so far.
    pub fn foreign_calls(&self) -> Vec<ForeignCall> {
        self.shared.lock().foreign_calls.clone()
    }

    /// Sets a plugin-wide property.
    pub fn set_property(&self, path: &[&str], value: impl Into<Vec<u8>>) {
        self.shared
            .lock()
            .properties
            .insert(property_key(path), value.into());
    }

    fn queue_token(&self, queues: &SharedQueues, name: &str) -> Result<u32> {
        queues
            .resolve(&self.shared.config.vm_id, name)
            .ok_or_else(|| self.unknown_queue(name))
    }

    fn unknown_queue(&self, name: &str) -> Error {
        Error::UnknownQueue {
            vm_id: self.shared.config.vm_id.clone(),
            name: name.to_owned(),
        }
    }

    /// Reads a context's host-side state, which `find` looks up in the VM's store data; a
    /// context that is gone, or a VM that does not exist, reads as the default state.
    pub(crate) fn read_context<S: Default, R>(
        &self,
        vm: usize,
        find: impl FnOnce(&VmState) -> Option<&S>,
        read: impl FnOnce(&S) -> R,
    ) -> R {
        let empty = S::default();
        match self.lock_vm(vm) {
            Ok(vm) => read(find(vm.store.data()).unwrap_or(&empty)),
            Err(_) => read(&empty),
        }
    }

    pub(crate) fn lock_vm(&self, vm: usize) -> Result<MutexGuard<'_, VmInstance>> {
        let slot = self.vms.get(vm).ok_or(Error::NoSuchVm {
            vm,
            count: self.vms.len(),
        })?;
        Ok(slot.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// Runs one top-level operation on a VM, then delivers the queue notifications it caused.
    pub(crate) fn with_vm<R>(
        &self,
        vm: usize,
        op: impl FnOnce(&mut VmInstance) -> Result<R>,
    ) -> Result<R> {
        let result = op(&mut *self.lock_vm(vm)?);
        let delivered = self.deliver_queue_ready();
        let value = result?;
        delivered?;
        Ok(value)
    }

    /// Delivers pending `proxy_on_queue_ready` calls (each to the queue's last registrant),
    /// including the ones those calls cause.
    fn deliver_queue_ready(&self) -> Result<()> {
        for _ in 0..MAX_ROUNDS {
            let next = self.shared.lock().queue_ready.pop_front();
            let Some((owner, token)) = next else {
                return Ok(());
            };
            let mut vm = self.lock_vm(owner.vm)?;
            if !vm.failed {
                vm.queue_ready(owner.root_context_id, token)?;
            }
        }
        Err(Error::Runaway(MAX_ROUNDS))
    }
}
