//! Driving one network (TCP) filter context through a VM the way Envoy's wasm network filter
//! does (`Context::onNewConnection`, `onData`, `onWrite`, `onEvent`, `onCloseTCP` in Envoy's
//! `source/extensions/common/wasm/context.cc`).
//!
//! * `proxy_on_new_connection` creates the context; until then data passes without calling
//!   the guest (Envoy's `in_vm_context_created_` check).
//! * Data: `Continue` passes the buffer on; `Pause` leaves it where it was, and the next chunk
//!   is appended, the callback seeing the whole buffer. Downstream data the filter holds goes
//!   on with `proxy_continue_stream(Downstream)` (Envoy's `continueReading`); upstream data has
//!   no such call (`Unimplemented`).
//! * Upstream data with end_of_stream is followed by `proxy_on_upstream_connection_close` with
//!   `Unknown` (Envoy cannot see the upstream connection's own close events).
//! * The downstream connection closing (the test's `close`, or the filter's
//!   `proxy_close_stream`, which Envoy turns into a local close) calls
//!   `proxy_on_downstream_connection_close` with `Local` or `Remote`, then `proxy_on_done`,
//!   `proxy_on_log`, `proxy_on_delete`.

use crate::error::{Error, Result};
use crate::net::state::{ConnectionState, Flow};
use crate::types::{Action, CloseType};
use crate::vm::exports::Pick;
use crate::vm::{size_u32, VmInstance};

/// Which direction of a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Way {
    /// From the client (read path).
    Downstream,
    /// From the upstream (write path).
    Upstream,
}

impl Way {
    fn of(self, connection: &mut ConnectionState) -> &mut Flow {
        match self {
            Way::Downstream => &mut connection.downstream,
            Way::Upstream => &mut connection.upstream,
        }
    }

    fn on_data(self) -> Pick<(u32, u32, u32), u32> {
        match self {
            Way::Downstream => |e| &e.downstream_data,
            Way::Upstream => |e| &e.upstream_data,
        }
    }
}

impl VmInstance {
    /// Reserves a context id for a connection; the guest sees nothing until
    /// [`VmInstance::new_connection`].
    pub fn create_connection(&mut self) -> u32 {
        let id = self.next_context_id();
        self.store
            .data_mut()
            .connections
            .insert(id, ConnectionState::default());
        id
    }

    fn connection_state(&mut self, context: u32) -> Result<&mut ConnectionState> {
        let vm = self.vm();
        match self.store.data_mut().connections.get_mut(&context) {
            Some(connection) if !connection.finished => Ok(connection),
            _ => Err(Error::StreamFinished {
                vm,
                context_id: context,
            }),
        }
    }

    /// `proxy_on_context_create(id, root)` then `proxy_on_new_connection(id)`.
    pub fn new_connection(&mut self, context: u32) -> Result<Action> {
        let vm = self.vm();
        let connection = self.connection_state(context)?;
        if connection.created {
            return Err(Error::ConnectionStarted {
                vm,
                context_id: context,
            });
        }
        connection.created = true;
        self.create_context(context)?;
        let action = self.call_action(|e| &e.new_connection, context, context)?;
        self.after_call()?;
        Ok(action)
    }

    /// Delivers a chunk to `proxy_on_{downstream,upstream}_data`.
    pub fn connection_data(
        &mut self,
        context: u32,
        way: Way,
        chunk: &[u8],
        end_of_stream: bool,
    ) -> Result<Action> {
        let connection = self.connection_state(context)?;
        let created = connection.created;
        let flow = way.of(connection);
        if !created {
            flow.forwarded.extend_from_slice(chunk);
            return Ok(Action::Continue);
        }
        flow.take_chunk(chunk);
        let args = (
            context,
            size_u32(flow.buffer.len()),
            u32::from(end_of_stream),
        );
        let action = self.call_action(way.on_data(), context, args)?;
        if action == Action::Continue {
            way.of(self.connection_state(context)?).pass_on();
        }
        // Envoy runs the deferred continue / close before the filter manager sees the action.
        self.after_call()?;
        if way == Way::Upstream && end_of_stream {
            self.upstream_closed(context)?;
        }
        Ok(action)
    }

    /// Envoy's `onUpstreamConnectionClose(Unknown)` after the last upstream data.
    fn upstream_closed(&mut self, context: u32) -> Result<()> {
        let Some(connection) = self.store.data_mut().connections.get_mut(&context) else {
            return Ok(());
        };
        if connection.finished {
            return Ok(());
        }
        connection.upstream_closed = true;
        let args = (context, CloseType::Unknown as u32);
        self.call(|e| &e.upstream_close, context, args)?;
        self.after_call()
    }

    /// The downstream connection closed (Envoy's `onEvent` with `LocalClose` / `RemoteClose`):
    /// `proxy_on_downstream_connection_close`, then `proxy_on_done`, `proxy_on_log`,
    /// `proxy_on_delete`. Nothing reaches the guest if the context was never created.
    pub fn close_connection(&mut self, context: u32, close_type: CloseType) -> Result<()> {
        let connection = self.connection_state(context)?;
        connection.downstream_closed = Some(close_type);
        if !connection.created {
            connection.finished = true;
            return Ok(());
        }
        let args = (context, close_type as u32);
        self.call(|e| &e.downstream_close, context, args)?;
        self.finish_connection(context)
    }

    /// Envoy's `onCloseTCP`: `proxy_on_done`, `proxy_on_log`, `proxy_on_delete`, once.
    fn finish_connection(&mut self, context: u32) -> Result<()> {
        self.connection_state(context)?.finished = true;
        self.call(|e| &e.done, context, context)?;
        self.call(|e| &e.log, context, context)?;
        self.call(|e| &e.delete, context, context)?;
        self.after_call()
    }

    /// Applies what network filters asked for during the last guest call: held downstream data
    /// goes on (`continueReading`), then a close closes the downstream connection locally.
    pub(crate) fn apply_connection_actions(&mut self) -> Result<()> {
        while let Some(context) = self.store.data_mut().connection_actions.pop() {
            let Some(connection) = self.store.data_mut().connections.get_mut(&context) else {
                continue;
            };
            if connection.finished {
                continue;
            }
            if std::mem::take(&mut connection.pending_continue) {
                connection.downstream.pass_on();
            }
            if std::mem::take(&mut connection.pending_close) {
                self.close_connection(context, CloseType::Local)?;
            }
        }
        Ok(())
    }
}
