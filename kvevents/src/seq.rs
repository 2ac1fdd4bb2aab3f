//! Sequence tracking for one publisher's live stream: gaps and restarts.

use std::ops::Range;

/// What a live message's sequence number says about the stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SeqStatus {
    /// The expected next number (or the first one seen by a tracker that joined mid-stream).
    InOrder,
    /// Numbers in `missing` were never received; this message is `missing.end`. Recover them
    /// through the replay socket, or resynchronise if the publisher no longer buffers them.
    Gap {
        /// The lost sequence numbers.
        missing: Range<u64>,
    },
    /// The number went backwards. A PUB socket never reorders or repeats messages on one
    /// connection, so the publisher restarted (its numbering starts again at 0): drop what
    /// was learned from it. Numbers in `missing` (before this one, since the restart) were lost.
    Restart {
        /// The lost sequence numbers since the restart (empty when this message is seq 0).
        missing: Range<u64>,
    },
}

/// Follows the sequence numbers of one publisher's live stream.
///
/// ```
/// use kvoy_kvevents::{SeqStatus, SeqTracker};
/// let mut t = SeqTracker::from_start();
/// assert_eq!(t.observe(0), SeqStatus::InOrder);
/// assert_eq!(t.observe(3), SeqStatus::Gap { missing: 1..3 });
/// assert_eq!(t.observe(0), SeqStatus::Restart { missing: 0..0 });
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SeqTracker {
    next: Option<u64>,
}

impl SeqTracker {
    /// A tracker that joins a stream mid-way: the first number seen is in order.
    pub fn new() -> Self {
        Self { next: None }
    }

    /// A tracker that wants every batch from the first (seq 0): a late first message is a gap.
    pub fn from_start() -> Self {
        Self::expecting(0)
    }

    /// A tracker whose next expected number is `next` (e.g. after a replay).
    pub fn expecting(next: u64) -> Self {
        Self { next: Some(next) }
    }

    /// The next number expected, if any was set or seen.
    pub fn next_expected(&self) -> Option<u64> {
        self.next
    }

    /// Records a live message's number and classifies it.
    pub fn observe(&mut self, seq: u64) -> SeqStatus {
        let status = match self.next {
            None => SeqStatus::InOrder,
            Some(next) if seq == next => SeqStatus::InOrder,
            Some(next) if seq > next => SeqStatus::Gap { missing: next..seq },
            Some(_) => SeqStatus::Restart { missing: 0..seq },
        };
        self.next = Some(seq.saturating_add(1));
        status
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn joining_mid_stream() {
        let mut t = SeqTracker::new();
        assert_eq!(t.observe(41), SeqStatus::InOrder);
        assert_eq!(t.observe(42), SeqStatus::InOrder);
        assert_eq!(t.observe(45), SeqStatus::Gap { missing: 43..45 });
        assert_eq!(t.next_expected(), Some(46));
        assert_eq!(t.observe(2), SeqStatus::Restart { missing: 0..2 });
        assert_eq!(t.observe(3), SeqStatus::InOrder);
    }

    #[test]
    fn from_start_sees_a_late_first_message_as_a_gap() {
        let mut t = SeqTracker::from_start();
        assert_eq!(t.observe(5), SeqStatus::Gap { missing: 0..5 });
        assert_eq!(
            t.observe(u64::MAX),
            SeqStatus::Gap {
                missing: 6..u64::MAX
            }
        );
        assert_eq!(t.next_expected(), Some(u64::MAX));
    }
}
