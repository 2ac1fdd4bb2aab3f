//! Properties and foreign functions.
//!
//! A property path arrives as the SDK serializes it: segments joined by `\0`. Lookup order:
//! the stream's own properties (set by the test or by `proxy_set_property`), the plugin-wide
//! ones, then Envoy attributes derived from the stream, encoded as Envoy encodes CEL values
//! (strings as bytes, integers and timestamps as 8-byte little-endian, maps as serialized
//! pairs):
//!
//! * `request.path`, `url_path`, `host`, `method`, `scheme`, `id` (`x-request-id`), `referer`,
//!   `useragent`, `query`, `headers` (pairs), `time` (ns, when the context was created),
//!   `size` (`content-length`, else the body seen);
//! * `response.code`, `code_details` (a local reply's details), `headers`, `trailers`, `size`;
//! * `source.port`, `destination.port`, `upstream.port`, from the `*.address` property the
//!   embedder set (e.g. `upstream.address` once the upstream is chosen);
//! * `filter_state.<name>`: what the filter stored with `set_envoy_filter_state`;
//! * `plugin_name`, `plugin_root_id`, `plugin_vm_id`.
//!
//! Anything else is `NotFound`.
//!
//! Foreign functions: a test-provided function of the name wins; otherwise Envoy's
//! `set_envoy_filter_state` (protobuf `SetEnvoyFilterStateArguments`: path = 1, value = 2,
//! span = 3; stored on the stream, `NotFound` from a root context, `BadArgument` when the
//! arguments do not decode) and `clear_route_cache` (a no-op) are built in.

use wasmtime::{Caller, Linker};

use super::memory::{copy_out, read, read_string};
use super::{env_fn, AbiResult};
use crate::http::state::StreamState;
use crate::plugin::foreign::ForeignCall;
use crate::types::Status;
use crate::vm::state::VmState;

type Ctx<'a> = Caller<'a, VmState>;

pub(super) fn add_to_linker(linker: &mut Linker<VmState>) -> wasmtime::Result<()> {
    env_fn!(linker, "proxy_get_property" => get_property(path_ptr, path_size, ptr_ptr, size_ptr));
    env_fn!(linker, "proxy_set_property" =>
        set_property(path_ptr, path_size, value_ptr, value_size));
    env_fn!(linker, "proxy_call_foreign_function" =>
        call_foreign_function(name_ptr, name_size, args_ptr, args_size, ptr_ptr, size_ptr));
    Ok(())
}

/// Looks a property up for the VM's effective context.
pub(crate) fn lookup(state: &VmState, path: &[u8]) -> Option<Vec<u8>> {
    let stream = state.stream();
    if let Some(value) = stream.and_then(|s| s.properties.get(path)) {
        return Some(value.clone());
    }
    let plugin_wide = |key: &[u8]| state.shared.lock().properties.get(key).cloned();
    if let Some(value) = plugin_wide(path) {
        return Some(value);
    }
    if let Some(stream) = stream {
        let set = |key: &[u8]| {
            stream
                .properties
                .get(key)
                .cloned()
                .or_else(|| plugin_wide(key))
        };
        if let Some(value) = derived(stream, path, set) {
            return Some(value);
        }
    }
    let config = &state.shared.config;
    match path {
        b"plugin_name" => Some(config.name.clone().into_bytes()),
        b"plugin_root_id" => Some(config.root_id.clone().into_bytes()),
        b"plugin_vm_id" => Some(config.vm_id.clone().into_bytes()),
        _ => None,
    }
}

fn int(value: i64) -> Vec<u8> {
    value.to_le_bytes().to_vec()
}

/// The port of an `ip:port` property, as an integer.
fn port_of(address: Option<Vec<u8>>) -> Option<Vec<u8>> {
    let text = String::from_utf8(address?).ok()?;
    let addr: std::net::SocketAddr = text.trim().parse().ok()?;
    Some(int(i64::from(addr.port())))
}

/// A body size: `content-length` if the headers have one, else the bytes seen.
fn size(headers: &crate::http::headers::HeaderMap, seen: usize) -> Vec<u8> {
    let declared = headers
        .get("content-length")
        .and_then(|v| v.trim().parse::<i64>().ok());
    int(declared.unwrap_or_else(|| i64::try_from(seen).unwrap_or(i64::MAX)))
}

