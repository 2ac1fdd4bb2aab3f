//! Hand-written WebAssembly guests for the host's ABI tests: every `env` import, a bump
//! allocator, and `$report` / `$show` to log statuses and returned bytes (see `host_abi.rs`).
#![allow(dead_code)]

use kvoy_harness::{Error, HeaderMap, Host, LogEntry, Plugin, PluginBuilder};

/// Lays byte strings out in guest memory from address 512 on; the scratch area for return
/// slots is 256..512.
pub struct Layout {
    next: u32,
    data: String,
}

/// Scratch return slots.
pub const PTR: u32 = 256;
pub const SIZE: u32 = 260;
pub const WORD: u32 = 264;
pub const TOKEN: u32 = 280;

impl Layout {
    pub fn new() -> Layout {
        Layout {
            next: 512,
            data: String::new(),
        }
    }

    /// Places `bytes`; returns `"ptr len"` for use as two `i32.const` arguments.
    pub fn put(&mut self, bytes: &[u8]) -> String {
        let at = self.next;
        let mut escaped = String::new();
        for b in bytes {
            escaped.push_str(&format!("\\{b:02x}"));
        }
        self.data
            .push_str(&format!("  (data (i32.const {at}) \"{escaped}\")\n"));
        self.next += (bytes.len() as u32 + 15) & !15;
        format!("(i32.const {at}) (i32.const {})", bytes.len())
    }
}

