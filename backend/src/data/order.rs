//! The order a file's examples are trained in: every epoch a seeded
//! permutation, each example once, computed per index (no state), so the
//! batch of any step is known without replaying the steps before it.

use super::Rng;

/// Element `i` of a pseudo-random permutation of `0..n` keyed by `key`: a
/// four-round Feistel network on the smallest even number of bits that
/// holds `n - 1`, walked until it lands below `n` (a bijection on `0..n`;
/// at most four tries expected).
pub fn permute(i: u64, n: u64, key: u64) -> u64 {
    debug_assert!(i < n, "index {i} out of 0..{n}");
    if n <= 1 {
        return i;
    }
    let bits = 64 - (n - 1).leading_zeros();
    let half = bits.div_ceil(2);
    let mask = (1u64 << half) - 1;
    let mut x = i;
    loop {
        let (mut l, mut r) = (x >> half, x & mask);
        for round in 0..4u64 {
            let f = Rng::keyed(key, round, r, 0x0DE5).next_u64() & mask;
            (l, r) = (r, l ^ f);
        }
        x = (l << half) | r;
        if x < n {
            return x;
        }
    }
}

/// The example at position `g` of the run's stream over `n` examples: epoch
/// `g / n`, shuffled with a key from `seed` and the epoch.
pub fn example(g: u64, n: u64, seed: u64) -> usize {
    let epoch = g / n;
    let key = Rng::keyed(seed, epoch, 0xE90C, 0).next_u64();
    permute(g % n, n, key) as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_epoch_is_a_permutation() {
        for n in [1u64, 2, 3, 7, 64, 100, 1000] {
            for epoch in 0..3 {
                let mut seen: Vec<usize> = (0..n).map(|i| example(epoch * n + i, n, 9)).collect();
                seen.sort();
                assert_eq!(seen, (0..n as usize).collect::<Vec<_>>(), "n {n}");
            }
        }
    }

    #[test]
    fn epochs_and_seeds_shuffle_differently() {
        let order = |seed: u64, epoch: u64| {
            (0..50u64)
                .map(|i| example(epoch * 50 + i, 50, seed))
                .collect::<Vec<usize>>()
        };
        assert_ne!(order(1, 0), order(1, 1));
        assert_ne!(order(1, 0), order(2, 0));
        assert_eq!(order(1, 0), order(1, 0));
        assert_ne!(order(1, 0), (0..50usize).collect::<Vec<_>>());
    }
}
