//! The aggregator's side of the snapshot: statuses stamped with the version they last
//! changed at, and tombstones of removed slots, to answer `since` polls.

use super::*;

/// The aggregator's side: the current statuses with the version each last changed at, and
/// tombstones of removed slots, to answer `since` queries.
#[derive(Debug, Clone)]
pub struct SnapshotHistory {
    epoch: u64,
    version: u64,
    /// Sorted by slot: (version it last changed at, status).
    current: Vec<(u64, EndpointStatus)>,
    /// (version removed at, slot), oldest first; at most one per slot, none for a present slot.
    pub(super) tombstones: VecDeque<(u64, u16)>,
    max_tombstones: usize,
    /// The oldest `since` still answered incrementally: tombstones before it were dropped.
    horizon: u64,
}

impl SnapshotHistory {
    /// An empty pool at version 0. Choose a new `epoch` on every start (a clock reading, a
    /// random number), so that filters holding an older history's versions reload.
    pub fn new(epoch: u64) -> Self {
        Self::with_tombstone_limit(epoch, MAX_TOMBSTONES)
    }

    pub(super) fn with_tombstone_limit(epoch: u64, max_tombstones: usize) -> Self {
        SnapshotHistory {
            epoch,
            version: 0,
            current: Vec::new(),
            tombstones: VecDeque::new(),
            max_tombstones,
            horizon: 0,
        }
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    pub fn version(&self) -> u64 {
        self.version
    }

    /// Replaces the whole set of endpoints with `statuses` (any order). Endpoints whose status
    /// differs from the current one (or are new) are stamped with a new version; slots no
    /// longer present become tombstones. The version is bumped once per call, only if anything
    /// changed. Returns whether anything changed.
    ///
    /// So that every answer decodes, statuses are normalized first: a repeated slot keeps its
    /// last status, a slot out of range is dropped, usage is clamped into 0..=1 (NaN counts as
    /// full), a non-finite hit rate becomes unknown and a finite one is clamped, invalid model
    /// names are dropped and the list cut to [`MAX_MODELS`].
    pub fn update(&mut self, statuses: Vec<EndpointStatus>) -> bool {
        let mut next: Vec<EndpointStatus> = statuses
            .into_iter()
            .filter_map(EndpointStatus::normalized)
            .collect();
        // stable: among equal slots the input order stays, and the last one wins below
        next.sort_by_key(|e| e.slot);
        let mut deduped: Vec<EndpointStatus> = Vec::with_capacity(next.len());
        for e in next {
            match deduped.last_mut() {
                Some(last) if last.slot == e.slot => *last = e,
                _ => deduped.push(e),
            }
        }

        let stamp = self.version.saturating_add(1);
        let mut changed = false;
        // new slots: any tombstone of theirs is dropped, the upsert covers it
        let mut added = SlotSet::new();
        let mut any_added = false;
        let mut merged = Vec::with_capacity(deduped.len());
        let mut old = std::mem::take(&mut self.current).into_iter().peekable();
        for e in deduped {
            while let Some((_, gone)) = old.next_if(|(_, o)| o.slot < e.slot) {
                self.tombstones.push_back((stamp, gone.slot));
                changed = true;
            }
            match old.next_if(|(_, o)| o.slot == e.slot) {
                Some((at, o)) if o == e => merged.push((at, o)),
                Some(_) => {
                    merged.push((stamp, e));
                    changed = true;
                }
                None => {
                    any_added |= added.insert(e.slot);
                    merged.push((stamp, e));
                    changed = true;
                }
            }
        }
        for (_, gone) in old {
            self.tombstones.push_back((stamp, gone.slot));
            changed = true;
        }
        self.current = merged;
        if any_added && !self.tombstones.is_empty() {
            self.tombstones.retain(|&(_, slot)| !added.contains(slot));
        }
        while self.tombstones.len() > self.max_tombstones {
            if let Some((at, _)) = self.tombstones.pop_front() {
                self.horizon = self.horizon.max(at);
            }
        }
        if changed {
            self.version = stamp;
        }
        changed
    }

    /// What a filter holding (`epoch`, `since`) needs. Full if the epoch is unknown or not
    /// ours, `since` is unknown or newer than our version, or older than the tombstones kept;
    /// else the changes after `since` (possibly none, with `version` the current version).
    pub fn delta_since(&self, epoch: Option<u64>, since: Option<u64>) -> SnapshotDelta {
        let since = match (epoch, since) {
            (Some(e), Some(s)) if e == self.epoch && s <= self.version && s >= self.horizon => s,
            _ => return self.snapshot().into_full(),
        };
        let upserts = self
            .current
            .iter()
            .filter(|(at, _)| *at > since)
            .map(|(_, e)| e.clone())
            .collect();
        let mut removed: Vec<u16> = self
            .tombstones
            .iter()
            .filter(|(at, _)| *at > since)
            .map(|&(_, slot)| slot)
            .collect();
        removed.sort_unstable();
        SnapshotDelta {
            epoch: self.epoch,
            base: Some(since),
            version: self.version,
            upserts,
            removed,
        }
    }

    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            epoch: self.epoch,
            version: self.version,
            endpoints: self.current.iter().map(|(_, e)| e.clone()).collect(),
        }
    }
}
