//! Every host function of proxy-wasm ABI 0.2.1 (and the WASI calls a Rust `wasm32-wasip1`
//! filter imports), success and error paths, with the statuses Envoy returns (see the table in
//! `harness/README.md`). The guests are hand-written WebAssembly text: each case logs the status
//! of one host call as one character of `0-9a-zA-Z` (so `c` is 12, `Unimplemented`; WASI errno
//! 8 is `8`, 21 `l`, 28 `s`, 52 `Q`, 58 `W`); values the host wrote back are logged as longer
//! lines.
//!
//! What can be observed of Envoy itself through kvoy's filters (routing, local replies, the
//! served-endpoint header, shared state across requests) is compared in the differential test
//! `local/tests/local_vs_envoy.rs`.

use std::net::TcpListener;
use std::time::Duration;

use kvoy_harness::{
    testing, Action, ChainState, Error, FilterChain, HeaderMap, HttpResponse, Status, StreamEvent,
};

use crate::wat_guest::*;

use crate::TestResult;

#[test]
fn logging_levels_time_ticks_and_done() -> TestResult {
    let mut l = Layout::new();
    let text = l.put(b"hello log");
    let wat = module(
        &l,
        &format!(
            r#"(func (export "proxy_on_vm_start") (param i32 i32) (result i32)
          (call $report (call $log (i32.const 3) {text}))
          (call $report (call $log (i32.const 6) {text}))
          (call $report (call $log (i32.const 2) (i32.const 0xFFFFFF00) (i32.const 512)))
          (call $report (call $get_log_level (i32.const {WORD})))
          (call $report (i32.load (i32.const {WORD})))
          (call $report (call $get_log_level (i32.const 0xFFFFFFFF)))
          (call $report (call $now (i32.const {WORD})))
          (call $report (call $now (i32.const 0xFFFFFFFD)))
          (call $report (call $tick_period (i32.const 100)))
          (call $report (call $done))
          (i32.const 1))
        (func (export "proxy_on_tick") (param i32)
          (call $report (call $now (i32.const {WORD}))))"#
        ),
    );
    let plugin = builder(&wat)?
        .log_level(kvoy_harness::LogLevel::Debug)
        .start()?;
    assert_eq!(reports(&plugin), "0260160".to_owned() + "601");
    assert!(plugin.logged("hello log"));
    assert_eq!(plugin.vm(0).tick_period(), Some(Duration::from_millis(100)));
    let before = plugin.now();
    plugin.advance(Duration::from_millis(250))?;
    // Two ticks in 250 ms (the first 100 ms after arming).
    assert_eq!(reports(&plugin), "0260160601".to_owned() + "00");
    assert_eq!(plugin.now(), before + Duration::from_millis(250));
    Ok(())
}

#[test]
fn effective_context_and_status() -> TestResult {
    let l = Layout::new();
    let wat = module(
        &l,
        &format!(
            r#"(func (export "proxy_on_request_headers") (param $ctx i32) (param i32 i32) (result i32)
          (call $report (call $set_effective (i32.const 1)))
          (call $report (call $set_effective (local.get $ctx)))
          (call $report (call $set_effective (i32.const 999)))
          ;; Outside a callout callback: code 0, empty message.
          (call $report (call $get_status (i32.const {WORD}) (i32.const {PTR}) (i32.const {SIZE})))
          (call $report (i32.load (i32.const {WORD})))
          (call $report (call $get_status (i32.const 0xFFFFFFFF) (i32.const {PTR}) (i32.const {SIZE})))
          (i32.const 0))"#
        ),
    );
    let plugin = start(&wat)?;
    let stream = plugin.vm(0).http_stream()?;
    stream.send_request_headers(HEADERS, true)?;
    assert_eq!(reports(&plugin), "002006");
    stream.finish()?;
    Ok(())
}

