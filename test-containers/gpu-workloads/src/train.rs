//! The state rule of `gpu-train`.
//!
//! Element i of device d starts at `init_i` and step k (k = 1, 2, ...) applies
//! `v_i <- v_i + a_i + k*b` (mod 2^32), so after k steps `v_i = init_i + k*a_i + b*k(k+1)/2`.
//! The program iterates the rule on the data it reads back from the device and checks the
//! result against the closed form, which needs nothing but (seed, device, i, k).

use crate::hash32;

/// Per-device constants of the rule (not state: they are derived from the seed alone).
pub struct Rule {
    pub init: Vec<u32>,
    pub a: Vec<u32>,
    pub b: u32,
}

impl Rule {
    pub fn new(seed: u64, device: u32, elements: usize) -> Rule {
        Rule {
            init: (0..elements as u64)
                .map(|i| hash32(seed, device, 0, i))
                .collect(),
            a: (0..elements as u64)
                .map(|i| hash32(seed, device, 1, i))
                .collect(),
            b: hash32(seed, device, 2, 0) | 1,
        }
    }

    /// One step of the rule: the value after step `k` from the value after step `k - 1`.
    pub fn advance(&self, i: usize, v: u32, k: u64) -> u32 {
        v.wrapping_add(self.a[i])
            .wrapping_add((k as u32).wrapping_mul(self.b))
    }

    /// The value of element `i` after `k` steps, from the seed alone.
    pub fn closed(&self, i: usize, k: u64) -> u32 {
        let tri = ((k as u128 * (k as u128 + 1)) / 2) as u32;
        self.init[i]
            .wrapping_add((k as u32).wrapping_mul(self.a[i]))
            .wrapping_add(tri.wrapping_mul(self.b))
    }

    /// The first element that differs from the closed form after `k` steps: (i, got, want).
    pub fn first_mismatch(&self, state: &[u32], k: u64) -> Option<(usize, u32, u32)> {
        state
            .iter()
            .enumerate()
            .find(|&(i, &v)| v != self.closed(i, k))
            .map(|(i, &v)| (i, v, self.closed(i, k)))
    }
}

/// Running checksum over device states (FNV-1a over 32-bit words).
pub struct Checksum(u64);

impl Default for Checksum {
    fn default() -> Self {
        Checksum(0xcbf2_9ce4_8422_2325)
    }
}

impl Checksum {
    pub fn add(&mut self, words: &[u32]) {
        for &w in words {
            self.0 = (self.0 ^ w as u64).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }

    pub fn value(&self) -> u64 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn closed_form_matches_iterated_rule() {
        let r = Rule::new(7, 1, 64);
        let mut v = r.init.clone();
        for k in 1..=300u64 {
            for (i, x) in v.iter_mut().enumerate() {
                *x = r.advance(i, *x, k);
            }
            assert_eq!(r.first_mismatch(&v, k), None, "step {k}");
        }
    }

    #[test]
    fn closed_form_wraps_for_large_steps() {
        let r = Rule::new(1, 0, 4);
        let k = (1u64 << 33) + 5;
        let mut v: Vec<u32> = (0..4).map(|i| r.closed(i, k - 1)).collect();
        for (i, x) in v.iter_mut().enumerate() {
            *x = r.advance(i, *x, k);
        }
        assert_eq!(r.first_mismatch(&v, k), None);
    }

    #[test]
    fn mismatch_is_reported_with_element() {
        let r = Rule::new(3, 0, 16);
        let mut v: Vec<u32> = (0..16).map(|i| r.closed(i, 4)).collect();
        v[9] ^= 1;
        let (i, got, want) = r.first_mismatch(&v, 4).unwrap();
        assert_eq!((i, got ^ 1), (9, want));
    }

    #[test]
    fn devices_and_seeds_differ() {
        let a = Rule::new(1, 0, 8);
        let b = Rule::new(1, 1, 8);
        let c = Rule::new(2, 0, 8);
        assert_ne!(a.init, b.init);
        assert_ne!(a.init, c.init);
        assert_ne!(a.a, b.a);
    }

    #[test]
    fn checksum_depends_on_order_and_value() {
        let mut x = Checksum::default();
        x.add(&[1, 2]);
        let mut y = Checksum::default();
        y.add(&[2, 1]);
        assert_ne!(x.value(), y.value());
    }
}
