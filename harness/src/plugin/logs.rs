//! Captured guest logs: `proxy_log`, and WASI writes to stdout/stderr split into lines.

use std::collections::VecDeque;
use std::fmt;

use crate::types::LogLevel;

/// The environment variable that makes the harness print every captured line to stderr.
pub const ECHO_ENV: &str = "KVOY_HARNESS_LOG";

/// Where a log line came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LogSource {
    /// `proxy_log` (the SDK's `log` macros and its panic hook).
    ProxyLog,
    /// WASI `fd_write` to fd 1; logged at `Info` like Envoy does.
    Stdout,
    /// WASI `fd_write` to fd 2 (Rust's default panic message); logged at `Error`.
    Stderr,
    /// The harness itself, about something the guest did.
    Host,
}

/// One captured line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogEntry {
    /// The VM that logged it.
    pub vm: usize,
    pub level: LogLevel,
    pub source: LogSource,
    pub message: String,
}

impl fmt::Display for LogEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let source = match self.source {
            LogSource::ProxyLog => "",
            LogSource::Stdout => " stdout",
            LogSource::Stderr => " stderr",
            LogSource::Host => " host",
        };
        write!(
            f,
            "[vm{} {}{}] {}",
            self.vm,
            self.level.as_str(),
            source,
            self.message
        )
    }
}

/// A bounded log: the newest `capacity` lines are kept.
#[derive(Debug)]
pub struct LogBuffer {
    entries: VecDeque<LogEntry>,
    capacity: usize,
    dropped: usize,
    echo: bool,
}

impl LogBuffer {
    /// A buffer keeping up to `capacity` lines; `echo` prints each line to stderr as it arrives.
    pub fn new(capacity: usize, echo: bool) -> LogBuffer {
        LogBuffer {
            entries: VecDeque::new(),
            capacity,
            dropped: 0,
            echo,
        }
    }

    /// Whether the echo environment variable asks for printing.
    pub fn echo_from_env() -> bool {
        std::env::var_os(ECHO_ENV).is_some_and(|v| !v.is_empty() && v != "0")
    }

    /// Appends a line, dropping the oldest when full.
    pub fn push(&mut self, entry: LogEntry) {
        if self.echo {
            eprintln!("{entry}");
        }
        if self.capacity == 0 {
            self.dropped += 1;
            return;
        }
        if self.entries.len() == self.capacity {
            self.entries.pop_front();
            self.dropped += 1;
        }
        self.entries.push_back(entry);
    }

    /// The kept lines, oldest first.
    pub fn entries(&self) -> impl Iterator<Item = &LogEntry> {
        self.entries.iter()
    }

    /// How many lines were dropped because the buffer was full.
    pub fn dropped(&self) -> usize {
        self.dropped
    }

    /// Forgets every kept line.
    pub fn clear(&mut self) {
        self.entries.clear();
    }
}

/// Splits a byte stream (one WASI fd of one VM) into lines.
#[derive(Debug, Default)]
pub struct LineSplitter {
    pending: Vec<u8>,
}

impl LineSplitter {
    /// Adds bytes and returns the lines they complete (without the newline).
    pub fn push(&mut self, bytes: &[u8]) -> Vec<String> {
        self.pending.extend_from_slice(bytes);
        let mut lines = Vec::new();
        while let Some(end) = self.pending.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = self.pending.drain(..=end).collect();
            lines.push(String::from_utf8_lossy(&line[..end]).into_owned());
        }
        lines
    }

    /// Returns the unterminated rest, if any.
    pub fn flush(&mut self) -> Option<String> {
        if self.pending.is_empty() {
            return None;
        }
        let rest = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        Some(rest)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(message: &str) -> LogEntry {
        LogEntry {
            vm: 0,
            level: LogLevel::Info,
            source: LogSource::ProxyLog,
            message: message.into(),
        }
    }

    #[test]
    fn bounded_buffer_keeps_the_newest() {
        let mut buffer = LogBuffer::new(2, false);
        buffer.push(entry("a"));
        buffer.push(entry("b"));
        buffer.push(entry("c"));
        let kept: Vec<&str> = buffer.entries().map(|e| e.message.as_str()).collect();
        assert_eq!(kept, ["b", "c"]);
        assert_eq!(buffer.dropped(), 1);
    }

    #[test]
    fn splitter_joins_partial_writes() {
        let mut split = LineSplitter::default();
        assert!(split.push(b"thread 'main' pan").is_empty());
        assert_eq!(
            split.push(b"icked at x\nnext"),
            ["thread 'main' panicked at x"]
        );
        assert_eq!(split.flush().as_deref(), Some("next"));
        assert_eq!(split.flush(), None);
    }

    #[test]
    fn display_names_vm_level_and_source() {
        let mut e = entry("hello");
        e.source = LogSource::Stderr;
        e.level = LogLevel::Error;
        assert_eq!(e.to_string(), "[vm0 error stderr] hello");
    }
}
