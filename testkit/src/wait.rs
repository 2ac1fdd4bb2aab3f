//! Polling a condition until it holds, with a deadline.

use std::time::{Duration, Instant};

/// How often a condition is checked.
const POLL: Duration = Duration::from_millis(10);

/// A condition did not hold in time.
#[derive(Debug, thiserror::Error)]
#[error("timed out after {timeout:?} waiting for {what}")]
pub struct TimedOut {
    pub what: String,
    pub timeout: Duration,
}

/// Polls `check` every 10 ms until it holds; returns how long that took, or [`TimedOut`] after
/// `timeout`. `check` runs at least once.
pub fn try_wait_for(
    what: &str,
    timeout: Duration,
    mut check: impl FnMut() -> bool,
) -> Result<Duration, TimedOut> {
    let start = Instant::now();
    // Bounded in count as well as time, should the clock misbehave.
    let rounds = timeout.as_millis() / POLL.as_millis() + 2;
    for _ in 0..rounds {
        if check() {
            return Ok(start.elapsed());
        }
        if start.elapsed() >= timeout {
            break;
        }
        std::thread::sleep(POLL);
    }
    Err(TimedOut {
        what: what.to_owned(),
        timeout,
    })
}

/// [`try_wait_for`] for tests: panics naming `what` when `timeout` runs out.
pub fn wait_for(what: &str, timeout: Duration, check: impl FnMut() -> bool) -> Duration {
    match try_wait_for(what, timeout, check) {
        Ok(took) => took,
        Err(e) => panic!("{e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn returns_once_the_condition_holds() {
        let mut n = 0;
        let took = wait_for("three calls", Duration::from_secs(5), || {
            n += 1;
            n == 3
        });
        assert_eq!(n, 3);
        assert!(took >= 2 * POLL);
    }

    #[test]
    fn times_out() {
        let e = try_wait_for("never", Duration::from_millis(30), || false).unwrap_err();
        assert_eq!(e.to_string(), "timed out after 30ms waiting for never");
    }
}
