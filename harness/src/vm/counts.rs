//! What a plugin's VMs cost in crossings: host calls, shared-data operations and VM entries,
//! counted as Envoy would pay for them (each host call and each entry into the VM is a
//! boundary crossing; each shared-data operation also takes Envoy's one process-wide lock).

use std::collections::BTreeMap;
use std::ops::{Add, Sub};

/// Crossings counted over a plugin's VMs (see [`crate::Plugin::call_counts`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CallCounts {
    /// Calls from the guest into the host (`proxy_*` and WASI imports).
    pub host_calls: u64,
    /// Of those, `proxy_get_shared_data`, `proxy_set_shared_data` and the shared-queue calls.
    pub shared_data: u64,
    /// Entries from the host into the VM: callbacks and the allocator calls that return
    /// buffers to the guest.
    pub vm_entries: u64,
}

impl Add for CallCounts {
    type Output = CallCounts;
    fn add(self, o: CallCounts) -> CallCounts {
        CallCounts {
            host_calls: self.host_calls + o.host_calls,
            shared_data: self.shared_data + o.shared_data,
            vm_entries: self.vm_entries + o.vm_entries,
        }
    }
}

/// The crossings between two readings (saturating: a later reading is never smaller).
impl Sub for CallCounts {
    type Output = CallCounts;
    fn sub(self, o: CallCounts) -> CallCounts {
        CallCounts {
            host_calls: self.host_calls.saturating_sub(o.host_calls),
            shared_data: self.shared_data.saturating_sub(o.shared_data),
            vm_entries: self.vm_entries.saturating_sub(o.vm_entries),
        }
    }
}

/// Host calls by import name, over a plugin's VMs (see [`crate::Plugin::host_call_names`]):
/// every proxy-wasm and WASI import; they add up to [`CallCounts::host_calls`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HostCallNames(pub BTreeMap<&'static str, u64>);

impl HostCallNames {
    /// Adds `o`'s counts to these.
    pub fn merge(&mut self, o: &HostCallNames) {
        for (name, n) in &o.0 {
            *self.0.entry(name).or_insert(0) += n;
        }
    }

    /// The calls since the reading `before` (names with none left out).
    pub fn since(&self, before: &HostCallNames) -> HostCallNames {
        HostCallNames(
            self.0
                .iter()
                .filter_map(|(name, n)| {
                    let d = n.saturating_sub(before.0.get(name).copied().unwrap_or(0));
                    (d > 0).then_some((*name, d))
                })
                .collect(),
        )
    }
}
