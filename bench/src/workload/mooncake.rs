//! Replay of the Mooncake conversation trace (FAST'25, Apache-2.0).
//!
//! Each line is a JSON object: `timestamp` (ms since the start), `input_length` and
//! `output_length` (tokens) and `hash_ids`, one id per 512-token block of the prompt, equal ids
//! meaning equal content. Block `j` of a prompt becomes 512 tokens of text seeded by its id
//! (the last block is cut to the prompt's length), so equal ids give equal text and requests
//! that share leading ids share a prefix. A prompt with fewer ids than blocks gets blocks unique
//! to the request for the rest; extra ids are ignored. An `output_length` of 0 is sent as 1 (a
//! server generates at least one token).
//!
//! The trace file is read from the path given on the command line; it is never copied.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;

use super::text::{seed_of, Part};
use super::{Plan, Session};

/// Tokens per `hash_id` block.
pub const TRACE_BLOCK_TOKENS: u32 = 512;

/// Why a trace could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("cannot read the trace {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}:{line}: not a trace record: {message}")]
    Json {
        path: PathBuf,
        line: usize,
        message: String,
    },
    #[error("{path}:{line}: `{field}` {reason}")]
    Field {
        path: PathBuf,
        line: usize,
        field: &'static str,
        reason: &'static str,
    },
    #[error("the trace {0} holds no request")]
    Empty(PathBuf),
}

#[derive(Deserialize)]
struct RawRecord {
    timestamp: f64,
    input_length: u64,
    output_length: u64,
    #[serde(default)]
    hash_ids: Vec<u64>,
}

/// One request of the trace.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceRecord {
    pub timestamp: Duration,
    pub input_length: u32,
    pub output_length: u32,
    pub hash_ids: Vec<u64>,
}

/// A loaded trace, sorted by timestamp.
#[derive(Clone, Debug, PartialEq)]
pub struct Trace {
    pub records: Vec<TraceRecord>,
}

impl Trace {
    /// Reads and checks a JSONL trace.
    pub fn load(path: &Path) -> Result<Trace, TraceError> {
        let text = std::fs::read_to_string(path).map_err(|source| TraceError::Io {
            path: path.to_owned(),
            source,
        })?;
        Trace::parse(&text, path)
    }

    /// Parses JSONL text (`path` only names the source in errors). Blank lines are skipped.
    pub fn parse(text: &str, path: &Path) -> Result<Trace, TraceError> {
        let mut records = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let line_no = i + 1;
            if line.trim().is_empty() {
                continue;
            }
            let raw: RawRecord = serde_json::from_str(line).map_err(|e| TraceError::Json {
                path: path.to_owned(),
                line: line_no,
                message: e.to_string(),
            })?;
            let field = |field: &'static str, reason: &'static str| TraceError::Field {
                path: path.to_owned(),
                line: line_no,
                field,
                reason,
            };
            if !(raw.timestamp.is_finite() && raw.timestamp >= 0.0) {
                return Err(field("timestamp", "must be a number of ms >= 0"));
            }
            if raw.input_length == 0 || raw.input_length > 16_000_000 {
                return Err(field("input_length", "must be within 1..=16000000"));
            }
            if raw.output_length > 1_000_000 {
                return Err(field("output_length", "must be within 0..=1000000"));
            }
            records.push(TraceRecord {
                timestamp: Duration::from_secs_f64(raw.timestamp / 1000.0),
                input_length: raw.input_length as u32,
                output_length: (raw.output_length as u32).max(1),
                hash_ids: raw.hash_ids,
            });
        }
        if records.is_empty() {
            return Err(TraceError::Empty(path.to_owned()));
        }
        records.sort_by_key(|r| r.timestamp);
        Ok(Trace { records })
    }

    /// Requests per second over the trace's span.
    pub fn rate(&self, limit: usize) -> f64 {
        let n = self.records.len().min(limit);
        let span = match (self.records.first(), self.records.get(n.saturating_sub(1))) {
            (Some(a), Some(b)) => b.timestamp.saturating_sub(a.timestamp).as_secs_f64(),
            _ => 0.0,
        };
        if span > 0.0 {
            n as f64 / span
        } else {
            n as f64
        }
    }
}

/// The prompt parts of one trace record (`index` seeds blocks that have no id).
pub fn record_parts(record: &TraceRecord, index: usize) -> Vec<Part> {
    let blocks = record.input_length.div_ceil(TRACE_BLOCK_TOKENS);
    (0..blocks)
        .map(|j| {
            let tokens = (record.input_length - j * TRACE_BLOCK_TOKENS).min(TRACE_BLOCK_TOKENS);
            let seed = match record.hash_ids.get(j as usize) {
                Some(&id) => seed_of("mooncake/block", id, 0),
                None => seed_of("mooncake/unnamed", index as u64, u64::from(j)),
            };
            Part::Text { seed, tokens }
        })
        .collect()
}

