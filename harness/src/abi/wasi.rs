//! The WASI preview1 functions a Rust `wasm32-wasip1` cdylib imports, implemented the way
//! Envoy's proxy-wasm host (proxy-wasm-cpp-host `exports.cc`) does: stdout/stderr go to the
//! log, clocks read the virtual clock, randomness is seeded per plugin, there are no files,
//! arguments or preopens, and the errno values are Envoy's. Imports not listed here trap when
//! called; `proc_exit` fails the VM (Envoy logs it and the guest traps right after).

use wasmtime::{Caller, Linker};

use crate::abi::memory::{read, write, write_u32, write_u64};
use crate::plugin::logs::LogSource;
use crate::types::{LogLevel, Status};
use crate::vm::state::VmState;

type Ctx<'a> = Caller<'a, VmState>;

const MODULE: &str = "wasi_snapshot_preview1";

const SUCCESS: i32 = 0;
const BADF: i32 = 8;
const FAULT: i32 = 21;
const INVAL: i32 = 28;
const NOENT: i32 = 44;
const NOSYS: i32 = 52;
const NOTSUP: i32 = 58;

/// Largest `random_get` Envoy serves (`PROXY_WASM_HOST_WASI_RANDOM_GET_MAX_SIZE_BYTES`).
const MAX_RANDOM: u32 = 64 * 1024;

/// Largest single `fd_write` the harness accepts (a guest could otherwise point many iovecs at
/// the same large region).
const MAX_WRITE: usize = 16 << 20;

/// The error `proc_exit` raises to unwind the guest.
#[derive(Debug, thiserror::Error)]
#[error("proc_exit({0})")]
pub(crate) struct ProcExit(pub i32);

