//! What every kvoy filter needs from the proxy-wasm host, in one place: Envoy shared data as
//! a [`kvoy_shared::shared_data::SharedStore`] ([`HostStore`]), the host clock in milliseconds
//! ([`now_ms`]), and metrics that fail soft ([`counter`], [`gauge`], [`add`], [`set`], and
//! [`SharedGauge`] for a figure every worker holds a part of: a metric that cannot be defined
//! is skipped, never fatal; [`defer_metrics`] keeps changes in the VM until flushed), and the
//! aggregator's snapshot as a filter follows it ([`LiveSnapshot`]).
//!
//! It depends only on kvoy-shared and proxy-wasm, and never on the stages or a filter crate.

mod snapshot_poll;

pub use snapshot_poll::{call_aggregator, call_response, CallBody, LiveSnapshot, PollStart};

use proxy_wasm::hostcalls;
use proxy_wasm::types::{MapType, MetricType, Status};

use kvoy_shared::shared_data::{SharedStore, StoreError};

/// Envoy shared data (process-wide per `vm_id`, compare-and-swap, no delete).
pub struct HostStore;

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

/// The value of header `name` in `map`; `None` when it is absent or not UTF-8.
///
/// Every kvoy filter reads headers through this, never through the SDK's `get_map_value`,
/// `get_map` or the context traits' header getters: those unwrap the UTF-8 conversion, and a
/// value with a byte such as 0xff (obs-text, which HTTP/1.1 and HTTP/2 both carry) trapped the
/// VM, failing that request and every later one on its worker (clippy.toml bans them).
pub fn header(map: MapType, name: &str) -> Option<String> {
    // The one allowed use: the bytes variant, which does not convert.
    #[allow(clippy::disallowed_methods)]
    let bytes = hostcalls::get_map_value_bytes(map, name).ok().flatten()?;
    String::from_utf8(bytes).ok()
}

/// Where a filter stage reads request (or response) headers from.
pub trait Headers {
    /// The value of header `name`; `None` when it is absent or not UTF-8.
    fn get(&self, name: &str) -> Option<String>;
}

/// The host's header map `map`, read on every [`Headers::get`] (a standalone filter's reads).
#[derive(Clone, Copy, Debug)]
pub struct HostHeaders(pub MapType);

impl Headers for HostHeaders {
    fn get(&self, name: &str) -> Option<String> {
        header(self.0, name)
    }
}

/// The whole header map `map` in one host call, as the host serialized it; `None` when the host
/// will not give it (the caller then reads header by header).
///
/// The SDK's `get_map` and `get_map_bytes` call the same import but convert every name (and,
/// for `get_map`, every value) with an unwrap, and panic on a status they do not expect; this
/// keeps the bytes and the status. Hand-written for the one host call it saves per header a
/// stage reads (a chat completion through the combined filter read 8 request headers).
#[allow(unsafe_code)]
pub fn header_map(map: MapType) -> Option<kvoy_shared::header_map::SerializedMap> {
    #[cfg(target_arch = "wasm32")]
    {
        #[link(wasm_import_module = "env")]
        extern "C" {
            fn proxy_get_header_map_pairs(
                map_type: u32,
                return_map_data: *mut *mut u8,
                return_map_size: *mut usize,
            ) -> u32;
        }
        let mut data: *mut u8 = std::ptr::null_mut();
        let mut size: usize = 0;
        // SAFETY: the host fills `data` and `size` with a buffer it allocated in this module
        // through `proxy_on_memory_allocate` (the SDK's: a boxed slice of exactly `size`
        // bytes), whose ownership passes to the caller, as the SDK's own `get_map` takes it.
        let status = unsafe { proxy_get_header_map_pairs(map as u32, &mut data, &mut size) };
        const OK: u32 = 0;
        if status != OK {
            return None;
        }
        let bytes = if data.is_null() {
            Vec::new()
        } else {
            // SAFETY: see above; a non-null buffer of `size` bytes owned by us from here on.
            unsafe { Vec::from_raw_parts(data, size, size) }
        };
        kvoy_shared::header_map::SerializedMap::new(bytes).ok()
    }
    #[cfg(not(target_arch = "wasm32"))]
    {
        // Natively there is no host: the filters' unit tests use their own header sources.
        let _ = map;
        None
    }
}

