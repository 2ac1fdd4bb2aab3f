//! The test's side of gRPC callouts: answering recorded calls and feeding recorded streams,
//! which delivers the `proxy_on_grpc_*` callbacks the way Envoy's async gRPC client does
//! (`GrpcCallClientHandler` / `GrpcStreamClientHandler` in Envoy's wasm `context.h`).
//!
//! * A unary call gets either `proxy_on_grpc_receive` (success: no `proxy_on_grpc_close`
//!   follows) or `proxy_on_grpc_close` with the failure status; then it is forgotten.
//! * A stream gets initial metadata, messages and trailing metadata in any order the test
//!   chooses, then `proxy_on_grpc_close`. Envoy forgets it once both sides closed (the remote
//!   close here, `proxy_grpc_close` from the filter), or at once on `proxy_grpc_cancel`.
//! * During a close callback `proxy_get_status` returns the gRPC status and message.

use crate::error::{Error, Result};
use crate::grpc::{GrpcCall, GrpcDelivery, GrpcStream};
use crate::http::headers::HeaderMap;
use crate::plugin::Plugin;
use crate::types::Status;
use crate::vm::exports::Pick;
use crate::vm::{size_u32, VmInstance};

impl VmInstance {
    /// Calls the callback for one delivery on the context that made the callout (the root
    /// context if that one has ended: Envoy owns callouts on the root context), with the
    /// message, metadata or status available to the guest only during the call.
    pub(crate) fn grpc_deliver(
        &mut self,
        context_id: u32,
        token: u32,
        delivery: GrpcDelivery,
    ) -> Result<()> {
        let context = if self.store.data().is_live_context(context_id) {
            context_id
        } else {
            self.root_id()
        };
        let state = self.store.data_mut();
        let (pick, value): (Pick<(u32, u32, u32), ()>, u32) = match delivery {
            GrpcDelivery::InitialMetadata(map) => {
                let pairs = size_u32(map.len());
                state.grpc_initial_metadata = Some(map);
                (|e| &e.grpc_initial_metadata, pairs)
            }
            GrpcDelivery::Message(message) => {
                let size = size_u32(message.len());
                state.grpc_receive = Some(message);
                (|e| &e.grpc_receive, size)
            }
            GrpcDelivery::TrailingMetadata(map) => {
                let pairs = size_u32(map.len());
                state.grpc_trailing_metadata = Some(map);
                (|e| &e.grpc_trailing_metadata, pairs)
            }
            GrpcDelivery::Close(status, message) => {
                state.call_status = (status, message);
                (|e| &e.grpc_close, status)
            }
        };
        let result = self.call(pick, context, (context, token, value));
        let state = self.store.data_mut();
        state.grpc_receive = None;
        state.grpc_initial_metadata = None;
        state.grpc_trailing_metadata = None;
        state.call_status = (Status::Ok as u32, String::new());
        result?;
        self.after_call()
    }
}

impl Plugin {
    /// Unary gRPC calls (`proxy_grpc_call`) waiting for an answer, oldest first.
    pub fn grpc_calls(&self) -> Vec<GrpcCall> {
        self.shared().lock().grpc_calls.clone()
    }

    /// gRPC streams (`proxy_grpc_stream`) still open on either side, oldest first, with the
    /// messages the filter sent so far.
    pub fn grpc_streams(&self) -> Vec<GrpcStream> {
        self.shared().lock().grpc_streams.clone()
    }

    /// Answers a unary call: `proxy_on_grpc_receive` with `message` in `GrpcReceiveBuffer`.
    /// Envoy then forgets the call; no `proxy_on_grpc_close` follows.
    pub fn respond_grpc_call(&self, call: &GrpcCall, message: impl Into<Vec<u8>>) -> Result<()> {
        self.answer_call(call, GrpcDelivery::Message(message.into()))
    }

    /// Fails a unary call: `proxy_on_grpc_close` with the gRPC `status` (e.g. 14, UNAVAILABLE);
    /// `proxy_get_status` returns it and `message` during the callback.
    pub fn fail_grpc_call(&self, call: &GrpcCall, status: u32, message: &str) -> Result<()> {
        self.answer_call(call, GrpcDelivery::Close(status, message.to_owned()))
    }

    /// `proxy_on_grpc_receive_initial_metadata` on an open stream.
    pub fn grpc_stream_initial_metadata(
        &self,
        stream: &GrpcStream,
        metadata: &[(&str, &str)],
    ) -> Result<()> {
        let map = HeaderMap::from_pairs(metadata.iter().copied());
        self.feed_stream(stream, GrpcDelivery::InitialMetadata(map))
    }

    /// `proxy_on_grpc_receive` with one message on an open stream.
    pub fn grpc_stream_message(
        &self,
        stream: &GrpcStream,
        message: impl Into<Vec<u8>>,
    ) -> Result<()> {
        self.feed_stream(stream, GrpcDelivery::Message(message.into()))
    }

    /// `proxy_on_grpc_receive_trailing_metadata` on an open stream.
    pub fn grpc_stream_trailing_metadata(
        &self,
        stream: &GrpcStream,
        metadata: &[(&str, &str)],
    ) -> Result<()> {
        let map = HeaderMap::from_pairs(metadata.iter().copied());
        self.feed_stream(stream, GrpcDelivery::TrailingMetadata(map))
    }

    /// The remote side closes the stream: `proxy_on_grpc_close` with `status` (0 = OK) and
    /// `message`. Nothing more can be delivered; the stream is forgotten if the filter had
    /// closed its side, else kept (and still listed) until it calls `proxy_grpc_close`.
    pub fn close_grpc_stream(&self, stream: &GrpcStream, status: u32, message: &str) -> Result<()> {
        self.feed_stream(stream, GrpcDelivery::Close(status, message.to_owned()))
    }

    fn answer_call(&self, call: &GrpcCall, delivery: GrpcDelivery) -> Result<()> {
        let same = |c: &GrpcCall| c.vm == call.vm && c.token == call.token;
        if !self.shared().lock().grpc_calls.iter().any(same) {
            return Err(unknown(call.vm, call.token));
        }
        let result = self.with_vm(call.vm, |vm| {
            vm.grpc_deliver(call.context_id, call.token, delivery)
        });
        // Envoy erases the call after the callback (the guest may have cancelled it meanwhile).
        self.shared().lock().grpc_calls.retain(|c| !same(c));
        result
    }

    fn feed_stream(&self, stream: &GrpcStream, delivery: GrpcDelivery) -> Result<()> {
        let same = |s: &GrpcStream| s.vm == stream.vm && s.token == stream.token;
        let closing = matches!(delivery, GrpcDelivery::Close(..));
        {
            let mut state = self.shared().lock();
            let open = state
                .grpc_streams
                .iter_mut()
                .find(|s| same(s) && !s.remote_closed)
                .ok_or_else(|| unknown(stream.vm, stream.token))?;
            // Envoy marks the remote close before the callback, so a `proxy_grpc_close` from
            // inside it forgets the stream at once.
            open.remote_closed |= closing;
        }
        let result = self.with_vm(stream.vm, |vm| {
            vm.grpc_deliver(stream.context_id, stream.token, delivery)
        });
        if closing {
            let mut state = self.shared().lock();
            state
                .grpc_streams
                .retain(|s| !(same(s) && s.local_closed && s.remote_closed));
        }
        result
    }
}

fn unknown(vm: usize, token: u32) -> Error {
    Error::UnknownGrpcCall { vm, token }
}
