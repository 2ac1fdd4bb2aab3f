//! Network (TCP) filters through the real Rust SDK: `harness/guest` with the configuration
//! word `tcp` is a `StreamContext` filter whose data says what to do (build it with
//! `make wasm`).

use kvoy_harness::{Action, CloseType, ConnectionEvent, Error, Plugin};

use crate::sdk_guest::host;
use crate::TestResult;

fn plugin() -> Result<Plugin, Error> {
    host()?.plugin().configuration("tcp").start()
}

/// The guest's log lines that start with `prefix`, in order.
fn lines(plugin: &Plugin, prefix: &str) -> Vec<String> {
    plugin
        .logs()
        .into_iter()
        .filter(|e| e.message.starts_with(prefix))
        .map(|e| e.message)
        .collect()
}

#[test]
fn downstream_data_passed_changed_held_and_released() -> TestResult {
    let plugin = plugin()?;
    let conn = plugin.vm(0).connection()?;
    assert_eq!(conn.new_connection()?, Action::Continue);
    assert!(plugin.logged("tcp new context=2"));

    assert_eq!(conn.downstream_data(b"hello", false)?, Action::Continue);
    assert_eq!(conn.downstream_data(b"rewrite", false)?, Action::Continue);
    assert_eq!(conn.downstream_data(b"append", false)?, Action::Continue);
    assert_eq!(
        conn.forwarded_downstream_data(),
        b"helloREWRITTENappend+tail"
    );

    assert_eq!(conn.downstream_data(b"a-hold", false)?, Action::Pause);
    assert_eq!(conn.buffered_downstream_data(), b"a-hold");
    // The held data and the new chunk arrive together; resume_downstream lets them go.
    assert_eq!(conn.downstream_data(b"+release", true)?, Action::Pause);
    assert!(plugin.logged("tcp downstream size=14 eos=true data=a-hold+release"));
    assert_eq!(
        conn.forwarded_downstream_data(),
        b"helloREWRITTENappend+taila-hold+release"
    );
    assert_eq!(conn.events(), [ConnectionEvent::Continued]);
    Ok(())
}

#[test]
fn upstream_data_and_the_close_sequence() -> TestResult {
    let plugin = plugin()?;
    let conn = plugin.connection(0)?;
    conn.new_connection()?;
    assert_eq!(conn.upstream_data(b"upper", false)?, Action::Continue);
    assert_eq!(conn.upstream_data(b"x-hold", false)?, Action::Pause);
    assert_eq!(conn.buffered_upstream_data(), b"x-hold");
    assert_eq!(conn.upstream_data(b"!", true)?, Action::Continue);
    assert_eq!(conn.forwarded_upstream_data(), b"UPPERx-hold!");
    assert!(plugin.logged("tcp upstream close Unknown"));
    assert!(
        !conn.is_finished(),
        "the upstream end alone does not end the context"
    );

    conn.close(CloseType::Remote)?;
    assert_eq!(
        lines(&plugin, "tcp ")[5..],
        [
            "tcp downstream close Remote context=2",
            "tcp done context=2",
            "tcp log context=2"
        ]
    );
    assert!(conn.is_finished());
    Ok(())
}

#[test]
fn the_filter_closes_the_connection() -> TestResult {
    let plugin = plugin()?;
    let conn = plugin.connection(0)?;
    conn.new_connection()?;
    conn.downstream_data(b"close", false)?;
    assert!(plugin.logged("tcp downstream close Local context=2"));
    assert!(plugin.logged("tcp log context=2"));
    assert_eq!(conn.closed(), Some(CloseType::Local));
    assert!(conn.downstream_data(b"more", false).is_err());

    // Two connections on one VM are separate contexts.
    let a = plugin.connection(0)?;
    let b = plugin.connection(0)?;
    a.new_connection()?;
    b.new_connection()?;
    a.downstream_data(b"one-hold", false)?;
    b.downstream_data(b"two", false)?;
    assert_eq!(a.buffered_downstream_data(), b"one-hold");
    assert_eq!(b.forwarded_downstream_data(), b"two");
    assert_ne!(a.context_id(), b.context_id());
    Ok(())
}
