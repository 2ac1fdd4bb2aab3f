//! Host-side state of one network (TCP) filter context: the data in each direction, with
//! Envoy's rules for when the guest may touch it, and what the filter did to the connection.

use crate::types::{CloseType, StreamType};

/// Something a network filter did to its connection, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConnectionEvent {
    /// `proxy_continue_stream(Downstream)` (the SDK's `resume_downstream`): Envoy's
    /// `continueReading`, applied after the guest call.
    Continued,
    /// `proxy_close_stream(Downstream | Upstream)` (the SDK's `close_downstream` /
    /// `close_upstream`): Envoy closes the connection after the guest call (both types close
    /// the downstream connection: the write filter's connection is the same one).
    Closed(StreamType),
}

/// One direction's data.
#[derive(Debug, Clone, Default)]
pub(crate) struct Flow {
    /// The data being delivered, or everything held while the filter returns `Pause` (Envoy
    /// leaves it in the connection's buffer and calls again with more appended).
    pub buffer: Vec<u8>,
    /// Envoy's `network_{downstream,upstream}_data_buffer_`: set from the data callback until
    /// it returns `Continue`; the guest reaches `buffer` only while it is set.
    pub live: bool,
    /// Bytes that went past the filter (upstream for downstream data, to the client for
    /// upstream data).
    pub forwarded: Vec<u8>,
}

impl Flow {
    /// Starts a data callback: the chunk joins held data or replaces what went on.
    pub fn take_chunk(&mut self, chunk: &[u8]) {
        if !self.live {
            self.buffer.clear();
        }
        self.buffer.extend_from_slice(chunk);
        self.live = true;
    }

    /// Lets the buffer go on (`Continue`, or `continueReading` for held downstream data).
    pub fn pass_on(&mut self) {
        self.forwarded.append(&mut self.buffer);
        self.live = false;
    }

    /// What the filter holds (empty unless it returned `Pause`).
    pub fn held(&self) -> &[u8] {
        if self.live {
            &self.buffer
        } else {
            &[]
        }
    }
}

/// Host-side state of one network context.
#[derive(Debug, Clone, Default)]
pub(crate) struct ConnectionState {
    /// `proxy_on_context_create` and `proxy_on_new_connection` ran (Envoy's
    /// `in_vm_context_created_`); until then data passes without calling the guest.
    pub created: bool,
    /// Data from the client (read filter path, `proxy_on_downstream_data`).
    pub downstream: Flow,
    /// Data from the upstream to the client (write filter path, `proxy_on_upstream_data`).
    pub upstream: Flow,
    pub events: Vec<ConnectionEvent>,
    /// A continue or close asked for during the current guest call.
    pub pending_continue: bool,
    pub pending_close: bool,
    /// How the downstream connection closed (Envoy's `onEvent`), if it did.
    pub downstream_closed: Option<CloseType>,
    /// The upstream side ended (upstream data with end_of_stream).
    pub upstream_closed: bool,
    /// `proxy_on_done`, `proxy_on_log`, `proxy_on_delete` ran (Envoy's `onCloseTCP`): no more
    /// callbacks.
    pub finished: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn held_data_accumulates_until_continue() {
        let mut flow = Flow::default();
        flow.take_chunk(b"ab");
        assert_eq!(flow.held(), b"ab", "live during the callback");
        // Pause: stays live; the next chunk joins it.
        flow.take_chunk(b"cd");
        assert_eq!(flow.buffer, b"abcd");
        flow.pass_on();
        assert_eq!(flow.forwarded, b"abcd");
        assert!(flow.held().is_empty());
        flow.take_chunk(b"e");
        assert_eq!(flow.buffer, b"e");
    }
}
