//! The floor of `kvoy-bench overhead`: the least any filter that routes on the request body does
//! in Envoy, so that the benchmark can say how much of kvoy's added latency and lost throughput
//! is wasm and Envoy's plumbing and how much is kvoy's own work.
//!
//! It depends on no kvoy crate: it is the floor, so it must not share kvoy's code.
//!
//! Per request: hold the headers, let Envoy buffer the whole body, copy it into the VM in one
//! call, hash it (xxh3, one pass), and set `x-gateway-destination-endpoint` to the pool address
//! the hash picks. No parsing, no index, no shared data, no metrics. It reads the combined
//! filter's configuration (the `prefix_affinity` section's `endpoints[].address`, or a top-level
//! `endpoints`), so the benchmark runs it in kvoy's own bootstrap. A benchmark instrument, not a
//! router: it ignores trailers and every other field, and a request with no body goes to the
//! first address.
//!
//! For the benchmark's calibration (`kvoy-bench overhead --host-calls N`), the section may also
//! carry `"floor": {"clock_reads": N}`: N more host calls per request, each a read of the clock
//! (`proxy_get_current_time_nanoseconds`: no data copied, no allocation in the VM), so that the
//! difference from the plain floor is what N crossings into Envoy and back cost, and nothing
//! else; or `"floor": {"shared_reads": N}`: N reads of one 64-byte shared-data value (Envoy's
//! process-wide lock, the copy, and the allocation of the answer in the VM: one more entry).

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel};
use std::rc::Rc;

const DESTINATION: &str = "x-gateway-destination-endpoint";

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Warn);
    proxy_wasm::set_root_context(|_| Box::new(Root { pool: Rc::new(Vec::new()), calibration: Calibration::default() }));
}}

struct Root {
    pool: Rc<Vec<String>>,
    calibration: Calibration,
}

/// The calibration's extra host calls per request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Calibration {
    clock_reads: u32,
    shared_reads: u32,
}

/// The shared-data key the `shared_reads` calibration reads.
const CALIBRATION_KEY: &str = "kvoy-floor-calibration";

/// The section the floor reads: `prefix_affinity` of the combined filter's configuration, or
/// the whole of a plain one.
fn section(v: &serde_json::Value) -> &serde_json::Value {
    v.get("prefix_affinity").unwrap_or(v)
}

/// `floor.clock_reads` and `floor.shared_reads` (0 when absent).
fn calibration(config: &[u8]) -> Calibration {
    let v = serde_json::from_slice::<serde_json::Value>(config).unwrap_or_default();
    let count = |name: &str| {
        section(&v)
            .get("floor")
            .and_then(|f| f.get(name))
            .and_then(serde_json::Value::as_u64)
            .map_or(0, |n| u32::try_from(n).unwrap_or(u32::MAX))
    };
    Calibration {
        clock_reads: count("clock_reads"),
        shared_reads: count("shared_reads"),
    }
}

/// The pool's addresses in `config`; empty when there are none.
fn addresses(config: &[u8]) -> Vec<String> {
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(config) else {
        return Vec::new();
    };
    let endpoints = section(&v).get("endpoints");
    endpoints
        .and_then(|e| e.as_array())
        .map(|list| {
            list.iter()
                .filter_map(|e| e.get("address").and_then(|a| a.as_str()))
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default()
}

impl Context for Root {}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let config = self.get_plugin_configuration().unwrap_or_default();
        self.pool = Rc::new(addresses(&config));
        self.calibration = calibration(&config);
        if self.calibration.shared_reads > 0
            && proxy_wasm::hostcalls::set_shared_data(CALIBRATION_KEY, Some(&[7u8; 64]), None)
                .is_err()
        {
            log::error!("kvoy_floor: cannot write the calibration's shared-data value");
            return false;
        }
        if self.pool.is_empty() {
            log::error!("kvoy_floor: the configuration names no endpoint address");
            return false;
        }
        true
    }

    fn create_http_context(&self, _id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Stream {
            pool: Rc::clone(&self.pool),
            calibration: self.calibration,
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Stream {
    pool: Rc<Vec<String>>,
    calibration: Calibration,
}

impl Stream {
    fn route(&self, hash: u64) {
        let n = self.pool.len().max(1) as u64;
        if let Some(address) = self.pool.get((hash % n) as usize) {
            self.set_http_request_header(DESTINATION, Some(address));
        }
    }
}

impl Context for Stream {}

impl HttpContext for Stream {
    fn on_http_request_headers(&mut self, _headers: usize, end_of_stream: bool) -> Action {
        if end_of_stream {
            self.route(0);
            return Action::Continue;
        }
        Action::Pause
    }

    fn on_http_request_body(&mut self, size: usize, end_of_stream: bool) -> Action {
        if !end_of_stream {
            return Action::Pause;
        }
        let body = self.get_http_request_body(0, size).unwrap_or_default();
        for _ in 0..self.calibration.clock_reads {
            std::hint::black_box(proxy_wasm::hostcalls::get_current_time().ok());
        }
        for _ in 0..self.calibration.shared_reads {
            std::hint::black_box(proxy_wasm::hostcalls::get_shared_data(CALIBRATION_KEY).ok());
        }
        self.route(xxhash_rust::xxh3::xxh3_64(&body));
        Action::Continue
    }
}

#[cfg(test)]
mod tests {
    use super::addresses;

    #[test]
    fn reads_the_combined_and_the_plain_configuration() {
        let combined = br#"{"session":{},"prefix_affinity":{"endpoints":[{"address":"127.0.0.1:1","models":["m"]},{"address":"127.0.0.1:2"}]}}"#;
        assert_eq!(addresses(combined), ["127.0.0.1:1", "127.0.0.1:2"]);
        assert_eq!(
            addresses(br#"{"endpoints":[{"address":"10.0.0.1:80"}]}"#),
            ["10.0.0.1:80"]
        );
        assert!(addresses(b"not json").is_empty());
        assert!(addresses(br#"{"endpoints":"x"}"#).is_empty());
    }

    #[test]
    fn reads_the_calibrations_host_calls() {
        use super::{calibration, Calibration};
        let combined = br#"{"prefix_affinity":{"endpoints":[],"floor":{"clock_reads":32}}}"#;
        assert_eq!(calibration(combined).clock_reads, 32);
        assert_eq!(
            calibration(br#"{"floor":{"shared_reads":4}}"#),
            Calibration {
                clock_reads: 0,
                shared_reads: 4
            }
        );
        assert_eq!(calibration(br#"{"endpoints":[]}"#), Calibration::default());
        assert_eq!(
            calibration(br#"{"floor":{"clock_reads":-1}}"#).clock_reads,
            0
        );
        assert_eq!(calibration(b"not json"), Calibration::default());
    }
}
