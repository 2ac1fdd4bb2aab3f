//! Shared data and shared queues.

use wasmtime::{Caller, Linker};

use super::memory::{copy_out, read, read_string, write_u32};
use super::{env_fn, AbiResult};
use crate::plugin::queues::QueueOwner;
use crate::types::Status;
use crate::vm::state::VmState;

type Ctx<'a> = Caller<'a, VmState>;

pub(super) fn add_to_linker(linker: &mut Linker<VmState>) -> wasmtime::Result<()> {
    env_fn!(linker, "proxy_get_shared_data" =>
        get_shared_data(key_ptr, key_size, ptr_ptr, size_ptr, cas_ptr));
    env_fn!(linker, "proxy_set_shared_data" =>
        set_shared_data(key_ptr, key_size, value_ptr, value_size, cas));
    env_fn!(linker, "proxy_register_shared_queue" =>
        register_queue(name_ptr, name_size, token_ptr));
    env_fn!(linker, "proxy_resolve_shared_queue" =>
        resolve_queue(vm_id_ptr, vm_id_size, name_ptr, name_size, token_ptr));
    env_fn!(linker, "proxy_dequeue_shared_queue" => dequeue(token, ptr_ptr, size_ptr));
    env_fn!(linker, "proxy_enqueue_shared_queue" => enqueue(token, value_ptr, value_size));
    Ok(())
}

fn get_shared_data(
    caller: &mut Ctx<'_>,
    key_ptr: u32,
    key_size: u32,
    ptr_ptr: u32,
    size_ptr: u32,
    cas_ptr: u32,
) -> AbiResult {
    caller.data_mut().counts.shared_data += 1;
    let key = read_string(caller, key_ptr, key_size)?;
    let (value, cas) = {
        let shared = caller.data().shared.lock();
        let (value, cas) = shared.data.get(&key).ok_or(Status::NotFound)?;
        (value.to_vec(), cas)
    };
    copy_out(caller, &value, ptr_ptr, size_ptr)?;
    write_u32(caller, cas_ptr, cas)?;
    Ok(())
}

fn set_shared_data(
    caller: &mut Ctx<'_>,
    key_ptr: u32,
    key_size: u32,
    value_ptr: u32,
    value_size: u32,
    cas: u32,
) -> AbiResult {
    caller.data_mut().counts.shared_data += 1;
    let key = read_string(caller, key_ptr, key_size)?;
    let value = read(caller, value_ptr, value_size)?;
    caller.data().shared.lock().data.set(&key, &value, cas)?;
    Ok(())
}

fn register_queue(
    caller: &mut Ctx<'_>,
    name_ptr: u32,
    name_size: u32,
    token_ptr: u32,
) -> AbiResult {
    let name = read_string(caller, name_ptr, name_size)?;
    let state = caller.data();
    let owner = QueueOwner {
        vm: state.vm,
        root_context_id: state.root_id,
    };
    let token = state
        .shared
        .lock()
        .queues
        .register(&state.shared.config.vm_id, &name, owner);
    write_u32(caller, token_ptr, token)?;
    Ok(())
}

fn resolve_queue(
    caller: &mut Ctx<'_>,
    vm_id_ptr: u32,
    vm_id_size: u32,
    name_ptr: u32,
    name_size: u32,
    token_ptr: u32,
) -> AbiResult {
    let vm_id = read_string(caller, vm_id_ptr, vm_id_size)?;
    let name = read_string(caller, name_ptr, name_size)?;
    let token = caller
        .data()
        .shared
        .lock()
        .queues
        .resolve(&vm_id, &name)
        .ok_or(Status::NotFound)?;
    write_u32(caller, token_ptr, token)?;
    Ok(())
}

fn dequeue(caller: &mut Ctx<'_>, token: u32, ptr_ptr: u32, size_ptr: u32) -> AbiResult {
    caller.data_mut().counts.shared_data += 1;
    let item = caller.data().shared.lock().queues.dequeue(token)?;
    copy_out(caller, &item, ptr_ptr, size_ptr)
}

/// Appends an item and schedules `proxy_on_queue_ready` on the queue's owner; like Envoy's
/// post to the owner's thread, it is delivered after the current guest call returns.
fn enqueue(caller: &mut Ctx<'_>, token: u32, value_ptr: u32, value_size: u32) -> AbiResult {
    caller.data_mut().counts.shared_data += 1;
    let value = read(caller, value_ptr, value_size)?;
    let mut shared = caller.data().shared.lock();
    let owner = shared.queues.enqueue(token, &value)?;
    shared.queue_ready.push_back((owner, token));
    Ok(())
}
