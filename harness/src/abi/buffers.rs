//! `proxy_get_buffer_bytes` / `proxy_set_buffer_bytes`.

use wasmtime::{Caller, Linker};

use super::memory::{copy_out, read, write_u32};
use super::{env_fn, AbiResult};
use crate::types::{BufferType, Status};
use crate::vm::state::VmState;

type Ctx<'a> = Caller<'a, VmState>;

pub(super) fn add_to_linker(linker: &mut Linker<VmState>) -> wasmtime::Result<()> {
    env_fn!(linker, "proxy_get_buffer_bytes" =>
        get_buffer_bytes(kind, start, max_size, ptr_ptr, size_ptr));
    env_fn!(linker, "proxy_set_buffer_bytes" =>
        set_buffer_bytes(kind, start, size, data_ptr, data_size));
    env_fn!(linker, "proxy_get_buffer_status" => get_buffer_status(kind, length_ptr, flags_ptr));
    Ok(())
}

/// The buffer a type names for the current context: `None` is `NotFound` (Envoy's null buffer).
/// Body buffers always exist and are empty when no body is in flight.
fn buffer(state: &VmState, kind: BufferType) -> Option<&[u8]> {
    const EMPTY: &[u8] = &[];
    match kind {
        BufferType::VmConfiguration => Some(&state.shared.config.vm_configuration),
        BufferType::PluginConfiguration => state
            .configuring
            .then_some(&state.shared.config.configuration[..]),
        BufferType::HttpRequestBody => Some(state.stream().map_or(EMPTY, |s| &s.request.body)),
        BufferType::HttpResponseBody => Some(state.stream().map_or(EMPTY, |s| &s.response.body)),
        BufferType::HttpCallResponseBody => state.http_response.as_ref().map(|r| &r.body[..]),
        BufferType::GrpcReceiveBuffer => Some(state.grpc_receive.as_deref().unwrap_or(EMPTY)),
        // Envoy's pointer to the connection's data: outside its lifetime an empty buffer.
        BufferType::DownstreamData => {
            Some(state.connection().map_or(EMPTY, |c| c.downstream.held()))
        }
        BufferType::UpstreamData => Some(state.connection().map_or(EMPTY, |c| c.upstream.held())),
        // Envoy sets it for the host's call of `proxy_on_foreign_function` only.
        BufferType::CallData => state.call_data.as_deref(),
    }
}

fn get_buffer_bytes(
    caller: &mut Ctx<'_>,
    kind: u32,
    start: u32,
    max_size: u32,
    ptr_ptr: u32,
    size_ptr: u32,
) -> AbiResult {
    let kind = BufferType::from_raw(kind).ok_or(Status::BadArgument)?;
    let bytes = {
        let buffer = buffer(caller.data(), kind).ok_or(Status::NotFound)?;
        let start = (start as usize).min(buffer.len());
        let end = start.saturating_add(max_size as usize).min(buffer.len());
        buffer[start..end].to_vec()
    };
    // Like Envoy, an empty range returns Ok without touching the return slots.
    if bytes.is_empty() {
        return Ok(());
    }
    copy_out(caller, &bytes, ptr_ptr, size_ptr)
}

/// The buffer's size and flags (always 0), as Envoy answers it.
fn get_buffer_status(
    caller: &mut Ctx<'_>,
    kind: u32,
    length_ptr: u32,
    flags_ptr: u32,
) -> AbiResult {
    let kind = BufferType::from_raw(kind).ok_or(Status::BadArgument)?;
    let length = buffer(caller.data(), kind).ok_or(Status::NotFound)?.len();
    write_u32(
        caller,
        length_ptr,
        u32::try_from(length).unwrap_or(u32::MAX),
    )?;
    write_u32(caller, flags_ptr, 0)?;
    Ok(())
}

/// The buffer a type names if the guest may change it now: the stream's bodies, the gRPC
/// message during `proxy_on_grpc_receive` (Envoy hands over the received buffer itself), a
/// connection's data from its callback until the filter lets it go.
/// Everything else is Envoy's immutable or null buffer: `BadArgument`.
fn writable(state: &mut VmState, kind: BufferType) -> Option<&mut Vec<u8>> {
    match kind {
        BufferType::HttpRequestBody => state.stream_mut().map(|s| &mut s.request.body),
        BufferType::HttpResponseBody => state.stream_mut().map(|s| &mut s.response.body),
        BufferType::GrpcReceiveBuffer => state.grpc_receive.as_mut(),
        BufferType::DownstreamData => state
            .connection_mut()
            .filter(|c| c.downstream.live)
            .map(|c| &mut c.downstream.buffer),
        BufferType::UpstreamData => state
            .connection_mut()
            .filter(|c| c.upstream.live)
            .map(|c| &mut c.upstream.buffer),
        _ => None,
    }
}

/// Envoy's `Buffer::copyFrom` for mutable buffers: at start 0, the first `size` bytes (all of
/// them if `size` is larger) are dropped and the data is prepended, so size 0 prepends and a
/// size covering the whole buffer replaces it; a start at or past the end appends; anything
/// else is `BadArgument`.
fn set_buffer_bytes(
    caller: &mut Ctx<'_>,
    kind: u32,
    start: u32,
    size: u32,
    data_ptr: u32,
    data_size: u32,
) -> AbiResult {
    let kind = BufferType::from_raw(kind).ok_or(Status::BadArgument)?;
    let data = read(caller, data_ptr, data_size)?;
    let body = writable(caller.data_mut(), kind).ok_or(Status::BadArgument)?;
    let (start, size) = (start as usize, size as usize);
    if start == 0 {
        let drained = size.min(body.len());
        body.splice(0..drained, data);
    } else if start >= body.len() {
        body.extend_from_slice(&data);
    } else {
        return Err(Status::BadArgument.into());
    }
    Ok(())
}
