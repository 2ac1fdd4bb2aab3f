//! The Responses API's stored conversations: per response id, the whole context of that turn
//! (its prompt, then its output), which a request naming it as `previous_response_id`
//! continues.
//!
//! Memory is bounded twice: at most `max_entries` responses and `max_bytes` bytes of context
//! (ids included); past either bound the least recently used responses (stored or continued
//! longest ago) are dropped, and continuing one of them then answers 404, as for an id the
//! simulator never saw. A context larger than `max_bytes` on its own is not stored.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};

/// A bounded LRU map from response id to context; shared by a simulator's handlers (each
/// call holds the lock briefly, never across an `.await`).
#[derive(Debug)]
pub struct ResponseStore {
    max_entries: usize,
    max_bytes: usize,
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    entries: HashMap<String, Entry>,
    /// Use tick to id, least recently used first.
    order: BTreeMap<u64, String>,
    tick: u64,
    bytes: usize,
}

#[derive(Debug)]
struct Entry {
    context: Arc<[u8]>,
    tick: u64,
}

fn cost(id: &str, context: &[u8]) -> usize {
    // The id is held twice (map key and order value).
    2 * id.len() + context.len()
}

impl ResponseStore {
    pub fn new(max_entries: usize, max_bytes: usize) -> Self {
        ResponseStore {
            max_entries,
            max_bytes,
            inner: Mutex::new(Inner::default()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        match self.inner.lock() {
            Ok(g) => g,
            Err(poisoned) => poisoned.into_inner(),
        }
    }

    /// The context stored under `id`, now the most recently used.
    pub fn get(&self, id: &str) -> Option<Arc<[u8]>> {
        let mut inner = self.lock();
        inner.tick += 1;
        let tick = inner.tick;
        let entry = inner.entries.get_mut(id)?;
        let old = std::mem::replace(&mut entry.tick, tick);
        let context = entry.context.clone();
        if let Some(key) = inner.order.remove(&old) {
            inner.order.insert(tick, key);
        }
        Some(context)
    }

    /// Stores `context` under `id` (replacing an entry of that id), then drops least recently
    /// used responses until both bounds hold.
    pub fn insert(&self, id: String, context: Vec<u8>) {
        let size = cost(&id, &context);
        if self.max_entries == 0 || size > self.max_bytes {
            return;
        }
        let mut inner = self.lock();
        inner.remove(&id);
        inner.tick += 1;
        let tick = inner.tick;
        inner.bytes += size;
        inner.order.insert(tick, id.clone());
        inner.entries.insert(
            id,
            Entry {
                context: context.into(),
                tick,
            },
        );
        while inner.entries.len() > self.max_entries || inner.bytes > self.max_bytes {
            let Some((_, oldest)) = inner.order.pop_first() else {
                break;
            };
            if let Some(e) = inner.entries.remove(&oldest) {
                inner.bytes -= cost(&oldest, &e.context);
            }
        }
    }

    /// Stored responses.
    pub fn len(&self) -> usize {
        self.lock().entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes held, as counted against `max_bytes`.
    pub fn bytes(&self) -> usize {
        self.lock().bytes
    }
}

impl Inner {
    fn remove(&mut self, id: &str) {
        if let Some(e) = self.entries.remove(id) {
            self.order.remove(&e.tick);
            self.bytes -= cost(id, &e.context);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evicts_the_least_recently_used_past_the_entry_bound() {
        let s = ResponseStore::new(2, 1 << 20);
        s.insert("a".into(), b"1".to_vec());
        s.insert("b".into(), b"2".to_vec());
        assert_eq!(s.get("a").as_deref(), Some(&b"1"[..])); // a is now more recent than b
        s.insert("c".into(), b"3".to_vec());
        assert_eq!(s.len(), 2);
        assert!(s.get("b").is_none());
        assert!(s.get("a").is_some() && s.get("c").is_some());
        assert_eq!(s.bytes(), 2 * (2 + 1));
    }

    #[test]
    fn byte_bound_and_replacement() {
        let s = ResponseStore::new(100, 20);
        s.insert("a".into(), vec![0; 8]); // 10 bytes
        s.insert("b".into(), vec![0; 8]);
        assert_eq!((s.len(), s.bytes()), (2, 20));
        s.insert("c".into(), vec![0; 3]); // 5 more: a goes
        assert!(s.get("a").is_none());
        assert_eq!((s.len(), s.bytes()), (2, 15));
        s.insert("c".into(), vec![0; 1]); // replaced, not added
        assert_eq!((s.len(), s.bytes()), (2, 13));
        s.insert("huge".into(), vec![0; 64]); // larger than the bound: not stored
        assert!(s.get("huge").is_none());
        assert_eq!(s.len(), 2);
        let none = ResponseStore::new(0, 1 << 20);
        none.insert("a".into(), vec![1]);
        assert!(none.is_empty());
    }
}
