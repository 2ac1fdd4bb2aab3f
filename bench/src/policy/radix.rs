//! An approximate radix tree over request text, one per worker, as SGLang's router keeps: edges
//! hold byte runs, each node remembers when a request last went through it, and eviction drops
//! least recently used leaves until the tree holds at most a given number of characters.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

const NONE: u32 = u32::MAX;
const ROOT: u32 = 0;

#[derive(Clone, Debug)]
struct Node {
    edge: Vec<u8>,
    children: Vec<u32>,
    parent: u32,
    last_access: u64,
}

/// A radix tree of the texts inserted into it.
#[derive(Clone, Debug)]
pub struct RadixTree {
    nodes: Vec<Node>,
    free: Vec<u32>,
    /// Characters (bytes) on all edges.
    size: usize,
    clock: u64,
}

impl Default for RadixTree {
    fn default() -> Self {
        RadixTree {
            nodes: vec![Node {
                edge: Vec::new(),
                children: Vec::new(),
                parent: NONE,
                last_access: 0,
            }],
            free: Vec::new(),
            size: 0,
            clock: 0,
        }
    }
}

/// Length of the common prefix of `a` and `b`, eight bytes at a time.
fn common_prefix(a: &[u8], b: &[u8]) -> usize {
    let n = a.len().min(b.len());
    let mut i = 0;
    while i + 8 <= n {
        let x = u64::from_le_bytes(a[i..i + 8].try_into().unwrap_or([0; 8]));
        let y = u64::from_le_bytes(b[i..i + 8].try_into().unwrap_or([0; 8]));
        if x != y {
            return i + ((x ^ y).trailing_zeros() / 8) as usize;
        }
        i += 8;
    }
    while i < n && a[i] == b[i] {
        i += 1;
    }
    i
}

impl RadixTree {
    /// Characters held.
    pub fn size(&self) -> usize {
        self.size
    }

    fn child(&self, node: u32, first: u8) -> Option<u32> {
        self.nodes[node as usize]
            .children
            .iter()
            .copied()
            .find(|&c| self.nodes[c as usize].edge.first() == Some(&first))
    }

    /// Leading bytes of `text` the tree holds.
    pub fn match_len(&self, text: &[u8]) -> usize {
        let (mut node, mut pos) = (ROOT, 0);
        while pos < text.len() {
            let Some(c) = self.child(node, text[pos]) else {
                break;
            };
            let edge = &self.nodes[c as usize].edge;
            let common = common_prefix(edge, &text[pos..]);
            pos += common;
            if common < edge.len() {
                break;
            }
            node = c;
        }
        pos
    }

    fn alloc(&mut self, node: Node) -> u32 {
        match self.free.pop() {
            Some(i) => {
                self.nodes[i as usize] = node;
                i
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as u32
            }
        }
    }

    /// Inserts `text`, marking every node on its path as just used.
    pub fn insert(&mut self, text: &[u8]) {
        self.clock += 1;
        let now = self.clock;
        let (mut node, mut pos) = (ROOT, 0);
        self.nodes[ROOT as usize].last_access = now;
        while pos < text.len() {
            let Some(c) = self.child(node, text[pos]) else {
                let leaf = self.alloc(Node {
                    edge: text[pos..].to_vec(),
                    children: Vec::new(),
                    parent: node,
                    last_access: now,
                });
                self.nodes[node as usize].children.push(leaf);
                self.size += text.len() - pos;
                return;
            };
            let common = common_prefix(&self.nodes[c as usize].edge, &text[pos..]);
            if common < self.nodes[c as usize].edge.len() {
                // Split `c`: a new node holds the common part, `c` keeps the rest below it.
                let rest = self.nodes[c as usize].edge.split_off(common);
                let head = std::mem::replace(&mut self.nodes[c as usize].edge, rest);
                let mid = self.alloc(Node {
                    edge: head,
                    children: vec![c],
                    parent: node,
                    last_access: now,
                });
                self.nodes[c as usize].parent = mid;
                for slot in &mut self.nodes[node as usize].children {
                    if *slot == c {
                        *slot = mid;
                    }
                }
                node = mid;
            } else {
                self.nodes[c as usize].last_access = now;
                node = c;
            }
            pos += common;
        }
    }

    /// Drops least recently used leaves until at most `max_chars` characters remain.
    pub fn evict_to(&mut self, max_chars: usize) {
        if self.size <= max_chars {
            return;
        }
        let mut leaves: BinaryHeap<Reverse<(u64, u32)>> = BinaryHeap::new();
        let live = self.live_nodes();
        for &i in &live {
            let n = &self.nodes[i as usize];
            if i != ROOT && n.children.is_empty() {
                leaves.push(Reverse((n.last_access, i)));
            }
        }
        while self.size > max_chars {
            let Some(Reverse((_, leaf))) = leaves.pop() else {
                break;
            };
            let parent = self.nodes[leaf as usize].parent;
            self.size -= self.nodes[leaf as usize].edge.len();
            self.nodes[leaf as usize].edge = Vec::new();
            self.nodes[leaf as usize].parent = NONE;
            self.free.push(leaf);
            let p = &mut self.nodes[parent as usize];
            p.children.retain(|&c| c != leaf);
            if parent != ROOT && p.children.is_empty() {
                leaves.push(Reverse((p.last_access, parent)));
            }
        }
    }

    /// Ids of the nodes reachable from the root.
    fn live_nodes(&self) -> Vec<u32> {
        let mut out = Vec::new();
        let mut stack = vec![ROOT];
        while let Some(i) = stack.pop() {
            out.push(i);
            stack.extend_from_slice(&self.nodes[i as usize].children);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_prefixes_and_splits_edges() {
        let mut t = RadixTree::default();
        assert_eq!(t.match_len(b"hello"), 0);
        t.insert(b"hello world");
        assert_eq!(t.size(), 11);
        assert_eq!(t.match_len(b"hello there"), 6);
        t.insert(b"hello there");
        assert_eq!(t.size(), 16, "shared 'hello ' stored once");
        assert_eq!(t.match_len(b"hello there, friend"), 11);
        assert_eq!(t.match_len(b"hello world"), 11);
        assert_eq!(t.match_len(b"help"), 3);
        t.insert(b"hello");
        assert_eq!(t.size(), 16);
        assert_eq!(common_prefix(b"abcdefghijkl", b"abcdefghijXl"), 10);
        assert_eq!(common_prefix(b"abc", b"abd"), 2);
    }

    #[test]
    fn evicts_least_recently_used_leaves() {
        let mut t = RadixTree::default();
        t.insert(b"common-prefix/aaaa");
        t.insert(b"common-prefix/bbbb");
        t.insert(b"other");
        t.insert(b"common-prefix/aaaa"); // a is now the most recent
        t.evict_to(t.size() - 4);
        assert_eq!(
            t.match_len(b"common-prefix/bbbb"),
            14,
            "b's leaf went first"
        );
        assert_eq!(t.match_len(b"common-prefix/aaaa"), 18);
        assert_eq!(t.match_len(b"other"), 5);
        t.evict_to(0);
        assert_eq!(t.size(), 0);
        assert_eq!(t.match_len(b"common"), 0);
        t.insert(b"again");
        assert_eq!(t.match_len(b"again"), 5);
    }
}