#[test]
fn buffers_read_write_status_and_envoys_copy_rules() -> TestResult {
    let mut l = Layout::new();
    let pre = l.put(b"PRE");
    let app = l.put(b"APP");
    let wat = module(
        &l,
        &format!(
            r#"(func (export "proxy_on_configure") (param i32 i32) (result i32)
          (call $report (call $get_buffer (i32.const 7) (i32.const 0) (i32.const 100) (i32.const {PTR}) (i32.const {SIZE})))
          (call $show)
          (call $report (call $get_configuration (i32.const {PTR}) (i32.const {SIZE})))
          (call $show)
          (i32.const 1))
        (func (export "proxy_on_request_body") (param i32 i32 i32) (result i32)
          ;; read 3 bytes from offset 1 of "hello"
          (call $report (call $get_buffer (i32.const 0) (i32.const 1) (i32.const 3) (i32.const {PTR}) (i32.const {SIZE})))
          (call $show)
          (call $report (call $buffer_status (i32.const 0) (i32.const {WORD}) (i32.const 268)))
          (call $report (i32.load (i32.const {WORD})))
          ;; the plugin configuration outside on_configure; an unknown type; bad return slot
          (call $report (call $get_buffer (i32.const 7) (i32.const 0) (i32.const 10) (i32.const {PTR}) (i32.const {SIZE})))
          (call $report (call $buffer_status (i32.const 7) (i32.const {WORD}) (i32.const 268)))
          (call $report (call $get_buffer (i32.const 42) (i32.const 0) (i32.const 10) (i32.const {PTR}) (i32.const {SIZE})))
          (call $report (call $buffer_status (i32.const 42) (i32.const {WORD}) (i32.const 268)))
          (call $report (call $buffer_status (i32.const 0) (i32.const 0xFFFFFFFF) (i32.const 268)))
          ;; "hello" -> drop 2 and prepend "PRE" -> "PREllo" -> append "APP" -> "PRElloAPP"
          (call $report (call $set_buffer (i32.const 0) (i32.const 0) (i32.const 2) {pre}))
          (call $report (call $set_buffer (i32.const 0) (i32.const 99) (i32.const 0) {app}))
          ;; inside the buffer: BadArgument; immutable buffer: BadArgument; bad data pointer
          (call $report (call $set_buffer (i32.const 0) (i32.const 2) (i32.const 1) {app}))
          (call $report (call $set_buffer (i32.const 6) (i32.const 0) (i32.const 0) {app}))
          (call $report (call $set_buffer (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0xFFFFFF00) (i32.const 512)))
          (i32.const 0))"#
        ),
    );
    let plugin = builder(&wat)?.configuration("plugin-config").start()?;
    assert_eq!(reports(&plugin), "00");
    assert_eq!(lines(&plugin), ["plugin-config", "plugin-config"]);
    let stream = plugin.vm(0).http_stream()?;
    stream.send_request_headers(HEADERS, false)?;
    assert_eq!(stream.send_request_body(b"hello", true)?, Action::Continue);
    assert_eq!(
        reports(&plugin),
        "00".to_owned() + "0" + "05" + "1122" + "6" + "00" + "226"
    );
    assert!(plugin.logged("ell"));
    assert_eq!(stream.forwarded_request_body(), b"PRElloAPP");
    stream.finish()?;
    Ok(())
}

#[test]
fn header_maps_every_call() -> TestResult {
    let mut l = Layout::new();
    let probe = l.put(b"x-probe");
    let one = l.put(b"one");
    let two = l.put(b"two");
    let missing = l.put(b"missing");
    let path = l.put(b":path");
    let new_pairs = l.put(&pairs(&[(":status", "201"), ("x-new", "n")]));
    let wat = module(
        &l,
        &format!(
            r#"(func (export "proxy_on_request_headers") (param i32 i32 i32) (result i32)
          (call $report (call $get_value (i32.const 0) {path} (i32.const {PTR}) (i32.const {SIZE})))
          (call $show)
          (call $report (call $get_value (i32.const 0) {missing} (i32.const {PTR}) (i32.const {SIZE})))
          (call $report (call $add_value (i32.const 0) {probe} {one}))
          (call $report (call $add_value (i32.const 0) {probe} {two}))
          (call $report (call $get_value (i32.const 0) {probe} (i32.const {PTR}) (i32.const {SIZE})))
          (call $show)
          (call $report (call $replace_value (i32.const 0) {probe} {two}))
          (call $report (call $remove_value (i32.const 0) {missing}))
          (call $report (call $map_size (i32.const 0) (i32.const {WORD})))
          (call $report (call $map_size (i32.const 8) (i32.const {WORD})))
          (call $report (call $map_size (i32.const 0) (i32.const 0xFFFFFFFF)))
          (call $report (call $get_pairs (i32.const 0) (i32.const {PTR}) (i32.const {SIZE})))
          ;; maps that are not there: trailers outside their callback, callout response
          (call $report (call $get_pairs (i32.const 6) (i32.const {PTR}) (i32.const {SIZE})))
          (call $report (i32.load (i32.const {SIZE})))
          (call $report (call $get_value (i32.const 1) {probe} (i32.const {PTR}) (i32.const {SIZE})))
          (call $report (call $add_value (i32.const 1) {probe} {one}))
          (call $report (call $remove_value (i32.const 99) {probe}))
          (i32.const 0))
        (func (export "proxy_on_response_headers") (param i32 i32 i32) (result i32)
          (call $report (call $set_pairs (i32.const 2) {new_pairs}))
          (call $report (call $set_pairs (i32.const 0) {new_pairs}))
          (i32.const 0))"#
        ),
    );
    let plugin = start(&wat)?;
    let stream = plugin.vm(0).http_stream()?;
    stream.send_request_headers(HEADERS, true)?;
    assert_eq!(
        reports(&plugin),
        "01000".to_owned() + "00026" + "0" + "00" + "222"
    );
    assert_eq!(lines(&plugin), ["/v1/chat/completions?x=1", "one"]);
    let up = stream.forwarded_request_headers().expect("continued");
    assert_eq!(up.get_all("x-probe").collect::<Vec<_>>(), ["two"]);
    stream.send_response_headers(&[(":status", "200"), ("x-old", "o")], true)?;
    assert_eq!(reports(&plugin)[16..], *"02");
    let down = stream.forwarded_response_headers().expect("continued");
    assert_eq!(
        down.to_vec(),
        [
            (":status".into(), "201".into()),
            ("x-new".into(), "n".into())
        ]
    );
    stream.finish()?;
    Ok(())
}

