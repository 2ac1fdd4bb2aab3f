//! `GET /metrics`: the simulator's state in Prometheus text format, with vLLM's metric names,
//! bucket boundaries and labels (`engine="0"`, `model_name`, sorted as prometheus_client sorts
//! them), from `vllm/v1/metrics/loggers.py`.
//!
//! Times are wall-clock seconds as a client sees them: the simulated durations divided by the
//! speedup. A simulator at `--speedup 10` is a server ten times faster than the profile, in its
//! latencies as in its token counters.

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
/// vLLM's `request_latency_buckets` (seconds): e2e, queue, inference, prefill and decode time.
const REQUEST_LATENCY_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

/// vLLM's `build_1_2_5_buckets(max_value)`: 1, 2, 5, 10, 20, 50, ... up to `max_value`.
fn buckets_1_2_5(max_value: u64) -> Vec<f64> {
    let mut out = Vec::new();
    let mut scale = 1u64;
    loop {
        for m in [1, 2, 5] {
            match scale.checked_mul(m) {
                Some(v) if v <= max_value => out.push(v as f64),
                _ => return out,
            }
        }
        scale = match scale.checked_mul(10) {
            Some(s) => s,
            None => return out,
        };
    }
}

#[derive(Debug, Clone)]
struct Histogram {
    bounds: Vec<f64>,
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn new(bounds: &[f64]) -> Self {
        Histogram {
            bounds: bounds.to_vec(),
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

    fn seconds(&mut self, d: Duration) {
        self.observe(d.as_secs_f64());
    }

    fn render(&self, out: &mut String, name: &str, help: &str, labels: &Labels) {
        let (engine, model) = (&labels.engine, &labels.model);
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            let _ = writeln!(out, "{name}_bucket{{{engine},le=\"{b}\",{model}}} {c}");
        }
        let _ = writeln!(
            out,
            "{name}_bucket{{{engine},le=\"+Inf\",{model}}} {}",
            self.count
        );
        let _ = writeln!(out, "{name}_sum{{{engine},{model}}} {}", self.sum);
        let _ = writeln!(out, "{name}_count{{{engine},{model}}} {}", self.count);
    }
}

/// The label pairs of every series, rendered once: `engine="0"` and `model_name="..."`.
struct Labels {
    engine: String,
    model: String,
}

impl Labels {
    fn new(model: &str) -> Self {
        Labels {
            engine: "engine=\"0\"".to_owned(),
            model: format!("model_name=\"{}\"", escape_label(model)),
        }
    }

    /// `engine="0",model_name="..."`.
    fn both(&self) -> String {
        format!("{},{}", self.engine, self.model)
    }
}

/// What the HTTP layer saw of one finished request (wall-clock durations), recorded into the
/// per-request histograms as vLLM records them when a request finishes.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct FinishedRequest {
    /// Waiting before the first scheduling.
    pub queue: Duration,
    /// First scheduling to first token.
    pub prefill: Duration,
    /// First token to last token.
    pub decode: Duration,
    /// Arrival to last token.
    pub e2e: Duration,
    pub prompt_tokens: u32,
    pub generation_tokens: u32,
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: u32,
}

/// Latency histograms and request counters recorded by the HTTP layer (wall clock).
#[derive(Debug)]
pub struct Recorder {
    inner: Mutex<Recorded>,
}

#[derive(Debug)]
struct Recorded {
    ttft: Histogram,
    itl: Histogram,
    e2e: Histogram,
    queue: Histogram,
    inference: Histogram,
    prefill: Histogram,
    decode: Histogram,
    prompt_tokens: Histogram,
    generation_tokens: Histogram,
    prefill_kv_computed: Histogram,
    success: u64,
    errors: u64,
    /// Disaggregation: requests whose prompt a prefill server computed, requests whose prefill
    /// failed and ran here, prefills done here for a remote decoder.
    remote_prefills: u64,
    remote_prefill_fallbacks: u64,
    prefills_for_remote: u64,
}

