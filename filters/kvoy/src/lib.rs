//! `kvoy`: the combined proxy-wasm HTTP filter. It runs the session, admission and
//! prefix-affinity stages ([`kvoy_filter_stages`]) in one VM pass per request, where the
//! separate `kvoy_session`, `kvoy_admission` and `kvoy_prefix_affinity` filters run three: the
//! request headers are read once (each name at most once), the body is copied into the VM once
//! and parsed once (the Responses API's session keys come from the same parse as the route), and
//! the session pin and the served endpoint pass between the stages as values, not headers.
//!
//! Like every filter crate it depends only on kvoy-shared, kvoy-filter-common, kvoy-filter-stages
//! and proxy-wasm: nothing native (no tokio, hyper, wasmtime) and no test crate.
//!
//! Per request, in order (the three-filter chain's order, so the decisions are the same): the
//! session stage finds the pin (at the headers, or at the end of the body for a Responses API
//! request); the admission stage admits, holds or sheds the request at its headers; the
//! prefix-affinity stage routes it once admitted (at the headers for a request it routes
//! without its body, else once the body is complete) by setting
//! `x-gateway-destination-endpoint`. A held request's body keeps buffering; when the VM releases
//! it (its tick, or another request's end) it is routed first and resumed only once its
//! destination is set, or, if its body is still arriving, routed and continued at the body's
//! end. On the response: the served endpoint is reported and the session bound to it, usage is
//! sampled, the outstanding work is released at the first byte and at the end.
//!
//! Envoy needs `allow_on_headers_stop_iteration: true` (as for the separate filters). Metrics
//! keep the separate filters' names (`kvoy_session_*`, `kvoy_admission_*`,
//! `kvoy_prefix_affinity_*`). Counters and the shared gauges are kept in the VM and given to
//! Envoy on the tick (every 20 ms with admission, 200 ms without, the poll interval with a live
//! pool), one call per metric changed: a request costs no metric host call, and Envoy's stats
//! lag the VM by a tick at most.
//!
//! Plugin configuration: a JSON object with a section per stage ([`config`]), e.g.
//! `{"session": {}, "admission": {"endpoints": 1},
//!   "prefix_affinity": {"endpoints": [{"address": "10.0.0.1:8000", "models": ["llama"]}]}}`.

pub mod config;
mod stream;

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::rc::Rc;
use std::time::Duration;

use log::{error, info};
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{ContextType, LogLevel};

use kvoy_filter_common::{now_ms, ClockPass};
use kvoy_filter_stages::admission::AdmissionVm;
use kvoy_filter_stages::prefix_affinity::PrefixVm;
use kvoy_filter_stages::session::SessionVm;

use crate::stream::{KvoyStream, Request};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|context_id| -> Box<dyn RootContext> {
        Box::new(KvoyRoot {
            context_id,
            vm: Rc::new(Vm::default()),
            ticks: Ticks::default(),
            serves: std::cell::Cell::new(false),
        })
    });
}}

/// What one VM keeps between requests: each enabled stage's state, and the requests the
/// admission stage holds (so that releasing one can route it first).
#[derive(Default)]
pub(crate) struct Vm {
    pub session: RefCell<Option<SessionVm>>,
    pub admission: RefCell<Option<AdmissionVm>>,
    pub prefix: RefCell<Option<PrefixVm>>,
    /// By context id. A `BTreeMap`: nothing in the VM draws on the host's randomness before the
    /// prefix-affinity stage seeds itself (see [`KvoyRoot::configure`]).
    pub held: RefCell<BTreeMap<u32, Rc<RefCell<Request>>>>,
}

/// When each stage's tick is next due (the VM ticks at the shortest period of the two).
#[derive(Default)]
struct Ticks {
    admission: Option<(Duration, u64)>,
    prefix: Option<(Duration, u64)>,
}

impl Ticks {
    /// The VM's tick: the shorter of the stages' periods.
    fn period(&self) -> Duration {
        [self.admission, self.prefix]
            .into_iter()
            .flatten()
            .map(|(p, _)| p)
            .min()
            .unwrap_or(Duration::from_millis(200))
    }

    /// Sets the host's tick to [`Ticks::period`] (after a stage's period changed).
    fn apply(&self) {
        let _ = hostcalls::set_tick_period(self.period());
    }

    /// Whether the stage's tick is due at `now` (and, if so, when it is due next).
    fn due(slot: &mut Option<(Duration, u64)>, now: u64) -> bool {
        let Some((period, next)) = slot.as_mut() else {
            return false;
        };
        if now < *next {
            return false;
        }
        // A little early counts: the host's ticks are not exact.
        let ms = u64::try_from(period.as_millis()).unwrap_or(u64::MAX);
        *next = now.saturating_add(ms.saturating_sub(ms / 10));
        true
    }
}

struct KvoyRoot {
    context_id: u32,
    vm: Rc<Vm>,
    ticks: Ticks,
    /// This VM has had a request (a worker's VM; Envoy's main-thread VM never has one).
    serves: std::cell::Cell<bool>,
}

