//! Prometheus text exposition (format 0.0.4; OpenMetrics' `# EOF`, float timestamps and
//! exemplars tolerated) and the model-server series kvoy routes on.
//!
//! The body comes from the network, so nothing here panics: a bad line is an `Err` item that
//! [`parse_server_metrics`] counts and skips, never a failed scrape. Samples borrow from the text
//! and their labels are scanned lazily, because kvoy reads a handful of the hundreds of series a
//! vLLM server exposes.
//!
//! ```
//! use kvoy_aggregator::prom::{parse_server_metrics, ServerFlavor};
//!
//! let body = "# TYPE vllm:num_requests_waiting gauge\n\
//!             vllm:num_requests_waiting{model_name=\"m\",engine=\"0\"} 3.0\n\
//!             vllm:kv_cache_usage_perc{model_name=\"m\",engine=\"0\"} 0.25\n";
//! let m = parse_server_metrics(body).unwrap();
//! assert_eq!(m.flavor, Some(ServerFlavor::Vllm));
//! assert_eq!((m.waiting, m.kv_cache_usage), (Some(3.0), Some(0.25)));
//! ```

use std::borrow::Cow;

/// One sample line, `name{labels} value [timestamp]`, borrowed from the exposition text.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample<'a> {
    pub name: &'a str,
    pub value: f64,
    /// Milliseconds since the epoch (OpenMetrics' float seconds are converted).
    pub timestamp_ms: Option<i64>,
    /// The text between the braces, already validated by the line parser.
    labels: &'a str,
}

impl<'a> Sample<'a> {
    /// The value of label `name`, unescaped (`\\`, `\"`, `\n`), if present (the first wins).
    pub fn label(&self, name: &str) -> Option<Cow<'a, str>> {
        self.labels().find(|(n, _)| *n == name).map(|(_, v)| v)
    }

    /// Iterates (name, value) label pairs, in the order they appear.
    pub fn labels(&self) -> impl Iterator<Item = (&'a str, Cow<'a, str>)> + '_ {
        let raw = self.labels;
        let mut pos = 0;
        std::iter::from_fn(move || match scan_label(raw, pos) {
            Ok(Step::Label(name, value, next)) => {
                pos = next;
                Some((name, unescape(value)))
            }
            Ok(Step::End(_)) | Err(_) => None,
        })
    }
}

/// Why a body, or one line of it, was not usable.
#[derive(Clone, Debug, thiserror::Error, PartialEq, Eq)]
pub enum PromError {
    /// A line that is neither blank, a comment nor a well-formed sample (1-based line number).
    #[error("line {line}: {reason}")]
    Malformed { line: usize, reason: &'static str },
    /// None of the known queue, running or KV-usage series appear: not a model server.
    #[error("no model-server metrics (no known queue, running or KV-usage series)")]
    NoServerMetrics,
}

/// Sample lines of a text exposition, in order. Comments (`# HELP`, `# TYPE`, others) and blank
/// lines are skipped; a malformed line yields `Err` and iteration continues with the next line.
/// Iteration stops at OpenMetrics' `# EOF`.
pub fn samples(text: &str) -> impl Iterator<Item = Result<Sample<'_>, PromError>> {
    text.split('\n')
        .enumerate()
        .take_while(|(_, line)| line.trim() != "# EOF")
        .filter_map(|(i, line)| match parse_line(line) {
            Ok(sample) => sample.map(Ok),
            Err(reason) => Some(Err(PromError::Malformed {
                line: i + 1,
                reason,
            })),
        })
}

/// The model-server implementations whose metric names kvoy knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ServerFlavor {
    Vllm,
    Sglang,
}

/// What kvoy reads from one model server's `/metrics`. Series repeated per engine (vLLM's
/// `engine` label) or per rank (SGLang's `dp_rank`) are summed for queues and counters and
/// maxed for usage and capacity.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ServerMetrics {
    /// Which names were found (the first known queue/running/usage series decides).
    pub flavor: Option<ServerFlavor>,
    /// `vllm:num_requests_waiting` | `sglang:num_queue_reqs`, summed.
    pub waiting: Option<f64>,
    /// `vllm:num_requests_running` | `sglang:num_running_reqs`, summed.
    pub running: Option<f64>,
    /// `vllm:kv_cache_usage_perc`, else `vllm:gpu_cache_usage_perc` | `sglang:token_usage`;
    /// the max over series, clamped to [0, 1].
    pub kv_cache_usage: Option<f64>,
    /// `vllm:cache_config_info{block_size}` | `sglang:page_size`.
    pub block_size: Option<u32>,
    /// `vllm:cache_config_info{num_gpu_blocks}` | `sglang:num_pages`, else
    /// `sglang:max_total_num_tokens / sglang:page_size`.
    pub num_gpu_blocks: Option<u32>,
    /// `vllm:prefix_cache_queries[_total]` (else the deprecated `vllm:gpu_prefix_cache_queries`)
    /// | `sglang:prompt_tokens_total`; tokens, summed.
    pub prefix_cache_queries: Option<f64>,
    /// `vllm:prefix_cache_hits[_total]` (else `vllm:gpu_prefix_cache_hits`)
    /// | `sglang:cached_tokens_total`; tokens, summed.
    pub prefix_cache_hits: Option<f64>,
    /// `vllm:prompt_tokens[_total]` | `sglang:prompt_tokens_total`: prompt tokens of requests
    /// that reached their first token (cached ones included), summed.
    pub prompt_tokens: Option<f64>,
    /// `vllm:generation_tokens[_total]` | `sglang:generation_tokens_total`, summed.
    pub generation_tokens: Option<f64>,
    /// `vllm:request_prefill_time_seconds` (first scheduled to first token, observed when a
    /// request finishes): `_sum` and `_count`, summed.
    pub prefill_time: Option<HistogramTotals>,
    /// `vllm:request_queue_time_seconds` (arrival at the engine to first scheduled).
    pub queue_time: Option<HistogramTotals>,
    /// `vllm:request_prefill_kv_computed_tokens` (prompt tokens computed, cached ones
    /// excluded; vLLM >= 0.11), observed with the prefill time of the same requests.
    pub prefill_computed_tokens: Option<HistogramTotals>,
    /// `vllm:lora_requests_info{running_lora_adapters}` of the newest series.
    pub running_lora_adapters: Vec<String>,
    /// `vllm:lora_requests_info{waiting_lora_adapters}` of the newest series.
    pub waiting_lora_adapters: Vec<String>,
    /// `vllm:lora_requests_info{max_lora}` of the newest series.
    pub max_lora: Option<u32>,
    /// Lines skipped as malformed.
    pub malformed_lines: u32,
}