#[test]
fn shared_data_statuses_and_cas() -> TestResult {
    let mut l = Layout::new();
    let key = l.put(b"key1");
    let value = l.put(b"value");
    let wat = module(
        &l,
        &format!(
            r#"(func (export "proxy_on_request_headers") (param i32 i32 i32) (result i32)
          (local $cas i32)
          (call $report (call $get_shared {key} (i32.const {PTR}) (i32.const {SIZE}) (i32.const {WORD})))
          (call $report (call $set_shared {key} {value} (i32.const 0)))
          (call $report (call $get_shared {key} (i32.const {PTR}) (i32.const {SIZE}) (i32.const {WORD})))
          (call $show)
          (local.set $cas (i32.load (i32.const {WORD})))
          (call $report (call $set_shared {key} {value} (local.get $cas)))
          ;; the CAS moved on: the old one is stale
          (call $report (call $set_shared {key} {value} (local.get $cas)))
          ;; any CAS on a missing key inserts (Envoy compares only existing keys)
          (call $report (call $set_shared {value} {key} (i32.const 12345)))
          (call $report (call $get_shared {key} (i32.const {PTR}) (i32.const {SIZE}) (i32.const 0xFFFFFFFF)))
          (call $report (call $set_shared (i32.const 0xFFFFFF00) (i32.const 512) {value} (i32.const 0)))
          (i32.const 0))"#
        ),
    );
    let plugin = start(&wat)?;
    let stream = plugin.vm(0).http_stream()?;
    stream.send_request_headers(HEADERS, true)?;
    assert_eq!(reports(&plugin), "1000".to_owned() + "8066");
    assert_eq!(lines(&plugin), ["value"]);
    assert_eq!(
        plugin.shared_data("value").map(|(v, _)| v),
        Some(b"key1".to_vec())
    );
    stream.finish()?;
    Ok(())
}

#[test]
fn shared_queues_registration_resolution_and_ready() -> TestResult {
    let mut l = Layout::new();
    let q = l.put(b"q");
    let other = l.put(b"other");
    let vm_id = l.put(b"vm");
    let item = l.put(b"item-1");
    let wat = module(
        &l,
        &format!(
            r#"(global $token (mut i32) (i32.const 0))
        (func (export "proxy_on_configure") (param i32 i32) (result i32)
          (call $report (call $register_queue {q} (i32.const {TOKEN})))
          (global.set $token (i32.load (i32.const {TOKEN})))
          (call $report (call $register_queue {q} (i32.const 0xFFFFFFFF)))
          (i32.const 1))
        (func (export "proxy_on_request_headers") (param i32 i32 i32) (result i32)
          (call $report (call $resolve_queue {vm_id} {q} (i32.const {TOKEN})))
          (call $report (call $resolve_queue {vm_id} {other} (i32.const {TOKEN})))
          (call $report (call $dequeue (global.get $token) (i32.const {PTR}) (i32.const {SIZE})))
          (call $report (call $dequeue (i32.const 77) (i32.const {PTR}) (i32.const {SIZE})))
          (call $report (call $enqueue (i32.const 77) {item}))
          (call $report (call $enqueue (global.get $token) {item}))
          (i32.const 0))
        (func (export "proxy_on_queue_ready") (param i32 i32)
          (call $report (call $dequeue (local.get 1) (i32.const {PTR}) (i32.const {SIZE})))
          (call $show)
          (call $report (call $dequeue (local.get 1) (i32.const {PTR}) (i32.const {SIZE}))))"#
        ),
    );
    let plugin = builder(&wat)?.vm_id("vm").start()?;
    assert_eq!(reports(&plugin), "06");
    let stream = plugin.vm(0).http_stream()?;
    stream.send_request_headers(HEADERS, true)?;
    // on_queue_ready ran after the enqueuing call returned.
    assert_eq!(reports(&plugin), "06".to_owned() + "017110" + "07");
    assert_eq!(lines(&plugin), ["item-1"]);
    stream.finish()?;
    Ok(())
}

