//! The memory pattern of `gpu-fill`.
//!
//! Each device's region is cut into chunks. Even chunks hold one 32-bit value repeated (written
//! with `cuMemsetD32`), odd chunks hold a hashed word per 4-byte offset (written with
//! `cuMemcpyHtoD`). Every value derives from (seed, device, offset), so a lost, stale or
//! misplaced byte shows up.

use crate::hash32;

/// Default chunk size for filling and verifying.
pub const CHUNK_BYTES: u64 = 64 << 20;
/// Default size of one device allocation (a multiple of the chunk size).
pub const ALLOC_BYTES: u64 = 1 << 30;

/// How one chunk is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `cuMemsetD32` with this value.
    Memset(u32),
    /// `cuMemcpyHtoD` of [`word`] for each 4-byte offset.
    Words,
}

/// One chunk of a device region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chunk {
    pub index: u64,
    /// Byte offset in the device region.
    pub offset: u64,
    pub bytes: u64,
    /// Which allocation holds it, and the offset inside that allocation.
    pub alloc: usize,
    pub alloc_offset: u64,
}

/// The layout of one device's region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Plan {
    pub bytes: u64,
    pub chunk_bytes: u64,
    pub alloc_bytes: u64,
}

impl Plan {
    /// A plan for `bytes` (a multiple of 4) with the default chunk and allocation sizes.
    pub fn new(bytes: u64) -> Plan {
        Plan {
            bytes,
            chunk_bytes: CHUNK_BYTES,
            alloc_bytes: ALLOC_BYTES,
        }
    }

    /// Sizes of the device allocations.
    pub fn allocs(&self) -> Vec<u64> {
        let mut v = Vec::new();
        let mut left = self.bytes;
        while left > 0 {
            let n = left.min(self.alloc_bytes);
            v.push(n);
            left -= n;
        }
        v
    }

    pub fn chunks(&self) -> impl Iterator<Item = Chunk> + '_ {
        let n = self.bytes.div_ceil(self.chunk_bytes);
        (0..n).map(move |index| {
            let offset = index * self.chunk_bytes;
            Chunk {
                index,
                offset,
                bytes: (self.bytes - offset).min(self.chunk_bytes),
                alloc: (offset / self.alloc_bytes) as usize,
                alloc_offset: offset % self.alloc_bytes,
            }
        })
    }
}

pub fn kind(seed: u64, device: u32, chunk: u64) -> Kind {
    if chunk & 1 == 0 {
        Kind::Memset(hash32(seed, device, 3, chunk))
    } else {
        Kind::Words
    }
}

/// The word at byte offset `4 * word_index` of a [`Kind::Words`] chunk.
pub fn word(seed: u64, device: u32, word_index: u64) -> u32 {
    hash32(seed, device, 4, word_index)
}

/// Writes the expected words of `chunk` into `out` (`chunk.bytes / 4` words).
pub fn expected(seed: u64, device: u32, chunk: &Chunk, out: &mut [u32]) {
    match kind(seed, device, chunk.index) {
        Kind::Memset(v) => out.fill(v),
        Kind::Words => {
            let first = chunk.offset / 4;
            for (j, w) in out.iter_mut().enumerate() {
                *w = word(seed, device, first + j as u64);
            }
        }
    }
}

/// The byte offset (within the chunk) of the first byte that differs, if any.
pub fn first_mismatch(got: &[u32], want: &[u32]) -> Option<u64> {
    let j = got.iter().zip(want).position(|(g, w)| g != w)?;
    let (g, w) = (got[j].to_ne_bytes(), want[j].to_ne_bytes());
    let b = g.iter().zip(&w).position(|(x, y)| x != y).unwrap_or(0);
    Some(j as u64 * 4 + b as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_the_region_inside_allocations() {
        let p = Plan {
            bytes: 10 * 16 + 8,
            chunk_bytes: 16,
            alloc_bytes: 64,
        };
        assert_eq!(p.allocs(), vec![64, 64, 40]);
        let c: Vec<Chunk> = p.chunks().collect();
        assert_eq!(c.len(), 11);
        assert_eq!(c.iter().map(|c| c.bytes).sum::<u64>(), p.bytes);
        assert_eq!(c[10].bytes, 8);
        for ch in &c {
            assert!(ch.alloc_offset + ch.bytes <= p.allocs()[ch.alloc]);
            assert_eq!(ch.alloc as u64 * 64 + ch.alloc_offset, ch.offset);
        }
    }

    #[test]
    fn both_kinds_are_used_and_seeded() {
        assert!(matches!(kind(1, 0, 0), Kind::Memset(_)));
        assert_eq!(kind(1, 0, 1), Kind::Words);
        assert_ne!(kind(1, 0, 0), kind(2, 0, 0));
        assert_ne!(kind(1, 0, 0), kind(1, 1, 0));
        assert_ne!(kind(1, 0, 0), kind(1, 0, 2));
        assert_ne!(word(1, 0, 5), word(1, 0, 6));
    }

    #[test]
    fn expected_words_depend_on_offset() {
        let p = Plan {
            bytes: 64,
            chunk_bytes: 32,
            alloc_bytes: 64,
        };
        let c: Vec<Chunk> = p.chunks().collect();
        let mut w = vec![0u32; 8];
        expected(9, 0, &c[1], &mut w);
        assert_eq!(w[0], word(9, 0, 8));
        assert_eq!(w[7], word(9, 0, 15));
        expected(9, 0, &c[0], &mut w);
        assert!(w.iter().all(|&x| x == w[0]));
    }

    #[test]
    fn mismatch_offset_is_exact_to_the_byte() {
        let want = vec![0x1111_1111u32; 4];
        let mut got = want.clone();
        assert_eq!(first_mismatch(&got, &want), None);
        let mut b = got[2].to_ne_bytes();
        b[1] ^= 0xff;
        got[2] = u32::from_ne_bytes(b);
        assert_eq!(first_mismatch(&got, &want), Some(9));
    }
}
