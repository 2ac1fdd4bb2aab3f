//! Driving one HTTP stream through a VM the way Envoy's HTTP filter does, with the plugin
//! option `allow_on_headers_stop_iteration: true`.
//!
//! * Headers: `Continue` lets them go on (the guest loses access to them); `Pause` holds them,
//!   and body callbacks still arrive, so headers can be changed until the filter continues.
//! * Body: while the filter returns `Pause`, chunks accumulate and each callback sees the total
//!   buffered so far; `Continue` passes the buffer on.
//! * A local reply ends the request direction, then travels back through this filter's
//!   response callbacks (as Envoy's local replies go through the encoder filters).
//! * A closed direction (local reply, reset) gets no more callbacks: sending to it returns
//!   `Pause` without calling the guest.

use crate::error::{Error, Result};
use crate::http::headers::HeaderMap;
use crate::http::state::{Direction, StreamState};
use crate::types::Action;
use crate::vm::exports::Pick;
use crate::vm::{size_u32, VmInstance};

/// Which direction of the stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Side {
    Request,
    Response,
}

impl Side {
    fn of(self, stream: &mut StreamState) -> &mut Direction {
        match self {
            Side::Request => &mut stream.request,
            Side::Response => &mut stream.response,
        }
    }

    fn on_headers(self) -> Pick<(u32, u32, u32), u32> {
        match self {
            Side::Request => |e| &e.request_headers,
            Side::Response => |e| &e.response_headers,
        }
    }

    fn on_body(self) -> Pick<(u32, u32, u32), u32> {
        match self {
            Side::Request => |e| &e.request_body,
            Side::Response => |e| &e.response_body,
        }
    }

    fn on_trailers(self) -> Pick<(u32, u32), u32> {
        match self {
            Side::Request => |e| &e.request_trailers,
            Side::Response => |e| &e.response_trailers,
        }
    }
}

impl VmInstance {
    /// Creates an HTTP context: `proxy_on_context_create(id, root)`.
    pub fn create_stream(&mut self) -> Result<u32> {
        let id = self.next_context_id();
        let started_at = self.store.data().shared.lock().clock.now();
        self.store.data_mut().streams.insert(
            id,
            StreamState {
                started_at,
                ..StreamState::default()
            },
        );
        self.create_context(id)?;
        self.after_call()?;
        Ok(id)
    }

    fn direction(&mut self, context: u32, side: Side) -> Result<&mut Direction> {
        let vm = self.vm();
        match self.store.data_mut().streams.get_mut(&context) {
            Some(stream) if !stream.finished => Ok(side.of(stream)),
            _ => Err(Error::StreamFinished {
                vm,
                context_id: context,
            }),
        }
    }

    /// One callback of a direction: `enter` readies the direction and returns the callback's
    /// arguments, `settle` applies the action to the direction if it is still open. A closed
    /// direction gets no callback (`Pause`). A local reply sent during the callback is applied
    /// before `settle` and wins over the action, as in Envoy.
    fn deliver<P: wasmtime::WasmParams>(
        &mut self,
        context: u32,
        side: Side,
        pick: Pick<P, u32>,
        enter: impl FnOnce(&mut Direction) -> P,
        settle: impl FnOnce(&mut Direction, Action),
    ) -> Result<Action> {
        let dir = self.direction(context, side)?;
        if dir.closed {
            return Ok(Action::Pause);
        }
        let args = enter(dir);
        let action = self.call_action(pick, context, args)?;
        self.after_call()?;
        let dir = self.direction(context, side)?;
        if !dir.closed {
            settle(dir, action);
        }
        Ok(action)
    }

    /// Delivers headers to `proxy_on_{request,response}_headers`.
    pub fn send_headers(
        &mut self,
        context: u32,
        side: Side,
        headers: HeaderMap,
        end_of_stream: bool,
    ) -> Result<Action> {
        let enter = |dir: &mut Direction| {
            dir.headers = headers;
            dir.headers_live = true;
            (
                context,
                size_u32(dir.headers.len()),
                u32::from(end_of_stream),
            )
        };
        let settle = |dir: &mut Direction, action| {
            if action == Action::Continue {
                dir.pass_on();
                dir.headers_live = false;
            }
        };
        self.deliver(context, side, side.on_headers(), enter, settle)
    }

    /// Delivers a body chunk to `proxy_on_{request,response}_body`.
    pub fn send_body(
        &mut self,
        context: u32,
        side: Side,
        chunk: &[u8],
        end_of_stream: bool,
    ) -> Result<Action> {
        let enter = |dir: &mut Direction| {
            dir.take_chunk(chunk);
            (context, size_u32(dir.body.len()), u32::from(end_of_stream))
        };
        let settle = |dir: &mut Direction, action| match action {
            Action::Continue => dir.pass_on(),
            Action::Pause => dir.buffering = true,
        };
        self.deliver(context, side, side.on_body(), enter, settle)
    }

