//! The virtual clock and the tick schedule of every VM's root context.
//!
//! Time only moves when the test advances it. `proxy_set_tick_period_milliseconds(p)` arms a
//! periodic timer whose first tick is `p` after the call; 0 disarms it. Advancing the clock fires
//! every tick that falls due on the way, in time order (ties in VM order), possibly several per VM.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Nanoseconds since the Unix epoch on the virtual clock.
pub type Nanos = u64;

/// The default start: 2026-01-01T00:00:00Z.
pub const DEFAULT_START: Nanos = 1_767_225_600 * 1_000_000_000;

#[derive(Debug, Clone, Copy)]
struct Timer {
    period: Nanos,
    next_due: Nanos,
}

/// Virtual wall clock plus one optional periodic timer per VM.
#[derive(Debug)]
pub struct Clock {
    start: Nanos,
    now: Nanos,
    timers: Vec<Option<Timer>>,
}

impl Clock {
    /// A clock at `start` for `vms` VMs with no timers armed.
    pub fn new(start: Nanos, vms: usize) -> Clock {
        Clock {
            start,
            now: start,
            timers: vec![None; vms],
        }
    }

    /// Current wall-clock time in nanoseconds since the epoch.
    pub fn now(&self) -> Nanos {
        self.now
    }

    /// Current time as a `SystemTime`.
    pub fn system_time(&self) -> SystemTime {
        UNIX_EPOCH + Duration::from_nanos(self.now)
    }

    /// Monotonic time: nanoseconds since the clock was created, plus one second so that it is
    /// never 0.
    pub fn monotonic(&self) -> Nanos {
        self.now - self.start + 1_000_000_000
    }

    /// Arms (or with 0, disarms) the VM's periodic tick, measured from now.
    pub fn set_tick_period(&mut self, vm: usize, period: Duration) {
        let Some(slot) = self.timers.get_mut(vm) else {
            return;
        };
        let period = u64::try_from(period.as_nanos()).unwrap_or(u64::MAX);
        *slot = (period > 0).then(|| Timer {
            period,
            next_due: self.now.saturating_add(period),
        });
    }

    /// The tick period the VM asked for, if any.
    pub fn tick_period(&self, vm: usize) -> Option<Duration> {
        self.timers
            .get(vm)
            .copied()
            .flatten()
            .map(|t| Duration::from_nanos(t.period))
    }

    /// If a tick falls due at or before `deadline`, moves the clock to it, reschedules that timer
    /// and returns the VM to tick. Call repeatedly until `None`, then `advance_to(deadline)`.
    pub fn next_tick_until(&mut self, deadline: Nanos) -> Option<usize> {
        let (vm, due) = self
            .timers
            .iter()
            .enumerate()
            .filter_map(|(vm, t)| t.map(|t| (vm, t.next_due)))
            .filter(|&(_, due)| due <= deadline)
            .min_by_key(|&(vm, due)| (due, vm))?;
        self.now = self.now.max(due);
        if let Some(Some(timer)) = self.timers.get_mut(vm) {
            timer.next_due = due.saturating_add(timer.period);
        }
        Some(vm)
    }

    /// Moves the clock forward to `deadline` (never backwards).
    pub fn advance_to(&mut self, deadline: Nanos) {
        self.now = self.now.max(deadline);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Nanos = 1_000_000;

    fn drain(clock: &mut Clock, deadline: Nanos) -> Vec<(usize, Nanos)> {
        let mut fired = Vec::new();
        while let Some(vm) = clock.next_tick_until(deadline) {
            fired.push((vm, clock.now() - DEFAULT_START));
        }
        clock.advance_to(deadline);
        fired
    }

    #[test]
    fn first_tick_comes_one_period_after_arming() {
        let mut clock = Clock::new(DEFAULT_START, 1);
        clock.set_tick_period(0, Duration::from_millis(100));
        assert!(drain(&mut clock, DEFAULT_START + 99 * MS).is_empty());
        assert_eq!(drain(&mut clock, DEFAULT_START + 100 * MS), [(0, 100 * MS)]);
        assert_eq!(clock.now(), DEFAULT_START + 100 * MS);
    }

    #[test]
    fn long_advances_fire_several_ticks_in_time_order() {
        let mut clock = Clock::new(DEFAULT_START, 2);
        clock.set_tick_period(0, Duration::from_millis(100));
        clock.set_tick_period(1, Duration::from_millis(150));
        let fired = drain(&mut clock, DEFAULT_START + 300 * MS);
        assert_eq!(
            fired,
            [
                (0, 100 * MS),
                (1, 150 * MS),
                (0, 200 * MS),
                (0, 300 * MS),
                (1, 300 * MS)
            ]
        );
        assert_eq!(clock.now(), DEFAULT_START + 300 * MS);
    }

    #[test]
    fn zero_period_disarms_and_rearming_restarts_from_now() {
        let mut clock = Clock::new(DEFAULT_START, 1);
        clock.set_tick_period(0, Duration::from_millis(10));
        clock.set_tick_period(0, Duration::ZERO);
        assert!(drain(&mut clock, DEFAULT_START + 50 * MS).is_empty());
        assert_eq!(clock.tick_period(0), None);
        clock.set_tick_period(0, Duration::from_millis(10));
        assert_eq!(
            drain(&mut clock, DEFAULT_START + 70 * MS),
            [(0, 60 * MS), (0, 70 * MS)]
        );
    }

    #[test]
    fn monotonic_starts_above_zero_and_follows_the_clock() {
        let mut clock = Clock::new(DEFAULT_START, 0);
        assert_eq!(clock.monotonic(), 1_000_000_000);
        clock.advance_to(DEFAULT_START + 5);
        clock.advance_to(DEFAULT_START + 1);
        assert_eq!(clock.monotonic(), 1_000_000_005);
        clock.set_tick_period(3, Duration::from_millis(1)); // no such VM: ignored
    }
}
