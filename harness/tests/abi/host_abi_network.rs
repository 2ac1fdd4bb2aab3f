//! Network (TCP) filters at the ABI: `proxy_on_new_connection`, `proxy_on_downstream_data`,
//! `proxy_on_upstream_data`, the connection-close callbacks, the `DownstreamData` /
//! `UpstreamData` buffers and `proxy_continue_stream` / `proxy_close_stream` on a connection,
//! with Envoy's rules (see `harness/README.md`). Statuses and small numbers are logged as one
//! character of `0-9a-zA-Z` (`c` is 12, `Unimplemented`); the close callbacks log 20 (`k`)
//! plus the upstream close type and 30 (`u`) plus the downstream one, and `proxy_on_done`,
//! `proxy_on_log`, `proxy_on_delete` log `z`, `A`, `B`. Data the host returned is logged as
//! a line.

use kvoy_harness::{Action, CloseType, ConnectionEvent, Error, StreamType};

use crate::wat_guest::*;

use crate::TestResult;

/// A network filter whose data's last byte says what to do: `H` hold (Pause), `G` continue
/// reading and Pause, `R` replace the data with `NEW`, `A` append `+t`, `C` / `U` close the
/// downstream / upstream stream.
fn network_guest() -> String {
    let mut l = Layout::new();
    let x = l.put(b"x");
    let new = l.put(b"NEW");
    let tail = l.put(b"+t");
    let last = format!(
        "(i32.load8_u (i32.add (i32.load (i32.const {PTR})) (i32.sub (i32.load (i32.const {SIZE})) (i32.const 1))))"
    );
    module(
        &l,
        &format!(
            r#"(func (export "proxy_on_new_connection") (param i32) (result i32)
          (call $report (local.get 0))
          (call $report (call $get_buffer (i32.const 2) (i32.const 0) (i32.const 10) (i32.const {PTR}) (i32.const {SIZE})))
          (call $report (call $set_buffer (i32.const 2) (i32.const 0) (i32.const 0) {x}))
          (call $report (call $continue_stream (i32.const 3)))
          (i32.const 0))
        (func (export "proxy_on_downstream_data") (param $ctx i32) (param $size i32) (param $eos i32) (result i32)
          (local $c i32)
          (call $report (local.get $size))
          (call $report (local.get $eos))
          (call $report (call $get_buffer (i32.const 2) (i32.const 0) (i32.const 100) (i32.const {PTR}) (i32.const {SIZE})))
          (call $show)
          (local.set $c {last})
          (call $report (call $get_buffer (i32.const 3) (i32.const 0) (i32.const 100) (i32.const {PTR}) (i32.const {SIZE})))
          (if (i32.eq (local.get $c) (i32.const 0x52))
            (then (call $report (call $set_buffer (i32.const 2) (i32.const 0) (local.get $size) {new}))))
          (if (i32.eq (local.get $c) (i32.const 0x41))
            (then
              (call $report (call $set_buffer (i32.const 2) (local.get $size) (i32.const 0) {tail}))
              (call $report (call $set_buffer (i32.const 2) (i32.const 1) (i32.const 0) {tail}))))
          (if (i32.eq (local.get $c) (i32.const 0x43))
            (then (call $report (call $close_stream (i32.const 2)))))
          (if (i32.eq (local.get $c) (i32.const 0x55))
            (then (call $report (call $close_stream (i32.const 3)))))
          (if (i32.eq (local.get $c) (i32.const 0x47))
            (then
              (call $report (call $continue_stream (i32.const 2)))
              (return (i32.const 1))))
          (i32.eq (local.get $c) (i32.const 0x48)))
        (func (export "proxy_on_upstream_data") (param $ctx i32) (param $size i32) (param $eos i32) (result i32)
          (local $c i32)
          (call $report (local.get $size))
          (call $report (local.get $eos))
          (call $report (call $get_buffer (i32.const 3) (i32.const 0) (i32.const 100) (i32.const {PTR}) (i32.const {SIZE})))
          (call $show)
          (local.set $c {last})
          (call $report (call $continue_stream (i32.const 3)))
          (if (i32.eq (local.get $c) (i32.const 0x52))
            (then (call $report (call $set_buffer (i32.const 3) (i32.const 0) (local.get $size) {new}))))
          (i32.eq (local.get $c) (i32.const 0x48)))
        (func (export "proxy_on_upstream_connection_close") (param i32 i32)
          (call $report (i32.add (i32.const 20) (local.get 1))))
        (func (export "proxy_on_downstream_connection_close") (param i32 i32)
          (call $report (i32.add (i32.const 30) (local.get 1))))
        (func (export "proxy_on_done") (param i32) (result i32)
          (call $report (i32.const 35))
          (i32.const 1))
        (func (export "proxy_on_log") (param i32)
          (call $report (i32.const 36)))
        (func (export "proxy_on_delete") (param i32)
          (call $report (i32.const 37)))
        (func (export "proxy_on_tick") (param i32)
          (call $report (call $set_effective (i32.const 2)))
          (call $report (call $get_buffer (i32.const 2) (i32.const 0) (i32.const 100) (i32.const {PTR}) (i32.const {SIZE})))
          (call $show))
        (func (export "proxy_on_request_headers") (param i32 i32 i32) (result i32)
          (call $report (call $close_stream (i32.const 2)))
          (call $report (call $close_stream (i32.const 3)))
          (call $report (call $continue_stream (i32.const 2)))
          (call $report (call $get_buffer (i32.const 2) (i32.const 0) (i32.const 10) (i32.const {PTR}) (i32.const {SIZE})))
          (call $report (call $set_buffer (i32.const 2) (i32.const 0) (i32.const 0) {x}))
          (i32.const 0))"#
        ),
    )
}