impl Default for Recorder {
    /// A recorder for a `max_model_len` of 131,072 tokens (the token-count buckets).
    fn default() -> Self {
        Recorder::new(131_072)
    }
}

impl Recorder {
    /// `max_model_len` bounds the token-count buckets, as in vLLM.
    pub fn new(max_model_len: u64) -> Self {
        let tokens = buckets_1_2_5(max_model_len);
        Recorder {
            inner: Mutex::new(Recorded {
                ttft: Histogram::new(TTFT_BUCKETS),
                itl: Histogram::new(ITL_BUCKETS),
                e2e: Histogram::new(REQUEST_LATENCY_BUCKETS),
                queue: Histogram::new(REQUEST_LATENCY_BUCKETS),
                inference: Histogram::new(REQUEST_LATENCY_BUCKETS),
                prefill: Histogram::new(REQUEST_LATENCY_BUCKETS),
                decode: Histogram::new(REQUEST_LATENCY_BUCKETS),
                prompt_tokens: Histogram::new(&tokens),
                generation_tokens: Histogram::new(&tokens),
                prefill_kv_computed: Histogram::new(&tokens),
                success: 0,
                errors: 0,
                remote_prefills: 0,
                remote_prefill_fallbacks: 0,
                prefills_for_remote: 0,
            }),
        }
    }

    fn with(&self, f: impl FnOnce(&mut Recorded)) {
        match self.inner.lock() {
            Ok(mut r) => f(&mut r),
            Err(poisoned) => f(&mut poisoned.into_inner()),
        }
    }

    pub fn ttft(&self, d: Duration) {
        self.with(|r| r.ttft.seconds(d));
    }

    pub fn inter_token(&self, d: Duration) {
        self.with(|r| r.itl.seconds(d));
    }

    /// A request that failed (injected fault, refused by the engine, client gone).
    pub fn failed(&self) {
        self.with(|r| r.errors += 1);
    }

    /// A disaggregated request's prefill elsewhere: done (`true`), or failed and run here.
    pub fn remote_prefill(&self, done: bool) {
        self.with(|r| {
            if done {
                r.remote_prefills += 1;
            } else {
                r.remote_prefill_fallbacks += 1;
            }
        });
    }

    /// A prefill run here for a remote decoder.
    pub fn prefilled_for_remote(&self) {
        self.with(|r| r.prefills_for_remote += 1);
    }

    /// A request that finished: `vllm:request_success_total` and the per-request histograms.
    pub fn completed(&self, f: &FinishedRequest) {
        self.with(|r| {
            r.success += 1;
            r.e2e.seconds(f.e2e);
            r.queue.seconds(f.queue);
            r.prefill.seconds(f.prefill);
            r.decode.seconds(f.decode);
            r.inference.seconds(f.prefill + f.decode);
            r.prompt_tokens.observe(f64::from(f.prompt_tokens));
            r.generation_tokens.observe(f64::from(f.generation_tokens));
            let computed = f.prompt_tokens.saturating_sub(f.cached_tokens);
            r.prefill_kv_computed.observe(f64::from(computed));
        });
    }

