//! Stream control (local replies, continue, close) and HTTP callouts.

use std::time::Duration;

use wasmtime::{Caller, Linker};

use super::memory::{read, read_string, write_u32};
use super::{env_fn, to_status, AbiResult};
use crate::http::callouts::HttpCall;
use crate::http::headers::HeaderMap;
use crate::http::state::LocalReply;
use crate::http::state::StreamEvent;
use crate::net::state::ConnectionEvent;
use crate::plugin::logs::LogSource;
use crate::types::{LogLevel, Status, StreamType};
use crate::vm::callout_ids::CalloutKind;
use crate::vm::state::VmState;

type Ctx<'a> = Caller<'a, VmState>;

pub(super) fn add_to_linker(linker: &mut Linker<VmState>) -> wasmtime::Result<()> {
    linker.func_wrap(
        "env",
        "proxy_send_local_response",
        |mut caller: Ctx<'_>,
         status: i32,
         details_ptr: i32,
         details_size: i32,
         body_ptr: i32,
         body_size: i32,
         headers_ptr: i32,
         headers_size: i32,
         grpc_status: i32| {
            caller
                .data_mut()
                .note_host_call("proxy_send_local_response");
            let args = LocalReplyArgs {
                status: status as u32,
                details: (details_ptr as u32, details_size as u32),
                body: (body_ptr as u32, body_size as u32),
                headers: (headers_ptr as u32, headers_size as u32),
                grpc_status,
            };
            to_status(send_local_response(&mut caller, args))
        },
    )?;
    env_fn!(linker, "proxy_continue_stream" => continue_stream(stream));
    // ABI 0.1.0 names Envoy still links.
    linker.func_wrap("env", "proxy_continue_request", |mut caller: Ctx<'_>| {
        caller.data_mut().note_host_call("proxy_continue_request");
        to_status(continue_stream(&mut caller, StreamType::HttpRequest as u32))
    })?;
    linker.func_wrap("env", "proxy_continue_response", |mut caller: Ctx<'_>| {
        caller.data_mut().note_host_call("proxy_continue_response");
        to_status(continue_stream(
            &mut caller,
            StreamType::HttpResponse as u32,
        ))
    })?;
    linker.func_wrap("env", "proxy_clear_route_cache", |mut caller: Ctx<'_>| {
        caller.data_mut().note_host_call("proxy_clear_route_cache");
        Status::Ok as i32
    })?;
    env_fn!(linker, "proxy_close_stream" => close_stream(stream));
    env_fn!(linker, "proxy_http_call" => http_call(
        upstream_ptr, upstream_size, headers_ptr, headers_size, body_ptr, body_size, trailers_ptr,
        trailers_size, timeout, token_ptr));
    Ok(())
}

struct LocalReplyArgs {
    status: u32,
    details: (u32, u32),
    body: (u32, u32),
    headers: (u32, u32),
    grpc_status: i32,
}

/// Records the reply; the harness applies it after the guest call returns, as Envoy does with
/// its after-VM-call action. From a root context (no stream) it does nothing, as in Envoy.
fn send_local_response(caller: &mut Ctx<'_>, args: LocalReplyArgs) -> AbiResult {
    let details = read_string(caller, args.details.0, args.details.1)?;
    let body = read(caller, args.body.0, args.body.1)?;
    let headers = read(caller, args.headers.0, args.headers.1)?;
    let headers = HeaderMap::decode(&headers).map_err(|_| Status::BadArgument)?;
    let reply = LocalReply {
        status: args.status,
        details,
        body,
        headers,
        grpc_status: u32::try_from(args.grpc_status).ok(),
    };
    let state = caller.data_mut();
    let context = state.effective;
    let Some(stream) = state.stream_mut() else {
        return Ok(());
    };
    stream.events.push(StreamEvent::LocalReply(reply.status));
    if stream.pending_reply.is_some() || stream.local_reply.is_some() {
        let message = format!(
            "context {context}: a second local reply ({}) was ignored",
            reply.status
        );
        state.log(LogLevel::Warn, LogSource::Host, message);
        return Ok(());
    }
    stream.pending_reply = Some(reply);
    state.local_replies.push(context);
    Ok(())
}

