//! HTTP callouts (`proxy_http_call`): the records a test answers, the responses it feeds back,
//! and their delivery to the guest (`proxy_on_http_call_response`).

use std::sync::mpsc::RecvTimeoutError;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::http::headers::HeaderMap;
use crate::plugin::Plugin;
use crate::types::Status;
use crate::vm::{size_u32, VmInstance};

/// An HTTP callout a filter made with `proxy_http_call`, waiting for the test to answer it with
/// [`crate::Plugin::respond_http_call`] or [`crate::Plugin::fail_http_call`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpCall {
    /// The VM that made the call; the response goes back to it.
    pub vm: usize,
    /// The context (root or stream) that made the call.
    pub context_id: u32,
    /// The token `proxy_http_call` returned.
    pub token: u32,
    /// The upstream cluster name.
    pub upstream: String,
    pub headers: HeaderMap,
    pub body: Vec<u8>,
    pub trailers: HeaderMap,
    pub timeout: Duration,
}

impl HttpCall {
    /// The `:path` header.
    pub fn path(&self) -> Option<&str> {
        self.headers.get(":path")
    }

    /// The `:method` header.
    pub fn method(&self) -> Option<&str> {
        self.headers.get(":method")
    }
}

/// A response the test delivers to an [`HttpCall`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HttpResponse {
    pub headers: HeaderMap,
    pub body: Vec<u8>,
    pub trailers: HeaderMap,
}

impl HttpResponse {
    /// A response with just a `:status` header.
    pub fn new(status: u16) -> HttpResponse {
        HttpResponse {
            headers: HeaderMap::from_pairs([(":status", status.to_string())]),
            ..HttpResponse::default()
        }
    }

    /// Adds a header.
    pub fn header(mut self, name: &str, value: &str) -> HttpResponse {
        self.headers.add(name, value);
        self
    }

    /// Sets the body.
    pub fn body(mut self, body: impl Into<Vec<u8>>) -> HttpResponse {
        self.body = body.into();
        self
    }

    /// Adds a trailer.
    pub fn trailer(mut self, name: &str, value: &str) -> HttpResponse {
        self.trailers.add(name, value);
        self
    }
}

impl VmInstance {
    /// Delivers a callout's response (`None`: the call failed, as on a reset) to the context that
    /// made it. During the callback the response maps and body are readable and
    /// `proxy_get_status` reports the outcome.
    pub fn http_call_response(
        &mut self,
        call: &HttpCall,
        response: Option<HttpResponse>,
    ) -> Result<()> {
        if !self.store.data().is_live_context(call.context_id) {
            return Err(unknown(call));
        }
        let (headers, body, trailers) = response.as_ref().map_or((0, 0, 0), |r| {
            (
                size_u32(r.headers.len()),
                size_u32(r.body.len()),
                size_u32(r.trailers.len()),
            )
        });
        let state = self.store.data_mut();
        state.call_status = match response {
            Some(_) => (Status::Ok as u32, String::new()),
            None => (Status::BrokenConnection as u32, "reset".to_owned()),
        };
        state.http_response = response;
        let args = (call.context_id, call.token, headers, body, trailers);
        let result = self.call(|e| &e.http_call_response, call.context_id, args);
        let state = self.store.data_mut();
        state.http_response = None;
        state.call_status = (Status::Ok as u32, String::new());
        result?;
        self.after_call()
    }
}

impl Plugin {
    /// HTTP callouts waiting for an answer, oldest first.
    pub fn http_calls(&self) -> Vec<HttpCall> {
        self.shared().lock().http_calls.clone()
    }

    /// Answers a callout: `proxy_on_http_call_response` on the VM and context that made it.
    pub fn respond_http_call(&self, call: &HttpCall, response: HttpResponse) -> Result<()> {
        self.finish_http_call(call, Some(response))
    }

    /// Fails a callout (as on a connection reset): the callback sees no headers or body and
    /// `proxy_get_status` reports `BrokenConnection` / "reset".
    pub fn fail_http_call(&self, call: &HttpCall) -> Result<()> {
        self.finish_http_call(call, None)
    }

    /// Real callouts (see [`crate::PluginBuilder::upstream`]) still in flight or not yet
    /// delivered.
    pub fn pending_upstream_calls(&self) -> usize {
        self.shared().lock().real_calls.len()
    }

    /// Delivers the answers of real callouts that have arrived: `proxy_on_http_call_response`
    /// on the VM and context that made each call. Never waits; returns how many were
    /// delivered. An answer for a context that has ended is dropped.
    pub fn deliver_http_responses(&self) -> Result<usize> {
        let mut delivered = 0;
        loop {
            let Ok((call, response)) = self.finished_calls().try_recv() else {
                return Ok(delivered);
            };
            delivered += usize::from(self.deliver_real(&call, response)?);
        }
    }

    /// Waits until every real callout in flight has been answered (or `timeout` passed),
    /// delivering the answers as they come; returns how many were delivered.
    pub fn wait_http_responses(&self, timeout: Duration) -> Result<usize> {
        let deadline = Instant::now() + timeout;
        let mut delivered = self.deliver_http_responses()?;
        while self.pending_upstream_calls() > 0 {
            let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                break;
            };
            match self.finished_calls().recv_timeout(left) {
                Ok((call, response)) => {
                    delivered += usize::from(self.deliver_real(&call, response)?);
                }
                Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected) => break,
            }
        }
        Ok(delivered)
    }

    fn deliver_real(&self, call: &HttpCall, response: Option<HttpResponse>) -> Result<bool> {
        if !take(&mut self.shared().lock().real_calls, call) {
            return Ok(false);
        }
        match self.with_vm(call.vm, |vm| vm.http_call_response(call, response)) {
            Ok(()) => Ok(true),
            // The context that made the call is gone (Envoy cancels its calls).
            Err(Error::UnknownHttpCall { .. } | Error::VmFailed { .. }) => Ok(false),
            Err(e) => Err(e),
        }
    }

    fn finish_http_call(&self, call: &HttpCall, response: Option<HttpResponse>) -> Result<()> {
        if !take(&mut self.shared().lock().http_calls, call) {
            return Err(unknown(call));
        }
        self.with_vm(call.vm, |vm| vm.http_call_response(call, response))
    }
}

/// Removes `call` (by VM and token) from a list of calls; whether it was there.
fn take(calls: &mut Vec<HttpCall>, call: &HttpCall) -> bool {
    let index = calls
        .iter()
        .position(|c| c.vm == call.vm && c.token == call.token);
    index.map(|i| calls.remove(i)).is_some()
}

fn unknown(call: &HttpCall) -> Error {
    Error::UnknownHttpCall {
        vm: call.vm,
        token: call.token,
    }
}