#[test]
fn data_held_continued_rewritten_and_forwarded() -> TestResult {
    let plugin = start(&network_guest())?;
    let conn = plugin.connection(0)?;
    // Before the context exists, data passes without calling the guest (Envoy's onData).
    assert_eq!(conn.downstream_data(b"early", false)?, Action::Continue);
    assert_eq!(reports(&plugin), "");

    // The context: id 2; no data buffer yet (empty, not writable); continue Upstream is
    // Unimplemented.
    assert_eq!(conn.new_connection()?, Action::Continue);
    assert_eq!(reports(&plugin), "202c");

    // Pause holds the data; it stays reachable (from another callback too) ...
    let mark = plugin.logs().len();
    assert_eq!(conn.downstream_data(b"abH", false)?, Action::Pause);
    assert_eq!(since(&plugin, mark), ("3000".into(), vec!["abH".into()]));
    assert_eq!(conn.buffered_downstream_data(), b"abH");
    let mark = plugin.logs().len();
    plugin.vm(0).tick()?;
    assert_eq!(since(&plugin, mark), ("00".into(), vec!["abH".into()]));
    // ... and the next chunk joins it; continue_stream(Downstream) lets it all go on.
    let mark = plugin.logs().len();
    assert_eq!(conn.downstream_data(b"xG", false)?, Action::Pause);
    assert_eq!(since(&plugin, mark), ("50000".into(), vec!["abHxG".into()]));
    assert_eq!(conn.forwarded_downstream_data(), b"earlyabHxG");
    assert!(conn.buffered_downstream_data().is_empty());
    assert_eq!(conn.events(), [ConnectionEvent::Continued]);

    // Envoy's copyFrom: start 0 drains `size` then prepends; at the end appends; else
    // BadArgument.
    let mark = plugin.logs().len();
    assert_eq!(conn.downstream_data(b"fooR", true)?, Action::Continue);
    assert_eq!(since(&plugin, mark).0, "41000");
    let mark = plugin.logs().len();
    conn.downstream_data(b"xA", false)?;
    assert_eq!(since(&plugin, mark).0, "200002");
    assert_eq!(conn.forwarded_downstream_data(), b"earlyabHxGNEWxA+t");

    // Upstream data: held the same way (continue Upstream is Unimplemented); its end is
    // followed by proxy_on_upstream_connection_close(Unknown).
    let mark = plugin.logs().len();
    assert_eq!(conn.upstream_data(b"upH", false)?, Action::Pause);
    assert_eq!(since(&plugin, mark), ("300c".into(), vec!["upH".into()]));
    assert_eq!(conn.buffered_upstream_data(), b"upH");
    let mark = plugin.logs().len();
    assert_eq!(conn.upstream_data(b"R", true)?, Action::Continue);
    assert_eq!(since(&plugin, mark), ("410c0k".into(), vec!["upHR".into()]));
    assert_eq!(conn.forwarded_upstream_data(), b"NEW");
    assert!(conn.upstream_closed() && !conn.is_finished());

    // The client closes: downstream close (Remote), then done, log, delete.
    let mark = plugin.logs().len();
    conn.close(CloseType::Remote)?;
    assert_eq!(since(&plugin, mark).0, "wzAB");
    assert!(conn.is_finished());
    assert_eq!(conn.closed(), Some(CloseType::Remote));
    let late = conn.downstream_data(b"late", false);
    assert!(
        matches!(late, Err(Error::StreamFinished { .. })),
        "{late:?}"
    );
    Ok(())
}

