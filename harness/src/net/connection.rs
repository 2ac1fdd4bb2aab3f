//! The test's handle on one network (TCP) filter context.

use crate::error::Result;
use crate::net::driver::Way;
use crate::net::state::{ConnectionEvent, ConnectionState};
use crate::plugin::Plugin;
use crate::types::{Action, CloseType};
use crate::vm::VmInstance;

/// One downstream connection through a network filter on one VM, driven by the test as Envoy
/// drives a `envoy.filters.network.wasm` filter in front of `tcp_proxy`. Start it with
/// [`Connection::new_connection`]; data methods return the filter's status ([`Action::Pause`]
/// is Envoy's `StopIteration`); observation methods show what went past the filter and what
/// it holds. Dropping the handle forgets the context's host-side state.
pub struct Connection {
    plugin: Plugin,
    vm: usize,
    context_id: u32,
}

impl Connection {
    pub(crate) fn new(plugin: Plugin, vm: usize, context_id: u32) -> Connection {
        Connection {
            plugin,
            vm,
            context_id,
        }
    }

    /// The VM running this connection.
    pub fn vm(&self) -> usize {
        self.vm
    }

    /// The connection's context id in its VM.
    pub fn context_id(&self) -> u32 {
        self.context_id
    }

    /// `proxy_on_context_create` and `proxy_on_new_connection` (Envoy's `onNewConnection`).
    /// Data sent before it passes without calling the guest, as in Envoy.
    pub fn new_connection(&self) -> Result<Action> {
        self.drive(|vm, id| vm.new_connection(id))
    }

    /// Data from the client: `proxy_on_downstream_data` (Envoy's `onData`).
    pub fn downstream_data(&self, data: &[u8], end_of_stream: bool) -> Result<Action> {
        self.drive(|vm, id| vm.connection_data(id, Way::Downstream, data, end_of_stream))
    }

    /// Data from the upstream: `proxy_on_upstream_data` (Envoy's `onWrite`); with
    /// `end_of_stream`, `proxy_on_upstream_connection_close(Unknown)` follows.
    pub fn upstream_data(&self, data: &[u8], end_of_stream: bool) -> Result<Action> {
        self.drive(|vm, id| vm.connection_data(id, Way::Upstream, data, end_of_stream))
    }

    /// The downstream connection closes (`Remote`: the client; `Local`: Envoy):
    /// `proxy_on_downstream_connection_close`, then `proxy_on_done`, `proxy_on_log`,
    /// `proxy_on_delete`.
    pub fn close(&self, close_type: CloseType) -> Result<()> {
        self.drive(|vm, id| vm.close_connection(id, close_type))
    }

    /// Downstream bytes that went past the filter (towards the upstream).
    pub fn forwarded_downstream_data(&self) -> Vec<u8> {
        self.with_state(|c| c.downstream.forwarded.clone())
    }

    /// Upstream bytes that went past the filter (towards the client).
    pub fn forwarded_upstream_data(&self) -> Vec<u8> {
        self.with_state(|c| c.upstream.forwarded.clone())
    }

    /// Downstream data the filter holds (it returned `Pause`).
    pub fn buffered_downstream_data(&self) -> Vec<u8> {
        self.with_state(|c| c.downstream.held().to_vec())
    }

    /// Upstream data the filter holds.
    pub fn buffered_upstream_data(&self) -> Vec<u8> {
        self.with_state(|c| c.upstream.held().to_vec())
    }

    /// What the filter did to the connection (continue, close), in order.
    pub fn events(&self) -> Vec<ConnectionEvent> {
        self.with_state(|c| c.events.clone())
    }

    /// How the downstream connection closed, if it did (a close by the filter is `Local`).
    pub fn closed(&self) -> Option<CloseType> {
        self.with_state(|c| c.downstream_closed)
    }

    /// Whether the upstream side ended (upstream data with end_of_stream).
    pub fn upstream_closed(&self) -> bool {
        self.with_state(|c| c.upstream_closed)
    }

    /// Whether the context ended (`proxy_on_done`, `proxy_on_log`, `proxy_on_delete` ran).
    pub fn is_finished(&self) -> bool {
        self.with_state(|c| c.finished)
    }

    fn drive<R>(&self, op: impl FnOnce(&mut VmInstance, u32) -> Result<R>) -> Result<R> {
        self.plugin.with_vm(self.vm, |vm| op(vm, self.context_id))
    }

    fn with_state<R>(&self, read: impl FnOnce(&ConnectionState) -> R) -> R {
        let id = self.context_id;
        self.plugin
            .read_context(self.vm, |state| state.connections.get(&id), read)
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        if let Ok(mut vm) = self.plugin.lock_vm(self.vm) {
            vm.store.data_mut().connections.remove(&self.context_id);
        }
    }
}
