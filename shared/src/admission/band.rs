//! The inside of a [`super::FlowQueue`]: bands of one priority, flows inside a band, and the
//! slab that holds the flows. Every structure is ordered (`BTreeMap`), so every operation is
//! O(log n), removal from the middle included, and nothing hashes client-chosen strings.

use std::collections::BTreeMap;

/// The position of a request inside its flow: (order key, arrival sequence number).
pub(super) type Position = (u64, u64);

/// The requests of one fairness id inside one band.
#[derive(Debug)]
pub(super) struct Flow {
    pub(super) name: Box<str>,
    /// This flow's place in its band's round-robin ([`Band::turns`]).
    pub(super) turn: u64,
    /// Request ids by position: the first is served next.
    pub(super) queue: BTreeMap<Position, u64>,
}

/// The requests of one priority. Only bands with requests exist.
#[derive(Debug)]
pub(super) struct Band {
    pub(super) priority: i32,
    /// Flow name -> index in [`Flows`].
    pub(super) flows: BTreeMap<Box<str>, usize>,
    /// The round-robin: turn -> flow index; the first turn goes next. Each flow of the band
    /// holds exactly one turn; after being served it takes a new one at the back.
    pub(super) turns: BTreeMap<u64, usize>,
    pub(super) next_turn: u64,
    pub(super) requests: usize,
    pub(super) bytes: u64,
}

impl Band {
    pub(super) fn new(priority: i32) -> Self {
        Band {
            priority,
            flows: BTreeMap::new(),
            turns: BTreeMap::new(),
            next_turn: 0,
            requests: 0,
            bytes: 0,
        }
    }

    /// A fresh turn at the back of the round-robin.
    pub(super) fn take_turn(&mut self, flow: usize) -> u64 {
        let turn = self.next_turn;
        self.next_turn = self.next_turn.wrapping_add(1);
        self.turns.insert(turn, flow);
        turn
    }

    /// The flow whose turn it is.
    pub(super) fn next_flow(&self) -> Option<(u64, usize)> {
        self.turns
            .first_key_value()
            .map(|(&turn, &flow)| (turn, flow))
    }
}

/// A slab of flows: indices stay valid while the flow lives, and are reused after.
#[derive(Debug, Default)]
pub(super) struct Flows {
    slots: Vec<Option<Flow>>,
    free: Vec<usize>,
}

impl Flows {
    pub(super) fn insert(&mut self, flow: Flow) -> usize {
        match self.free.pop() {
            Some(i) if i < self.slots.len() => {
                self.slots[i] = Some(flow);
                i
            }
            _ => {
                self.slots.push(Some(flow));
                self.slots.len() - 1
            }
        }
    }

    pub(super) fn get(&self, i: usize) -> Option<&Flow> {
        self.slots.get(i).and_then(Option::as_ref)
    }

    pub(super) fn get_mut(&mut self, i: usize) -> Option<&mut Flow> {
        self.slots.get_mut(i).and_then(Option::as_mut)
    }

    pub(super) fn remove(&mut self, i: usize) -> Option<Flow> {
        let flow = self.slots.get_mut(i)?.take()?;
        self.free.push(i);
        Some(flow)
    }

    /// Live flows.
    pub(super) fn len(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    /// Drops all flows and the slab's memory.
    pub(super) fn clear(&mut self) {
        *self = Flows::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flow(name: &str) -> Flow {
        Flow {
            name: name.into(),
            turn: 0,
            queue: BTreeMap::new(),
        }
    }

    #[test]
    fn slab_reuses_indices() {
        let mut flows = Flows::default();
        let a = flows.insert(flow("a"));
        let b = flows.insert(flow("b"));
        assert_eq!((a, b, flows.len()), (0, 1, 2));
        assert_eq!(flows.remove(a).map(|f| f.name), Some("a".into()));
        assert!(flows.remove(a).is_none(), "removed once");
        assert!(flows.get(a).is_none() && flows.get_mut(7).is_none());
        assert_eq!(flows.insert(flow("c")), a);
        assert_eq!(flows.get(a).map(|f| &*f.name), Some("c"));
        assert_eq!(flows.len(), 2);
        flows.clear();
        assert_eq!(flows.len(), 0);
    }

    #[test]
    fn turns_rotate() {
        let mut band = Band::new(3);
        let t0 = band.take_turn(10);
        let t1 = band.take_turn(11);
        assert_eq!(band.next_flow(), Some((t0, 10)));
        band.turns.remove(&t0);
        band.take_turn(10);
        assert_eq!(band.next_flow(), Some((t1, 11)));
    }
}