#[derive(Clone, Debug)]
pub struct Mooncake {
    trace: Arc<Trace>,
    limit: usize,
}

impl Mooncake {
    pub fn new(trace: Arc<Trace>, limit: Option<usize>) -> Self {
        let limit = limit.unwrap_or(usize::MAX).min(trace.records.len());
        Mooncake { trace, limit }
    }

    /// The trace's own rate (req/s) over the replayed requests.
    pub fn native_rate(&self) -> f64 {
        self.trace.rate(self.limit)
    }

    pub fn describe(&self) -> String {
        format!(
            "Mooncake conversation trace replay: {} requests at {:.2} req/s natively, \
             512-token hash_id blocks, timestamps scaled to the target rate",
            self.limit,
            self.native_rate()
        )
    }

    /// The replay with timestamps scaled so that the mean rate is `rate` req/s.
    pub fn plan(&self, rate: f64) -> Plan {
        let factor = if rate > 0.0 {
            self.native_rate() / rate
        } else {
            1.0
        };
        let start0 = self
            .trace
            .records
            .first()
            .map_or(Duration::ZERO, |r| r.timestamp);
        let sessions = self
            .trace
            .records
            .iter()
            .take(self.limit)
            .enumerate()
            .map(|(i, r)| {
                Session::single(
                    Duration::from_secs_f64(
                        (r.timestamp.saturating_sub(start0).as_secs_f64() * factor).min(1e9),
                    ),
                    "trace",
                    record_parts(r, i),
                    r.output_length,
                )
            })
            .collect();
        Plan::finish(sessions)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::text::render_all;

    const SAMPLE: &str = r#"{"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]}
{"timestamp": 500, "input_length": 1030, "output_length": 0, "hash_ids": [0, 1, 7]}

{"timestamp": 1000, "input_length": 600, "output_length": 9, "hash_ids": [3]}
"#;

    fn text_of(parts: &[Part]) -> String {
        let mut s = String::new();
        render_all(parts, &mut s);
        s
    }

    #[test]
    fn equal_ids_give_equal_prefixes() {
        let trace = Trace::parse(SAMPLE, Path::new("sample")).unwrap();
        assert_eq!(trace.records.len(), 3);
        assert_eq!(trace.records[1].output_length, 1, "0 is sent as 1");
        let a = text_of(&record_parts(&trace.records[0], 0));
        let b = text_of(&record_parts(&trace.records[1], 1));
        let c = text_of(&record_parts(&trace.records[2], 2));
        assert_eq!((a.len(), b.len(), c.len()), (4400, 4120, 2400));
        let shared = 2 * 512 * 4;
        assert_eq!(a[..shared], b[..shared]);
        assert_ne!(a[shared..shared + 24], b[shared..shared + 24]);
        assert_ne!(a[..64], c[..64]);
        // 600 tokens with one id: the second block is unique to the request.
        assert_eq!(record_parts(&trace.records[2], 2).len(), 2);
    }

    #[test]
    fn replay_rate_scales_timestamps() {
        let trace = Arc::new(Trace::parse(SAMPLE, Path::new("sample")).unwrap());
        let w = Mooncake::new(trace, None);
        assert!((w.native_rate() - 3.0).abs() < 1e-9);
        let plan = w.plan(6.0);
        assert_eq!(plan.sessions[2].start, Duration::from_millis(500));
        let limited = Mooncake::new(w.trace.clone(), Some(2));
        assert_eq!(limited.plan(1.0).requests(), 2);
    }

    #[test]
    fn bad_records_are_named() {
        let e = Trace::parse("{\"timestamp\": 1}\n", Path::new("t.jsonl")).unwrap_err();
        assert!(
            e.to_string().starts_with("t.jsonl:1: not a trace record"),
            "{e}"
        );
        let e = Trace::parse(
            "{\"timestamp\": -1, \"input_length\": 1, \"output_length\": 1}",
            Path::new("t"),
        )
        .unwrap_err();
        assert!(e.to_string().contains("`timestamp`"), "{e}");
        let e = Trace::parse(
            "{\"timestamp\": 1, \"input_length\": 0, \"output_length\": 1}",
            Path::new("t"),
        )
        .unwrap_err();
        assert!(e.to_string().contains("`input_length`"), "{e}");
        assert!(matches!(
            Trace::parse("\n\n", Path::new("t")),
            Err(TraceError::Empty(_))
        ));
        assert!(matches!(
            Trace::load(Path::new("/nonexistent/trace.jsonl")),
            Err(TraceError::Io { .. })
        ));
    }
}