#[test]
fn the_filter_closes_the_connection() -> TestResult {
    let plugin = start(&network_guest())?;
    for (data, kind) in [
        (&b"byeC"[..], StreamType::Downstream),
        (b"byeU", StreamType::Upstream),
    ] {
        let conn = plugin.vm(0).connection()?;
        conn.new_connection()?;
        let mark = plugin.logs().len();
        assert_eq!(conn.downstream_data(data, false)?, Action::Continue);
        // Close after the guest call: a local close of the downstream connection for either
        // stream type (Envoy's write filter shares the connection).
        assert_eq!(since(&plugin, mark).0, "40000vzAB");
        assert_eq!(conn.events(), [ConnectionEvent::Closed(kind)]);
        assert_eq!(conn.closed(), Some(CloseType::Local));
        assert!(conn.is_finished());
        assert_eq!(conn.forwarded_downstream_data(), data);
    }
    Ok(())
}

#[test]
fn nothing_reaches_the_guest_before_the_context_exists() -> TestResult {
    let plugin = start(&network_guest())?;
    let conn = plugin.connection(0)?;
    assert_eq!(conn.upstream_data(b"up", true)?, Action::Continue);
    assert_eq!(conn.forwarded_upstream_data(), b"up");
    conn.close(CloseType::Local)?;
    assert_eq!(
        reports(&plugin),
        "",
        "no upstream close, no downstream close"
    );
    assert!(conn.is_finished());
    assert!(conn.new_connection().is_err());
    Ok(())
}

#[test]
fn network_calls_from_an_http_context_do_nothing() -> TestResult {
    let plugin = start(&network_guest())?;
    let stream = plugin.vm(0).http_stream()?;
    stream.send_request_headers(HEADERS, false)?;
    // close / continue on the network stream types: Ok, no effect (Envoy has no network
    // callbacks there); no connection data: empty, not writable.
    assert_eq!(reports(&plugin), "00002");
    assert!(stream.events().is_empty());
    assert_eq!(
        stream.send_request_body(b"still open", true)?,
        Action::Continue
    );
    stream.finish()?;
    Ok(())
}

#[test]
fn missing_network_exports_default_to_continue() -> TestResult {
    let plugin = start(&module(&Layout::new(), ""))?;
    let conn = plugin.connection(0)?;
    assert_eq!(conn.new_connection()?, Action::Continue);
    assert_eq!(conn.downstream_data(b"in", false)?, Action::Continue);
    assert_eq!(conn.upstream_data(b"out", true)?, Action::Continue);
    assert_eq!(
        (
            conn.forwarded_downstream_data(),
            conn.forwarded_upstream_data()
        ),
        (b"in".to_vec(), b"out".to_vec())
    );
    conn.close(CloseType::Remote)?;
    assert!(conn.is_finished() && conn.upstream_closed());
    Ok(())
}