    /// The whole exposition: engine gauges and counters, then the recorded histograms.
    pub fn render(&self, model: &str, stats: &EngineStats) -> String {
        let labels = Labels::new(model);
        let both = labels.both();
        let mut out = String::with_capacity(16 * 1024);
        let gauge = |out: &mut String, name: &str, help: &str, v: f64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} gauge\n{name}{{{both}}} {v}"
            );
        };
        let counter = |out: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name}{{{both}}} {v}"
            );
        };
        gauge(
            &mut out,
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            stats.running as f64,
        );
        gauge(
            &mut out,
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            stats.waiting as f64,
        );
        gauge(
            &mut out,
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            stats.kv_cache_usage,
        );
        let _ = writeln!(
            out,
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{{block_size=\"{}\",enable_prefix_caching=\"True\",{},num_gpu_blocks=\"{}\"}} 1",
            stats.block_size, labels.engine, stats.num_gpu_blocks
        );
        counter(
            &mut out,
            "vllm:prefix_cache_queries_total",
            "Prefix cache queries, in terms of number of queried tokens.",
            stats.prefix_cache_queries,
        );
        counter(
            &mut out,
            "vllm:prefix_cache_hits_total",
            "Prefix cache hits, in terms of number of cached tokens.",
            stats.prefix_cache_hits,
        );
        // vLLM registers these with or without a connector; they stay 0 without the CPU tier.
        counter(
            &mut out,
            "vllm:external_prefix_cache_queries_total",
            "External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of queried tokens.",
            stats.external_prefix_cache_queries,
        );
        counter(
            &mut out,
            "vllm:external_prefix_cache_hits_total",
            "External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of cached tokens.",
            stats.external_prefix_cache_hits,
        );
        counter(
            &mut out,
            "vllm:num_preemptions_total",
            "Cumulative number of preemption from the engine.",
            stats.preemptions,
        );
        counter(
            &mut out,
            "vllm:prompt_tokens_total",
            "Number of prefill tokens processed.",
            stats.prompt_tokens,
        );
        counter(
            &mut out,
            "vllm:generation_tokens_total",
            "Number of generation tokens processed.",
            stats.generation_tokens,
        );
        self.with(|r| {
            // The simulated model always runs to `max_tokens`: every success is "length".
            let _ = writeln!(
                out,
                "# HELP vllm:request_success_total Count of successfully processed requests.\n# TYPE vllm:request_success_total counter\nvllm:request_success_total{{{},finished_reason=\"length\",{}}} {}",
                labels.engine, labels.model, r.success
            );
            counter(
                &mut out,
                "kvoy_sim_request_errors_total",
                "Requests that failed (injected faults included).",
                r.errors,
            );
            counter(
                &mut out,
                "kvoy_sim_remote_prefills_total",
                "Requests whose prompt a prefill server computed (x-prefiller-host-port).",
                r.remote_prefills,
            );
            counter(
                &mut out,
                "kvoy_sim_remote_prefill_fallbacks_total",
                "Requests whose remote prefill failed and ran here instead.",
                r.remote_prefill_fallbacks,
            );
            counter(
                &mut out,
                "kvoy_sim_prefills_for_remote_decode_total",
                "Prefills run here for a remote decoder (kv_transfer_params.do_remote_decode).",
                r.prefills_for_remote,
            );
            let histograms: [(&Histogram, &str, &str); 10] = [
                (
                    &r.ttft,
                    "vllm:time_to_first_token_seconds",
                    "Histogram of time to first token in seconds.",
                ),
                (
                    &r.itl,
                    "vllm:inter_token_latency_seconds",
                    "Histogram of inter-token latency in seconds.",
                ),
                (
                    &r.e2e,
                    "vllm:e2e_request_latency_seconds",
                    "Histogram of e2e request latency in seconds.",
                ),
                (
                    &r.queue,
                    "vllm:request_queue_time_seconds",
                    "Histogram of time spent in WAITING phase for request.",
                ),
                (
                    &r.inference,
                    "vllm:request_inference_time_seconds",
                    "Histogram of time spent in RUNNING phase for request.",
                ),
                (
                    &r.prefill,
                    "vllm:request_prefill_time_seconds",
                    "Histogram of time spent in PREFILL phase for request.",
                ),
                (
                    &r.decode,
                    "vllm:request_decode_time_seconds",
                    "Histogram of time spent in DECODE phase for request.",
                ),
                (
                    &r.prompt_tokens,
                    "vllm:request_prompt_tokens",
                    "Number of prefill tokens processed.",
                ),
                (
                    &r.generation_tokens,
                    "vllm:request_generation_tokens",
                    "Number of generation tokens processed.",
                ),
                (
                    &r.prefill_kv_computed,
                    "vllm:request_prefill_kv_computed_tokens",
                    "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
                ),
            ];
            for (h, name, help) in histograms {
                h.render(&mut out, name, help, &labels);
            }
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
        h.render(&mut out, "x", "help", &Labels::new("m"));
        let l = "engine=\"0\"";
        assert!(out.contains("# TYPE x histogram\n"), "{out}");
        assert!(
            out.contains(&format!("x_bucket{{{l},le=\"0.1\",model_name=\"m\"}} 1\n")),
            "{out}"
        );
        assert!(
            out.contains(&format!("x_bucket{{{l},le=\"1\",model_name=\"m\"}} 2\n")),
            "{out}"
        );
        assert!(
            out.contains(&format!("x_bucket{{{l},le=\"+Inf\",model_name=\"m\"}} 3\n")),
            "{out}"
        );
        assert!(
            out.contains(&format!("x_count{{{l},model_name=\"m\"}} 3\n")),
            "{out}"
        );
        assert!(
            out.contains(&format!("x_sum{{{l},model_name=\"m\"}} 5.55\n")),
            "{out}"
        );
    }

    #[test]
    fn token_buckets_are_vllms_1_2_5() {
        assert_eq!(buckets_1_2_5(100), [1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0]);
        let b = buckets_1_2_5(131_072);
        assert_eq!((b.len(), b.last()), (16, Some(&100_000.0)));
        assert!(buckets_1_2_5(0).is_empty());
        assert_eq!(buckets_1_2_5(u64::MAX).len(), 58);
    }

    #[test]
    fn completed_requests_fill_the_per_request_histograms() {
        let r = Recorder::new(1000);
        r.completed(&FinishedRequest {
            queue: Duration::from_millis(100),
            prefill: Duration::from_millis(400),
            decode: Duration::from_millis(600),
            e2e: Duration::from_millis(1200),
            prompt_tokens: 300,
            generation_tokens: 7,
            cached_tokens: 96,
        });
        r.failed();
        let text = r.render(
            "m",
            &EngineStats {
                running: 0,
                waiting: 0,
                kv_cache_usage: 0.0,
                num_gpu_blocks: 10,
                block_size: 16,
                num_cached_blocks: 0,
                prefix_cache_queries: 300,
                prefix_cache_hits: 96,
                external_prefix_cache_queries: 300,
                external_prefix_cache_hits: 32,
                num_cpu_cached_blocks: 2,
                preemptions: 0,
                prompt_tokens: 300,
                generation_tokens: 7,
            },
        );
        let l = "{engine=\"0\",model_name=\"m\"}";
        for line in [
            format!("vllm:request_prefill_time_seconds_sum{l} 0.4"),
            format!("vllm:request_queue_time_seconds_count{l} 1"),
            format!("vllm:request_inference_time_seconds_sum{l} 1"),
            format!("vllm:request_prefill_kv_computed_tokens_sum{l} 204"),
            format!("vllm:request_prompt_tokens_sum{l} 300"),
            format!("vllm:prompt_tokens_total{l} 300"),
            format!("vllm:generation_tokens_total{l} 7"),
            format!("vllm:external_prefix_cache_queries_total{l} 300"),
            format!("vllm:external_prefix_cache_hits_total{l} 32"),
            "vllm:request_prefill_kv_computed_tokens_bucket{engine=\"0\",le=\"1000\",model_name=\"m\"} 1".to_owned(),
            "vllm:request_prefill_kv_computed_tokens_bucket{engine=\"0\",le=\"200\",model_name=\"m\"} 0".to_owned(),
            "vllm:request_success_total{engine=\"0\",finished_reason=\"length\",model_name=\"m\"} 1".to_owned(),
            format!("kvoy_sim_request_errors_total{l} 1"),
        ] {
            assert!(text.contains(&format!("{line}\n")), "missing {line}:\n{text}");
        }
    }

    #[test]
    fn labels_are_escaped() {
        assert_eq!(escape_label("a\"b\\c"), "a\\\"b\\\\c");
    }
}