/// The `_sum` and `_count` of a histogram, summed over its series (engines).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct HistogramTotals {
    pub sum: f64,
    pub count: f64,
}

/// Parses a `/metrics` body. `Err(PromError::NoServerMetrics)` if none of the known
/// queue/running/usage series appear (not a model server); malformed lines are skipped and
/// counted; NaN and infinite values are ignored (a gauge that is only NaN reads as absent).
pub fn parse_server_metrics(text: &str) -> Result<ServerMetrics, PromError> {
    let mut acc = Acc::default();
    let mut malformed = 0u32;
    for item in samples(text) {
        match item {
            Ok(sample) => acc.add(sample),
            Err(_) => malformed = malformed.saturating_add(1),
        }
    }
    acc.finish(malformed)
}

/// Series read by value, by exact sample name. The discriminant indexes [`Acc`]'s arrays.
#[derive(Clone, Copy)]
enum Series {
    VWaiting,
    VRunning,
    VKvUsage,
    VGpuUsage,
    VQueries,
    VHits,
    VGpuQueries,
    VGpuHits,
    SWaiting,
    SRunning,
    STokenUsage,
    SMaxTokens,
    SPageSize,
    SNumPages,
    SPromptTokens,
    SCachedTokens,
    VPromptTokens,
    VGenerationTokens,
    SGenerationTokens,
    VPrefillTimeSum,
    VPrefillTimeCount,
    VQueueTimeSum,
    VQueueTimeCount,
    VComputedSum,
    VComputedCount,
}
const SERIES: usize = Series::VComputedCount as usize + 1;

fn series(name: &str) -> Option<Series> {
    use Series::*;
    Some(match name {
        "vllm:num_requests_waiting" => VWaiting,
        "vllm:num_requests_running" => VRunning,
        "vllm:kv_cache_usage_perc" => VKvUsage,
        "vllm:gpu_cache_usage_perc" => VGpuUsage,
        // Counters: `_total` in the 0.0.4 output of prometheus_client, bare in some exporters.
        "vllm:prefix_cache_queries_total" | "vllm:prefix_cache_queries" => VQueries,
        "vllm:prefix_cache_hits_total" | "vllm:prefix_cache_hits" => VHits,
        "vllm:gpu_prefix_cache_queries_total" | "vllm:gpu_prefix_cache_queries" => VGpuQueries,
        "vllm:gpu_prefix_cache_hits_total" | "vllm:gpu_prefix_cache_hits" => VGpuHits,
        "sglang:num_queue_reqs" => SWaiting,
        "sglang:num_running_reqs" => SRunning,
        "sglang:token_usage" => STokenUsage,
        "sglang:max_total_num_tokens" => SMaxTokens,
        "sglang:page_size" => SPageSize,
        "sglang:num_pages" => SNumPages,
        "sglang:prompt_tokens_total" => SPromptTokens,
        "sglang:cached_tokens_total" => SCachedTokens,
        "vllm:prompt_tokens_total" | "vllm:prompt_tokens" => VPromptTokens,
        "vllm:generation_tokens_total" | "vllm:generation_tokens" => VGenerationTokens,
        "sglang:generation_tokens_total" => SGenerationTokens,
        "vllm:request_prefill_time_seconds_sum" => VPrefillTimeSum,
        "vllm:request_prefill_time_seconds_count" => VPrefillTimeCount,
        "vllm:request_queue_time_seconds_sum" => VQueueTimeSum,
        "vllm:request_queue_time_seconds_count" => VQueueTimeCount,
        "vllm:request_prefill_kv_computed_tokens_sum" => VComputedSum,
        "vllm:request_prefill_kv_computed_tokens_count" => VComputedCount,
        _ => return None,
    })
}