    /// Delivers trailers to `proxy_on_{request,response}_trailers`.
    pub fn send_trailers(
        &mut self,
        context: u32,
        side: Side,
        trailers: HeaderMap,
    ) -> Result<Action> {
        let enter = |dir: &mut Direction| {
            dir.trailers = trailers;
            dir.trailers_live = true;
            (context, size_u32(dir.trailers.len()))
        };
        let settle = |dir: &mut Direction, action| {
            if action == Action::Continue {
                dir.pass_on();
                dir.trailers_live = false;
            }
        };
        self.deliver(context, side, side.on_trailers(), enter, settle)
    }

    /// Ends the stream: `proxy_on_done`, `proxy_on_log` (request and response headers readable),
    /// `proxy_on_delete`. Returns the stream's final state.
    pub fn finish_stream(&mut self, context: u32) -> Result<StreamState> {
        self.direction(context, Side::Request)?;
        self.call(|e| &e.done, context, context)?;
        self.call_log(context)?;
        self.delete_stream(context)
    }

    /// Envoy's access-log phase for one stream: `proxy_on_log`, with the request and response
    /// headers readable. (Envoy logs every filter of the chain, then destroys them.)
    pub fn log_stream(&mut self, context: u32) -> Result<()> {
        self.direction(context, Side::Request)?;
        self.call_log(context)?;
        self.after_call()
    }

    /// Envoy's filter destruction for one stream: `proxy_on_done`, `proxy_on_delete`. Returns
    /// the stream's final state.
    pub fn destroy_stream(&mut self, context: u32) -> Result<StreamState> {
        self.direction(context, Side::Request)?;
        self.call(|e| &e.done, context, context)?;
        self.delete_stream(context)
    }

    /// `proxy_on_log`, with the request and response headers readable during it.
    fn call_log(&mut self, context: u32) -> Result<()> {
        self.set_in_log(context, true);
        let logged = self.call(|e| &e.log, context, context);
        self.set_in_log(context, false);
        logged.map(drop)
    }

    /// `proxy_on_delete`, then the stream's final state.
    fn delete_stream(&mut self, context: u32) -> Result<StreamState> {
        self.call(|e| &e.delete, context, context)?;
        self.after_call()?;
        let mut stream = self
            .store
            .data_mut()
            .streams
            .remove(&context)
            .unwrap_or_default();
        stream.finished = true;
        Ok(stream)
    }

    fn set_in_log(&mut self, context: u32, in_log: bool) {
        if let Some(stream) = self.store.data_mut().streams.get_mut(&context) {
            stream.in_log = in_log;
        }
    }

    /// Applies a local reply recorded during the last guest call.
    pub(crate) fn apply_local_reply(&mut self, context: u32) -> Result<()> {
        let Some(stream) = self.store.data_mut().streams.get_mut(&context) else {
            return Ok(());
        };
        let Some(reply) = stream.pending_reply.take() else {
            return Ok(());
        };
        stream.request.closed = true;
        stream.request.body.clear();
        stream.request.buffering = false;

        // As Envoy's `sendLocalReply`: the filter's headers are added to `:status`, then a body
        // gets its `content-length` and, unless the filter named one, `content-type: text/plain`.
        let mut headers = HeaderMap::new();
        headers.add(":status", &reply.status.to_string());
        for (name, value) in reply.headers.iter() {
            headers.add(name, value);
        }
        if !reply.body.is_empty() {
            headers.replace("content-length", &reply.body.len().to_string());
            if !headers.contains("content-type") {
                headers.add("content-type", "text/plain");
            }
        }
        let body = reply.body.clone();
        stream.local_reply = Some(reply);

        let response = &mut stream.response;
        let response_started =
            response.closed || response.headers_live || response.forwarded_headers.is_some();
        if response_started {
            // Sent while the upstream response was being processed: the reply replaces it
            // without running this filter's callbacks again.
            response.headers = headers.clone();
            response.headers_live = false;
            response.forwarded_headers = Some(headers);
            response.forwarded_body = body;
            response.body.clear();
            response.closed = true;
            return Ok(());
        }
        let end_of_stream = body.is_empty();
        self.send_headers(context, Side::Response, headers, end_of_stream)?;
        if !end_of_stream {
            self.send_body(context, Side::Response, &body, true)?;
        }
        let dir = self.direction(context, Side::Response)?;
        if !dir.closed {
            dir.pass_on();
            dir.closed = true;
        }
        Ok(())
    }
}
