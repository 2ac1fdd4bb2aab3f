//! The Prometheus text parser (`kvoy_aggregator::prom`), which the aggregator runs on every
//! model server's `/metrics`.
//!
//! Beyond "no panic":
//! - every sample's name is a metric name and a slice of the text, its labels have label names
//!   and are no more than the text's quotes allow, and there are no more samples and errors
//!   than lines;
//! - what `parse_server_metrics` reports is within range: usage in 0..=1, queues, counters and
//!   histogram totals finite and non-negative, the malformed count no more than the lines.
#![no_main]

use kvoy_aggregator::prom::{parse_server_metrics, samples, HistogramTotals, PromError};
use libfuzzer_sys::fuzz_target;

fn metric_name(s: &str) -> bool {
    let mut b = s.bytes();
    b.next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == b'_' || c == b':')
        && b.all(|c| c.is_ascii_alphanumeric() || c == b'_' || c == b':')
}

fn label_name(s: &str) -> bool {
    let mut b = s.bytes();
    b.next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == b'_')
        && b.all(|c| c.is_ascii_alphanumeric() || c == b'_')
}

fn within(text: &str, part: &str) -> bool {
    let (t, p) = (text.as_ptr() as usize, part.as_ptr() as usize);
    p >= t && p + part.len() <= t + text.len()
}

fn count(v: Option<f64>) -> bool {
    v.is_none_or(|v| v.is_finite() && v >= 0.0)
}

fn totals(h: Option<HistogramTotals>) -> bool {
    h.is_none_or(|h| count(Some(h.sum)) && count(Some(h.count)))
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let lines = text.split('\n').count();
    let quotes = text.bytes().filter(|&b| b == b'"').count();
    let mut items = 0;
    for item in samples(text) {
        items += 1;
        match item {
            Ok(s) => {
                assert!(
                    metric_name(s.name) && within(text, s.name),
                    "name {:?}",
                    s.name
                );
                let mut labels = 0;
                for (name, value) in s.labels() {
                    labels += 1;
                    assert!(label_name(name) && within(text, name), "label {name:?}");
                    assert!(value.len() <= text.len());
                    assert!(labels * 2 <= quotes, "more labels than quoted values");
                }
            }
            Err(PromError::Malformed { line, .. }) => assert!((1..=lines).contains(&line)),
            Err(e) => panic!("samples gave {e}"),
        }
    }
    assert!(items <= lines);
    match parse_server_metrics(text) {
        Ok(m) => {
            assert!(m.flavor.is_some());
            assert!(m.kv_cache_usage.is_none_or(|u| (0.0..=1.0).contains(&u)));
            for v in [
                m.waiting,
                m.running,
                m.prefix_cache_queries,
                m.prefix_cache_hits,
                m.prompt_tokens,
                m.generation_tokens,
            ] {
                assert!(count(v), "{m:?}");
            }
            for h in [m.prefill_time, m.queue_time, m.prefill_computed_tokens] {
                assert!(totals(h), "{m:?}");
            }
            assert!(m.block_size != Some(0) && m.num_gpu_blocks != Some(0));
            assert!(m.malformed_lines as usize <= lines);
        }
        Err(e) => assert_eq!(e, PromError::NoServerMetrics),
    }
});
