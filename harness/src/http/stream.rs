//! The test's handle on one HTTP stream.

use std::sync::OnceLock;

use crate::error::{Error, Result};
use crate::http::driver::Side;
use crate::http::headers::HeaderMap;
use crate::http::state::LocalReply;
use crate::http::state::{StreamEvent, StreamState};
use crate::plugin::shared::property_key;
use crate::plugin::Plugin;
use crate::types::Action;
use crate::vm::VmInstance;

/// One HTTP stream (request and response) on one VM, driven by the test as Envoy would drive
/// it. Sending methods return the filter's [`Action`]; observation methods show the headers and
/// bodies as the filter left them. Call [`HttpStream::finish`] at the end (Envoy always does):
/// dropping the handle without it leaves the context alive in the VM.
pub struct HttpStream {
    plugin: Plugin,
    vm: usize,
    context_id: u32,
    finished: OnceLock<StreamState>,
}

impl HttpStream {
    pub(crate) fn new(plugin: Plugin, vm: usize, context_id: u32) -> HttpStream {
        HttpStream {
            plugin,
            vm,
            context_id,
            finished: OnceLock::new(),
        }
    }

    /// The VM running this stream.
    pub fn vm(&self) -> usize {
        self.vm
    }

    /// The stream's context id in its VM.
    pub fn context_id(&self) -> u32 {
        self.context_id
    }

    /// `proxy_on_request_headers`. Names are lower-cased.
    pub fn send_request_headers(
        &self,
        headers: &[(&str, &str)],
        end_of_stream: bool,
    ) -> Result<Action> {
        let headers = HeaderMap::from_pairs(headers.iter().copied());
        self.send_headers_map(Side::Request, headers, end_of_stream)
    }

    /// `proxy_on_request_body` with one more chunk.
    pub fn send_request_body(&self, chunk: &[u8], end_of_stream: bool) -> Result<Action> {
        self.send_body_on(Side::Request, chunk, end_of_stream)
    }

    /// `proxy_on_request_trailers` (ends the request).
    pub fn send_request_trailers(&self, trailers: &[(&str, &str)]) -> Result<Action> {
        self.send_trailers_on(Side::Request, trailers)
    }

    /// Headers, then (if `body` is not empty) the whole body as one final chunk; returns the
    /// last callback's action.
    pub fn send_request(&self, headers: &[(&str, &str)], body: &[u8]) -> Result<Action> {
        self.send_whole(Side::Request, headers, body)
    }

    /// `proxy_on_response_headers`.
    pub fn send_response_headers(
        &self,
        headers: &[(&str, &str)],
        end_of_stream: bool,
    ) -> Result<Action> {
        let headers = HeaderMap::from_pairs(headers.iter().copied());
        self.send_headers_map(Side::Response, headers, end_of_stream)
    }

    /// `proxy_on_response_body` with one more chunk.
    pub fn send_response_body(&self, chunk: &[u8], end_of_stream: bool) -> Result<Action> {
        self.send_body_on(Side::Response, chunk, end_of_stream)
    }

    /// `proxy_on_response_trailers` (ends the response).
    pub fn send_response_trailers(&self, trailers: &[(&str, &str)]) -> Result<Action> {
        self.send_trailers_on(Side::Response, trailers)
    }

    /// Response headers, then the body as one final chunk if not empty.
    pub fn send_response(&self, headers: &[(&str, &str)], body: &[u8]) -> Result<Action> {
        self.send_whole(Side::Response, headers, body)
    }

    /// Ends the stream: `proxy_on_done`, `proxy_on_log`, `proxy_on_delete`. The handle keeps
    /// answering the observation methods afterwards.
    pub fn finish(&self) -> Result<()> {
        self.end(VmInstance::finish_stream)
    }

    /// Whether [`HttpStream::finish`] ran.
    pub fn is_finished(&self) -> bool {
        self.finished.get().is_some()
    }

    /// The request headers as the filter left them.
    pub fn request_headers(&self) -> HeaderMap {
        self.with_state(|s| s.request.headers.clone())
    }

    /// One request header as the filter left it.
    pub fn request_header(&self, name: &str) -> Option<String> {
        self.with_state(|s| s.request.headers.get(name).map(str::to_owned))
    }

    /// The request headers as they went upstream (when the filter let them go); `None` while
    /// the filter holds them or if the stream ended first.
    pub fn forwarded_request_headers(&self) -> Option<HeaderMap> {
        self.with_state(|s| s.request.forwarded_headers.clone())
    }

    /// Request body bytes that went upstream.
    pub fn forwarded_request_body(&self) -> Vec<u8> {
        self.with_state(|s| s.request.forwarded_body.clone())
    }

    /// Request body the filter is holding (buffered while it returns `Pause`).
    pub fn buffered_request_body(&self) -> Vec<u8> {
        self.with_state(|s| s.request.held_body())
    }

    /// Response body the filter is holding (buffered while it returns `Pause`).
    pub fn buffered_response_body(&self) -> Vec<u8> {
        self.with_state(|s| s.response.held_body())
    }