/// A header map read once: the whole map in one host call the first time a header is asked
/// for ([`header_map`]), so stages run in one pass (the combined filter) pay one crossing for
/// all their headers. If the host will not give the whole map, each name is read on its own
/// and remembered. Keep it only while the map does not change under it.
#[derive(Debug)]
pub struct HeaderCache {
    map: MapType,
    all: std::cell::OnceCell<Option<kvoy_shared::header_map::SerializedMap>>,
    seen: std::cell::RefCell<Vec<(String, Option<String>)>>,
}

impl HeaderCache {
    pub fn new(map: MapType) -> Self {
        HeaderCache {
            map,
            all: std::cell::OnceCell::new(),
            seen: std::cell::RefCell::new(Vec::new()),
        }
    }

    /// Whether the map may hold header `name`: present with any value (one that is not UTF-8
    /// too), or the host would not give the whole map. For a caller that strips a header, so
    /// that a request without it costs no host call.
    pub fn may_contain(&self, name: &str) -> bool {
        match self.all.get_or_init(|| header_map(self.map)) {
            Some(all) => all.get(name).is_some(),
            None => true,
        }
    }
}

impl Headers for HeaderCache {
    fn get(&self, name: &str) -> Option<String> {
        if let Some(all) = self.all.get_or_init(|| header_map(self.map)) {
            return all
                .get(name)
                .and_then(|v| String::from_utf8(v.to_vec()).ok());
        }
        if let Ok(seen) = self.seen.try_borrow() {
            if let Some((_, value)) = seen.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)) {
                return value.clone();
            }
        }
        let value = header(self.map, name);
        if let Ok(mut seen) = self.seen.try_borrow_mut() {
            seen.push((name.to_owned(), value.clone()));
        }
        value
    }
}

std::thread_local! {
    /// The clock as read once in the current callback, while a [`ClockPass`] is open: `Some(None)`
    /// not read yet, `Some(Some(t))` read.
    static PASS_CLOCK: std::cell::Cell<Option<Option<std::time::Duration>>> =
        const { std::cell::Cell::new(None) };
}

/// Host time in milliseconds since the Unix epoch (0 if unavailable); see [`now`].
pub fn now_ms() -> u64 {
    u64::try_from(now().as_millis()).unwrap_or(u64::MAX)
}

/// The host's clock since the Unix epoch (zero if the host will not tell): every VM of the
/// proxy reads the same clock, so times written to shared data compare across workers. Inside
/// a [`ClockPass`] the host is asked once and the answer reused.
pub fn now() -> std::time::Duration {
    if let Some(Some(t)) = PASS_CLOCK.with(std::cell::Cell::get) {
        return t;
    }
    let t = hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .unwrap_or_default();
    PASS_CLOCK.with(|c| {
        if c.get().is_some() {
            c.set(Some(Some(t)));
        }
    });
    t
}

/// One callback's view of the clock: while it lives, [`now`] reads the host's clock at most
/// once (a callback is a moment: the stages of the combined filter need not each ask). Open it
/// at the start of a callback, and let it drop at the end.
pub struct ClockPass(());

impl ClockPass {
    pub fn begin() -> ClockPass {
        PASS_CLOCK.with(|c| c.set(Some(None)));
        ClockPass(())
    }
}

impl Drop for ClockPass {
    fn drop(&mut self) {
        PASS_CLOCK.with(|c| c.set(None));
    }
}

/// A per-VM random value: the host's random source (WASI `random_get`, through std's hash
/// keys) mixed with the clock and the root context id, so that VMs differ in tie-breaks,
/// log origin ids and lease ownership.
pub fn vm_seed(context_id: u32) -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    let now = hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos() as u64);
    h.write_u64(now);
    h.write_u32(context_id);
    h.finish()
}

/// Defines a counter; `None` if the host refuses.
pub fn counter(name: &str) -> Option<u32> {
    hostcalls::define_metric(MetricType::Counter, name).ok()
}

/// Defines a gauge; `None` if the host refuses.
pub fn gauge(name: &str) -> Option<u32> {
    hostcalls::define_metric(MetricType::Gauge, name).ok()
}