pub(crate) fn add_to_linker(linker: &mut Linker<VmState>) -> wasmtime::Result<()> {
    linker.func_wrap(
        MODULE,
        "fd_write",
        |mut c: Ctx<'_>, fd: i32, iovs: i32, len: i32, nwritten: i32| {
            c.data_mut().note_host_call("fd_write");
            errno(fd_write(
                &mut c,
                fd,
                iovs as u32,
                len as u32,
                nwritten as u32,
            ))
        },
    )?;
    // As Envoy's proxy-wasm host: no file reads, seek and close "succeed" (Envoy logs them),
    // no preopened directories, no files to open.
    linker.func_wrap(
        MODULE,
        "fd_read",
        |mut c: Ctx<'_>, _fd: i32, _iovs: i32, _len: i32, _nread: i32| {
            c.data_mut().note_host_call("fd_read");
            NOSYS
        },
    )?;
    linker.func_wrap(MODULE, "fd_close", |mut c: Ctx<'_>, fd: i32| {
        c.data_mut().note_host_call("fd_close");
        unsupported(&mut c, "fd_close", fd);
        SUCCESS
    })?;
    linker.func_wrap(
        MODULE,
        "fd_seek",
        |mut c: Ctx<'_>, fd: i32, _offset: i64, _whence: i32, _new: i32| {
            c.data_mut().note_host_call("fd_seek");
            unsupported(&mut c, "fd_seek", fd);
            SUCCESS
        },
    )?;
    linker.func_wrap(
        MODULE,
        "fd_fdstat_get",
        |mut c: Ctx<'_>, fd: i32, stat: i32| {
            c.data_mut().note_host_call("fd_fdstat_get");
            errno(fd_fdstat_get(&mut c, fd, stat as u32))
        },
    )?;
    linker.func_wrap(
        MODULE,
        "fd_prestat_get",
        |mut c: Ctx<'_>, _fd: i32, _out: i32| {
            c.data_mut().note_host_call("fd_prestat_get");
            BADF
        },
    )?;
    linker.func_wrap(
        MODULE,
        "fd_prestat_dir_name",
        |mut c: Ctx<'_>, _fd: i32, _path: i32, _len: i32| {
            c.data_mut().note_host_call("fd_prestat_dir_name");
            NOSYS
        },
    )?;
    linker.func_wrap(
        MODULE,
        "path_open",
        |mut c: Ctx<'_>,
         _fd: i32,
         _dirflags: i32,
         _path: i32,
         _path_len: i32,
         _oflags: i32,
         _base: i64,
         _inheriting: i64,
         _fdflags: i32,
         _out: i32| {
            c.data_mut().note_host_call("path_open");
            NOENT
        },
    )?;
    linker.func_wrap(
        MODULE,
        "environ_sizes_get",
        |mut c: Ctx<'_>, count: i32, size: i32| {
            c.data_mut().note_host_call("environ_sizes_get");
            let env = environment(c.data());
            errno(sizes_get(&mut c, &env, count as u32, size as u32))
        },
    )?;
    linker.func_wrap(
        MODULE,
        "environ_get",
        |mut c: Ctx<'_>, ptrs: i32, buf: i32| {
            c.data_mut().note_host_call("environ_get");
            let env = environment(c.data());
            errno(strings_get(&mut c, &env, ptrs as u32, buf as u32))
        },
    )?;
    linker.func_wrap(
        MODULE,
        "args_sizes_get",
        |mut c: Ctx<'_>, count: i32, size: i32| {
            c.data_mut().note_host_call("args_sizes_get");
            errno(sizes_get(&mut c, &[], count as u32, size as u32))
        },
    )?;
    linker.func_wrap(MODULE, "args_get", |mut c: Ctx<'_>, ptrs: i32, buf: i32| {
        c.data_mut().note_host_call("args_get");
        errno(strings_get(&mut c, &[], ptrs as u32, buf as u32))
    })?;
    linker.func_wrap(
        MODULE,
        "clock_time_get",
        |mut c: Ctx<'_>, id: i32, _precision: i64, out: i32| {
            c.data_mut().note_host_call("clock_time_get");
            errno(clock_time_get(&mut c, id, out as u32))
        },
    )?;
    linker.func_wrap(
        MODULE,
        "clock_res_get",
        |mut c: Ctx<'_>, id: i32, out: i32| {
            c.data_mut().note_host_call("clock_res_get");
            if !(0..=1).contains(&id) {
                return NOTSUP;
            }
            errno(write_u64(&mut c, out as u32, 1).map_err(|_| FAULT))
        },
    )?;
    linker.func_wrap(
        MODULE,
        "random_get",
        |mut c: Ctx<'_>, buf: i32, len: i32| {
            c.data_mut().note_host_call("random_get");
            errno(random_get(&mut c, buf as u32, len as u32))
        },
    )?;
    linker.func_wrap(MODULE, "sched_yield", |mut c: Ctx<'_>| {
        c.data_mut().note_host_call("sched_yield");
        SUCCESS
    })?;
    linker.func_wrap(
        MODULE,
        "proc_exit",
        |mut c: Ctx<'_>, code: i32| -> wasmtime::Result<()> {
            c.data_mut().note_host_call("proc_exit");
            Err(wasmtime::Error::new(ProcExit(code)))
        },
    )?;
    Ok(())
}

fn errno(result: Result<(), i32>) -> i32 {
    result.err().unwrap_or(SUCCESS)
}

fn fault(_: Status) -> i32 {
    FAULT
}

/// Envoy logs these calls (at trace) and answers success.
fn unsupported(caller: &mut Ctx<'_>, call: &str, fd: i32) {
    let message = format!("wasi {call}({fd}) is not supported; answered success as Envoy does");
    caller
        .data_mut()
        .log(LogLevel::Debug, LogSource::Host, message);
}