#[test]
fn metrics_every_kind_and_status() -> TestResult {
    let mut l = Layout::new();
    let name = l.put(b"kvoy_test_total");
    let gauge = l.put(b"kvoy_test_gauge");
    let hist = l.put(b"kvoy_test_ms");
    let wat = module(
        &l,
        &format!(
            r#"(func (export "proxy_on_request_headers") (param i32 i32 i32) (result i32)
          (local $c i32) (local $g i32) (local $h i32)
          (call $report (call $define_metric (i32.const 0) {name} (i32.const {TOKEN})))
          (local.set $c (i32.load (i32.const {TOKEN})))
          (call $report (call $define_metric (i32.const 1) {gauge} (i32.const {TOKEN})))
          (local.set $g (i32.load (i32.const {TOKEN})))
          (call $report (call $define_metric (i32.const 2) {hist} (i32.const {TOKEN})))
          (local.set $h (i32.load (i32.const {TOKEN})))
          (call $report (call $define_metric (i32.const 3) {name} (i32.const {TOKEN})))
          (call $report (call $increment_metric (local.get $c) (i64.const 3)))
          (call $report (call $increment_metric (local.get $c) (i64.const -1)))
          (call $report (call $record_metric (local.get $c) (i64.const 2)))
          (call $report (call $get_metric (local.get $c) (i32.const {WORD})))
          (call $report (i32.load (i32.const {WORD})))
          (call $report (call $record_metric (local.get $g) (i64.const 7)))
          (call $report (call $increment_metric (local.get $g) (i64.const -2)))
          (call $report (call $get_metric (local.get $g) (i32.const {WORD})))
          (call $report (i32.load (i32.const {WORD})))
          (call $report (call $record_metric (local.get $h) (i64.const 42)))
          (call $report (call $increment_metric (local.get $h) (i64.const 1)))
          (call $report (call $get_metric (local.get $h) (i32.const {WORD})))
          (call $report (call $record_metric (i32.const 4000) (i64.const 1)))
          (call $report (call $get_metric (local.get $c) (i32.const 0xFFFFFFFF)))
          (i32.const 0))"#
        ),
    );
    let plugin = start(&wat)?;
    let stream = plugin.vm(0).http_stream()?;
    stream.send_request_headers(HEADERS, true)?;
    assert_eq!(
        reports(&plugin),
        "0002".to_owned() + "02005" + "0005" + "022" + "16"
    );
    assert_eq!(plugin.counter("kvoy_test_total"), Some(5));
    assert_eq!(plugin.gauge("kvoy_test_gauge"), Some(5));
    assert_eq!(plugin.histogram("kvoy_test_ms"), Some(vec![42]));
    stream.finish()?;
    Ok(())
}

#[test]
fn properties_derived_set_and_envoy_attributes() -> TestResult {
    let mut l = Layout::new();
    let path = l.put(b"request\0path");
    let url_path = l.put(b"request\0url_path");
    let query = l.put(b"request\0query");
    let size = l.put(b"request\0size");
    let up_port = l.put(b"upstream\0port");
    let up_addr = l.put(b"upstream\0address");
    let code = l.put(b"response\0code");
    let name = l.put(b"plugin_name");
    let note = l.put(b"kvoy_note");
    let value = l.put(b"noted");
    let nope = l.put(b"no\0such");
    let wat = module(
        &l,
        &format!(
            r#"(func (export "proxy_on_request_headers") (param i32 i32 i32) (result i32)
          (call $report (call $get_property {path} (i32.const {PTR}) (i32.const {SIZE})))
          (call $show)
          (call $report (call $get_property {url_path} (i32.const {PTR}) (i32.const {SIZE})))
          (call $show)
          (call $report (call $get_property {query} (i32.const {PTR}) (i32.const {SIZE})))
          (call $show)
          (call $report (call $get_property {size} (i32.const {PTR}) (i32.const {SIZE})))
          (call $report (i32.load (i32.load (i32.const {PTR}))))
          (call $report (call $get_property {name} (i32.const {PTR}) (i32.const {SIZE})))
          (call $show)
          (call $report (call $get_property {up_port} (i32.const {PTR}) (i32.const {SIZE})))
          (call $report (call $get_property {nope} (i32.const {PTR}) (i32.const {SIZE})))
          (call $report (call $set_property {note} {value}))
          (call $report (call $get_property {note} (i32.const {PTR}) (i32.const {SIZE})))
          (call $show)
          (call $report (call $get_property (i32.const 0xFFFFFF00) (i32.const 512) (i32.const {PTR}) (i32.const {SIZE})))
          (i32.const 0))
        (func (export "proxy_on_response_headers") (param i32 i32 i32) (result i32)
          (call $report (call $get_property {up_addr} (i32.const {PTR}) (i32.const {SIZE})))
          (call $show)
          (call $report (call $get_property {up_port} (i32.const {PTR}) (i32.const {SIZE})))
          (drop (call $log (i32.const 2) (i32.const 0) (i32.load (i32.load (i32.const {PTR})))))
          (call $report (call $get_property {code} (i32.const {PTR}) (i32.const {SIZE})))
          (i32.const 0))"#
        ),
    );
    let plugin = builder(&wat)?.name("kvoy_test").start()?;
    let stream = plugin.vm(0).http_stream()?;
    stream.send_request_headers(HEADERS, true)?;
    assert_eq!(
        reports(&plugin),
        "0000".to_owned() + "5" + "0" + "11" + "00" + "6"
    );
    assert_eq!(
        lines(&plugin),
        [
            "/v1/chat/completions?x=1",
            "/v1/chat/completions",
            "x=1",
            "kvoy_test",
            "noted"
        ]
    );
    assert_eq!(stream.property(&["kvoy_note"]), Some(b"noted".to_vec()));
    // What `kvoy-local serve` sets once it has chosen the upstream.
    stream.set_property(&["upstream", "address"], "127.0.0.1:12")?;
    stream.send_response_headers(&[(":status", "200")], true)?;
    assert_eq!(reports(&plugin)[11..], *"000");
    // The port (12) as an 8-byte integer: logging its first 12 bytes of the digit table.
    assert!(lines(&plugin).contains(&"127.0.0.1:12".to_owned()));
    assert!(lines(&plugin).contains(&"0123456789ab".to_owned()));
    stream.finish()?;
    Ok(())
}

