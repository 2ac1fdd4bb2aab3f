//! Properties and foreign functions.
//!
//! A property path arrives as the SDK serializes it: segments joined by `\0`. Lookup order:
//! the stream's own properties (set by the test or by `proxy_set_property`), the plugin-wide
//! ones, then a few Envoy attributes derived from the stream's headers (`request.path`,
//! `request.url_path`, `request.host`, `request.method`, `request.scheme`, `request.id`,
//! `response.code` as an 8-byte little-endian integer) and the plugin's `plugin_name`,
//! `plugin_root_id`, `plugin_vm_id`. Anything else is `NotFound`.

use wasmtime::{Caller, Linker};

use super::memory::{copy_out, read, read_string};
use super::{env_fn, AbiResult};
use crate::callouts::ForeignCall;
use crate::stream_state::StreamState;
use crate::types::Status;
use crate::vm_state::VmState;

type Ctx<'a> = Caller<'a, VmState>;

pub(super) fn add_to_linker(linker: &mut Linker<VmState>) -> wasmtime::Result<()> {
    env_fn!(
        linker,
        "proxy_get_property",
        get_property,
        (path_ptr, path_size, ptr_ptr, size_ptr)
    );
    env_fn!(
        linker,
        "proxy_set_property",
        set_property,
        (path_ptr, path_size, value_ptr, value_size)
    );
    env_fn!(
        linker,
        "proxy_call_foreign_function",
        call_foreign_function,
        (name_ptr, name_size, args_ptr, args_size, ptr_ptr, size_ptr)
    );
    Ok(())
}

/// Looks a property up for the VM's effective context.
pub(crate) fn lookup(state: &VmState, path: &[u8]) -> Option<Vec<u8>> {
    let stream = state.stream();
    if let Some(value) = stream.and_then(|s| s.properties.get(path)) {
        return Some(value.clone());
    }
    if let Some(value) = state.shared.lock().properties.get(path) {
        return Some(value.clone());
    }
    if let Some(value) = stream.and_then(|s| derived(s, path)) {
        return Some(value);
    }
    let config = &state.shared.config;
    match path {
        b"plugin_name" => Some(config.name.clone().into_bytes()),
        b"plugin_root_id" => Some(config.root_id.clone().into_bytes()),
        b"plugin_vm_id" => Some(config.vm_id.clone().into_bytes()),
        _ => None,
    }
}

/// Attributes Envoy computes from the stream's headers.
fn derived(stream: &StreamState, path: &[u8]) -> Option<Vec<u8>> {
    let request = |name: &str| {
        stream
            .request
            .headers
            .get(name)
            .map(|v| v.as_bytes().to_vec())
    };
    match path {
        b"request\0path" => request(":path"),
        b"request\0url_path" => {
            let path = stream.request.headers.get(":path")?;
            Some(path.split('?').next().unwrap_or(path).as_bytes().to_vec())
        }
        b"request\0host" => request(":authority"),
        b"request\0method" => request(":method"),
        b"request\0scheme" => request(":scheme"),
        b"request\0id" => request("x-request-id"),
        b"response\0code" => {
            let code: i64 = stream.response.headers.get(":status")?.parse().ok()?;
            Some(code.to_le_bytes().to_vec())
        }
        _ => None,
    }
}

fn get_property(
    caller: &mut Ctx<'_>,
    path_ptr: u32,
    path_size: u32,
    ptr_ptr: u32,
    size_ptr: u32,
) -> AbiResult {
    let path = read(caller, path_ptr, path_size)?;
    let value = lookup(caller.data(), &path).ok_or(Status::NotFound)?;
    copy_out(caller, &value, ptr_ptr, size_ptr)
}

/// Stores a property on the effective stream, or plugin-wide from a root context.
fn set_property(
    caller: &mut Ctx<'_>,
    path_ptr: u32,
    path_size: u32,
    value_ptr: u32,
    value_size: u32,
) -> AbiResult {
    let path = read(caller, path_ptr, path_size)?;
    let value = read(caller, value_ptr, value_size)?;
    let state = caller.data_mut();
    match state.stream_mut() {
        Some(stream) => {
            stream.properties.insert(path, value);
        }
        None => {
            state.shared.lock().properties.insert(path, value);
        }
    }
    Ok(())
}

fn call_foreign_function(
    caller: &mut Ctx<'_>,
    name_ptr: u32,
    name_size: u32,
    args_ptr: u32,
    args_size: u32,
    ptr_ptr: u32,
    size_ptr: u32,
) -> AbiResult {
    let name = read_string(caller, name_ptr, name_size)?;
    let arguments = read(caller, args_ptr, args_size)?;
    let state = caller.data();
    let shared = state.shared.clone();
    shared.lock().foreign_calls.push(ForeignCall {
        vm: state.vm,
        context_id: state.effective,
        name: name.clone(),
        arguments: arguments.clone(),
    });
    let result = {
        let mut functions = shared.foreign();
        let function = functions.get_mut(&name).ok_or(Status::NotFound)?;
        function(&arguments)?
    };
    copy_out(caller, &result, ptr_ptr, size_ptr)
}
