//! Shared queues with Envoy's registration rule.
//!
//! A queue is named by (vm_id, name) and has one token for its whole life. Registering an existing
//! name again keeps the token and its items but moves ownership: only the last VM (root context)
//! to register a queue is told about new items through `proxy_on_queue_ready`. Any VM can enqueue
//! or dequeue by token.

use std::collections::{HashMap, VecDeque};

use crate::types::Status;

/// The root context that gets `proxy_on_queue_ready` for a queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueOwner {
    pub vm: usize,
    pub root_context_id: u32,
}

#[derive(Debug)]
struct Queue {
    owner: QueueOwner,
    items: VecDeque<Vec<u8>>,
}

/// All shared queues of one process.
#[derive(Debug)]
pub struct SharedQueues {
    tokens: HashMap<(String, String), u32>,
    queues: HashMap<u32, Queue>,
    next_token: u32,
}

impl Default for SharedQueues {
    fn default() -> Self {
        SharedQueues {
            tokens: HashMap::new(),
            queues: HashMap::new(),
            next_token: 1,
        }
    }
}

impl SharedQueues {
    /// Registers (or re-registers) a queue; the caller becomes its owner.
    pub fn register(&mut self, vm_id: &str, name: &str, owner: QueueOwner) -> u32 {
        let key = (vm_id.to_owned(), name.to_owned());
        if let Some(&token) = self.tokens.get(&key) {
            if let Some(queue) = self.queues.get_mut(&token) {
                queue.owner = owner;
            }
            return token;
        }
        let token = self.next_token;
        self.next_token = self.next_token.wrapping_add(1).max(1);
        self.tokens.insert(key, token);
        self.queues.insert(
            token,
            Queue {
                owner,
                items: VecDeque::new(),
            },
        );
        token
    }

    /// The token of a registered queue.
    pub fn resolve(&self, vm_id: &str, name: &str) -> Option<u32> {
        self.tokens
            .get(&(vm_id.to_owned(), name.to_owned()))
            .copied()
    }

    /// Appends an item; returns the owner to notify.
    pub fn enqueue(&mut self, token: u32, item: &[u8]) -> Result<QueueOwner, Status> {
        let queue = self.queues.get_mut(&token).ok_or(Status::NotFound)?;
        queue.items.push_back(item.to_vec());
        Ok(queue.owner)
    }

    /// Takes the oldest item: `NotFound` for an unknown token, `Empty` for an empty queue.
    pub fn dequeue(&mut self, token: u32) -> Result<Vec<u8>, Status> {
        let queue = self.queues.get_mut(&token).ok_or(Status::NotFound)?;
        queue.items.pop_front().ok_or(Status::Empty)
    }

    /// Number of items waiting in a queue.
    pub fn len(&self, token: u32) -> Option<usize> {
        self.queues.get(&token).map(|q| q.items.len())
    }

    /// The current owner of a queue.
    #[cfg(test)]
    pub fn owner(&self, token: u32) -> Option<QueueOwner> {
        self.queues.get(&token).map(|q| q.owner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const VM0: QueueOwner = QueueOwner {
        vm: 0,
        root_context_id: 1,
    };
    const VM1: QueueOwner = QueueOwner {
        vm: 1,
        root_context_id: 1,
    };

    #[test]
    fn last_registration_owns_the_queue() {
        let mut queues = SharedQueues::default();
        let a = queues.register("vm", "events", VM0);
        let b = queues.register("vm", "events", VM1);
        assert_eq!(a, b, "same name, same token");
        assert_eq!(queues.enqueue(a, b"x"), Ok(VM1));
        assert_eq!(queues.owner(a), Some(VM1));
    }

    #[test]
    fn names_are_scoped_by_vm_id() {
        let mut queues = SharedQueues::default();
        let a = queues.register("vm-a", "q", VM0);
        let b = queues.register("vm-b", "q", VM1);
        assert_ne!(a, b);
        assert_eq!(queues.resolve("vm-a", "q"), Some(a));
        assert_eq!(queues.resolve("vm-c", "q"), None);
    }

    #[test]
    fn fifo_with_envoy_statuses() {
        let mut queues = SharedQueues::default();
        let token = queues.register("", "q", VM0);
        assert_eq!(queues.dequeue(token), Err(Status::Empty));
        assert_eq!(queues.dequeue(token + 1), Err(Status::NotFound));
        assert_eq!(queues.enqueue(token + 1, b"x"), Err(Status::NotFound));
        queues.enqueue(token, b"1").expect("enqueue");
        queues.enqueue(token, b"2").expect("enqueue");
        // Re-registration keeps the items.
        queues.register("", "q", VM1);
        assert_eq!(queues.len(token), Some(2));
        assert_eq!(queues.dequeue(token).as_deref(), Ok(&b"1"[..]));
        assert_eq!(queues.dequeue(token).as_deref(), Ok(&b"2"[..]));
        assert_eq!(queues.dequeue(token), Err(Status::Empty));
    }
}
