//! The harness's error type.

use std::path::PathBuf;

/// Everything that can go wrong while loading or driving a filter.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("reading {}: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },

    #[error("compiling the wasm module: {0}")]
    Compile(String),

    #[error("the module does not declare a supported proxy-wasm ABI (it exports none of {0})")]
    UnsupportedAbi(&'static str),

    #[error("the module's export `{name}` has the wrong signature: {message}")]
    BadExport { name: &'static str, message: String },

    #[error("the module exports no memory named `memory`")]
    NoMemory,

    #[error("the module exports neither `proxy_on_memory_allocate` nor `malloc`")]
    NoAllocator,

    #[error("instantiating VM {vm}: {message}")]
    Instantiate { vm: usize, message: String },

    #[error("VM {vm}: `{call}` trapped: {message}{}", guest_log_suffix(guest_log))]
    Trap {
        vm: usize,
        call: &'static str,
        message: String,
        guest_log: Vec<String>,
    },

    #[error(
        "VM {vm}: the guest called proc_exit({code}) in `{call}`{}",
        guest_log_suffix(guest_log)
    )]
    ProcExit {
        vm: usize,
        call: &'static str,
        code: i32,
        guest_log: Vec<String>,
    },

    #[error("VM {vm}: `{call}` returned false{}", guest_log_suffix(guest_log))]
    Rejected {
        vm: usize,
        call: &'static str,
        guest_log: Vec<String>,
    },

    #[error("VM {vm}: `{call}` returned {value}, which is not an Action the harness knows")]
    BadAction {
        vm: usize,
        call: &'static str,
        value: u32,
    },

    #[error("VM {vm} failed earlier (a trap or proc_exit) and takes no more calls")]
    VmFailed { vm: usize },

    #[error("no VM {vm}: the plugin has {count}")]
    NoSuchVm { vm: usize, count: usize },

    #[error("a plugin needs at least one VM")]
    NoVms,

    #[error("stream {context_id} on VM {vm} is finished")]
    StreamFinished { vm: usize, context_id: u32 },

    #[error("connection {context_id} on VM {vm} was already started")]
    ConnectionStarted { vm: usize, context_id: u32 },

    #[error("no pending HTTP call with token {token} on VM {vm}")]
    UnknownHttpCall { vm: usize, token: u32 },

    #[error("no open gRPC call or stream with token {token} on VM {vm}")]
    UnknownGrpcCall { vm: usize, token: u32 },

    #[error("no shared queue named {name:?} (vm_id {vm_id:?})")]
    UnknownQueue { vm_id: String, name: String },

    #[error("deferred host actions kept triggering each other ({0} rounds); stopped")]
    Runaway(usize),

    #[error("{name}.wasm is not built (looked for {}); run `make wasm` first", path.display())]
    WasmNotBuilt { name: String, path: PathBuf },
}

/// The harness's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A wasmtime error with its causes, on one line.
pub(crate) fn describe(error: &wasmtime::Error) -> String {
    let mut text = String::new();
    for cause in error.chain() {
        if !text.is_empty() {
            text.push_str(": ");
        }
        text.push_str(&cause.to_string());
    }
    text
}

fn guest_log_suffix(lines: &[String]) -> String {
    if lines.is_empty() {
        return String::new();
    }
    let mut out = String::from("; guest log:");
    for line in lines {
        out.push_str("\n  ");
        out.push_str(line);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trap_message_carries_the_guest_log() {
        let err = Error::Trap {
            vm: 1,
            call: "proxy_on_request_body",
            message: "wasm trap: unreachable".into(),
            guest_log: vec!["panicked at src/lib.rs:3:5: boom".into()],
        };
        let text = err.to_string();
        assert!(text.starts_with("VM 1: `proxy_on_request_body` trapped: wasm trap: unreachable"));
        assert!(text.contains("panicked at src/lib.rs:3:5: boom"));
    }
}