#[test]
fn foreign_functions_builtin_registered_and_missing() -> TestResult {
    let mut l = Layout::new();
    let fs = l.put(b"set_envoy_filter_state");
    let crc = l.put(b"clear_route_cache");
    let echo = l.put(b"echo");
    let missing = l.put(b"compress");
    // path = "envoy.network.transport_socket.original_dst_address", value = "127.0.0.1:9"
    let key = b"envoy.network.transport_socket.original_dst_address";
    let mut proto = vec![0x0a, key.len() as u8];
    proto.extend_from_slice(key);
    proto.extend_from_slice(&[0x12, 11]);
    proto.extend_from_slice(b"127.0.0.1:9");
    let args = l.put(&proto);
    let bad = l.put(&[0x0a, 50, b'x']);
    let wat = module(
        &l,
        &format!(
            r#"(func (export "proxy_on_request_headers") (param i32 i32 i32) (result i32)
          (call $report (call $foreign {fs} {args} (i32.const {PTR}) (i32.const {SIZE})))
          (call $report (call $foreign {fs} {bad} (i32.const {PTR}) (i32.const {SIZE})))
          (call $report (call $foreign {crc} (i32.const 0) (i32.const 0) (i32.const {PTR}) (i32.const {SIZE})))
          (call $report (call $foreign {echo} {args} (i32.const {PTR}) (i32.const {SIZE})))
          (call $report (i32.load (i32.const {SIZE})))
          (call $report (call $foreign {missing} (i32.const 0) (i32.const 0) (i32.const {PTR}) (i32.const {SIZE})))
          (call $report (call $foreign (i32.const 0xFFFFFF00) (i32.const 512) (i32.const 0) (i32.const 0) (i32.const {PTR}) (i32.const {SIZE})))
          (i32.const 0))
        (func (export "proxy_on_tick") (param i32)
          ;; no stream: Envoy has no filter state to write
          (call $report (call $foreign {fs} {args} (i32.const {PTR}) (i32.const {SIZE}))))"#
        ),
    );
    let plugin = builder(&wat)?
        .foreign_function("echo", |args| Ok(args[..5].to_vec()))
        .start()?;
    let stream = plugin.vm(0).http_stream()?;
    stream.send_request_headers(HEADERS, true)?;
    assert_eq!(reports(&plugin), "020051".to_owned() + "6");
    assert_eq!(
        stream.filter_state("envoy.network.transport_socket.original_dst_address"),
        Some(b"127.0.0.1:9".to_vec())
    );
    assert_eq!(plugin.foreign_calls().len(), 5);
    plugin.vm(0).tick()?;
    assert_eq!(reports(&plugin), "0200516".to_owned() + "1");
    stream.finish()?;
    Ok(())
}

#[test]
fn stream_control_continue_close_and_local_reply() -> TestResult {
    let mut l = Layout::new();
    let details = l.put(b"kvoy_denied");
    let body = l.put(b"{\"error\":{}}");
    let reply_headers = l.put(&pairs(&[
        ("content-type", "application/json"),
        ("x-why", "test"),
    ]));
    let malformed = l.put(&[5, 0, 0, 0]);
    let wat = module(
        &l,
        &format!(
            r#"(func (export "proxy_on_request_headers") (param i32 i32 i32) (result i32)
          (call $report (call $continue_stream (i32.const 2)))
          (call $report (call $continue_stream (i32.const 3)))
          (call $report (call $continue_stream (i32.const 9)))
          (call $report (call $close_stream (i32.const 9)))
          (i32.const 1))
        (func (export "proxy_on_request_body") (param i32 i32 i32) (result i32)
          (call $report (call $local_reply (i32.const 429) {details} {body} {malformed} (i32.const -1)))
          (call $report (call $local_reply (i32.const 429) {details} {body} {reply_headers} (i32.const -1)))
          (i32.const 0))
        (func (export "proxy_on_response_headers") (param i32 i32 i32) (result i32)
          (call $report (i32.const 9))
          (i32.const 0))"#
        ),
    );
    let plugin = start(&wat)?;
    let stream = plugin.vm(0).http_stream()?;
    assert_eq!(stream.send_request_headers(HEADERS, false)?, Action::Pause);
    stream.send_request_body(b"hello", true)?;
    assert_eq!(reports(&plugin), "0c22".to_owned() + "20" + "9");
    let reply = stream.local_reply().expect("reply");
    assert_eq!((reply.status, reply.details.as_str()), (429, "kvoy_denied"));
    // As Envoy's sendLocalReply: the filter's content-type is kept, not doubled.
    let down = stream.forwarded_response_headers().expect("sent");
    assert_eq!(
        down.get_all("content-type").collect::<Vec<_>>(),
        ["application/json"]
    );
    assert_eq!(down.get("content-length"), Some("12"));
    assert_eq!(down.get("x-why"), Some("test"));
    stream.finish()?;

    // close_stream resets both directions; continue_request (ABI 0.1) resumes.
    let wat = module(
        &Layout::new(),
        r#"(func (export "proxy_on_request_headers") (param i32 i32 i32) (result i32)
          (call $report (call $close_stream (i32.const 1)))
          (i32.const 1))"#,
    );
    let plugin = start(&wat)?;
    let stream = plugin.vm(0).http_stream()?;
    stream.send_request_headers(HEADERS, false)?;
    assert_eq!(
        stream.events(),
        [StreamEvent::Closed(kvoy_harness::StreamType::HttpResponse)]
    );
    assert_eq!(stream.send_request_body(b"x", true)?, Action::Pause);
    stream.finish()?;
    Ok(())
}

