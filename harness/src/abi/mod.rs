//! The host functions a guest imports: the proxy-wasm ABI 0.2.1 (module `env`), one file per
//! area, and the WASI preview 1 calls a Rust `wasm32-wasip1` filter imports ([`wasi`]).
//!
//! Each host function reads its arguments out of guest memory, acts on the VM's store data or
//! the plugin's shared state, and returns a [`Status`]. Bad pointers and sizes become
//! `InvalidMemoryAccess`, bad enum values `BadArgument`, as in Envoy; the host never panics on
//! guest input. Only a trap inside a nested guest call (the allocator) propagates as a trap.

mod buffers;
mod core;
mod grpc;
mod headers;
mod http;
pub(crate) mod memory;
mod metrics;
mod properties;
mod shared;
pub(crate) mod wasi;

use wasmtime::Linker;

use crate::types::Status;
use crate::vm::state::VmState;

/// Why a host function did not return `Ok`.
pub(crate) enum Fail {
    /// Returned to the guest as the call's status.
    Status(Status),
    /// A trap in a nested guest call; unwinds the guest.
    Trap(wasmtime::Error),
}

impl From<Status> for Fail {
    fn from(status: Status) -> Fail {
        Fail::Status(status)
    }
}

impl From<wasmtime::Error> for Fail {
    fn from(error: wasmtime::Error) -> Fail {
        Fail::Trap(error)
    }
}

/// What host function bodies return: `Ok(())` is `Status::Ok`.
pub(crate) type AbiResult = Result<(), Fail>;

/// Converts a body's result into the raw status the guest sees.
pub(crate) fn to_status(result: AbiResult) -> wasmtime::Result<i32> {
    match result {
        Ok(()) => Ok(Status::Ok as i32),
        Err(Fail::Status(status)) => Ok(status as i32),
        Err(Fail::Trap(error)) => Err(error),
    }
}

/// Wraps a body `fn(&mut Caller<VmState>, u32...) -> AbiResult` as an `env` import taking i32s:
/// `env_fn!(linker, "proxy_log" => log(level, ptr, size))`. Arguments after a `;` are passed
/// to the body as they are, after the guest's (one body serving two imports).
macro_rules! env_fn {
    ($linker:expr, $name:literal => $body:ident($($arg:ident),* $(; $extra:expr)?)) => {
        $linker.func_wrap(
            "env",
            $name,
            |mut caller: wasmtime::Caller<'_, crate::vm::state::VmState>, $($arg: i32),*| {
                caller.data_mut().note_host_call($name);
                crate::abi::to_status($body(&mut caller, $($arg as u32,)* $($extra)?))
            },
        )?;
    };
}
pub(crate) use env_fn;

/// Registers every `env` host function and the WASI calls.
pub(crate) fn add_to_linker(linker: &mut Linker<VmState>) -> wasmtime::Result<()> {
    core::add_to_linker(linker)?;
    buffers::add_to_linker(linker)?;
    headers::add_to_linker(linker)?;
    properties::add_to_linker(linker)?;
    shared::add_to_linker(linker)?;
    metrics::add_to_linker(linker)?;
    http::add_to_linker(linker)?;
    grpc::add_to_linker(linker)?;
    wasi::add_to_linker(linker)?;
    Ok(())
}
