//! Metric definition and updates.

use wasmtime::{Caller, Linker};

use super::memory::{read_string, write_u32, write_u64};
use super::{env_fn, to_status, AbiResult};
use crate::plugin::metrics::Metrics;
use crate::types::{MetricType, Status};
use crate::vm::state::VmState;

type Ctx<'a> = Caller<'a, VmState>;

pub(super) fn add_to_linker(linker: &mut Linker<VmState>) -> wasmtime::Result<()> {
    env_fn!(linker, "proxy_define_metric" => define_metric(kind, name_ptr, name_size, id_ptr));
    env_fn!(linker, "proxy_get_metric" => get_metric(id, value_ptr));
    // The two calls with a 64-bit argument, which `env_fn!` (all `i32`) does not cover.
    update_fn(linker, "proxy_record_metric", |metrics, id, value| {
        metrics.record(id, value as u64)
    })?;
    update_fn(linker, "proxy_increment_metric", Metrics::increment)?;
    Ok(())
}

fn define_metric(
    caller: &mut Ctx<'_>,
    kind: u32,
    name_ptr: u32,
    name_size: u32,
    id_ptr: u32,
) -> AbiResult {
    let kind = MetricType::from_raw(kind).ok_or(Status::BadArgument)?;
    let name = read_string(caller, name_ptr, name_size)?;
    let id = caller.data().shared.lock().metrics.define(kind, &name);
    write_u32(caller, id_ptr, id)?;
    Ok(())
}

fn get_metric(caller: &mut Ctx<'_>, id: u32, value_ptr: u32) -> AbiResult {
    let value = caller.data().shared.lock().metrics.get(id)?;
    write_u64(caller, value_ptr, value)?;
    Ok(())
}

/// Registers a metric update `(id: i32, value: i64) -> status`.
fn update_fn(
    linker: &mut Linker<VmState>,
    name: &'static str,
    update: fn(&mut Metrics, u32, i64) -> Result<(), Status>,
) -> wasmtime::Result<()> {
    linker.func_wrap(
        "env",
        name,
        move |mut caller: Ctx<'_>, id: i32, value: i64| {
            caller.data_mut().note_host_call(name);
            let updated = update(&mut caller.data().shared.lock().metrics, id as u32, value);
            to_status(updated.map_err(Into::into))
        },
    )?;
    Ok(())
}
