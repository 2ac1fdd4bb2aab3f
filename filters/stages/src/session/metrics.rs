//! The filter's Envoy metrics (`kvoy_session_*`). A metric that fails to define is skipped.

use kvoy_filter_common::counter;

pub struct Metrics {
    /// Requests that carried a session key or token.
    pub keyed: Option<u32>,
    /// Requests whose key was bound (or whose token was well-formed): a pin was handed over.
    pub hits: Option<u32>,
    /// Requests with a key but no live binding.
    pub misses: Option<u32>,
    /// Bindings written (new or refreshed).
    pub bindings: Option<u32>,
    /// Response ids bound (Responses API).
    pub response_ids: Option<u32>,
    pub invalid_tokens: Option<u32>,
    pub shared_state_errors: Option<u32>,
}

impl Metrics {
    pub fn define() -> Self {
        Metrics {
            keyed: counter("kvoy_session_keyed_requests_total"),
            hits: counter("kvoy_session_hits_total"),
            misses: counter("kvoy_session_misses_total"),
            bindings: counter("kvoy_session_bindings_total"),
            response_ids: counter("kvoy_session_response_ids_bound_total"),
            invalid_tokens: counter("kvoy_session_invalid_tokens_total"),
            shared_state_errors: counter("kvoy_session_shared_state_errors_total"),
        }
    }

    pub fn add(id: Option<u32>, n: u64) {
        kvoy_filter_common::add(id, n);
    }
}