pub const IMPORTS: &str = r#"
  (import "env" "proxy_log" (func $log (param i32 i32 i32) (result i32)))
  (import "env" "proxy_get_log_level" (func $get_log_level (param i32) (result i32)))
  (import "env" "proxy_get_current_time_nanoseconds" (func $now (param i32) (result i32)))
  (import "env" "proxy_set_tick_period_milliseconds" (func $tick_period (param i32) (result i32)))
  (import "env" "proxy_set_effective_context" (func $set_effective (param i32) (result i32)))
  (import "env" "proxy_done" (func $done (result i32)))
  (import "env" "proxy_get_status" (func $get_status (param i32 i32 i32) (result i32)))
  (import "env" "proxy_get_buffer_bytes" (func $get_buffer (param i32 i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_set_buffer_bytes" (func $set_buffer (param i32 i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_get_buffer_status" (func $buffer_status (param i32 i32 i32) (result i32)))
  (import "env" "proxy_get_header_map_pairs" (func $get_pairs (param i32 i32 i32) (result i32)))
  (import "env" "proxy_set_header_map_pairs" (func $set_pairs (param i32 i32 i32) (result i32)))
  (import "env" "proxy_get_header_map_value" (func $get_value (param i32 i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_add_header_map_value" (func $add_value (param i32 i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_replace_header_map_value" (func $replace_value (param i32 i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_remove_header_map_value" (func $remove_value (param i32 i32 i32) (result i32)))
  (import "env" "proxy_get_header_map_size" (func $map_size (param i32 i32) (result i32)))
  (import "env" "proxy_get_shared_data" (func $get_shared (param i32 i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_set_shared_data" (func $set_shared (param i32 i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_register_shared_queue" (func $register_queue (param i32 i32 i32) (result i32)))
  (import "env" "proxy_resolve_shared_queue" (func $resolve_queue (param i32 i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_enqueue_shared_queue" (func $enqueue (param i32 i32 i32) (result i32)))
  (import "env" "proxy_dequeue_shared_queue" (func $dequeue (param i32 i32 i32) (result i32)))
  (import "env" "proxy_define_metric" (func $define_metric (param i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_increment_metric" (func $increment_metric (param i32 i64) (result i32)))
  (import "env" "proxy_record_metric" (func $record_metric (param i32 i64) (result i32)))
  (import "env" "proxy_get_metric" (func $get_metric (param i32 i32) (result i32)))
  (import "env" "proxy_get_property" (func $get_property (param i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_set_property" (func $set_property (param i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_call_foreign_function" (func $foreign (param i32 i32 i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_continue_stream" (func $continue_stream (param i32) (result i32)))
  (import "env" "proxy_close_stream" (func $close_stream (param i32) (result i32)))
  (import "env" "proxy_send_local_response" (func $local_reply (param i32 i32 i32 i32 i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_http_call" (func $http_call (param i32 i32 i32 i32 i32 i32 i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_grpc_call" (func $grpc_call (param i32 i32 i32 i32 i32 i32 i32 i32 i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_grpc_send" (func $grpc_send (param i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_grpc_cancel" (func $grpc_cancel (param i32) (result i32)))
  (import "env" "proxy_grpc_stream" (func $grpc_stream (param i32 i32 i32 i32 i32 i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_grpc_close" (func $grpc_close (param i32) (result i32)))
  (import "env" "proxy_continue_request" (func $continue_request (result i32)))
  (import "env" "proxy_get_configuration" (func $get_configuration (param i32 i32) (result i32)))
  (import "env" "proxy_clear_route_cache" (func $clear_route_cache (result i32)))
  (import "wasi_snapshot_preview1" "fd_write" (func $fd_write (param i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "fd_read" (func $fd_read (param i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "clock_time_get" (func $clock_time_get (param i32 i64 i32) (result i32)))
  (import "wasi_snapshot_preview1" "clock_res_get" (func $clock_res_get (param i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "random_get" (func $random_get (param i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "environ_sizes_get" (func $environ_sizes_get (param i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "environ_get" (func $environ_get (param i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "args_sizes_get" (func $args_sizes_get (param i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "fd_fdstat_get" (func $fd_fdstat_get (param i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "sched_yield" (func $sched_yield (result i32)))
"#;

/// A module: all imports, memory with the digit table and `layout`'s data, a bump allocator
/// from 64 KiB on, `$report` (status as one character), `$show` (the slot pair at PTR/SIZE as a
/// log line), `$show_word` (the u64 at WORD in decimal is not needed: the slot is logged as 8
/// raw bytes in hex by the test), and `body`.
pub fn module(layout: &Layout, body: &str) -> String {
    format!(
        r#"(module
{IMPORTS}
  (memory (export "memory") 4)
  (data (i32.const 0) "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ@#")
{data}
  (global $heap (mut i32) (i32.const 65536))
  (func (export "proxy_on_memory_allocate") (param $size i32) (result i32)
    (local $p i32)
    (local.set $p (global.get $heap))
    (global.set $heap (i32.add (global.get $heap) (local.get $size)))
    (local.get $p))
  (func (export "proxy_abi_version_0_2_1"))
  (func $report (param $status i32)
    (drop (call $log (i32.const 2) (local.get $status) (i32.const 1))))
  (func $show
    (drop (call $log (i32.const 2) (i32.load (i32.const {PTR})) (i32.load (i32.const {SIZE})))))
{body}
)"#,
        data = layout.data,
    )
}

pub fn host(wat: &str) -> Result<Host, Error> {
    let bytes = wat::parse_str(wat).map_err(|e| Error::Compile(e.to_string()))?;
    Host::from_bytes(&bytes)
}

pub fn start(wat: &str) -> Result<Plugin, Error> {
    host(wat)?.plugin().start()
}

pub fn builder(wat: &str) -> Result<PluginBuilder, Error> {
    Ok(host(wat)?.plugin())
}

/// The one-character reports, in order.
pub fn reports(plugin: &Plugin) -> String {
    split(&plugin.logs()).0
}

/// The longer log lines, in order.
pub fn lines(plugin: &Plugin) -> Vec<String> {
    split(&plugin.logs()).1
}

/// What the guest logged since entry `from` (reports and lines), for one callback at a time.
pub fn since(plugin: &Plugin, from: usize) -> (String, Vec<String>) {
    split(&plugin.logs()[from..])
}

/// Log entries as the reports (one character each, joined) and the longer lines.
fn split(entries: &[LogEntry]) -> (String, Vec<String>) {
    let (reports, lines): (Vec<&LogEntry>, Vec<&LogEntry>) =
        entries.iter().partition(|e| e.message.len() == 1);
    (
        reports.iter().map(|e| e.message.as_str()).collect(),
        lines.iter().map(|e| e.message.clone()).collect(),
    )
}

pub const HEADERS: &[(&str, &str)] = &[
    (":method", "POST"),
    (":path", "/v1/chat/completions?x=1"),
    (":authority", "gw"),
    ("content-length", "5"),
];

pub fn pairs(pairs: &[(&str, &str)]) -> Vec<u8> {
    HeaderMap::from_pairs(pairs.iter().copied()).encode()
}