impl Series {
    /// The flavor this series proves, if it is one of the queue/running/usage series.
    fn proves(self) -> Option<ServerFlavor> {
        use Series::*;
        match self {
            VWaiting | VRunning | VKvUsage | VGpuUsage => Some(ServerFlavor::Vllm),
            SWaiting | SRunning | STokenUsage => Some(ServerFlavor::Sglang),
            _ => None,
        }
    }
}

/// Running sums and maxima per series, plus the label-carrying info series.
#[derive(Default)]
struct Acc<'a> {
    sum: [Option<f64>; SERIES],
    max: [Option<f64>; SERIES],
    flavor: Option<ServerFlavor>,
    block_size: Option<u32>,
    num_gpu_blocks: Option<u32>,
    lora: Option<Sample<'a>>,
}

impl<'a> Acc<'a> {
    fn add(&mut self, s: Sample<'a>) {
        match s.name {
            // An info gauge (value 1): the data is in the labels, strings like "16" or "None".
            // Engines of one server share a config, so max also skips an engine's "None".
            "vllm:cache_config_info" => {
                let label_u32 = |name| s.label(name).and_then(|v| parse_u32(&v));
                self.block_size = self.block_size.max(label_u32("block_size"));
                self.num_gpu_blocks = self.num_gpu_blocks.max(label_u32("num_gpu_blocks"));
            }
            // Its value is the time the label set was last current, and old label sets stay
            // exported (multiprocess mode "sum"): the largest value is the present state.
            "vllm:lora_requests_info" => {
                if s.value.is_finite() && self.lora.as_ref().is_none_or(|b| s.value >= b.value) {
                    self.lora = Some(s);
                }
            }
            name => {
                let Some(k) = series(name) else { return };
                if self.flavor.is_none() {
                    self.flavor = k.proves();
                }
                if s.value.is_finite() {
                    let i = k as usize;
                    // Finite values can still sum past f64::MAX: saturate, so a sum is finite.
                    let sum = self.sum[i].unwrap_or(0.0) + s.value;
                    self.sum[i] = Some(sum.clamp(f64::MIN, f64::MAX));
                    self.max[i] = Some(self.max[i].map_or(s.value, |m| m.max(s.value)));
                }
            }
        }
    }

    fn finish(self, malformed_lines: u32) -> Result<ServerMetrics, PromError> {
        use Series::*;
        let flavor = self.flavor.ok_or(PromError::NoServerMetrics)?;
        let sum = |k: Series| self.sum[k as usize].map(|v| v.max(0.0));
        let max = |k: Series| self.max[k as usize];
        // SGLang has no cache_config_info. Its KV pool is `page_size`-token pages
        // (`sglang:page_size`, `sglang:num_pages`, startup constants repeated per TP rank, hence
        // max); older servers only export the capacity in tokens, `sglang:max_total_num_tokens`,
        // from which pages = tokens / page_size. Both are reported only as a pair, and a zero
        // capacity (a server not ready yet) reads as unknown.
        let page = max(SPageSize).and_then(f64_to_u32).filter(|&p| p > 0);
        let pages = max(SNumPages)
            .or_else(|| Some(max(SMaxTokens)? / f64::from(page?)))
            .and_then(f64_to_u32)
            .filter(|&n| n > 0);
        let (sg_block, sg_blocks) = page.zip(pages).unzip();
        // `sglang:cache_hit_rate` is reset to 0 on every decode report, so the counters are the
        // reliable source: prompt tokens (queries) and cached prompt tokens (hits), as a pair.
        let (sg_queries, sg_hits) = sum(SPromptTokens).zip(sum(SCachedTokens)).unzip();
        let histogram = |sum_of: Series, count_of: Series| {
            let (sum, count) = sum(sum_of).zip(sum(count_of))?;
            Some(HistogramTotals { sum, count })
        };
        let lora_label = |name| self.lora.as_ref().and_then(|s| s.label(name));
        let adapters = |name| lora_label(name).map(|v| split_list(&v)).unwrap_or_default();
        Ok(ServerMetrics {
            flavor: Some(flavor),
            waiting: sum(VWaiting).or(sum(SWaiting)),
            running: sum(VRunning).or(sum(SRunning)),
            kv_cache_usage: (max(VKvUsage).or(max(VGpuUsage)).or(max(STokenUsage)))
                .map(|u| u.clamp(0.0, 1.0)),
            block_size: self.block_size.filter(|&b| b > 0).or(sg_block),
            num_gpu_blocks: self.num_gpu_blocks.filter(|&n| n > 0).or(sg_blocks),
            prefix_cache_queries: sum(VQueries).or(sum(VGpuQueries)).or(sg_queries),
            prefix_cache_hits: sum(VHits).or(sum(VGpuHits)).or(sg_hits),
            prompt_tokens: sum(VPromptTokens).or(sum(SPromptTokens)),
            generation_tokens: sum(VGenerationTokens).or(sum(SGenerationTokens)),
            prefill_time: histogram(VPrefillTimeSum, VPrefillTimeCount),
            queue_time: histogram(VQueueTimeSum, VQueueTimeCount),
            prefill_computed_tokens: histogram(VComputedSum, VComputedCount),
            running_lora_adapters: adapters("running_lora_adapters"),
            waiting_lora_adapters: adapters("waiting_lora_adapters"),
            max_lora: lora_label("max_lora").and_then(|v| parse_u32(&v)),
            malformed_lines,
        })
    }
}