    /// The response headers as the filter left them (for a local reply, the reply's headers).
    pub fn response_headers(&self) -> HeaderMap {
        self.with_state(|s| s.response.headers.clone())
    }

    /// One response header as the filter left it.
    pub fn response_header(&self, name: &str) -> Option<String> {
        self.with_state(|s| s.response.headers.get(name).map(str::to_owned))
    }

    /// The response headers as they went downstream.
    pub fn forwarded_response_headers(&self) -> Option<HeaderMap> {
        self.with_state(|s| s.response.forwarded_headers.clone())
    }

    /// Response body bytes that went downstream.
    pub fn forwarded_response_body(&self) -> Vec<u8> {
        self.with_state(|s| s.response.forwarded_body.clone())
    }

    /// The local reply the filter sent, if any.
    pub fn local_reply(&self) -> Option<LocalReply> {
        self.with_state(|s| s.local_reply.clone())
    }

    /// What the filter did to the stream (continue, close, local reply), in order.
    pub fn events(&self) -> Vec<StreamEvent> {
        self.with_state(|s| s.events.clone())
    }

    /// Sets a per-stream property, e.g. `(&["upstream", "address"], "127.0.0.1:18001")`.
    pub fn set_property(&self, path: &[&str], value: impl Into<Vec<u8>>) -> Result<()> {
        let value = value.into();
        let mut vm = self.plugin.lock_vm(self.vm)?;
        let stream = vm
            .store
            .data_mut()
            .streams
            .get_mut(&self.context_id)
            .filter(|s| !s.finished);
        let stream = stream.ok_or_else(|| self.finished_error())?;
        stream.properties.insert(property_key(path), value);
        Ok(())
    }

    /// An Envoy filter state object the filter set with the `set_envoy_filter_state` foreign
    /// function (e.g. `envoy.network.transport_socket.original_dst_address`).
    pub fn filter_state(&self, name: &str) -> Option<Vec<u8>> {
        self.with_state(|s| s.filter_state.get(name).cloned())
    }

    /// A per-stream property (set by the test or the filter).
    pub fn property(&self, path: &[&str]) -> Option<Vec<u8>> {
        let key = property_key(path);
        self.with_state(|s| s.properties.get(&key).cloned())
    }

    /// Headers to either direction, as a map (the filter chain's entry point).
    pub(crate) fn send_headers_map(
        &self,
        side: Side,
        headers: HeaderMap,
        end_of_stream: bool,
    ) -> Result<Action> {
        self.drive(|vm, id| vm.send_headers(id, side, headers, end_of_stream))
    }

    /// A body chunk to either direction.
    pub(crate) fn send_body_on(
        &self,
        side: Side,
        chunk: &[u8],
        end_of_stream: bool,
    ) -> Result<Action> {
        self.drive(|vm, id| vm.send_body(id, side, chunk, end_of_stream))
    }

    fn send_trailers_on(&self, side: Side, trailers: &[(&str, &str)]) -> Result<Action> {
        let trailers = HeaderMap::from_pairs(trailers.iter().copied());
        self.drive(|vm, id| vm.send_trailers(id, side, trailers))
    }

    fn send_whole(&self, side: Side, headers: &[(&str, &str)], body: &[u8]) -> Result<Action> {
        let headers = HeaderMap::from_pairs(headers.iter().copied());
        let action = self.send_headers_map(side, headers, body.is_empty())?;
        if body.is_empty() {
            return Ok(action);
        }
        self.send_body_on(side, body, true)
    }

    /// Envoy's end of a stream in a filter chain, first half: `proxy_on_log`.
    pub(crate) fn log_phase(&self) -> Result<()> {
        self.drive(|vm, id| vm.log_stream(id))
    }

    /// Second half: `proxy_on_done`, `proxy_on_delete`; the handle is finished afterwards.
    pub(crate) fn destroy(&self) -> Result<()> {
        self.end(VmInstance::destroy_stream)
    }

    /// Ends the context with `op`; the handle keeps the final state.
    fn end(&self, op: fn(&mut VmInstance, u32) -> Result<StreamState>) -> Result<()> {
        if self.finished.get().is_some() {
            return Err(self.finished_error());
        }
        let state = self.plugin.with_vm(self.vm, |vm| op(vm, self.context_id))?;
        // A second end racing on another thread would have failed in `op`.
        let _ = self.finished.set(state);
        Ok(())
    }

    fn drive<R>(&self, op: impl FnOnce(&mut VmInstance, u32) -> Result<R>) -> Result<R> {
        if self.finished.get().is_some() {
            return Err(self.finished_error());
        }
        self.plugin.with_vm(self.vm, |vm| op(vm, self.context_id))
    }

    pub(crate) fn with_state<R>(&self, read: impl FnOnce(&StreamState) -> R) -> R {
        if let Some(state) = self.finished.get() {
            return read(state);
        }
        let id = self.context_id;
        self.plugin
            .read_context(self.vm, |state| state.streams.get(&id), read)
    }

    fn finished_error(&self) -> Error {
        Error::StreamFinished {
            vm: self.vm,
            context_id: self.context_id,
        }
    }
}