impl KvoyRoot {
    fn configure(&mut self, raw: &[u8]) -> Result<(), String> {
        let sections = config::sections(raw).map_err(|e| e.to_string())?;
        // The prefix-affinity stage first: its VM seed (tie-breaks, index hashing) is then
        // drawn exactly as the separate filter draws it, so that the same host randomness gives
        // the same decisions in both layouts.
        let prefix = PrefixVm::configure(sections.prefix_affinity, self.context_id)
            .map_err(|e| format!("`prefix_affinity`: {e}"))?;
        let session = sections
            .session
            .map(SessionVm::configure)
            .transpose()
            .map_err(|e| format!("`session`: {e}"))?;
        let admission = sections
            .admission
            .map(|s| AdmissionVm::configure(s, self.context_id))
            .transpose()
            .map_err(|e| format!("`admission`: {e}"))?;
        let now = now_ms();
        self.ticks = Ticks {
            admission: admission.as_ref().map(|a| (a.tick_period(), now)),
            prefix: Some((prefix.tick_period(), now)),
        };
        let period = self.ticks.period();
        if hostcalls::set_tick_period(period).is_ok() {
            // See the crate doc: metrics kept in the VM until the tick.
            kvoy_filter_common::defer_metrics();
        } else {
            error!("kvoy: cannot set the tick period; held requests are released only as others end, idle workers catch up on requests only, and an aggregator is not polled");
        }
        info!(
            "kvoy: stages session {}, admission {}, prefix_affinity on; tick every {} ms",
            if session.is_some() { "on" } else { "off" },
            if admission.is_some() { "on" } else { "off" },
            period.as_millis()
        );
        *self.vm.session.borrow_mut() = session;
        *self.vm.admission.borrow_mut() = admission;
        *self.vm.prefix.borrow_mut() = Some(prefix);
        Ok(())
    }
}

impl Context for KvoyRoot {
    fn on_done(&mut self) -> bool {
        // The VM is going away: what the last tick did not give Envoy goes now.
        kvoy_filter_common::flush_metrics();
        true
    }

    fn on_http_call_response(
        &mut self,
        token_id: u32,
        num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        let _clock = ClockPass::begin();
        if let Ok(mut guard) = self.vm.admission.try_borrow_mut() {
            if let Some(vm) = guard.as_mut().filter(|vm| vm.owns_call(token_id)) {
                vm.on_http_call_response(token_id, num_headers, body_size);
                kvoy_filter_common::flush_metrics();
                return;
            }
        }
        if let Ok(mut guard) = self.vm.prefix.try_borrow_mut() {
            if let Some(vm) = guard.as_mut() {
                vm.on_http_call_response(token_id, num_headers, body_size);
            }
        }
        kvoy_filter_common::flush_metrics();
    }
}

impl RootContext for KvoyRoot {
    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        let raw = self.get_plugin_configuration().unwrap_or_default();
        match self.configure(&raw) {
            Ok(()) => true,
            Err(e) => {
                error!("kvoy: bad configuration: {e}");
                false
            }
        }
    }

    fn on_tick(&mut self) {
        let _clock = ClockPass::begin();
        let now = now_ms();
        if Ticks::due(&mut self.ticks.admission, now) {
            let vm = self.vm.clone();
            if let Ok(mut guard) = self.vm.admission.try_borrow_mut() {
                if let Some(admission) = guard.as_mut() {
                    admission.on_tick(&mut |context| stream::on_release(&vm, context));
                }
            }
        }
        if Ticks::due(&mut self.ticks.prefix, now) {
            if let Ok(mut guard) = self.vm.prefix.try_borrow_mut() {
                if let Some(prefix) = guard.as_mut() {
                    // A VM that has had no request (Envoy's main-thread VM) keeps no index: it
                    // follows the live pool, and replays the log once it serves.
                    // Its poll reports the admission queue, read from the held board only
                    // when the poll starts, unless the admission stage polls (and reports)
                    // itself: one report per proxy, or the aggregator would count it twice.
                    let admission = &self.vm.admission;
                    prefix.on_tick_with(self.serves.get(), || {
                        admission
                            .try_borrow_mut()
                            .ok()?
                            .as_mut()
                            .filter(|a| !a.polls_aggregator())
                            .map(AdmissionVm::held_in_proxy)
                    });
                    // The stage's period follows its role (the lease holder relays every few
                    // milliseconds): the VM ticks at the shorter of the two stages'.
                    let period = prefix.tick_period();
                    if self.ticks.prefix.is_some_and(|(p, _)| p != period) {
                        self.ticks.prefix = Some((period, now));
                        self.ticks.apply();
                    }
                }
            }
        }
        kvoy_filter_common::flush_metrics();
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        self.serves.set(true);
        Some(Box::new(KvoyStream::new(self.vm.clone(), context_id)))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}
