//! Envoy shared data as a [`SharedStore`].

use proxy_wasm::hostcalls;
use proxy_wasm::types::Status;

use kvoy_shared::replica::{SharedStore, StoreError};

pub(crate) struct HostStore;

impl SharedStore for HostStore {
    fn get(&self, key: &str) -> Option<(Vec<u8>, u32)> {
        match hostcalls::get_shared_data(key) {
            Ok((Some(bytes), cas)) => Some((bytes, cas.unwrap_or(0))),
            _ => None,
        }
    }

    fn set(&self, key: &str, value: &[u8], cas: u32) -> Result<(), StoreError> {
        let cas = (cas != 0).then_some(cas);
        match hostcalls::set_shared_data(key, Some(value), cas) {
            Ok(()) => Ok(()),
            Err(Status::CasMismatch) => Err(StoreError::CasMismatch),
            Err(status) => Err(StoreError::Unavailable(format!("{status:?}"))),
        }
    }
}
