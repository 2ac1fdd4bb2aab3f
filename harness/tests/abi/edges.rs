//! Host behaviour the Rust SDK never shows: bad pointers, bad enum values, missing exports,
//! unknown imports, `proc_exit`, odd allocators. The guests are hand-written WebAssembly text.
//!
//! Each guest reports the status of a host call by logging one character: the status as a
//! digit (`0`-`9`, then `a`, `b`, `c`).

use kvoy_harness::{Action, Error, Host};

use crate::wat_guest::{host, reports, start};
use crate::TestResult;

/// Imports, memory with the digit table and some strings, a bump allocator, the ABI marker, and
/// `$report`. `extra` adds functions and exports.
fn module(extra: &str) -> String {
    module_with(
        extra,
        r#"(func (export "proxy_on_memory_allocate") (param $size i32) (result i32) (call $bump (local.get $size)))"#,
    )
}

fn module_with(extra: &str, allocator: &str) -> String {
    format!(
        r#"(module
  (import "env" "proxy_log" (func $log (param i32 i32 i32) (result i32)))
  (import "env" "proxy_get_header_map_value" (func $get_value (param i32 i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_replace_header_map_value" (func $replace_value (param i32 i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_set_header_map_pairs" (func $set_pairs (param i32 i32 i32) (result i32)))
  (import "env" "proxy_get_buffer_bytes" (func $get_buffer (param i32 i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_get_shared_data" (func $get_shared (param i32 i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_set_effective_context" (func $set_effective (param i32) (result i32)))
  (import "env" "proxy_dequeue_shared_queue" (func $dequeue (param i32 i32 i32) (result i32)))
  (import "env" "proxy_get_property" (func $get_property (param i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_call_foreign_function" (func $foreign (param i32 i32 i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_get_metric" (func $get_metric (param i32 i32) (result i32)))
  (import "env" "proxy_define_metric" (func $define_metric (param i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_continue_stream" (func $continue_stream (param i32) (result i32)))
  (import "env" "proxy_http_call" (func $http_call (param i32 i32 i32 i32 i32 i32 i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_send_local_response" (func $local_reply (param i32 i32 i32 i32 i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "proc_exit" (func $proc_exit (param i32)))
  (import "wasi_snapshot_preview1" "fd_write" (func $fd_write (param i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (data (i32.const 0) "0123456789abc")
  (data (i32.const 16) ":path")
  (data (i32.const 32) "missing")
  (data (i32.const 48) "x-probe")
  (data (i32.const 64) "1")
  (data (i32.const 80) "\05\00\00\00")
  (data (i32.const 96) "nope")
  (global $heap (mut i32) (i32.const 1024))
  (func $bump (param $size i32) (result i32)
    (local $p i32)
    (local.set $p (global.get $heap))
    (global.set $heap (i32.add (global.get $heap) (local.get $size)))
    (local.get $p))
  {allocator}
  (func (export "proxy_abi_version_0_2_1"))
  (func $report (param $status i32)
    (drop (call $log (i32.const 2) (local.get $status) (i32.const 1))))
  {extra}
)"#
    )
}

const HEADERS: &[(&str, &str)] = &[(":method", "GET"), (":path", "/"), (":authority", "a")];

#[test]
fn bad_pointers_and_values_get_envoy_statuses() -> TestResult {
    let plugin = start(&module(
        r#"(func (export "proxy_on_request_headers") (param $ctx i32) (param $n i32) (param $eos i32) (result i32)
          ;; key out of bounds; return slot out of bounds; bad map type
          (call $report (call $get_value (i32.const 0) (i32.const 0xFFFF0000) (i32.const 4) (i32.const 256) (i32.const 260)))
          (call $report (call $get_value (i32.const 0) (i32.const 16) (i32.const 5) (i32.const 0xFFFFFFF0) (i32.const 260)))
          (call $report (call $get_value (i32.const 99) (i32.const 16) (i32.const 5) (i32.const 256) (i32.const 260)))
          ;; bad log level; bad buffer type; malformed pairs
          (call $report (call $log (i32.const 9) (i32.const 0) (i32.const 1)))
          (call $report (call $get_buffer (i32.const 42) (i32.const 0) (i32.const 10) (i32.const 256) (i32.const 260)))
          (call $report (call $set_pairs (i32.const 0) (i32.const 80) (i32.const 4)))
          ;; missing header, shared data, property; unknown context, queue, foreign function, metric
          (call $report (call $get_value (i32.const 0) (i32.const 32) (i32.const 7) (i32.const 256) (i32.const 260)))
          (call $report (call $get_shared (i32.const 96) (i32.const 4) (i32.const 256) (i32.const 260) (i32.const 264)))
          (call $report (call $get_property (i32.const 96) (i32.const 4) (i32.const 256) (i32.const 260)))
          (call $report (call $set_effective (i32.const 999)))
          (call $report (call $dequeue (i32.const 77) (i32.const 256) (i32.const 260)))
          (call $report (call $foreign (i32.const 96) (i32.const 4) (i32.const 0) (i32.const 0) (i32.const 256) (i32.const 260)))
          (call $report (call $get_metric (i32.const 1234) (i32.const 264)))
          ;; bad metric type, stream type; http call with malformed headers
          (call $report (call $define_metric (i32.const 7) (i32.const 96) (i32.const 4) (i32.const 264)))
          (call $report (call $continue_stream (i32.const 9)))
          (call $report (call $http_call (i32.const 96) (i32.const 4) (i32.const 80) (i32.const 4) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 100) (i32.const 256)))
          ;; size overflowing the address space
          (call $report (call $log (i32.const 2) (i32.const 0xFFFFFFFF) (i32.const 0xFFFFFFFF)))
          (call $report (call $get_value (i32.const 0) (i32.const 16) (i32.const 5) (i32.const 256) (i32.const 260)))
          (i32.const 1))"#,
    ))?;
    let stream = plugin.vm(0).http_stream()?;
    assert_eq!(stream.send_request_headers(HEADERS, true)?, Action::Pause);
    assert_eq!(
        reports(&plugin),
        "66".to_owned() + "2222" + "1112111" + "222" + "60"
    );
    Ok(())
}

#[test]
fn header_access_follows_envoy_lifetimes() -> TestResult {
    let plugin = start(&module(
        r#"(func (export "proxy_on_request_headers") (param i32 i32 i32) (result i32)
          (call $report (call $replace_value (i32.const 0) (i32.const 48) (i32.const 7) (i32.const 64) (i32.const 1)))
          (i32.const 0))
        (func (export "proxy_on_response_headers") (param i32 i32 i32) (result i32)
          ;; The request headers went upstream with Continue: gone for the guest.
          (call $report (call $get_value (i32.const 0) (i32.const 16) (i32.const 5) (i32.const 256) (i32.const 260)))
          (call $report (call $replace_value (i32.const 0) (i32.const 48) (i32.const 7) (i32.const 64) (i32.const 1)))
          ;; Response headers are there; call-response headers are not.
          (call $report (call $replace_value (i32.const 2) (i32.const 48) (i32.const 7) (i32.const 64) (i32.const 1)))
          (call $report (call $get_value (i32.const 6) (i32.const 16) (i32.const 5) (i32.const 256) (i32.const 260)))
          (i32.const 0))
        (func (export "proxy_on_log") (param i32)
          ;; Readable again for logging.
          (call $report (call $get_value (i32.const 0) (i32.const 16) (i32.const 5) (i32.const 256) (i32.const 260))))"#,
    ))?;
    let stream = plugin.vm(0).http_stream()?;
    assert_eq!(
        stream.send_request_headers(HEADERS, true)?,
        Action::Continue
    );
    assert_eq!(
        stream
            .forwarded_request_headers()
            .and_then(|h| h.get("x-probe").map(str::to_owned))
            .as_deref(),
        Some("1")
    );
    stream.send_response_headers(&[(":status", "200")], true)?;
    stream.finish()?;
    assert_eq!(reports(&plugin), "022020");
    assert_eq!(stream.response_header("x-probe").as_deref(), Some("1"));
    Ok(())
}

#[test]
fn a_local_reply_wins_over_continue() -> TestResult {
    let plugin = start(&module(
        r#"(func (export "proxy_on_request_headers") (param i32 i32 i32) (result i32)
          ;; status 418, details "nope", body "missing", no extra headers; then Continue anyway
          (call $report (call $local_reply (i32.const 418) (i32.const 96) (i32.const 4) (i32.const 32) (i32.const 7) (i32.const 0) (i32.const 0) (i32.const -1)))
          (i32.const 0))
        (func (export "proxy_on_response_headers") (param i32 i32 i32) (result i32)
          (call $report (i32.const 9))
          (i32.const 0))"#,
    ))?;
    let stream = plugin.vm(0).http_stream()?;
    assert_eq!(
        stream.send_request_headers(HEADERS, false)?,
        Action::Continue
    );
    assert_eq!(
        reports(&plugin),
        "09",
        "the reply went through on_response_headers"
    );
    assert_eq!(
        stream.forwarded_request_headers(),
        None,
        "nothing went upstream"
    );
    let reply = stream.local_reply().expect("reply");
    assert_eq!(
        (reply.status, reply.details.as_str(), reply.grpc_status),
        (418, "nope", None)
    );
    let response = stream
        .forwarded_response_headers()
        .expect("sent downstream");
    assert_eq!(response.get(":status"), Some("418"));
    assert_eq!(response.get("content-length"), Some("7"));
    assert_eq!(stream.forwarded_response_body(), b"missing");
    // Neither direction takes more callbacks.
    assert_eq!(stream.send_request_body(b"x", true)?, Action::Pause);
    assert_eq!(
        stream.send_response_headers(&[(":status", "200")], true)?,
        Action::Pause
    );
    assert_eq!(reports(&plugin), "09");
    stream.finish()?;
    Ok(())
}

#[test]
fn missing_callbacks_default_like_envoy() -> TestResult {
    let plugin = start(&module(""))?;
    let stream = plugin.vm(0).http_stream()?;
    assert_eq!(stream.send_request(HEADERS, b"body")?, Action::Continue);
    assert_eq!(stream.forwarded_request_body(), b"body");
    stream.finish()?;
    Ok(())
}

#[test]
fn unknown_imports_link_and_trap_when_called() -> TestResult {
    let wat = module(
        r#"(func (export "proxy_on_request_headers") (param i32 i32 i32) (result i32)
          (call $future) (i32.const 0))"#,
    )
    .replace(
        "(memory (export",
        r#"(import "env" "proxy_from_the_future" (func $future)) (memory (export"#,
    );
    let plugin = start(&wat)?;
    let stream = plugin.vm(0).http_stream()?;
    let err = stream
        .send_request_headers(HEADERS, true)
        .expect_err("trap");
    assert!(
        matches!(
            err,
            Error::Trap {
                call: "proxy_on_request_headers",
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("proxy_from_the_future"), "{err}");
    assert!(matches!(
        stream.send_request_headers(HEADERS, true),
        Err(Error::VmFailed { vm: 0 })
    ));
    Ok(())
}

#[test]
fn proc_exit_is_an_error() -> TestResult {
    let plugin = start(&module(
        r#"(func (export "proxy_on_request_headers") (param i32 i32 i32) (result i32)
          (call $proc_exit (i32.const 3)) (i32.const 0))"#,
    ))?;
    let err = plugin
        .vm(0)
        .http_stream()?
        .send_request_headers(HEADERS, true)
        .expect_err("exit");
    assert!(matches!(err, Error::ProcExit { code: 3, .. }), "{err}");
    Ok(())
}

#[test]
fn unterminated_stderr_is_flushed_into_the_error() -> TestResult {
    let plugin = start(&module(
        r#"(data (i32.const 128) "\c0\00\00\00\05\00\00\00")
        (data (i32.const 192) "oops!")
        (func (export "proxy_on_request_headers") (param i32 i32 i32) (result i32)
          (drop (call $fd_write (i32.const 2) (i32.const 128) (i32.const 1) (i32.const 256)))
          unreachable)"#,
    ))?;
    let err = plugin
        .vm(0)
        .http_stream()?
        .send_request_headers(HEADERS, true)
        .expect_err("trap");
    let Error::Trap { guest_log, .. } = err else {
        panic!("unexpected {err:?}")
    };
    assert_eq!(guest_log, ["oops!"]);
    Ok(())
}

#[test]
fn malloc_allocator_and_vm_configuration() -> TestResult {
    let wat = module_with(
        r#"(func (export "proxy_on_vm_start") (param $root i32) (param $size i32) (result i32)
          (call $report (call $get_buffer (i32.const 6) (i32.const 0) (local.get $size) (i32.const 256) (i32.const 260)))
          (drop (call $log (i32.const 2) (i32.load (i32.const 256)) (i32.load (i32.const 260))))
          (i32.const 1))"#,
        r#"(func (export "malloc") (param $size i32) (result i32) (call $bump (local.get $size)))"#,
    );
    let plugin = host(&wat)?.plugin().vm_configuration("hello-vm").start()?;
    assert_eq!(reports(&plugin), "0");
    assert!(plugin.logged("hello-vm"));
    Ok(())
}

#[test]
fn a_null_allocation_is_invalid_memory_access() -> TestResult {
    let wat = module_with(
        r#"(func (export "proxy_on_vm_start") (param $root i32) (param $size i32) (result i32)
          (call $report (call $get_buffer (i32.const 6) (i32.const 0) (local.get $size) (i32.const 256) (i32.const 260)))
          (i32.const 1))"#,
        r#"(func (export "proxy_on_memory_allocate") (param i32) (result i32) (i32.const 0))"#,
    );
    let plugin = host(&wat)?.plugin().vm_configuration("x").start()?;
    assert_eq!(reports(&plugin), "6");
    Ok(())
}

#[test]
fn a_trap_in_the_allocator_fails_the_outer_call() -> TestResult {
    let wat = module_with(
        r#"(func (export "proxy_on_vm_start") (param $root i32) (param $size i32) (result i32)
          (drop (call $get_buffer (i32.const 6) (i32.const 0) (local.get $size) (i32.const 256) (i32.const 260)))
          (i32.const 1))"#,
        r#"(func (export "proxy_on_memory_allocate") (param i32) (result i32) unreachable)"#,
    );
    let err = host(&wat)?
        .plugin()
        .vm_configuration("x")
        .start()
        .err()
        .expect("trap");
    assert!(
        matches!(
            err,
            Error::Trap {
                call: "proxy_on_vm_start",
                ..
            }
        ),
        "{err}"
    );
    Ok(())
}

#[test]
fn vm_start_false_and_bad_actions() -> TestResult {
    let err = start(&module(
        r#"(func (export "proxy_on_vm_start") (param i32 i32) (result i32) (i32.const 0))"#,
    ))
    .err()
    .expect("rejected");
    assert!(
        matches!(
            err,
            Error::Rejected {
                call: "proxy_on_vm_start",
                ..
            }
        ),
        "{err}"
    );

    let plugin = start(&module(
        r#"(func (export "proxy_on_request_headers") (param i32 i32 i32) (result i32) (i32.const 7))"#,
    ))?;
    let err = plugin
        .vm(0)
        .http_stream()?
        .send_request_headers(HEADERS, true)
        .expect_err("bad action");
    assert!(matches!(err, Error::BadAction { value: 7, .. }), "{err}");
    Ok(())
}

#[test]
fn modules_without_the_abi_marker_memory_or_allocator_are_refused() {
    let no_abi = module("").replace(r#"(func (export "proxy_abi_version_0_2_1"))"#, "");
    assert!(matches!(host(&no_abi), Err(Error::UnsupportedAbi(_))));
    let no_memory = module("").replace(r#"(memory (export "memory") 1)"#, "(memory 1)");
    assert!(matches!(host(&no_memory), Err(Error::NoMemory)));
    let no_allocator = module_with("", "");
    assert!(matches!(host(&no_allocator), Err(Error::NoAllocator)));
    assert!(matches!(
        Host::from_bytes(b"not wasm"),
        Err(Error::Compile(_))
    ));
    assert!(matches!(
        Host::load("/nonexistent/filter.wasm"),
        Err(Error::Read { .. })
    ));
}

#[test]
fn a_plugin_needs_a_vm() -> TestResult {
    let err = host(&module(""))?
        .plugin()
        .vms(0)
        .start()
        .err()
        .expect("no VMs");
    assert!(matches!(err, Error::NoVms));
    let plugin = start(&module(""))?;
    assert!(matches!(
        plugin.vm(3).http_stream(),
        Err(Error::NoSuchVm { vm: 3, count: 1 })
    ));
    Ok(())
}
