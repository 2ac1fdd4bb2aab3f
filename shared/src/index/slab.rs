//! A slab of `u32`-addressed items kept in fixed-size pages: growing never copies the items
//! nor leaves more than one page unused, and released ids are reused first, through a free
//! list threaded through the vacant items themselves.

use std::ops::{Index, IndexMut};

/// No item: the end of a list, or no parent.
pub(super) const NIL: u32 = u32::MAX;
const PAGE_BITS: u32 = 10;
/// Items per page.
const PAGE: usize = 1 << PAGE_BITS;

/// An item whose slot can be marked vacant, linking the next vacant slot.
pub(super) trait Vacancy {
    fn vacant(next: u32) -> Self;
    /// The next vacant id (or [`NIL`]) if this slot is vacant.
    fn next_vacant(&self) -> Option<u32>;
}

#[derive(Clone, Debug)]
pub(super) struct Slab<T> {
    pages: Vec<Vec<T>>,
    /// Ids handed out so far (live or vacant).
    len: u32,
    /// First vacant id, [`NIL`] if none.
    free: u32,
    live: usize,
}

impl<T: Vacancy> Slab<T> {
    pub fn new() -> Self {
        Slab {
            pages: Vec::new(),
            len: 0,
            free: NIL,
            live: 0,
        }
    }

    /// Items in use.
    pub fn live(&self) -> usize {
        self.live
    }

    /// The most memory a slab of at most `items` items holds: whole pages, and the page list.
    pub fn max_bytes(items: u64) -> u64 {
        let pages = items.div_ceil(PAGE as u64).max(1);
        let page = (PAGE * std::mem::size_of::<T>()) as u64;
        let list = 2 * std::mem::size_of::<Vec<T>>() as u64;
        pages.saturating_mul(page.saturating_add(list))
    }

    pub fn alloc(&mut self, item: T) -> u32 {
        self.live += 1;
        if self.free != NIL {
            let id = self.free;
            self.free = self[id].next_vacant().unwrap_or(NIL);
            self[id] = item;
            return id;
        }
        let id = self.len;
        match self.pages.last_mut() {
            Some(page) if page.len() < PAGE => page.push(item),
            _ => {
                let mut page = Vec::with_capacity(PAGE);
                page.push(item);
                self.pages.push(page);
            }
        }
        self.len += 1;
        id
    }

    /// Marks `id` vacant (dropping what its item owned) for reuse.
    pub fn release(&mut self, id: u32) {
        self[id] = T::vacant(self.free);
        self.free = id;
        self.live = self.live.saturating_sub(1);
    }

    /// Forgets every item and returns the memory.
    pub fn clear(&mut self) {
        *self = Slab::new();
    }

    /// Live items with their ids (tests and debugging).
    #[cfg(test)]
    pub fn iter(&self) -> impl Iterator<Item = (u32, &T)> + '_ {
        self.pages
            .iter()
            .flatten()
            .enumerate()
            .filter(|(_, t)| t.next_vacant().is_none())
            .map(|(i, t)| (i as u32, t))
    }
}

impl<T> Index<u32> for Slab<T> {
    type Output = T;

    #[inline]
    fn index(&self, id: u32) -> &T {
        &self.pages[(id >> PAGE_BITS) as usize][id as usize & (PAGE - 1)]
    }
}

impl<T> IndexMut<u32> for Slab<T> {
    #[inline]
    fn index_mut(&mut self, id: u32) -> &mut T {
        &mut self.pages[(id >> PAGE_BITS) as usize][id as usize & (PAGE - 1)]
    }
}
