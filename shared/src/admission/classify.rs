//! From request headers to a [`Class`]: priority band, flow (fairness id) and size.

use super::config::AdmissionConfig;

/// The flow of a request without a fairness id.
pub const DEFAULT_FLOW: &str = "default-flow";
/// Longest fairness id kept, in bytes; longer ones are cut (at a character boundary).
pub const MAX_FLOW_BYTES: usize = 128;

/// How one request is queued. It borrows the fairness id from the header value, so
/// classifying allocates nothing; the queue copies the id only when it queues the request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Class<'a> {
    /// The band: higher priorities are released first.
    pub priority: i32,
    /// The fairness id, trimmed, at most [`MAX_FLOW_BYTES`] bytes, never empty.
    pub flow: &'a str,
    /// The request's `content-length` (0 when unknown, e.g. a chunked body): what the byte
    /// caps count.
    pub bytes: u64,
    /// `priority < 0`: rejected at once when the pool is saturated, unless
    /// `queue_sheddable`.
    pub sheddable: bool,
    /// The request's own deadline (ms, the caller's clock), if it has one; [`classify`] sets
    /// none. It expires the request early, and orders it under
    /// [`super::FlowOrdering::Edf`].
    pub deadline_ms: Option<u64>,
}

/// Classifies a request from its objective and fairness-id header values (the filter reads
/// [`crate::protocol::OBJECTIVE_HEADERS`] and [`crate::protocol::FAIRNESS_HEADERS`], first present wins) and its
/// `content-length`. An unknown or absent objective gets `default_priority`; an absent or
/// blank fairness id is [`DEFAULT_FLOW`]. Allocates nothing.
///
/// ```
/// use kvoy_shared::admission::{classify, AdmissionConfig};
/// let cfg = AdmissionConfig::from_json(br#"{"objectives":{"batch":-1}}"#).unwrap();
/// let c = classify(&cfg, Some("batch"), Some(" tenant-a "), Some(512));
/// assert_eq!((c.priority, c.flow, c.bytes, c.sheddable), (-1, "tenant-a", 512, true));
/// let c = classify(&cfg, Some("unknown"), None, None);
/// assert_eq!((c.priority, c.flow, c.bytes, c.sheddable), (0, "default-flow", 0, false));
/// ```
pub fn classify<'a>(
    config: &AdmissionConfig,
    objective: Option<&str>,
    fairness_id: Option<&'a str>,
    content_length: Option<u64>,
) -> Class<'a> {
    let objective = objective.map(str::trim).filter(|o| !o.is_empty());
    let priority = config.priority(objective);
    Class {
        priority,
        flow: flow_id(fairness_id),
        bytes: content_length.unwrap_or(0),
        sheddable: priority < 0,
        deadline_ms: None,
    }
}

/// The flow of a fairness-id header value: trimmed, cut to [`MAX_FLOW_BYTES`], or
/// [`DEFAULT_FLOW`] when that leaves nothing.
pub fn flow_id(header: Option<&str>) -> &str {
    let id = header.map(str::trim).unwrap_or("");
    let mut end = id.len().min(MAX_FLOW_BYTES);
    while !id.is_char_boundary(end) {
        end -= 1;
    }
    let id = id.get(..end).unwrap_or("").trim_end();
    if id.is_empty() {
        DEFAULT_FLOW
    } else {
        id
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> AdmissionConfig {
        AdmissionConfig::from_json(
            br#"{"objectives":{"chat":10,"batch":-1,"zero":0},"default_priority":2}"#,
        )
        .unwrap()
    }

    #[test]
    fn objectives_set_the_band() {
        let cfg = config();
        let c = classify(&cfg, Some("chat"), Some("a"), Some(100));
        assert_eq!(
            c,
            Class {
                priority: 10,
                flow: "a",
                bytes: 100,
                sheddable: false,
                deadline_ms: None
            }
        );
        assert_eq!(classify(&cfg, Some(" chat\t"), None, None).priority, 10);
        let c = classify(&cfg, Some("batch"), None, None);
        assert!(c.sheddable && c.priority == -1);
        assert_eq!(classify(&cfg, Some("zero"), None, None).priority, 0);
        for unknown in [None, Some(""), Some("  "), Some("Chat"), Some("other")] {
            let c = classify(&cfg, unknown, None, None);
            assert_eq!((c.priority, c.sheddable), (2, false), "{unknown:?}");
        }
        let neg = AdmissionConfig::from_json(br#"{"default_priority":-5}"#).unwrap();
        assert!(classify(&neg, None, None, None).sheddable);
    }

    #[test]
    fn flow_ids_are_trimmed_capped_and_defaulted() {
        assert_eq!(flow_id(None), DEFAULT_FLOW);
        assert_eq!(flow_id(Some("")), DEFAULT_FLOW);
        assert_eq!(flow_id(Some(" \t ")), DEFAULT_FLOW);
        assert_eq!(flow_id(Some(" tenant-a ")), "tenant-a");
        let long = "x".repeat(300);
        assert_eq!(flow_id(Some(&long)).len(), MAX_FLOW_BYTES);
        // a cut never splits a character: 127 ASCII bytes, then a 2-byte 'é'
        let id = format!("{}é tail", "y".repeat(127));
        let cut = flow_id(Some(&id));
        assert_eq!(cut, "y".repeat(127));
        let wide = "€".repeat(100);
        let cut = flow_id(Some(&wide));
        assert!(cut.len() <= MAX_FLOW_BYTES && cut.chars().all(|c| c == '€'));
        assert_eq!(cut.len(), 126);
        // whitespace left at the cut is trimmed too
        let id = format!("{} {}", "z".repeat(127), "more");
        assert_eq!(flow_id(Some(&id)), "z".repeat(127));
    }

    #[test]
    fn content_length_is_the_size() {
        let cfg = config();
        assert_eq!(classify(&cfg, None, None, Some(u64::MAX)).bytes, u64::MAX);
        assert_eq!(classify(&cfg, None, None, None).bytes, 0);
    }
}