fn fd_write(caller: &mut Ctx<'_>, fd: i32, iovs: u32, len: u32, nwritten: u32) -> Result<(), i32> {
    let (level, source) = match fd {
        1 => (LogLevel::Info, LogSource::Stdout),
        2 => (LogLevel::Error, LogSource::Stderr),
        _ => return Err(BADF),
    };
    let table = read(caller, iovs, len.checked_mul(8).ok_or(INVAL)?).map_err(fault)?;
    let mut bytes = Vec::new();
    for iov in table.chunks_exact(8) {
        let ptr = u32::from_le_bytes([iov[0], iov[1], iov[2], iov[3]]);
        let size = u32::from_le_bytes([iov[4], iov[5], iov[6], iov[7]]);
        if bytes.len().saturating_add(size as usize) > MAX_WRITE {
            return Err(INVAL);
        }
        bytes.extend(read(caller, ptr, size).map_err(fault)?);
    }
    let state = caller.data_mut();
    let splitter = if fd == 1 {
        &mut state.stdout
    } else {
        &mut state.stderr
    };
    for line in splitter.push(&bytes) {
        state.log(level, source, line);
    }
    let written = u32::try_from(bytes.len()).unwrap_or(u32::MAX);
    write_u32(caller, nwritten, written).map_err(fault)
}

/// As Envoy: only stdout and stderr exist, with the write right (file type left 0).
fn fd_fdstat_get(caller: &mut Ctx<'_>, fd: i32, stat: u32) -> Result<(), i32> {
    const RIGHT_FD_WRITE: u64 = 1 << 6;
    if fd != 1 && fd != 2 {
        return Err(BADF);
    }
    let mut out = [0u8; 24];
    out[8..16].copy_from_slice(&RIGHT_FD_WRITE.to_le_bytes());
    write(caller, stat, &out).map_err(fault)
}

fn environment(state: &VmState) -> Vec<Vec<u8>> {
    state
        .shared
        .config
        .env
        .iter()
        .map(|(key, value)| format!("{key}={value}\0").into_bytes())
        .collect()
}

fn sizes_get(caller: &mut Ctx<'_>, strings: &[Vec<u8>], count: u32, size: u32) -> Result<(), i32> {
    let total: usize = strings.iter().map(Vec::len).sum();
    let n = u32::try_from(strings.len()).map_err(|_| INVAL)?;
    write_u32(caller, count, n).map_err(fault)?;
    write_u32(caller, size, u32::try_from(total).map_err(|_| INVAL)?).map_err(fault)
}

/// Writes NUL-terminated strings to `buf` and their addresses to `ptrs`.
fn strings_get(caller: &mut Ctx<'_>, strings: &[Vec<u8>], ptrs: u32, buf: u32) -> Result<(), i32> {
    let mut at = buf;
    for (index, string) in strings.iter().enumerate() {
        let slot = u32::try_from(index * 4)
            .ok()
            .and_then(|o| ptrs.checked_add(o))
            .ok_or(FAULT)?;
        write_u32(caller, slot, at).map_err(fault)?;
        write(caller, at, string).map_err(fault)?;
        let len = u32::try_from(string.len()).map_err(|_| FAULT)?;
        at = at.checked_add(len).ok_or(FAULT)?;
    }
    Ok(())
}

/// Realtime (0) reads the virtual wall clock, monotonic (1) virtual time since the plugin
/// started; the CPU-time clocks are `NOTSUP`, as in Envoy.
fn clock_time_get(caller: &mut Ctx<'_>, id: i32, out: u32) -> Result<(), i32> {
    let now = {
        let shared = caller.data().shared.lock();
        match id {
            0 => shared.clock.now(),
            1 => shared.clock.monotonic(),
            _ => return Err(NOTSUP),
        }
    };
    write_u64(caller, out, now).map_err(fault)
}

fn random_get(caller: &mut Ctx<'_>, buf: u32, len: u32) -> Result<(), i32> {
    if len > MAX_RANDOM {
        return Err(INVAL);
    }
    // Check the range before allocating, so a huge length cannot exhaust host memory.
    let memory_size = caller.data().memory.map_or(0, |m| m.data_size(&*caller));
    if (buf as usize).saturating_add(len as usize) > memory_size {
        return Err(FAULT);
    }
    let mut bytes = vec![0u8; len as usize];
    caller.data_mut().rng.fill(&mut bytes);
    write(caller, buf, &bytes).map_err(fault)
}