/// Lets held headers and buffered body go on. Like Envoy, the guest loses access to that
/// direction's headers. `DOWNSTREAM` continues reading a connection after the guest call
/// (a no-op outside a network context), `UPSTREAM` is `Unimplemented`, as in Envoy.
fn continue_stream(caller: &mut Ctx<'_>, stream: u32) -> AbiResult {
    let kind = match StreamType::from_raw(stream) {
        Some(kind @ (StreamType::HttpRequest | StreamType::HttpResponse)) => kind,
        Some(StreamType::Downstream) => {
            let state = caller.data_mut();
            let context = state.effective;
            if let Some(connection) = state.connection_mut() {
                connection.events.push(ConnectionEvent::Continued);
                connection.pending_continue = true;
                state.connection_actions.push(context);
            }
            return Ok(());
        }
        Some(StreamType::Upstream) => return Err(Status::Unimplemented.into()),
        None => return Err(Status::BadArgument.into()),
    };
    if let Some(stream) = caller.data_mut().stream_mut() {
        stream.events.push(StreamEvent::Continued(kind));
        if let Some(direction) = stream.direction_mut(kind) {
            if !direction.closed {
                direction.pass_on();
            }
            direction.headers_live = false;
        }
    }
    Ok(())
}

/// Resets an HTTP stream (no more callbacks in either direction), or closes a network
/// context's connection after the guest call (`DOWNSTREAM` and `UPSTREAM` alike, as Envoy);
/// a type that does not match the context is a no-op `Ok`, as in Envoy.
fn close_stream(caller: &mut Ctx<'_>, stream: u32) -> AbiResult {
    let kind = StreamType::from_raw(stream).ok_or(Status::BadArgument)?;
    let state = caller.data_mut();
    if matches!(kind, StreamType::Downstream | StreamType::Upstream) {
        let context = state.effective;
        if let Some(connection) = state.connection_mut() {
            connection.events.push(ConnectionEvent::Closed(kind));
            connection.pending_close = true;
            state.connection_actions.push(context);
        }
        return Ok(());
    }
    if let Some(stream) = state.stream_mut() {
        stream.events.push(StreamEvent::Closed(kind));
        stream.request.closed = true;
        stream.response.closed = true;
    }
    Ok(())
}

/// Records the call for the test to answer. As in Envoy: a negative timeout, an unknown cluster
/// (when the plugin lists its clusters) or missing `:method`, `:path` or `:authority` is
/// `BadArgument`.
#[allow(clippy::too_many_arguments)]
fn http_call(
    caller: &mut Ctx<'_>,
    upstream_ptr: u32,
    upstream_size: u32,
    headers_ptr: u32,
    headers_size: u32,
    body_ptr: u32,
    body_size: u32,
    trailers_ptr: u32,
    trailers_size: u32,
    timeout: u32,
    token_ptr: u32,
) -> AbiResult {
    let upstream = read_string(caller, upstream_ptr, upstream_size)?;
    let headers = HeaderMap::decode(&read(caller, headers_ptr, headers_size)?)
        .map_err(|_| Status::BadArgument)?;
    let body = read(caller, body_ptr, body_size)?;
    let trailers = HeaderMap::decode(&read(caller, trailers_ptr, trailers_size)?)
        .map_err(|_| Status::BadArgument)?;
    if (timeout as i32) < 0 {
        return Err(Status::BadArgument.into());
    }
    let state = caller.data_mut();
    if state
        .shared
        .config
        .clusters
        .as_ref()
        .is_some_and(|known| !known.contains(&upstream))
    {
        return Err(Status::BadArgument.into());
    }
    if ![":method", ":path", ":authority"]
        .iter()
        .all(|name| headers.contains(name))
    {
        return Err(Status::BadArgument.into());
    }
    let token = state.take_token(CalloutKind::Http);
    let call = HttpCall {
        vm: state.vm,
        context_id: state.effective,
        token,
        upstream,
        headers,
        body,
        trailers,
        timeout: Duration::from_millis(u64::from(timeout)),
    };
    let shared = state.shared.clone();
    write_u32(caller, token_ptr, token)?;
    match shared.config.upstreams.get(&call.upstream) {
        Some(&address) => {
            shared.lock().real_calls.push(call.clone());
            crate::http::upstream::spawn(call, address, shared.finished_sender());
        }
        None => shared.lock().http_calls.push(call),
    }
    Ok(())
}
