//! The `proxy_*_header_map_*` calls.
//!
//! Availability follows Envoy's `Context::getMap` / `getConstMap`: a stream's headers are
//! reachable from their callback until the filter lets them go (see `Direction::headers_live`),
//! during `proxy_on_log` the request and response headers are readable, and the HTTP callout
//! response maps exist (read-only) only inside `proxy_on_http_call_response`, the gRPC
//! metadata maps (read-only) only inside their `proxy_on_grpc_receive_*_metadata` callback.
//! Reading a map that is not there lists no pairs, and getting a value from it is
//! `BadArgument`; changing it is `BadArgument` (which the Rust SDK turns into a panic, as in
//! Envoy).

use wasmtime::{Caller, Linker};

use super::memory::{copy_out, read, read_string, write_u32};
use super::{env_fn, AbiResult};
use crate::http::headers::HeaderMap;
use crate::types::{MapType, Status};
use crate::vm::state::VmState;

type Ctx<'a> = Caller<'a, VmState>;

pub(super) fn add_to_linker(linker: &mut Linker<VmState>) -> wasmtime::Result<()> {
    env_fn!(linker, "proxy_get_header_map_pairs" => get_pairs(kind, ptr_ptr, size_ptr));
    env_fn!(linker, "proxy_set_header_map_pairs" => set_pairs(kind, ptr, size));
    env_fn!(linker, "proxy_get_header_map_value" =>
        get_value(kind, key_ptr, key_size, ptr_ptr, size_ptr));
    env_fn!(linker, "proxy_add_header_map_value" =>
        set_value(kind, key_ptr, key_size, value_ptr, value_size; HeaderMap::add));
    env_fn!(linker, "proxy_replace_header_map_value" =>
        set_value(kind, key_ptr, key_size, value_ptr, value_size; HeaderMap::replace));
    env_fn!(linker, "proxy_remove_header_map_value" => remove_value(kind, key_ptr, key_size));
    env_fn!(linker, "proxy_get_header_map_size" => get_size(kind, size_ptr));
    Ok(())
}

fn map_type(raw: u32) -> Result<MapType, Status> {
    MapType::from_raw(raw).ok_or(Status::BadArgument)
}

/// The map the guest may read, or `None` if Envoy would have no map there.
fn readable(state: &VmState, kind: MapType) -> Option<&HeaderMap> {
    match kind {
        MapType::HttpCallResponseHeaders => state.http_response.as_ref().map(|r| &r.headers),
        MapType::HttpCallResponseTrailers => state.http_response.as_ref().map(|r| &r.trailers),
        MapType::GrpcReceiveInitialMetadata => state.grpc_initial_metadata.as_ref(),
        MapType::GrpcReceiveTrailingMetadata => state.grpc_trailing_metadata.as_ref(),
        MapType::HttpRequestHeaders => {
            let s = state.stream()?;
            (s.request.headers_live || s.in_log).then_some(&s.request.headers)
        }
        MapType::HttpRequestTrailers => {
            let s = state.stream()?;
            s.request.trailers_live.then_some(&s.request.trailers)
        }
        MapType::HttpResponseHeaders => {
            let s = state.stream()?;
            (s.response.headers_live || s.in_log).then_some(&s.response.headers)
        }
        MapType::HttpResponseTrailers => {
            let s = state.stream()?;
            (s.response.trailers_live || s.in_log).then_some(&s.response.trailers)
        }
    }
}

/// The map the guest may change, or `None`.
fn writable(state: &mut VmState, kind: MapType) -> Option<&mut HeaderMap> {
    let s = state.stream_mut()?;
    match kind {
        MapType::HttpRequestHeaders => s.request.headers_live.then_some(&mut s.request.headers),
        MapType::HttpRequestTrailers => s.request.trailers_live.then_some(&mut s.request.trailers),
        MapType::HttpResponseHeaders => s.response.headers_live.then_some(&mut s.response.headers),
        MapType::HttpResponseTrailers => {
            s.response.trailers_live.then_some(&mut s.response.trailers)
        }
        _ => None,
    }
}

fn get_pairs(caller: &mut Ctx<'_>, kind: u32, ptr_ptr: u32, size_ptr: u32) -> AbiResult {
    let kind = map_type(kind)?;
    let encoded = match readable(caller.data(), kind) {
        Some(map) if !map.is_empty() => map.encode(),
        _ => Vec::new(),
    };
    copy_out(caller, &encoded, ptr_ptr, size_ptr)
}

fn set_pairs(caller: &mut Ctx<'_>, kind: u32, ptr: u32, size: u32) -> AbiResult {
    let kind = map_type(kind)?;
    let bytes = read(caller, ptr, size)?;
    let decoded = HeaderMap::decode(&bytes).map_err(|_| Status::BadArgument)?;
    let map = writable(caller.data_mut(), kind).ok_or(Status::BadArgument)?;
    *map = decoded;
    Ok(())
}

fn get_value(
    caller: &mut Ctx<'_>,
    kind: u32,
    key_ptr: u32,
    key_size: u32,
    ptr_ptr: u32,
    size_ptr: u32,
) -> AbiResult {
    let kind = map_type(kind)?;
    let key = read_string(caller, key_ptr, key_size)?;
    let value = {
        let map = readable(caller.data(), kind).ok_or(Status::BadArgument)?;
        map.get(&key).ok_or(Status::NotFound)?.to_owned()
    };
    copy_out(caller, value.as_bytes(), ptr_ptr, size_ptr)
}

/// `proxy_add_header_map_value` (`op` = add) and `proxy_replace_header_map_value` (replace).
fn set_value(
    caller: &mut Ctx<'_>,
    kind: u32,
    key_ptr: u32,
    key_size: u32,
    value_ptr: u32,
    value_size: u32,
    op: fn(&mut HeaderMap, &str, &str),
) -> AbiResult {
    let value = Some((value_ptr, value_size));
    change(caller, kind, (key_ptr, key_size), value, op)
}

fn remove_value(caller: &mut Ctx<'_>, kind: u32, key_ptr: u32, key_size: u32) -> AbiResult {
    change(caller, kind, (key_ptr, key_size), None, |map, key, _| {
        map.remove(key)
    })
}

/// Reads the map type, the key and the value (if the call has one; else empty), then applies
/// `op` to the map if it is writable (else `BadArgument`).
fn change(
    caller: &mut Ctx<'_>,
    kind: u32,
    (key_ptr, key_size): (u32, u32),
    value: Option<(u32, u32)>,
    op: impl FnOnce(&mut HeaderMap, &str, &str),
) -> AbiResult {
    let kind = map_type(kind)?;
    let key = read_string(caller, key_ptr, key_size)?;
    let value = match value {
        Some((ptr, size)) => read_string(caller, ptr, size)?,
        None => String::new(),
    };
    let map = writable(caller.data_mut(), kind).ok_or(Status::BadArgument)?;
    op(map, &key, &value);
    Ok(())
}

fn get_size(caller: &mut Ctx<'_>, kind: u32, size_ptr: u32) -> AbiResult {
    let kind = map_type(kind)?;
    let size = writable(caller.data_mut(), kind)
        .ok_or(Status::BadArgument)?
        .byte_size();
    write_u32(caller, size_ptr, u32::try_from(size).unwrap_or(u32::MAX))?;
    Ok(())
}
