//! What kvoy says on the wire, in one place: the headers the filters read and write, the
//! aggregator's paths, the OpenAI paths the filters route, and the OpenAI error body. Every
//! crate (filters, aggregator, kvoy-local, tests and benchmarks) takes these names from here.

/// The destination the ORIGINAL_DST cluster routes by (Gateway API Inference Extension): set by
/// the prefix-affinity stage, removed when a client sends it.
pub const DESTINATION_HEADER: &str = "x-gateway-destination-endpoint";
/// The endpoint that actually served the request, on the response (set by the prefix-affinity
/// stage; the session stage binds a session to it).
pub const SERVED_HEADER: &str = "x-gateway-destination-endpoint-served";
/// The prefill endpoint (`ip:port`) of a disaggregated request, for the decode endpoint's
/// sidecar (llm-d/llm-d-router at ebab687, `pkg/common/routing/common.go`). Set by the
/// prefix-affinity stage when it splits a request; any value a client sent is removed first.
pub const PREFILLER_HEADER: &str = "x-prefiller-host-port";
/// The internal request header by which the separate `kvoy_session` filter hands the pinned
/// endpoint (`ip:port`) to `kvoy_prefix_affinity`. Both filters remove any client-sent value;
/// the prefix-affinity filter removes it before the request leaves the proxy.
pub const PIN_HEADER: &str = "x-kvoy-session-endpoint";
/// Why the admission stage answered a request 429 (or 503): `saturated`, `queue-full`,
/// `ttl-expired`, `no-endpoint`.
pub const DROPPED_REASON_HEADER: &str = "x-kvoy-dropped-reason";
/// Request headers naming the InferenceObjective, in the order the admission stage reads them.
pub const OBJECTIVE_HEADERS: [&str; 2] = [
    "x-gateway-inference-objective",
    "x-llm-d-inference-objective",
];
/// Request headers carrying the fairness id, in the order the admission stage reads them.
pub const FAIRNESS_HEADERS: [&str; 2] = [
    "x-gateway-inference-fairness-id",
    "x-llm-d-inference-fairness-id",
];
/// The aggregator's header saying why `/v1/snapshot` has no snapshot (`not-loaded`).
pub const AGGREGATOR_STATUS_HEADER: &str = "x-kvoy-aggregator-status";

/// The aggregator's snapshot, polled by the filters.
pub const SNAPSHOT_PATH: &str = "/v1/snapshot";
/// The aggregator's decision exchange ([`crate::relay`]).
pub const DECISIONS_PATH: &str = "/v1/decisions";
/// The aggregator's list of removed and offloaded prefixes (JSON, for people and tests).
pub const REMOVALS_PATH: &str = "/v1/removals";
/// The aggregator's endpoints as it sees them (JSON).
pub const ENDPOINTS_PATH: &str = "/v1/endpoints";
/// The aggregator's pool view (JSON; the pool page reads it).
pub const POOL_PATH: &str = "/v1/pool";

/// OpenAI's chat completions API.
pub const CHAT_COMPLETIONS_PATH: &str = "/v1/chat/completions";
/// OpenAI's (legacy) completions API.
pub const COMPLETIONS_PATH: &str = "/v1/completions";
/// OpenAI's Responses API.
pub const RESPONSES_PATH: &str = "/v1/responses";
/// OpenAI's model list.
pub const MODELS_PATH: &str = "/v1/models";

/// A JSON error body in OpenAI's shape:
/// `{"error":{"message":..,"type":..,"param":..,"code":..}}`.
pub fn openai_error_body(
    message: &str,
    kind: &str,
    param: Option<&str>,
    code: Option<&str>,
) -> String {
    serde_json::json!({
        "error": {"message": message, "type": kind, "param": param, "code": code}
    })
    .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_body_is_openais_shape() {
        let body = openai_error_body("no", "invalid_request_error", Some("model"), None);
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"error": {"message": "no", "type": "invalid_request_error",
                "param": "model", "code": null}})
        );
    }
}
