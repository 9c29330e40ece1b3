//! The numbers of the NCCL workloads (`nccl-train` and `c/nccl_allreduce.c`, which computes the
//! same ones): what each rank contributes at step k and what every collective must give.
//!
//! All arithmetic is on u32 modulo 2^32 (NCCL's `ncclUint32` sum wraps the same way). Rank r's
//! gradient at step k is `g(k,r,i) = a(r,i) + k*b(r)`, so the allreduced gradient is
//! `A(i) + k*B` (A, B the sums of a and b over the ranks). Rank 0 adds it to the parameters and
//! broadcasts them, so after step k they are `p(0,i) + k*A(i) + k(k+1)/2*B`. The split
//! communicator (ranks of one parity) sums `c(r,i) + k*d(r)` the same way. Every value has a
//! closed form in (seed, world, rank parity, k): a restored run is checked against it, and its
//! digest of a step equals the original's.

use crate::hash32;
use crate::train::Checksum;

const TAG_PARAM: u32 = 0;
const TAG_GRAD: u32 = 1;
const TAG_GRAD_STEP: u32 = 2;
const TAG_SPLIT: u32 = 3;
const TAG_SPLIT_STEP: u32 = 4;

/// The per-step factor of rank `rank` for `tag` (odd, so that every step changes every value).
fn step_factor(seed: u64, rank: u32, tag: u32) -> u32 {
    hash32(seed, rank, tag, 0) | 1
}

/// `k(k+1)/2` modulo 2^32.
fn tri(k: u64) -> u32 {
    ((k as u128 * (k as u128 + 1)) / 2) as u32
}

/// What a step's collectives leave in a buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Buffer {
    /// The parameters left by the previous step, read before this step's collectives.
    Parameters,
    /// The gradient after the allreduce on the world communicator.
    Allreduce,
    /// The parameters after rank 0's broadcast.
    Broadcast,
    /// The sum on the communicator split by rank parity.
    Split,
}

impl Buffer {
    pub fn name(self) -> &'static str {
        match self {
            Buffer::Parameters => "parameters",
            Buffer::Allreduce => "allreduce",
            Buffer::Broadcast => "broadcast",
            Buffer::Split => "split-allreduce",
        }
    }
}

/// One rank's constants: its contributions and the closed forms of what it receives.
pub struct Sums {
    seed: u64,
    rank: u32,
    grad_sum: Vec<u32>,
    grad_step_sum: u32,
    split_sum: Vec<u32>,
    split_step_sum: u32,
    param0: Vec<u32>,
}

impl Sums {
    pub fn new(seed: u64, rank: u32, world: u32, elements: usize) -> Sums {
        let n = elements as u64;
        let mut s = Sums {
            seed,
            rank,
            grad_sum: vec![0; elements],
            grad_step_sum: 0,
            split_sum: vec![0; elements],
            split_step_sum: 0,
            param0: (0..n).map(|i| hash32(seed, 0, TAG_PARAM, i)).collect(),
        };
        for q in 0..world {
            s.grad_step_sum = s
                .grad_step_sum
                .wrapping_add(step_factor(seed, q, TAG_GRAD_STEP));
            add_hashes(&mut s.grad_sum, seed, q, TAG_GRAD);
            if q % 2 == rank % 2 {
                s.split_step_sum =
                    s.split_step_sum
                        .wrapping_add(step_factor(seed, q, TAG_SPLIT_STEP));
                add_hashes(&mut s.split_sum, seed, q, TAG_SPLIT);
            }
        }
        s
    }

    /// The parameters before step 1.
    pub fn initial_parameters(&self) -> &[u32] {
        &self.param0
    }

    /// This rank's gradient for step `k`.
    pub fn gradient(&self, k: u64) -> Vec<u32> {
        self.contribution(k, TAG_GRAD, TAG_GRAD_STEP)
    }

    /// This rank's contribution to the split communicator's allreduce at step `k`.
    pub fn split_part(&self, k: u64) -> Vec<u32> {
        self.contribution(k, TAG_SPLIT, TAG_SPLIT_STEP)
    }

    fn contribution(&self, k: u64, tag: u32, step_tag: u32) -> Vec<u32> {
        let f = (k as u32).wrapping_mul(step_factor(self.seed, self.rank, step_tag));
        (0..self.param0.len() as u64)
            .map(|i| hash32(self.seed, self.rank, tag, i).wrapping_add(f))
            .collect()
    }