#[test]
fn http_calls_recorded_answered_and_failed() -> TestResult {
    let mut l = Layout::new();
    let cluster = l.put(b"agg");
    let unknown = l.put(b"nowhere");
    let good = l.put(&pairs(&[
        (":method", "GET"),
        (":path", "/v1/snapshot"),
        (":authority", "agg"),
    ]));
    let partial = l.put(&pairs(&[(":method", "GET"), (":path", "/")]));
    let status_key = l.put(b":status");
    let wat = module(
        &l,
        &format!(
            r#"(func (export "proxy_on_tick") (param i32)
          (call $report (call $http_call {cluster} {good} (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 1000) (i32.const {TOKEN})))
          (call $report (call $http_call {unknown} {good} (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 1000) (i32.const {TOKEN})))
          (call $report (call $http_call {cluster} {partial} (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 1000) (i32.const {TOKEN})))
          (call $report (call $http_call {cluster} {good} (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const -1) (i32.const {TOKEN})))
          (call $report (call $http_call {cluster} {good} (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 1000) (i32.const 0xFFFFFFFF))))
        (func (export "proxy_on_http_call_response") (param i32 i32 i32 i32 i32)
          (call $report (local.get 2))
          (call $report (call $get_status (i32.const {WORD}) (i32.const {PTR}) (i32.const {SIZE})))
          (call $report (i32.load (i32.const {WORD})))
          (call $report (call $get_value (i32.const 6) {status_key} (i32.const {PTR}) (i32.const {SIZE})))
          (call $report (call $get_buffer (i32.const 4) (i32.const 0) (i32.const 100) (i32.const {PTR}) (i32.const {SIZE})))
          (call $show))"#
        ),
    );
    let plugin = builder(&wat)?.clusters(["agg"]).start()?;
    plugin.vm(0).tick()?;
    assert_eq!(reports(&plugin), "02226");
    let calls = plugin.http_calls();
    assert_eq!(calls.len(), 1);
    // Envoy's HTTP callout ids: 4, 8, ... (gRPC calls and streams have their own sequences).
    assert_eq!(calls[0].token, 4);
    assert_eq!(calls[0].path(), Some("/v1/snapshot"));
    assert_eq!(calls[0].timeout, Duration::from_millis(1000));
    plugin.respond_http_call(&calls[0], HttpResponse::new(200).body("snapshot-bytes"))?;
    assert_eq!(reports(&plugin)[5..], *"10000");
    assert!(plugin.logged("snapshot-bytes"));
    // A failed call: no headers, BrokenConnection (11) from get_status, no response maps.
    plugin.vm(0).tick()?;
    let call = plugin.http_calls().pop().expect("second call");
    plugin.fail_http_call(&call)?;
    let r = reports(&plugin);
    // Envoy: no response body buffer on a failed call (NotFound).
    assert_eq!(r[r.len() - 5..], *"00b21", "{r}");
    Ok(())
}

#[test]
fn http_calls_to_real_addresses() -> TestResult {
    let mut l = Layout::new();
    let cluster = l.put(b"agg");
    let dead = l.put(b"dead");
    let good = l.put(&pairs(&[
        (":method", "GET"),
        (":path", "/v1/snapshot"),
        (":authority", "agg"),
    ]));
    let wat = module(
        &l,
        &format!(
            r#"(func (export "proxy_on_tick") (param i32)
          (call $report (call $http_call {cluster} {good} (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 2000) (i32.const {TOKEN})))
          (call $report (call $http_call {dead} {good} (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 2000) (i32.const {TOKEN}))))
        (func (export "proxy_on_http_call_response") (param i32 i32 i32 i32 i32)
          (call $report (local.get 2))
          (call $report (call $get_buffer (i32.const 4) (i32.const 0) (i32.const 200) (i32.const {PTR}) (i32.const {SIZE})))
          (call $show))"#
        ),
    );
    let (addr, server) =
        testing::serve_once(b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\nsnap-real")
            .expect("serve");
    let closed = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port");
    let plugin = builder(&wat)?
        .clusters(["other"])
        .upstream("agg", addr)
        .upstream("dead", closed)
        .start()?;
    plugin.vm(0).tick()?;
    assert_eq!(reports(&plugin), "00");
    assert!(
        plugin.http_calls().is_empty(),
        "real calls are not for the test to answer"
    );
    assert_eq!(plugin.wait_http_responses(Duration::from_secs(10))?, 2);
    assert_eq!(plugin.pending_upstream_calls(), 0);
    let request = server.join().expect("server").expect("read");
    assert!(
        request.starts_with("GET /v1/snapshot HTTP/1.1\r\nhost: agg\r\n"),
        "{request}"
    );
    assert!(plugin.logged("snap-real"));
    // Connection refused: Envoy's own 503 reply, with headers (3 of them) and a body.
    assert!(plugin.logged("upstream connect error or disconnect/reset before headers"));
    assert_eq!(reports(&plugin).matches('0').count(), 4);
    Ok(())
}

