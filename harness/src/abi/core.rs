//! Logging, time, ticks, contexts and call status.

use std::time::Duration;

use wasmtime::{Caller, Linker};

use super::memory::{copy_out, read_string, write_u32, write_u64};
use super::{env_fn, AbiResult};
use crate::plugin::logs::LogSource;
use crate::types::{LogLevel, Status};
use crate::vm::state::VmState;

type Ctx<'a> = Caller<'a, VmState>;

pub(super) fn add_to_linker(linker: &mut Linker<VmState>) -> wasmtime::Result<()> {
    env_fn!(linker, "proxy_log" => log(level, ptr, size));
    env_fn!(linker, "proxy_get_log_level" => get_log_level(ptr));
    env_fn!(linker, "proxy_get_current_time_nanoseconds" => get_current_time(ptr));
    env_fn!(linker, "proxy_set_tick_period_milliseconds" => set_tick_period(period));
    env_fn!(linker, "proxy_set_effective_context" => set_effective_context(context_id));
    env_fn!(linker, "proxy_get_status" => get_status(code_ptr, ptr_ptr, size_ptr));
    env_fn!(linker, "proxy_done" => done());
    // ABI 0.1.0 name Envoy still links: the plugin configuration during
    // `proxy_on_configure`, the VM configuration otherwise.
    env_fn!(linker, "proxy_get_configuration" => get_configuration(ptr_ptr, size_ptr));
    Ok(())
}

fn log(caller: &mut Ctx<'_>, level: u32, ptr: u32, size: u32) -> AbiResult {
    let level = LogLevel::from_raw(level).ok_or(Status::BadArgument)?;
    let message = read_string(caller, ptr, size)?;
    caller.data_mut().log(level, LogSource::ProxyLog, message);
    Ok(())
}

fn get_log_level(caller: &mut Ctx<'_>, ptr: u32) -> AbiResult {
    let level = caller.data().shared.config.log_level as u32;
    write_u32(caller, ptr, level)?;
    Ok(())
}

fn get_current_time(caller: &mut Ctx<'_>, ptr: u32) -> AbiResult {
    let now = caller.data().shared.lock().clock.now();
    write_u64(caller, ptr, now)?;
    Ok(())
}

fn set_tick_period(caller: &mut Ctx<'_>, period: u32) -> AbiResult {
    let vm = caller.data().vm;
    caller
        .data()
        .shared
        .lock()
        .clock
        .set_tick_period(vm, Duration::from_millis(u64::from(period)));
    Ok(())
}

fn set_effective_context(caller: &mut Ctx<'_>, context_id: u32) -> AbiResult {
    let state = caller.data_mut();
    if !state.is_live_context(context_id) {
        return Err(Status::BadArgument.into());
    }
    state.effective = context_id;
    Ok(())
}

fn get_status(caller: &mut Ctx<'_>, code_ptr: u32, ptr_ptr: u32, size_ptr: u32) -> AbiResult {
    let (code, message) = caller.data().call_status.clone();
    write_u32(caller, code_ptr, code)?;
    copy_out(caller, message.as_bytes(), ptr_ptr, size_ptr)
}

/// Envoy uses this to finish a context whose `proxy_on_done` returned false; the harness never
/// waits for that, so no context is pending and the answer is Envoy's `NotFound`.
fn done(_caller: &mut Ctx<'_>) -> AbiResult {
    Err(Status::NotFound.into())
}

fn get_configuration(caller: &mut Ctx<'_>, ptr_ptr: u32, size_ptr: u32) -> AbiResult {
    let config = &caller.data().shared.config;
    let bytes = if caller.data().configuring {
        config.configuration.clone()
    } else {
        config.vm_configuration.clone()
    };
    copy_out(caller, &bytes, ptr_ptr, size_ptr)
}
