//! gRPC callouts: `proxy_grpc_call`, `proxy_grpc_stream`, `proxy_grpc_send`,
//! `proxy_grpc_cancel`, `proxy_grpc_close`, with Envoy's statuses (`Context::grpcCall`,
//! `grpcStream`, `grpcSend`, `grpcCancel`, `grpcClose` in `context.cc`).
//!
//! Envoy makes every gRPC callout on the VM's root context, so any context of the VM can send
//! on, cancel or close any token of that VM; the harness keeps them per VM the same way.

use std::time::Duration;

use wasmtime::{Caller, Linker};

use super::memory::{read, write_u32};
use super::{env_fn, AbiResult};
use crate::grpc::{read_service, GrpcCall, GrpcOpening, GrpcStream, GrpcTarget, ServiceArg};
use crate::http::headers::HeaderMap;
use crate::plugin::shared::SharedState;
use crate::types::Status;
use crate::vm::callout_ids::CalloutKind;
use crate::vm::state::VmState;

type Ctx<'a> = Caller<'a, VmState>;

pub(super) fn add_to_linker(linker: &mut Linker<VmState>) -> wasmtime::Result<()> {
    env_fn!(linker, "proxy_grpc_call" => grpc_call(
        service_ptr, service_size, service_name_ptr, service_name_size, method_ptr, method_size,
        metadata_ptr, metadata_size, message_ptr, message_size, timeout, token_ptr));
    env_fn!(linker, "proxy_grpc_stream" => grpc_stream(
        service_ptr, service_size, service_name_ptr, service_name_size, method_ptr, method_size,
        metadata_ptr, metadata_size, token_ptr));
    env_fn!(linker, "proxy_grpc_send" => grpc_send(token, message_ptr, message_size, end_stream));
    env_fn!(linker, "proxy_grpc_cancel" => grpc_cancel(token));
    env_fn!(linker, "proxy_grpc_close" => grpc_close(token));
    Ok(())
}

/// Reads what both calls take and records the opening. As Envoy: a service argument that
/// parses as a `GrpcService` proto is one (naming no target is `BadArgument`, after a token of
/// `kind` was taken); else it is a cluster name, and an unknown one (with
/// `PluginBuilder::clusters`) is `ParseFailure`. Malformed metadata pairs are `BadArgument`
/// (Envoy decodes them as no metadata).
fn opening(
    caller: &mut Ctx<'_>,
    kind: CalloutKind,
    [service, service_name, method, metadata]: [(u32, u32); 4],
) -> Result<GrpcOpening, super::Fail> {
    let service = read(caller, service.0, service.1)?;
    let service_name = read(caller, service_name.0, service_name.1)?;
    let method = read(caller, method.0, method.1)?;
    let metadata = read(caller, metadata.0, metadata.1)?;
    let initial_metadata = HeaderMap::decode(&metadata).map_err(|_| Status::BadArgument)?;
    let (target, service_proto) = match read_service(&service) {
        ServiceArg::Proto(target) => (target, Some(service)),
        ServiceArg::ClusterName(name) => {
            let known = &caller.data().shared.config.clusters;
            if known.as_ref().is_some_and(|k| !k.contains(&name)) {
                return Err(Status::ParseFailure.into());
            }
            (Some(GrpcTarget::Cluster(name)), None)
        }
    };
    let state = caller.data_mut();
    let token = state.take_token(kind);
    Ok(GrpcOpening {
        vm: state.vm,
        context_id: state.effective,
        token,
        target: target.ok_or(Status::BadArgument)?,
        service_proto,
        service_name: String::from_utf8_lossy(&service_name).into_owned(),
        method: String::from_utf8_lossy(&method).into_owned(),
        initial_metadata,
    })
}