#[test]
fn wasi_calls_a_rust_filter_imports() -> TestResult {
    let mut l = Layout::new();
    l.put(b"to stdout\n");
    let wat = module(
        &l,
        &format!(
            r#"(func (export "proxy_on_vm_start") (param i32 i32) (result i32)
          ;; iovec at 300: {{ptr, len}} of the text
          (i32.store (i32.const 300) (i32.const 512))
          (i32.store (i32.const 304) (i32.const 10))
          (call $report (call $fd_write (i32.const 1) (i32.const 300) (i32.const 1) (i32.const {WORD})))
          (call $report (i32.load (i32.const {WORD})))
          (call $report (call $fd_write (i32.const 9) (i32.const 300) (i32.const 1) (i32.const {WORD})))
          (call $report (call $fd_write (i32.const 1) (i32.const 0xFFFFFFF0) (i32.const 1) (i32.const {WORD})))
          (call $report (call $fd_read (i32.const 5) (i32.const 300) (i32.const 1) (i32.const {WORD})))
          (call $report (call $clock_time_get (i32.const 0) (i64.const 1) (i32.const {WORD})))
          (call $report (call $clock_time_get (i32.const 1) (i64.const 1) (i32.const {WORD})))
          (call $report (call $clock_time_get (i32.const 7) (i64.const 1) (i32.const {WORD})))
          (call $report (call $clock_res_get (i32.const 0) (i32.const {WORD})))
          (call $report (call $random_get (i32.const {WORD}) (i32.const 8)))
          (call $report (call $random_get (i32.const 0xFFFFFFF0) (i32.const 64)))
          (call $report (call $environ_sizes_get (i32.const {WORD}) (i32.const 268)))
          (call $report (i32.load (i32.const {WORD})))
          (call $report (call $environ_get (i32.const 300) (i32.const 320)))
          (drop (call $log (i32.const 2) (i32.const 320) (i32.const 7)))
          (call $report (call $args_sizes_get (i32.const {WORD}) (i32.const 268)))
          (call $report (i32.load (i32.const {WORD})))
          (call $report (call $fd_fdstat_get (i32.const 1) (i32.const 300)))
          (call $report (call $fd_fdstat_get (i32.const 7) (i32.const 300)))
          (call $report (call $sched_yield))
          (i32.const 1))"#
        ),
    );
    let plugin = builder(&wat)?.env("KVOY_A", "1").start()?;
    let expected = "0a8lQ".to_owned() // fd_write: ok, 10 bytes, bad fd, bad iovec; fd_read
        + "00W" // realtime, monotonic, CPU time: NOTSUP
        + "00l" // clock_res_get; random_get, bad buffer
        + "01" // one environment variable
        + "0" // environ_get
        + "00" // no arguments
        + "08" // fd_fdstat_get: stdout, unknown fd
        + "0"; // sched_yield
    assert_eq!(reports(&plugin), expected);
    assert!(plugin.logged("to stdout"));
    assert!(plugin.logged("KVOY_A="));
    Ok(())
}

/// A filter for the chain tests: `pass` continues everything; `hold` pauses at headers and
/// body until its tick continues the held stream; `reply` answers 403 at the body.
fn chain_filter(kind: &str) -> String {
    let mut l = Layout::new();
    let details = l.put(b"denied");
    let body = l.put(b"no");
    let tag = l.put(format!("x-{kind}").as_bytes());
    let one = l.put(b"1");
    let (headers, body_action) = match kind {
        "hold" => ("1", "1"),
        "reply" => ("1", "0"),
        _ => ("0", "0"),
    };
    let reply = if kind == "reply" {
        format!("(drop (call $local_reply (i32.const 403) {details} {body} (i32.const 0) (i32.const 0) (i32.const -1)))")
    } else {
        String::new()
    };
    module(
        &l,
        &format!(
            r#"(global $held (mut i32) (i32.const 0))
        (func (export "proxy_on_configure") (param i32 i32) (result i32)
          (drop (call $tick_period (i32.const 10)))
          (i32.const 1))
        (func (export "proxy_on_request_headers") (param $ctx i32) (param i32 i32) (result i32)
          (drop (call $add_value (i32.const 0) {tag} {one}))
          (global.set $held (local.get $ctx))
          (i32.const {headers}))
        (func (export "proxy_on_request_body") (param i32 i32 i32) (result i32)
          {reply}
          (i32.const {body_action}))
        (func (export "proxy_on_response_headers") (param i32 i32 i32) (result i32)
          (drop (call $add_value (i32.const 2) {tag} {one}))
          (i32.const 0))
        (func (export "proxy_on_tick") (param i32)
          (if (global.get $held)
            (then
              (drop (call $set_effective (global.get $held)))
              (drop (call $continue_stream (i32.const 0)))
              (global.set $held (i32.const 0)))))
        (func (export "proxy_on_log") (param i32)
          (drop (call $log (i32.const 2) {tag})))"#
        ),
    )
}

