//! Guest memory access through wasmtime's safe API, and returning buffers to the guest.

use wasmtime::Caller;

use super::Fail;
use crate::types::Status;
use crate::vm::state::VmState;

type Ctx<'a> = Caller<'a, VmState>;

/// Copies `len` bytes at `ptr` out of guest memory.
pub(crate) fn read(caller: &Ctx<'_>, ptr: u32, len: u32) -> Result<Vec<u8>, Status> {
    let memory = caller.data().memory.ok_or(Status::InvalidMemoryAccess)?;
    let start = ptr as usize;
    let end = start
        .checked_add(len as usize)
        .ok_or(Status::InvalidMemoryAccess)?;
    memory
        .data(caller)
        .get(start..end)
        .map(<[u8]>::to_vec)
        .ok_or(Status::InvalidMemoryAccess)
}

/// Reads guest bytes as text, replacing invalid UTF-8.
pub(crate) fn read_string(caller: &Ctx<'_>, ptr: u32, len: u32) -> Result<String, Status> {
    let bytes = read(caller, ptr, len)?;
    Ok(match String::from_utf8(bytes) {
        Ok(text) => text,
        Err(err) => String::from_utf8_lossy(err.as_bytes()).into_owned(),
    })
}

/// Writes bytes into guest memory.
pub(crate) fn write(caller: &mut Ctx<'_>, ptr: u32, bytes: &[u8]) -> Result<(), Status> {
    let memory = caller.data().memory.ok_or(Status::InvalidMemoryAccess)?;
    memory
        .write(caller, ptr as usize, bytes)
        .map_err(|_| Status::InvalidMemoryAccess)
}

/// Writes a little-endian u32 (a pointer, size, id or token slot).
pub(crate) fn write_u32(caller: &mut Ctx<'_>, ptr: u32, value: u32) -> Result<(), Status> {
    write(caller, ptr, &value.to_le_bytes())
}

/// Writes a little-endian u64.
pub(crate) fn write_u64(caller: &mut Ctx<'_>, ptr: u32, value: u64) -> Result<(), Status> {
    write(caller, ptr, &value.to_le_bytes())
}

/// Hands bytes to the guest: allocates with the guest's own allocator, copies, and writes the
/// pointer and size to the return slots. Empty data writes a null pointer and size 0, which the
/// SDK reads as "no value".
pub(crate) fn copy_out(
    caller: &mut Ctx<'_>,
    bytes: &[u8],
    ptr_ptr: u32,
    size_ptr: u32,
) -> Result<(), Fail> {
    if bytes.is_empty() {
        write_u32(caller, ptr_ptr, 0)?;
        write_u32(caller, size_ptr, 0)?;
        return Ok(());
    }
    let size = u32::try_from(bytes.len()).map_err(|_| Status::InvalidMemoryAccess)?;
    let ptr = allocate(caller, size)?;
    write(caller, ptr, bytes)?;
    write_u32(caller, ptr_ptr, ptr)?;
    write_u32(caller, size_ptr, size)?;
    Ok(())
}

/// Calls the guest's `proxy_on_memory_allocate` (or `malloc`).
fn allocate(caller: &mut Ctx<'_>, size: u32) -> Result<u32, Fail> {
    let allocate = caller
        .data()
        .allocate
        .clone()
        .ok_or(Status::InvalidMemoryAccess)?;
    let ptr = allocate.call(&mut *caller, size)?;
    if ptr == 0 {
        return Err(Status::InvalidMemoryAccess.into());
    }
    Ok(ptr)
}
