//! Object ids unique across simulators and restarts, as OpenAI's look: a prefix and 48 hex
//! digits. The first 32 digits are drawn once per process (from the standard library's
//! OS-seeded hasher keys, the process id and the clock), the last 16 count the ids this
//! process handed out, so every simulator of a process (`--count N`) and every restart draws
//! ids no other one does.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{SystemTime, UNIX_EPOCH};

static NONCE: OnceLock<[u64; 2]> = OnceLock::new();
static COUNTER: AtomicU64 = AtomicU64::new(1);

fn nonce() -> [u64; 2] {
    *NONCE.get_or_init(|| {
        let clock = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let mut words = [0u64; 2];
        for (i, word) in (0u64..).zip(words.iter_mut()) {
            // Each `RandomState` carries fresh keys seeded from the OS.
            let mut h = RandomState::new().build_hasher();
            h.write_u64(i);
            h.write_u32(std::process::id());
            h.write_u128(clock);
            *word = h.finish();
        }
        words
    })
}

/// A new id: `prefix` then 48 lowercase hex digits, never repeated by this process.
pub fn next(prefix: &str) -> String {
    let [a, b] = nonce();
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    format!("{prefix}{a:016x}{b:016x}{n:016x}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_share_the_process_nonce_and_never_repeat() {
        let (x, y) = (next("resp_"), next("resp_"));
        assert_ne!(x, y);
        assert_eq!(x.len(), "resp_".len() + 48);
        assert_eq!(x[..5 + 32], y[..5 + 32]);
        assert!(x[5..].bytes().all(|c| c.is_ascii_hexdigit()));
    }
}