    /// Element `i` of `buffer` after step `k` (for [`Buffer::Parameters`], `k` is the step that
    /// left them).
    pub fn want(&self, buffer: Buffer, k: u64, i: usize) -> u32 {
        let k32 = k as u32;
        match buffer {
            Buffer::Allreduce => {
                self.grad_sum[i].wrapping_add(k32.wrapping_mul(self.grad_step_sum))
            }
            Buffer::Parameters | Buffer::Broadcast => self.param0[i]
                .wrapping_add(k32.wrapping_mul(self.grad_sum[i]))
                .wrapping_add(tri(k).wrapping_mul(self.grad_step_sum)),
            Buffer::Split => self.split_sum[i].wrapping_add(k32.wrapping_mul(self.split_step_sum)),
        }
    }

    /// The first element of `got` that differs from `buffer`'s closed form: (i, got, want).
    pub fn first_mismatch(&self, buffer: Buffer, k: u64, got: &[u32]) -> Option<(usize, u32, u32)> {
        got.iter()
            .enumerate()
            .map(|(i, &g)| (i, g, self.want(buffer, k, i)))
            .find(|&(_, g, w)| g != w)
    }

    /// The digest printed for step `k`: FNV-1a over the verified allreduce, broadcast and split
    /// results, in that order.
    pub fn digest(&self, k: u64) -> u64 {
        let mut sum = Checksum::default();
        for b in [Buffer::Allreduce, Buffer::Broadcast, Buffer::Split] {
            let v: Vec<u32> = (0..self.param0.len()).map(|i| self.want(b, k, i)).collect();
            sum.add(&v);
        }
        sum.value()
    }
}

fn add_hashes(acc: &mut [u32], seed: u64, rank: u32, tag: u32) {
    for (i, x) in acc.iter_mut().enumerate() {
        *x = x.wrapping_add(hash32(seed, rank, tag, i as u64));
    }
}

/// The line a rank prints for a verified step.
pub fn step_line(rank: u32, k: u64, digest: u64) -> String {
    format!("rank {rank} step {k} checksum {digest:016x}")
}

/// The line a rank prints for the first element that failed its check.
pub fn mismatch_line(
    rank: u32,
    k: u64,
    buffer: Buffer,
    (i, got, want): (usize, u32, u32),
) -> String {
    format!(
        "MISMATCH rank {rank} step {k} {} element {i} got {got:08x} want {want:08x}",
        buffer.name()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The collectives done on the host: every rank's view matches the closed forms.
    #[test]
    fn closed_forms_match_summed_contributions() {
        let (world, n) = (5u32, 33usize);
        let ranks: Vec<Sums> = (0..world).map(|r| Sums::new(9, r, world, n)).collect();
        let mut params = ranks[0].initial_parameters().to_vec();
        for k in 1..=40u64 {
            let mut grad = vec![0u32; n];
            let mut split = [vec![0u32; n], vec![0u32; n]];
            for (r, s) in ranks.iter().enumerate() {
                for (i, (g, p)) in s.gradient(k).into_iter().zip(s.split_part(k)).enumerate() {
                    grad[i] = grad[i].wrapping_add(g);
                    split[r % 2][i] = split[r % 2][i].wrapping_add(p);
                }
            }
            for (p, g) in params.iter_mut().zip(&grad) {
                *p = p.wrapping_add(*g);
            }
            for (r, s) in ranks.iter().enumerate() {
                assert_eq!(s.first_mismatch(Buffer::Allreduce, k, &grad), None);
                assert_eq!(s.first_mismatch(Buffer::Broadcast, k, &params), None);
                assert_eq!(s.first_mismatch(Buffer::Split, k, &split[r % 2]), None);
            }
        }
    }

    #[test]
    fn a_flipped_element_is_named() {
        let s = Sums::new(1, 2, 4, 16);
        let mut v: Vec<u32> = (0..16).map(|i| s.want(Buffer::Allreduce, 7, i)).collect();
        v[11] ^= 1;
        let m = s.first_mismatch(Buffer::Allreduce, 7, &v).unwrap();
        assert_eq!((m.0, m.1 ^ 1), (11, m.2));
        assert!(mismatch_line(2, 7, Buffer::Allreduce, m)
            .starts_with("MISMATCH rank 2 step 7 allreduce element 11 got "));
    }

    #[test]
    fn digests_differ_by_step_and_parity_only() {
        let a = Sums::new(3, 0, 4, 64);
        let b = Sums::new(3, 2, 4, 64);
        let c = Sums::new(3, 1, 4, 64);
        assert_eq!(a.digest(5), b.digest(5));
        assert_ne!(a.digest(5), c.digest(5));
        assert_ne!(a.digest(5), a.digest(6));
        assert!(step_line(1, 5, c.digest(5)).starts_with("rank 1 step 5 checksum "));
    }
}