/// Attributes Envoy computes from the stream; `set` reads an explicitly set property.
fn derived(
    stream: &StreamState,
    path: &[u8],
    set: impl Fn(&[u8]) -> Option<Vec<u8>>,
) -> Option<Vec<u8>> {
    let request = &stream.request.headers;
    let response = &stream.response.headers;
    let header = |name: &str| request.get(name).map(|v| v.as_bytes().to_vec());
    match path {
        b"request\0path" => header(":path"),
        b"request\0url_path" => {
            let path = request.get(":path")?;
            Some(path.split('?').next().unwrap_or(path).as_bytes().to_vec())
        }
        b"request\0query" => {
            let path = request.get(":path")?;
            Some(
                path.split_once('?')
                    .map_or("", |(_, q)| q)
                    .as_bytes()
                    .to_vec(),
            )
        }
        b"request\0host" => header(":authority"),
        b"request\0method" => header(":method"),
        b"request\0scheme" => header(":scheme"),
        b"request\0id" => header("x-request-id"),
        b"request\0referer" => header("referer"),
        b"request\0useragent" => header("user-agent"),
        b"request\0headers" => Some(request.encode()),
        b"request\0time" => Some(int(i64::try_from(stream.started_at).unwrap_or(i64::MAX))),
        b"request\0size" => {
            let seen = stream.request.forwarded_body.len() + stream.request.body.len();
            Some(size(request, seen))
        }
        b"response\0code" => {
            let code: i64 = response.get(":status")?.parse().ok()?;
            Some(int(code))
        }
        b"response\0code_details" => stream
            .local_reply
            .as_ref()
            .map(|r| r.details.clone().into_bytes()),
        b"response\0headers" => Some(response.encode()),
        b"response\0trailers" => Some(stream.response.trailers.encode()),
        b"response\0size" => {
            let seen = stream.response.forwarded_body.len() + stream.response.body.len();
            Some(size(response, seen))
        }
        b"source\0port" => port_of(set(b"source\0address")),
        b"destination\0port" => port_of(set(b"destination\0address")),
        b"upstream\0port" => port_of(set(b"upstream\0address")),
        _ => {
            let name = path.strip_prefix(b"filter_state\0")?;
            let name = std::str::from_utf8(name).ok()?;
            stream.filter_state.get(name).cloned()
        }
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
    let registered = {
        let mut functions = shared.foreign();
        functions
            .get_mut(&name)
            .map(|function| function(&arguments))
    };
    let result = match registered {
        Some(result) => result?,
        None => builtin_foreign(caller, &name, &arguments)?,
    };
    copy_out(caller, &result, ptr_ptr, size_ptr)
}

/// Envoy's foreign functions kvoy may use.
fn builtin_foreign(caller: &mut Ctx<'_>, name: &str, arguments: &[u8]) -> Result<Vec<u8>, Status> {
    match name {
        "clear_route_cache" => Ok(Vec::new()),
        "set_envoy_filter_state" => {
            let args = FilterStateArgs::decode(arguments).ok_or(Status::BadArgument)?;
            let stream = caller.data_mut().stream_mut().ok_or(Status::NotFound)?;
            stream.filter_state.insert(args.path, args.value);
            Ok(Vec::new())
        }
        _ => Err(Status::NotFound),
    }
}

/// `envoy.source.extensions.common.wasm.SetEnvoyFilterStateArguments`.
#[derive(Debug, Default, PartialEq)]
pub(crate) struct FilterStateArgs {
    pub path: String,
    pub value: Vec<u8>,
    pub span: u64,
}

impl FilterStateArgs {
    /// Decodes the protobuf message; `None` if it is malformed.
    pub fn decode(mut bytes: &[u8]) -> Option<FilterStateArgs> {
        fn varint(bytes: &mut &[u8]) -> Option<u64> {
            let mut value = 0u64;
            for shift in (0..64).step_by(7) {
                let (&b, rest) = bytes.split_first()?;
                *bytes = rest;
                value |= u64::from(b & 0x7f) << shift;
                if b & 0x80 == 0 {
                    return Some(value);
                }
            }
            None
        }
        let mut args = FilterStateArgs::default();
        while !bytes.is_empty() {
            let key = varint(&mut bytes)?;
            let (field, wire) = (key >> 3, key & 7);
            match wire {
                0 => {
                    let v = varint(&mut bytes)?;
                    if field == 3 {
                        args.span = v;
                    }
                }
                1 | 5 => {
                    let n = if wire == 1 { 8 } else { 4 };
                    bytes = bytes.get(n..)?;
                }
                2 => {
                    let len = usize::try_from(varint(&mut bytes)?).ok()?;
                    let data = bytes.get(..len)?;
                    bytes = bytes.get(len..)?;
                    match field {
                        1 => args.path = String::from_utf8(data.to_vec()).ok()?,
                        2 => args.value = data.to_vec(),
                        _ => {}
                    }
                }
                _ => return None,
            }
        }
        Some(args)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filter_state_arguments_decode() {
        // path = "a.b", value = "1.2.3.4:5", span = 1, plus an unknown fixed32 field.
        let mut bytes = vec![0x0a, 3];
        bytes.extend_from_slice(b"a.b");
        bytes.extend_from_slice(&[0x12, 9]);
        bytes.extend_from_slice(b"1.2.3.4:5");
        bytes.extend_from_slice(&[0x18, 1, 0x25, 0, 0, 0, 0]);
        let args = FilterStateArgs::decode(&bytes).expect("decodes");
        assert_eq!(args.path, "a.b");
        assert_eq!(args.value, b"1.2.3.4:5");
        assert_eq!(args.span, 1);
        assert_eq!(FilterStateArgs::decode(&[0x0a, 5, b'x']), None);
        assert_eq!(FilterStateArgs::decode(&[0x0b]), None);
        assert_eq!(
            FilterStateArgs::decode(&[]),
            Some(FilterStateArgs::default())
        );
    }
}
