//! Foreign functions (`proxy_call_foreign_function`): what a filter called, and the
//! test-provided implementations (the built-ins are in `abi/properties.rs`).

use crate::types::Status;

/// A call to `proxy_call_foreign_function`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ForeignCall {
    pub vm: usize,
    pub context_id: u32,
    pub name: String,
    pub arguments: Vec<u8>,
}

/// A test-provided implementation of a foreign function: arguments in, result bytes or a status
/// out. It runs inside the guest's host call, while the calling VM is locked: it must not drive
/// that plugin's VMs or streams (reading logs, metrics or shared data is fine).
pub type ForeignFunction = Box<dyn FnMut(&[u8]) -> Result<Vec<u8>, Status> + Send>;
