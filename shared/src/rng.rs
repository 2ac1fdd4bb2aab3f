//! The project's one seeded random source (SplitMix64): every run replays exactly from its
//! seed. The router's tie-breaks, the benchmark's workloads and policies, the harness's WASI
//! `random_get` and the test tokenizer's corpus all draw from it.

/// SplitMix64 with the few draws its users need.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    /// A generator for a named sub-stream of `seed` (workload parts, policies, rates), so that
    /// adding draws to one stream never shifts another.
    pub fn derive(seed: u64, stream: &str, index: u64) -> Self {
        let mut h = xxhash_rust::xxh3::xxh3_64_with_seed(stream.as_bytes(), seed);
        h ^= index.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        Rng(h)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n`; `n` must be > 0 (returns 0 otherwise).
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            return 0;
        }
        ((u128::from(self.next_u64()) * n as u128) >> 64) as usize
    }

    /// Uniform in `lo..=hi` (`lo` when `hi < lo`).
    pub fn range(&mut self, lo: u32, hi: u32) -> u32 {
        if hi <= lo {
            return lo;
        }
        lo + self.below((hi - lo) as usize + 1) as u32
    }

    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Exponentially distributed with the given rate (per second); infinite for a rate of 0.
    pub fn exp(&mut self, rate: f64) -> f64 {
        if rate <= 0.0 {
            return f64::INFINITY;
        }
        -(1.0 - self.unit()).ln() / rate
    }

    /// Fisher-Yates shuffle.
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.below(i + 1);
            items.swap(i, j);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replays_and_stays_in_range() {
        let mut a = Rng::new(7);
        let mut b = Rng::new(7);
        for _ in 0..1000 {
            assert_eq!(a.next_u64(), b.next_u64());
            let u = a.unit();
            assert!((0.0..1.0).contains(&u));
            b.unit();
            assert!(a.range(3, 5) >= 3 && b.range(3, 5) <= 5);
        }
        assert_eq!(a.below(0), 0);
        assert_eq!(a.range(9, 2), 9);
        assert!(Rng::derive(1, "x", 0).next_u64() != Rng::derive(1, "y", 0).next_u64());
    }

    #[test]
    fn exponential_mean() {
        let mut r = Rng::new(3);
        let n = 20_000;
        let mean: f64 = (0..n).map(|_| r.exp(4.0)).sum::<f64>() / n as f64;
        assert!((mean - 0.25).abs() < 0.01, "{mean}");
    }
}