/// Writes the token back, then records the callout (a token that cannot be written back
/// records nothing: the guest never learns of the call).
fn record(
    caller: &mut Ctx<'_>,
    token_ptr: u32,
    token: u32,
    push: impl FnOnce(&mut SharedState),
) -> AbiResult {
    let shared = caller.data().shared.clone();
    write_u32(caller, token_ptr, token)?;
    push(&mut shared.lock());
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn grpc_call(
    caller: &mut Ctx<'_>,
    service_ptr: u32,
    service_size: u32,
    service_name_ptr: u32,
    service_name_size: u32,
    method_ptr: u32,
    method_size: u32,
    metadata_ptr: u32,
    metadata_size: u32,
    message_ptr: u32,
    message_size: u32,
    timeout: u32,
    token_ptr: u32,
) -> AbiResult {
    let message = read(caller, message_ptr, message_size)?;
    let opened = [
        (service_ptr, service_size),
        (service_name_ptr, service_name_size),
        (method_ptr, method_size),
        (metadata_ptr, metadata_size),
    ];
    let opening = opening(caller, CalloutKind::GrpcCall, opened)?;
    let token = opening.token;
    let call = GrpcCall {
        opening,
        message,
        timeout: Duration::from_millis(u64::from(timeout)),
    };
    record(caller, token_ptr, token, |shared| {
        shared.grpc_calls.push(call)
    })
}

/// `proxy_grpc_stream`: the arguments of `proxy_grpc_call` up to the metadata, then the token.
#[allow(clippy::too_many_arguments)]
fn grpc_stream(
    caller: &mut Ctx<'_>,
    service_ptr: u32,
    service_size: u32,
    service_name_ptr: u32,
    service_name_size: u32,
    method_ptr: u32,
    method_size: u32,
    metadata_ptr: u32,
    metadata_size: u32,
    token_ptr: u32,
) -> AbiResult {
    let opened = [
        (service_ptr, service_size),
        (service_name_ptr, service_name_size),
        (method_ptr, method_size),
        (metadata_ptr, metadata_size),
    ];
    let opening = opening(caller, CalloutKind::GrpcStream, opened)?;
    let token = opening.token;
    let stream = GrpcStream {
        opening,
        messages: Vec::new(),
        half_closed: false,
        local_closed: false,
        remote_closed: false,
    };
    record(caller, token_ptr, token, |shared| {
        shared.grpc_streams.push(stream)
    })
}

/// Envoy's `grpcSend`: only stream tokens (`BadArgument` otherwise); `NotFound` for a stream
/// that is gone (cancelled, or closed on both sides). A stream the remote side closed but the
/// filter has not still takes messages (`Ok`), as in Envoy.
fn grpc_send(
    caller: &mut Ctx<'_>,
    token: u32,
    message_ptr: u32,
    message_size: u32,
    end_stream: u32,
) -> AbiResult {
    let message = read(caller, message_ptr, message_size)?;
    if CalloutKind::of(token) != Some(CalloutKind::GrpcStream) {
        return Err(Status::BadArgument.into());
    }
    let vm = caller.data().vm;
    let mut state = caller.data().shared.lock();
    let stream = state
        .grpc_streams
        .iter_mut()
        .find(|s| s.vm == vm && s.token == token)
        .ok_or(Status::NotFound)?;
    stream.messages.push(message);
    if end_stream != 0 {
        stream.half_closed = true;
    }
    Ok(())
}

/// Envoy's `grpcCancel`: a call is cancelled, a stream reset; either is forgotten at once and
/// gets no more callbacks. `NotFound` for an unknown call or stream token, `BadArgument` for a
/// token that is neither.
fn grpc_cancel(caller: &mut Ctx<'_>, token: u32) -> AbiResult {
    let vm = caller.data().vm;
    let mut state = caller.data().shared.lock();
    match CalloutKind::of(token) {
        Some(CalloutKind::GrpcCall) => {
            let index = state
                .grpc_calls
                .iter()
                .position(|c| c.vm == vm && c.token == token)
                .ok_or(Status::NotFound)?;
            state.grpc_calls.remove(index);
        }
        Some(CalloutKind::GrpcStream) => {
            let index = state
                .grpc_streams
                .iter()
                .position(|s| s.vm == vm && s.token == token)
                .ok_or(Status::NotFound)?;
            state.grpc_streams.remove(index);
        }
        _ => return Err(Status::BadArgument.into()),
    }
    Ok(())
}

/// Envoy's `grpcClose`: a call is cancelled (as `grpcCancel`); a stream is half-closed by the
/// filter and forgotten if the remote side already closed, else it keeps receiving until the
/// remote close.
fn grpc_close(caller: &mut Ctx<'_>, token: u32) -> AbiResult {
    if CalloutKind::of(token) != Some(CalloutKind::GrpcStream) {
        return grpc_cancel(caller, token);
    }
    let vm = caller.data().vm;
    let mut state = caller.data().shared.lock();
    let index = state
        .grpc_streams
        .iter()
        .position(|s| s.vm == vm && s.token == token)
        .ok_or(Status::NotFound)?;
    let stream = &mut state.grpc_streams[index];
    stream.half_closed = true;
    stream.local_closed = true;
    if stream.remote_closed {
        state.grpc_streams.remove(index);
    }
    Ok(())
}
