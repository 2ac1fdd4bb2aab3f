//! `GET /metrics`: the simulator's state in Prometheus text format, with vLLM's metric names.

use std::fmt::Write;
use std::sync::Mutex;
use std::time::Duration;

use crate::engine::EngineStats;

/// vLLM's TTFT buckets (seconds).
const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
/// vLLM's inter-token latency buckets (seconds).
const ITL_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];

#[derive(Debug, Clone)]
struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            counts: vec![0; bounds.len()],
            sum: 0.0,
            count: 0,
        }
    }

    fn observe(&mut self, v: f64) {
        for (b, c) in self.bounds.iter().zip(self.counts.iter_mut()) {
            if v <= *b {
                *c += 1;
            }
        }
        self.sum += v;
        self.count += 1;
    }

    fn render(&self, out: &mut String, name: &str, labels: &str) {
        let _ = writeln!(out, "# TYPE {name} histogram");
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{b}\"}} {c}");
        }
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum{{{labels}}} {}", self.sum);
        let _ = writeln!(out, "{name}_count{{{labels}}} {}", self.count);
    }
}

/// Latency histograms and request counters recorded by the HTTP layer, in simulated time.
#[derive(Debug)]
pub struct Recorder {
    inner: Mutex<Recorded>,
}

#[derive(Debug)]
struct Recorded {
    ttft: Histogram,
    itl: Histogram,
    success: u64,
    errors: u64,
}

impl Default for Recorder {
    fn default() -> Self {
        Recorder {
            inner: Mutex::new(Recorded {
                ttft: Histogram::new(TTFT_BUCKETS),
                itl: Histogram::new(ITL_BUCKETS),
                success: 0,
                errors: 0,
            }),
        }
    }
}

impl Recorder {
    fn with(&self, f: impl FnOnce(&mut Recorded)) {
        match self.inner.lock() {
            Ok(mut r) => f(&mut r),
            Err(poisoned) => f(&mut poisoned.into_inner()),
        }
    }

    pub fn ttft(&self, d: Duration) {
        self.with(|r| r.ttft.observe(d.as_secs_f64()));
    }

    pub fn inter_token(&self, d: Duration) {
        self.with(|r| r.itl.observe(d.as_secs_f64()));
    }

    pub fn finished(&self, ok: bool) {
        self.with(|r| if ok { r.success += 1 } else { r.errors += 1 });
    }

    /// The whole exposition: engine gauges and counters, then the recorded histograms.
    pub fn render(&self, model: &str, stats: &EngineStats) -> String {
        let labels = format!("model_name=\"{}\"", escape_label(model));
        let mut out = String::with_capacity(4096);
        let gauge = |out: &mut String, name: &str, help: &str, v: f64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} gauge\n{name}{{{labels}}} {v}"
            );
        };
        let counter = |out: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name}{{{labels}}} {v}"
            );
        };
        gauge(
            &mut out,
            "vllm:num_requests_running",
            "Requests in the running batch.",
            stats.running as f64,
        );
        gauge(
            &mut out,
            "vllm:num_requests_waiting",
            "Requests waiting to be scheduled.",
            stats.waiting as f64,
        );
        gauge(
            &mut out,
            "vllm:kv_cache_usage_perc",
            "KV-cache usage, 1 means 100 percent.",
            stats.kv_cache_usage,
        );
        let _ = writeln!(
            out,
            "# HELP vllm:cache_config_info Information of the KV cache configuration.\n# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{{{labels},block_size=\"{}\",num_gpu_blocks=\"{}\"}} 1",
            stats.block_size, stats.num_gpu_blocks
        );
        counter(
            &mut out,
            "vllm:prefix_cache_queries_total",
            "Prompt tokens looked up in the prefix cache.",
            stats.prefix_cache_queries,
        );
        counter(
            &mut out,
            "vllm:prefix_cache_hits_total",
            "Prompt tokens found in the prefix cache.",
            stats.prefix_cache_hits,
        );
        counter(
            &mut out,
            "vllm:num_preemptions_total",
            "Preempted requests.",
            stats.preemptions,
        );
        self.with(|r| {
            counter(
                &mut out,
                "vllm:request_success_total",
                "Requests finished.",
                r.success,
            );
            counter(
                &mut out,
                "kvoy_sim_request_errors_total",
                "Requests that failed (injected faults included).",
                r.errors,
            );
            r.ttft
                .render(&mut out, "vllm:time_to_first_token_seconds", &labels);
            r.itl
                .render(&mut out, "vllm:inter_token_latency_seconds", &labels);
        });
        out
    }
}

fn escape_label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_is_cumulative() {
        let mut h = Histogram::new(&[0.1, 1.0]);
        h.observe(0.05);
        h.observe(0.5);
        h.observe(5.0);
        let mut out = String::new();
        h.render(&mut out, "x", "a=\"b\"");
        assert!(out.contains("x_bucket{a=\"b\",le=\"0.1\"} 1\n"), "{out}");
        assert!(out.contains("x_bucket{a=\"b\",le=\"1\"} 2\n"), "{out}");
        assert!(out.contains("x_bucket{a=\"b\",le=\"+Inf\"} 3\n"), "{out}");
        assert!(out.contains("x_count{a=\"b\"} 3\n"), "{out}");
    }

    #[test]
    fn labels_are_escaped() {
        assert_eq!(escape_label("a\"b\\c"), "a\\\"b\\\\c");
    }
}
