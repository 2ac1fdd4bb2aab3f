//! Logging a rejected input once: a bounded memory of what was already reported, so a bad
//! snapshot polled ten times a second, or a refused endpoint in every pool update, is logged
//! the first time with its reason and then only counted.
//!
//! ```
//! let mut once = kvoy_shared::LogOnce::new(8);
//! assert!(once.first(&("refused", "10.0.0.1:22")));
//! assert!(!once.first(&("refused", "10.0.0.1:22")));
//! ```

use fnv::FnvHashSet;
use std::hash::{BuildHasher, Hash};

/// What was already logged, up to `capacity` distinct keys; past that every new key is
/// reported as seen (the counters still count it).
#[derive(Debug, Clone)]
pub struct LogOnce {
    seen: FnvHashSet<u64>,
    capacity: usize,
    hasher: std::hash::RandomState,
}

impl LogOnce {
    pub fn new(capacity: usize) -> Self {
        LogOnce {
            seen: FnvHashSet::default(),
            capacity,
            hasher: std::hash::RandomState::new(),
        }
    }

    /// True the first time `key` is seen (log it now), false after, and false for every new
    /// key once `capacity` keys were logged.
    pub fn first<K: Hash + ?Sized>(&mut self, key: &K) -> bool {
        if self.seen.len() >= self.capacity {
            return false;
        }
        self.seen.insert(self.hasher.hash_one(key))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn once_per_key_and_bounded() {
        let mut once = LogOnce::new(2);
        assert!(once.first("a"));
        assert!(!once.first("a"));
        assert!(once.first("b"));
        assert!(!once.first("c"), "full: no more logging");
    }
}
