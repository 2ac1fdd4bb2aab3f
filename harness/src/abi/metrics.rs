//! Metric definition and updates.

use wasmtime::{Caller, Linker};

use super::memory::{read_string, write_u32, write_u64};
use super::{env_fn, to_status, AbiResult};
use crate::types::{MetricType, Status};
use crate::vm::state::VmState;

type Ctx<'a> = Caller<'a, VmState>;

pub(super) fn add_to_linker(linker: &mut Linker<VmState>) -> wasmtime::Result<()> {
    env_fn!(
        linker,
        "proxy_define_metric",
        define_metric,
        (kind, name_ptr, name_size, id_ptr)
    );
    env_fn!(linker, "proxy_get_metric", get_metric, (id, value_ptr));
    linker.func_wrap(
        "env",
        "proxy_record_metric",
        |mut caller: Ctx<'_>, id: i32, value: i64| {
            caller.data_mut().note_host_call("proxy_record_metric");
            to_status(
                caller
                    .data()
                    .shared
                    .lock()
                    .metrics
                    .record(id as u32, value as u64)
                    .map_err(Into::into),
            )
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_increment_metric",
        |mut caller: Ctx<'_>, id: i32, offset: i64| {
            caller.data_mut().note_host_call("proxy_increment_metric");
            to_status(
                caller
                    .data()
                    .shared
                    .lock()
                    .metrics
                    .increment(id as u32, offset)
                    .map_err(Into::into),
            )
        },
    )?;
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