/// A non-negative integer label value: "16", or "16.0" from a float-typed config field.
fn parse_u32(s: &str) -> Option<u32> {
    let s = s.trim();
    s.parse().ok().or_else(|| {
        let v: f64 = s.parse().ok()?;
        (v.fract() == 0.0).then_some(v).and_then(f64_to_u32)
    })
}

/// Truncates a finite value in `[0, u32::MAX]`; anything else is unknown.
fn f64_to_u32(v: f64) -> Option<u32> {
    (0.0..=f64::from(u32::MAX)).contains(&v).then_some(v as u32)
}

/// vLLM joins adapter names with ',' (an empty label means none).
fn split_list(v: &str) -> Vec<String> {
    v.split(',')
        .map(str::trim)
        .filter(|a| !a.is_empty())
        .map(String::from)
        .collect()
}

/// Parses one line: `Ok(None)` for blank lines and comments, `Err(reason)` if malformed.
fn parse_line(line: &str) -> Result<Option<Sample<'_>>, &'static str> {
    let line = line.trim(); // also drops the '\r' of "\r\n" endings
    if line.is_empty() || line.starts_with('#') {
        return Ok(None);
    }
    let b = line.as_bytes();
    let name_end = take_name(b, 0, true);
    if name_end == 0 {
        return Err("expected a metric name");
    }
    let mut labels = "";
    let mut i = name_end;
    if b.get(i) == Some(&b'{') {
        let start = i + 1;
        let mut pos = start;
        loop {
            match scan_label(line, pos)? {
                Step::Label(_, _, next) => pos = next,
                Step::End(end) if b.get(end) == Some(&b'}') => {
                    labels = &line[start..end];
                    i = end + 1;
                    break;
                }
                Step::End(_) => return Err("unterminated label set"),
            }
        }
    } else if !matches!(b.get(i), Some(b' ' | b'\t') | None) {
        return Err("invalid character in metric name");
    }
    let mut rest = line[i..].split_ascii_whitespace();
    let value = rest.next().ok_or("missing value")?;
    let value = value.parse::<f64>().map_err(|_| "invalid value")?;
    // Whatever follows '#' is an OpenMetrics exemplar, which kvoy does not read.
    let mut tail = rest.next();
    let mut timestamp_ms = None;
    if let Some(t) = tail.filter(|t| !t.starts_with('#')) {
        timestamp_ms = Some(parse_timestamp(t).ok_or("invalid timestamp")?);
        tail = rest.next();
    }
    if tail.is_some_and(|t| !t.starts_with('#')) {
        return Err("unexpected text after the sample");
    }
    Ok(Some(Sample {
        name: &line[..name_end],
        value,
        timestamp_ms,
        labels,
    }))
}

/// Text format 0.0.4 has integer milliseconds; OpenMetrics has float seconds.
fn parse_timestamp(t: &str) -> Option<i64> {
    t.parse().ok().or_else(|| {
        let secs: f64 = t.parse().ok()?;
        // `as` saturates; NaN and infinities are filtered out first.
        secs.is_finite().then(|| (secs * 1000.0).round() as i64)
    })
}

/// Advances over a metric name (`[a-zA-Z_:][a-zA-Z0-9_:]*`) or, without colons, a label name.
fn take_name(b: &[u8], mut i: usize, colons: bool) -> usize {
    let start = i;
    while let Some(&c) = b.get(i) {
        let ok = c.is_ascii_alphabetic()
            || c == b'_'
            || (colons && c == b':')
            || (i > start && c.is_ascii_digit());
        if !ok {
            break;
        }
        i += 1;
    }
    i
}

fn skip_blanks(b: &[u8], mut i: usize) -> usize {
    while matches!(b.get(i), Some(b' ' | b'\t')) {
        i += 1;
    }
    i
}

enum Step<'a> {
    /// A label's name, its raw (escaped) value, and the offset past it and its ',' if any.
    Label(&'a str, &'a str, usize),
    /// No more labels: the offset of the closing '}', or the end of the text.
    End(usize),
}

/// Scans the label at `pos` of `s` (text after '{'). Used both to validate a line and, over a
/// validated label text without its '}', to iterate. Only ASCII offsets are ever sliced at, so
/// multi-byte characters in values are safe.
fn scan_label(s: &str, pos: usize) -> Result<Step<'_>, &'static str> {
    let b = s.as_bytes();
    let start = skip_blanks(b, pos);
    if matches!(b.get(start), None | Some(b'}')) {
        return Ok(Step::End(start));
    }
    let name_end = take_name(b, start, false);
    if name_end == start {
        return Err("expected a label name");
    }
    let mut i = skip_blanks(b, name_end);
    if b.get(i) != Some(&b'=') {
        return Err("expected '=' after a label name");
    }
    i = skip_blanks(b, i + 1);
    if b.get(i) != Some(&b'"') {
        return Err("expected '\"' to open a label value");
    }
    let value_start = i + 1;
    i = value_start;
    loop {
        match b.get(i) {
            None => return Err("unterminated label value"),
            Some(b'\\') => i += 2,
            Some(b'"') => break,
            Some(_) => i += 1,
        }
    }
    let value = &s[value_start..i];
    i = skip_blanks(b, i + 1);
    match b.get(i) {
        Some(b',') => i += 1,
        None | Some(b'}') => {}
        Some(_) => return Err("expected ',' or '}' after a label value"),
    }
    Ok(Step::Label(&s[start..name_end], value, i))
}