#[test]
fn filter_chain_holds_releases_replies_and_logs_in_envoy_order() -> TestResult {
    let chain = FilterChain::new()
        .filter("a", start(&chain_filter("pass"))?)
        .filter("b", start(&chain_filter("hold"))?)
        .filter("c", start(&chain_filter("pass"))?);
    let mut s = chain.stream(0)?;
    s.set_property(&["source", "address"], "127.0.0.1:5000")?;
    s.send_request(HeaderMap::from_pairs(HEADERS.iter().copied()), b"hello")?;
    assert_eq!(s.state(), ChainState::Held { at: 1 });
    assert!(
        s.filter_stream(2).is_none(),
        "c has no context before the request reaches it"
    );
    chain.advance(Duration::from_millis(10))?;
    s.pump()?;
    assert_eq!(s.state(), ChainState::Upstream);
    let up = s.take_upstream_request().expect("upstream request");
    assert_eq!(up.body, b"hello");
    assert_eq!(
        ["x-pass", "x-hold"].map(|h| up.headers.get(h)),
        [Some("1"), Some("1")]
    );
    assert!(s.take_upstream_request().is_none(), "only once");
    s.send_response_headers(HeaderMap::from_pairs([(":status", "200")]), false)?;
    s.send_response_body(b"world", true)?;
    let down = s.take_downstream();
    let headers = down.headers.expect("headers");
    assert_eq!(headers.get("x-hold"), Some("1"));
    assert_eq!((down.body.as_slice(), down.end), (&b"world"[..], true));
    assert_eq!(s.take_downstream(), kvoy_harness::Downstream::default());
    s.finish()?;
    // proxy_on_log of every filter, in chain order.
    let logs: Vec<String> = chain
        .plugin(0)
        .map(|p| p.logs().iter().map(|e| e.message.clone()).collect())
        .unwrap_or_default();
    assert_eq!(logs, ["x-pass"]);
    assert!(s.filter_time().iter().all(|t| !t.is_zero()));

    // A local reply from the second filter: the third never sees the request (but logs), the
    // first sees the reply.
    let chain = FilterChain::new()
        .filter("a", start(&chain_filter("pass"))?)
        .filter("b", start(&chain_filter("reply"))?)
        .filter("c", start(&chain_filter("pass"))?);
    let mut s = chain.stream(0)?;
    s.send_request(HeaderMap::from_pairs(HEADERS.iter().copied()), b"hello")?;
    assert_eq!(s.state(), ChainState::LocalReply { from: 1 });
    assert_eq!(s.local_reply().map(|(i, r)| (i, r.status)), Some((1, 403)));
    let down = s.take_downstream();
    let headers = down.headers.expect("reply headers");
    assert_eq!(headers.get(":status"), Some("403"));
    assert_eq!(
        headers.get("x-pass"),
        Some("1"),
        "went through the first filter"
    );
    assert_eq!((down.body.as_slice(), down.end), (&b"no"[..], true));
    assert!(s.upstream_request().is_none());
    s.finish()?;
    assert!(
        chain.plugin(2).is_some_and(|p| p.logged("x-pass")),
        "c logged"
    );
    assert!(matches!(
        chain.stream(5),
        Err(Error::NoSuchVm { vm: 5, .. })
    ));
    Ok(())
}

#[test]
fn status_numbers_are_the_specs() {
    assert_eq!(Status::Unimplemented as u32, 12);
    assert_eq!(Status::BrokenConnection as u32, 11);
}

#[test]
fn foreign_function_callbacks_read_their_arguments_as_call_data() -> TestResult {
    let l = Layout::new();
    let wat = module(
        &l,
        &format!(
            r#"(func (export "proxy_on_configure") (param i32 i32) (result i32)
          ;; CallData outside proxy_on_foreign_function: NotFound
          (call $report (call $get_buffer (i32.const 8) (i32.const 0) (i32.const 10) (i32.const {PTR}) (i32.const {SIZE})))
          (i32.const 1))
        (func (export "proxy_on_foreign_function") (param $root i32) (param $id i32) (param $size i32)
          (call $report (local.get $id))
          (call $report (call $get_buffer (i32.const 8) (i32.const 0) (local.get $size) (i32.const {PTR}) (i32.const {SIZE})))
          (call $show))"#
        ),
    );
    let plugin = start(&wat)?;
    assert_eq!(reports(&plugin), "1");
    plugin.vm(0).foreign_function(7, b"arguments")?;
    assert_eq!(reports(&plugin), "170");
    assert_eq!(lines(&plugin), ["arguments"]);
    // A guest without the export ignores the call, as Envoy's null function does.
    let plain = start(&module(&Layout::new(), ""))?;
    plain.vm(0).foreign_function(1, b"x")?;
    Ok(())
}
