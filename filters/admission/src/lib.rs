//! `kvoy_admission`: a proxy-wasm HTTP filter, between `kvoy_session` and
//! `kvoy_prefix_affinity`, that admits requests at once while the pool has room and otherwise
//! holds them in priority bands with fair share between flows.
//!
//! It depends only on kvoy-shared, kvoy-filter-common, kvoy-filter-stages and proxy-wasm: nothing
//! native and no test crate.
//!
//! A thin adapter over the admission stage ([`kvoy_filter_stages::admission`], logic in
//! [`kvoy_shared::admission`]): admit (continue), queue (pause, also at the body callbacks), or
//! reject (429 with `x-kvoy-dropped-reason`). Held requests are released by the VM that holds
//! them, in the queue's order, when one of its requests completes and on every tick; those past
//! the queue TTL get 429 `ttl-expired`; a client that leaves while held is removed. The combined
//! `kvoy` filter runs the same stage with the other two in one pass.
//!
//! Plugin configuration: the JSON of [`kvoy_shared::admission::AdmissionFilterConfig`].

mod stream;

use proxy_wasm::traits::RootContext;
use proxy_wasm::types::LogLevel;

use kvoy_filter_stages::admission::AdmissionVm;
use kvoy_filter_stages::root::{SharedVm, StageRoot};

use crate::stream::AdmissionStream;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|context_id| -> Box<dyn RootContext> {
        Box::new(StageRoot::<AdmissionVm>::new(context_id, |vm, id| {
            Box::new(AdmissionStream::new(vm, id))
        }))
    });
}}

pub(crate) type SharedState = SharedVm<AdmissionVm>;