/// Undoes `\\`, `\"` and `\n`; any other escape is kept as written, as Prometheus does.
fn unescape(raw: &str) -> Cow<'_, str> {
    if !raw.contains('\\') {
        return Cow::Borrowed(raw);
    }
    let mut out = String::with_capacity(raw.len());
    let mut chars = raw.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('n') => out.push('\n'),
            Some(e @ ('\\' | '"')) => out.push(e),
            Some(other) => {
                out.push('\\');
                out.push(other);
            }
            None => out.push('\\'),
        }
    }
    Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// `family type engine0 engine1`, rendered the way prometheus_client 0.0.4 does (counters as
    /// `_total` plus `_created`), with vLLM v1's `engine` and `model_name` labels.
    const V1_TABLE: &str = "vllm:num_requests_running gauge 4.0 3.0
        vllm:num_requests_waiting gauge 2.0 0.0
        vllm:gpu_cache_usage_perc gauge 0.3125 0.4375
        vllm:kv_cache_usage_perc gauge 0.3125 0.4375
        vllm:gpu_prefix_cache_queries counter 123456.0 65432.0
        vllm:prefix_cache_queries counter 123456.0 65432.0
        vllm:prefix_cache_hits counter 100000.0 40000.0
        vllm:num_preemptions counter 3.0 0.0
        vllm:prompt_tokens counter 5000.0 3000.0
        vllm:generation_tokens counter 700.0 300.0";
    const V1_REST: &str = r#"# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_sum{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.2346
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 6.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 7.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 7.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.0
# HELP vllm:request_prefill_time_seconds Histogram of time spent in PREFILL phase for request.
# TYPE vllm:request_prefill_time_seconds histogram
vllm:request_prefill_time_seconds_sum{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.25
vllm:request_prefill_time_seconds_bucket{engine="0",le="0.3",model_name="meta-llama/Llama-3.1-8B-Instruct"} 5.0
vllm:request_prefill_time_seconds_bucket{engine="0",le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 7.0
vllm:request_prefill_time_seconds_count{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 7.0
vllm:request_prefill_time_seconds_created{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.7409e+09
vllm:request_prefill_time_seconds_sum{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.5
vllm:request_prefill_time_seconds_count{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.0
vllm:request_queue_time_seconds_sum{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.125
vllm:request_queue_time_seconds_count{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 7.0
vllm:request_prefill_kv_computed_tokens_sum{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 21000.0
vllm:request_prefill_kv_computed_tokens_count{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 7.0
vllm:request_prefill_kv_computed_tokens_sum{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 9000.0
vllm:request_prefill_kv_computed_tokens_count{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.0
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",gpu_memory_utilization="0.9",swap_space="4",cache_dtype="auto",is_attention_free="False",num_gpu_blocks_override="None",sliding_window="None",enable_prefix_caching="True",prefix_caching_hash_algo="sha256",cpu_offload_gb="0",calculate_kv_scales="False",kv_cache_memory_bytes="None",num_gpu_blocks="27536",num_cpu_blocks="None",engine="0"} 1.0
vllm:cache_config_info{block_size="16",gpu_memory_utilization="0.9",swap_space="4",cache_dtype="auto",is_attention_free="False",num_gpu_blocks_override="None",sliding_window="None",enable_prefix_caching="True",prefix_caching_hash_algo="sha256",cpu_offload_gb="0",calculate_kv_scales="False",kv_cache_memory_bytes="None",num_gpu_blocks="None",num_cpu_blocks="None",engine="1"} 1.0
# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="4",waiting_lora_adapters="",running_lora_adapters=""} 1.7409501e+09
vllm:lora_requests_info{max_lora="4",waiting_lora_adapters="chat-lora",running_lora_adapters="sql-lora,fr-lora"} 1.7409513e+09
vllm:lora_requests_info{max_lora="4",waiting_lora_adapters="",running_lora_adapters="sql-lora"} 1.7409512e+09
"#;

    /// Renders a `family type v0 v1` table: one series per value, labelled by `labels(index)`.
    fn render_table(table: &str, labels: impl Fn(usize) -> String) -> String {
        let mut out = String::new();
        for row in table.lines() {
            let cols: Vec<&str> = row.split_whitespace().collect();
            let (family, kind) = (cols[0], cols[1]);
            out += &format!("# HELP {family} Some help.\n# TYPE {family} {kind}\n");
            for (i, v) in cols[2..].iter().enumerate() {
                if kind == "counter" {
                    out += &format!("{family}_total{{{}}} {v}\n", labels(i));
                    out += &format!("{family}_created{{{}}} 1.7409e+09\n", labels(i));
                } else {
                    out += &format!("{family}{{{}}} {v}\n", labels(i));
                }
            }
        }
        out
    }

    /// Modelled on vLLM v1 (`vllm/v1/metrics/loggers.py`) with DP=2. vLLM refuses LoRA with
    /// DP > 1; both are combined here to exercise every field.
    #[test]
    fn vllm_v1_every_field() {
        let model = "meta-llama/Llama-3.1-8B-Instruct";
        let body = render_table(V1_TABLE, |e| {
            format!("engine=\"{e}\",model_name=\"{model}\"")
        });
        let body = body + V1_REST;
        let expected = ServerMetrics {
            flavor: Some(ServerFlavor::Vllm),
            waiting: Some(2.0),
            running: Some(7.0),
            kv_cache_usage: Some(0.4375),
            block_size: Some(16),
            num_gpu_blocks: Some(27536),
            prefix_cache_queries: Some(188888.0), // the deprecated copy is not added
            prefix_cache_hits: Some(140000.0),
            prompt_tokens: Some(8000.0),
            generation_tokens: Some(1000.0),
            prefill_time: Some(HistogramTotals {
                sum: 1.75,
                count: 9.0,
            }),
            queue_time: Some(HistogramTotals {
                sum: 0.125,
                count: 7.0,
            }),
            prefill_computed_tokens: Some(HistogramTotals {
                sum: 30000.0,
                count: 9.0,
            }),
            running_lora_adapters: vec!["sql-lora".into(), "fr-lora".into()],
            waiting_lora_adapters: vec!["chat-lora".into()],
            max_lora: Some(4),
            malformed_lines: 0,
        };
        assert_eq!(parse_server_metrics(&body).unwrap(), expected);
        let inf = |s: &Sample| {
            s.name.starts_with("vllm:time_to_first_token")
                && s.label("le").as_deref() == Some("+Inf")
        };
        let buckets: Vec<_> = samples(&body).map(Result::unwrap).filter(inf).collect();
        let engines: Vec<_> = buckets
            .iter()
            .map(|s| (s.label("engine"), s.value))
            .collect();
        assert_eq!(engines, [(Some("0".into()), 7.0), (Some("1".into()), 2.0)]);
    }

    #[test]
    fn older_vllm_reads_gpu_cache_usage() {
        let body = r#"# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="32",cache_dtype="auto",enable_prefix_caching="False",gpu_memory_utilization="0.9",num_cpu_blocks="2048",num_gpu_blocks="7455",num_gpu_blocks_override="None",sliding_window="None",swap_space_bytes="4294967296"} 1.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 1.0
vllm:num_requests_swapped{model_name="m"} 0.0
vllm:num_requests_waiting{model_name="m"} 5.0
vllm:gpu_cache_usage_perc{model_name="m"} 0.0125
vllm:cpu_cache_usage_perc{model_name="m"} 0.0
vllm:gpu_prefix_cache_hit_rate{model_name="m"} -1.0
"#;
        let m = parse_server_metrics(body).unwrap();
        assert_eq!((m.waiting, m.running), (Some(5.0), Some(1.0)));
        assert_eq!(m.kv_cache_usage, Some(0.0125));
        assert_eq!((m.block_size, m.num_gpu_blocks), (Some(32), Some(7455)));
        assert_eq!((m.prefix_cache_queries, m.max_lora), (None, None));
        assert!(m.running_lora_adapters.is_empty());
    }

    /// Names from sglang/srt/metrics/collector.py; two DP ranks; the startup constants
    /// (`max_total_num_tokens`, `page_size`) repeated per TP rank.
    #[test]
    fn sglang_body() {
        let table = "sglang:num_running_reqs gauge 12.0 9.0
            sglang:num_queue_reqs gauge 3.0 1.0
            sglang:token_usage gauge 0.61 0.58
            sglang:cache_hit_rate gauge 0.0 0.0
            sglang:max_total_num_tokens gauge 1.041408e+06 1.041408e+06
            sglang:page_size gauge 16.0 16.0
            sglang:prompt_tokens counter 8.128902e+06
            sglang:cached_tokens counter 3.2e+06";
        let labels = |r| {
            format!("dp_rank=\"{r}\",engine_type=\"unified\",model_name=\"Qwen/Qwen3-8B\",moe_ep_rank=\"0\",pp_rank=\"0\",tp_rank=\"{}\"", 2 * r)
        };
        let body = render_table(table, labels);
        let expected = ServerMetrics {
            flavor: Some(ServerFlavor::Sglang),
            waiting: Some(4.0),
            running: Some(21.0),
            kv_cache_usage: Some(0.61),
            block_size: Some(16),
            num_gpu_blocks: Some(65088), // 1041408 / 16
            prefix_cache_queries: Some(8.128902e6),
            prefix_cache_hits: Some(3.2e6),
            prompt_tokens: Some(8.128902e6),
            ..ServerMetrics::default()
        };
        assert_eq!(parse_server_metrics(&body).unwrap(), expected);
        // `num_pages` wins over the division; without `page_size` neither is reported.
        let m = parse_server_metrics(&format!("{body}sglang:num_pages 65000\n")).unwrap();
        assert_eq!((m.block_size, m.num_gpu_blocks), (Some(16), Some(65000)));
        let m = parse_server_metrics(&body.replace("sglang:page_size", "sglang:other")).unwrap();
        assert_eq!((m.block_size, m.num_gpu_blocks), (None, None));
    }

    /// The exact shape `kvoy-sim` renders (simulator/src/server/metrics.rs): `engine` and
    /// `model_name` labels sorted as prometheus_client sorts them, Rust's float formatting ("3",
    /// "0.30000000000000004", "1"), `le` between the labels.
    #[test]
    fn simulator_shape() {
        let body = r#"# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="sim"} 3
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="sim"} 0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="sim"} 0.30000000000000004
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",enable_prefix_caching="True",engine="0",num_gpu_blocks="2048"} 1
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="sim"} 1200
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="sim"} 960
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="sim"} 1200
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="sim"} 6
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="sim"} 0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="sim"} 2
vllm:time_to_first_token_seconds_sum{engine="0",model_name="sim"} 0.75
vllm:time_to_first_token_seconds_count{engine="0",model_name="sim"} 2
# TYPE vllm:request_prefill_time_seconds histogram
vllm:request_prefill_time_seconds_bucket{engine="0",le="0.3",model_name="sim"} 2
vllm:request_prefill_time_seconds_bucket{engine="0",le="+Inf",model_name="sim"} 2
vllm:request_prefill_time_seconds_sum{engine="0",model_name="sim"} 0.0625
vllm:request_prefill_time_seconds_count{engine="0",model_name="sim"} 2
# TYPE vllm:request_prefill_kv_computed_tokens histogram
vllm:request_prefill_kv_computed_tokens_bucket{engine="0",le="1",model_name="sim"} 0
vllm:request_prefill_kv_computed_tokens_sum{engine="0",model_name="sim"} 240
vllm:request_prefill_kv_computed_tokens_count{engine="0",model_name="sim"} 2
"#;
        let m = parse_server_metrics(body).unwrap();
        assert_eq!((m.running, m.waiting), (Some(3.0), Some(0.0)));
        assert_eq!(m.kv_cache_usage, Some(0.30000000000000004));
        assert_eq!((m.block_size, m.num_gpu_blocks), (Some(16), Some(2048)));
        assert_eq!(
            (m.prefix_cache_queries, m.prefix_cache_hits),
            (Some(1200.0), Some(960.0))
        );
        assert_eq!(
            (m.prompt_tokens, m.generation_tokens),
            (Some(1200.0), Some(6.0))
        );
        let totals = |sum, count| Some(HistogramTotals { sum, count });
        assert_eq!(m.prefill_time, totals(0.0625, 2.0));
        assert_eq!(m.prefill_computed_tokens, totals(240.0, 2.0));
        assert_eq!(m.queue_time, None);
        assert_eq!(m.malformed_lines, 0);
        // a histogram with only one of `_sum` and `_count` is unknown
        let half = body.replace("vllm:request_prefill_time_seconds_count", "other");
        assert_eq!(parse_server_metrics(&half).unwrap().prefill_time, None);
    }

    #[test]
    fn escaped_labels() {
        let line = r#"x:y{a="q\"uote}",b = "back\\slash, a=b",c="new\nline",d="odd\t",e="",} 1"#;
        let s = samples(line).next().unwrap().unwrap();
        let got: Vec<_> = s.labels().map(|(n, v)| (n, v.into_owned())).collect();
        let want = [
            ("a", "q\"uote}"),
            ("b", "back\\slash, a=b"),
            ("c", "new\nline"),
        ];
        let want = [want[0], want[1], want[2], ("d", "odd\\t"), ("e", "")];
        assert_eq!(got, want.map(|(n, v)| (n, v.to_string())));
        assert!(matches!(s.label("e"), Some(Cow::Borrowed(""))));
        assert_eq!((s.name, s.label("zz")), ("x:y", None));
    }

    #[test]
    fn values_timestamps_and_openmetrics() {
        let text = "a 1e+06 1700000000123\r\nb{} +Inf\nc -Inf\nd NaN\n  e\t2 -5  \n\
            f{le=\"0.1\"} 8 1520879607.789 # {trace_id=\"x\"} 0.03\ng 3 # {id=\"y\"} 1\n# EOF\nh 1\n";
        let got: Vec<_> = samples(text).map(Result::unwrap).collect();
        let got: Vec<_> = got
            .iter()
            .map(|s| (s.name, s.value, s.timestamp_ms))
            .collect();
        assert_eq!(got[0], ("a", 1e6, Some(1_700_000_000_123)));
        assert_eq!(got[1], ("b", f64::INFINITY, None));
        assert_eq!(got[2], ("c", f64::NEG_INFINITY, None));
        assert!(got[3].1.is_nan());
        assert_eq!(got[4], ("e", 2.0, Some(-5)));
        assert_eq!(got[5], ("f", 8.0, Some(1_520_879_607_789)));
        assert_eq!(got[6], ("g", 3.0, None));
        assert_eq!(got.len(), 7, "nothing after # EOF");
    }

    #[test]
    fn non_finite_gauges_and_usage_clamp() {
        let text = "vllm:num_requests_waiting NaN\nvllm:num_requests_running 2\n\
            vllm:num_requests_running +Inf\nvllm:kv_cache_usage_perc 1.7\nvllm:gpu_cache_usage_perc 0.2\n";
        let m = parse_server_metrics(text).unwrap();
        assert_eq!(
            (m.waiting, m.running, m.kv_cache_usage),
            (None, Some(2.0), Some(1.0))
        );
    }

    /// Caught by the `prometheus` fuzz target's range check: finite samples whose sum overflows
    /// made an infinite queue or counter, which the doc says is ignored. Sums now saturate.
    #[test]
    fn sums_stay_finite() {
        let text = "vllm:num_requests_waiting 1e308\nvllm:num_requests_waiting 1e308\n\
            vllm:prompt_tokens_total 1.7e308\nvllm:prompt_tokens_total 1.7e308\n\
            vllm:num_requests_running -1e308\nvllm:num_requests_running -1e308\n";
        let m = parse_server_metrics(text).unwrap();
        assert_eq!(
            (m.waiting, m.prompt_tokens, m.running),
            (Some(f64::MAX), Some(f64::MAX), Some(0.0))
        );
    }

    #[test]
    fn malformed_lines_are_counted_and_skipped() {
        let text = "vllm:num_requests_waiting{engine=\"0\"} 2\n{a=\"b\"} 1\nx{a=\"b\" 1\nx{a=b} 1\n\
            y 1 2 3\nz one\nw{a=\"b\"c=\"d\"} 1\n9x 1\nv\nvllm:num_requests_waiting{engine=\"1\"} 3\n";
        let errs: Vec<_> = samples(text).filter_map(Result::err).collect();
        assert_eq!(errs.len(), 8);
        let reason = "expected a metric name";
        assert_eq!(errs[0], PromError::Malformed { line: 2, reason });
        assert_eq!(errs[0].to_string(), "line 2: expected a metric name");
        let m = parse_server_metrics(text).unwrap();
        assert_eq!((m.waiting, m.malformed_lines), (Some(5.0), 8));
    }

    #[test]
    fn not_a_model_server() {
        let text = "# HELP go_goroutines Number of goroutines.\n# TYPE go_goroutines gauge\n\
            go_goroutines 42\nprocess_cpu_seconds_total 1.5\nvllm:cache_config_info{block_size=\"16\"} 1\n";
        assert_eq!(parse_server_metrics(text), Err(PromError::NoServerMetrics));
        assert_eq!(parse_server_metrics(""), Err(PromError::NoServerMetrics));
        assert_eq!(samples("").count() + samples("\n\r\n# c\n").count(), 0);
    }

    fn escape(v: &str) -> String {
        v.replace('\\', r"\\")
            .replace('"', "\\\"")
            .replace('\n', r"\n")
    }

    /// name, labels, value, timestamp, braces even when empty, value in exponent form.
    type Line = (String, Vec<(String, String)>, f64, Option<i64>, bool, bool);

    fn line() -> impl Strategy<Value = Line> {
        let value = prop_oneof!["[a-z\"\\\\\n}{,= #]{0,12}", any::<String>()];
        let labels = proptest::collection::vec(("[a-zA-Z_][a-zA-Z0-9_]{0,12}", value), 0..5);
        let finite = any::<f64>().prop_filter("finite", |v| v.is_finite());
        let ts = proptest::option::of(any::<i64>());
        (
            "[a-zA-Z_:][a-zA-Z0-9_:]{0,24}",
            labels,
            finite,
            ts,
            any::<bool>(),
            any::<bool>(),
        )
    }

    fn render((name, labels, value, ts, braces, sci): &Line, eol: &str) -> String {
        let mut out = name.clone();
        if *braces || !labels.is_empty() {
            let l: Vec<_> = labels
                .iter()
                .map(|(n, v)| format!("{n}=\"{}\"", escape(v)))
                .collect();
            out += &format!("{{{}}}", l.join(","));
        }
        out += &if *sci {
            format!(" {value:e}")
        } else {
            format!(" {value}")
        };
        out += &ts.map(|t| format!(" {t}")).unwrap_or_default();
        out + eol
    }

    proptest! {
        #[test]
        fn never_panics_on_any_string(s in any::<String>()) {
            let _ = samples(&s).count();
            let _ = parse_server_metrics(&s);
        }

        #[test]
        fn never_panics_on_metric_like_text(s in r#"[a-zINf_:{}=",\\ .0-9eE+\-#\n\r\t]{0,200}"#) {
            let _ = samples(&s).flatten().map(|s| s.labels().count()).sum::<usize>();
            if let Ok(m) = parse_server_metrics(&s) {
                let errs = samples(&s).filter(Result::is_err).count();
                prop_assert_eq!(m.malformed_lines as usize, errs);
                prop_assert!(m.kv_cache_usage.is_none_or(|u| (0.0..=1.0).contains(&u)));
            }
        }

        #[test]
        fn render_then_parse_round_trips(lines in proptest::collection::vec(line(), 1..5), crlf: bool) {
            let text: String = lines.iter().map(|l| render(l, if crlf { "\r\n" } else { "\n" })).collect();
            let parsed: Vec<_> = samples(&text).collect::<Result<_, _>>().unwrap();
            prop_assert_eq!(parsed.len(), lines.len());
            for (s, (name, labels, value, ts, _, _)) in parsed.iter().zip(&lines) {
                prop_assert_eq!((s.name, s.value, s.timestamp_ms), (name.as_str(), *value, *ts));
                let got: Vec<_> = s.labels().map(|(n, v)| (n.to_string(), v.into_owned())).collect();
                prop_assert_eq!(&got, labels);
            }
        }
    }
}
