//! The event queue: virtual time, then insertion order, so equal times replay identically.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::Duration;

/// What happens at a point in virtual time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Event {
    /// Turn `turn` of session `session` reaches the proxy.
    Arrival { session: u32, turn: u32 },
    /// Engine `engine`'s step ends; its outputs take effect.
    StepEnd { engine: u32 },
    /// The metrics scrape (and the aggregator's refresh).
    Scrape,
    /// The admission stage's tick: held requests are looked at (queued only while some are
    /// held).
    Tick,
    /// A split request's KV reached its decode engine (`id`: its prefill half's).
    Transferred { id: u64 },
}

#[derive(Debug, Default)]
pub struct Queue {
    heap: BinaryHeap<Reverse<(u128, u64, Event)>>,
    seq: u64,
    /// Queued events other than scrapes: the run goes on while there are any.
    work: usize,
}

impl Queue {
    pub fn push(&mut self, at: Duration, event: Event) {
        if event != Event::Scrape {
            self.work += 1;
        }
        self.seq += 1;
        self.heap.push(Reverse((at.as_nanos(), self.seq, event)));
    }

    pub fn pop(&mut self) -> Option<(Duration, Event)> {
        let Reverse((at, _, event)) = self.heap.pop()?;
        if event != Event::Scrape {
            self.work -= 1;
        }
        let at = Duration::from_nanos(u64::try_from(at).unwrap_or(u64::MAX));
        Some((at, event))
    }

    /// Events other than scrapes are queued.
    pub fn has_work(&self) -> bool {
        self.work > 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn time_then_insertion_order() {
        let mut q = Queue::default();
        let ms = Duration::from_millis;
        q.push(ms(5), Event::Scrape);
        q.push(ms(1), Event::StepEnd { engine: 2 });
        q.push(
            ms(1),
            Event::Arrival {
                session: 0,
                turn: 0,
            },
        );
        assert!(q.has_work());
        assert_eq!(q.pop(), Some((ms(1), Event::StepEnd { engine: 2 })));
        assert_eq!(
            q.pop(),
            Some((
                ms(1),
                Event::Arrival {
                    session: 0,
                    turn: 0
                }
            ))
        );
        assert!(!q.has_work());
        assert_eq!(q.pop(), Some((ms(5), Event::Scrape)));
        assert_eq!(q.pop(), None);
    }
}