std::thread_local! {
    /// Counter additions and [`SharedGauge`] moves kept in the VM until [`flush_metrics`], as
    /// `(metric id, delta)`, one entry per metric; `None` until [`defer_metrics`] (every change
    /// goes to the host at once).
    static PENDING: std::cell::RefCell<Option<Vec<(u32, i64)>>> =
        const { std::cell::RefCell::new(None) };
}

/// From now on this VM keeps counter additions ([`add`]) and [`SharedGauge`] moves to itself,
/// summed per metric, and gives them to the host at [`flush_metrics`] (the combined filter
/// flushes on its tick): a request then costs no metric host call, and a tick one per metric
/// that changed since the last.
pub fn defer_metrics() {
    PENDING.with(|p| {
        if let Ok(mut p) = p.try_borrow_mut() {
            p.get_or_insert_with(Vec::new);
        }
    });
}

/// Gives the host the metric changes kept since the last flush (see [`defer_metrics`]).
pub fn flush_metrics() {
    PENDING.with(|p| {
        let Ok(mut p) = p.try_borrow_mut() else {
            return;
        };
        let Some(pending) = p.as_mut() else {
            return;
        };
        for (id, delta) in pending.drain(..) {
            if delta != 0 {
                let _ = hostcalls::increment_metric(id, delta);
            }
        }
    });
}

/// Moves metric `id` by `delta`: kept in the VM when deferred, else given to the host at once.
/// `false` if the host refused.
fn increment(id: u32, delta: i64) -> bool {
    let kept = PENDING.with(|p| {
        let Ok(mut p) = p.try_borrow_mut() else {
            return false;
        };
        let Some(pending) = p.as_mut() else {
            return false;
        };
        match pending.iter_mut().find(|(i, _)| *i == id) {
            Some((_, d)) => *d = d.saturating_add(delta),
            None => pending.push((id, delta)),
        }
        true
    });
    kept || hostcalls::increment_metric(id, delta).is_ok()
}

/// Adds `n` to a counter defined with [`counter`] (nothing if it was not defined).
pub fn add(id: Option<u32>, n: u64) {
    if let Some(id) = id {
        increment(id, n.min(i64::MAX as u64) as i64);
    }
}

/// Sets a gauge defined with [`gauge`].
pub fn set(id: Option<u32>, value: u64) {
    if let Some(id) = id {
        let _ = hostcalls::record_metric(id, value);
    }
}

/// A gauge that several VMs (one per Envoy worker) share by name, each contributing its own
/// part: Envoy keeps one gauge per name for the whole process, so a per-worker figure (a
/// worker's queue, its requests in flight) set with [`set`] would show only the last worker
/// that wrote it. A `SharedGauge` moves the gauge by the change in this VM's part instead, so
/// the gauge reads the sum over all VMs.
#[derive(Debug)]
pub struct SharedGauge {
    id: Option<u32>,
    /// This VM's part, as last added to the gauge.
    part: std::cell::Cell<u64>,
}

impl SharedGauge {
    /// Defines the gauge `name` (skipped if the host refuses); this VM's part starts at 0.
    pub fn define(name: &str) -> Self {
        SharedGauge {
            id: gauge(name),
            part: std::cell::Cell::new(0),
        }
    }

    /// Sets this VM's part to `value`.
    pub fn set(&self, value: u64) {
        let old = self.part.get();
        if value == old {
            return;
        }
        let Some(id) = self.id else {
            self.part.set(value);
            return;
        };
        let delta = if value > old {
            i64::try_from(value - old).unwrap_or(i64::MAX)
        } else {
            i64::try_from(old - value).map_or(i64::MIN + 1, |d| -d)
        };
        // Only a part the gauge took is remembered, so the gauge never goes below the others'.
        if increment(id, delta) {
            self.part.set(value);
        }
    }

    /// Adds `delta` (negative: subtracts, not below 0) to this VM's part.
    pub fn add(&self, delta: i64) {
        self.set(self.part.get().saturating_add_signed(delta));
    }

    /// This VM's part.
    pub fn part(&self) -> u64 {
        self.part.get()
    }
}

/// Defines a histogram; `None` if the host refuses.
pub fn histogram(name: &str) -> Option<u32> {
    hostcalls::define_metric(MetricType::Histogram, name).ok()
}

/// Records a value in a histogram defined with [`histogram`].
pub fn record(id: Option<u32>, value: u64) {
    if let Some(id) = id {
        let _ = hostcalls::record_metric(id, value);
    }
}
