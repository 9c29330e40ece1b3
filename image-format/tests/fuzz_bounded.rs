//! Bounded fuzzing on stable Rust: drives the same entry points as the cargo-fuzz targets
//! (`image_format::fuzzing::{archive_reader, manifest_parser}`) with inputs mutated from a seed corpus
//! (valid archives, every hostile case, manifests) by a seeded, deterministic mutator.
//!
//! Bounded by GPU_CKPT_FUZZ_ITERS (default 3000 per target) and GPU_CKPT_FUZZ_SECS (default 20 per
//! target); GPU_CKPT_FUZZ_SEED changes the seed. `make -C image-format fuzz-long` runs it for longer.
//! A panic is a finding: the failing input is written to target/fuzz-findings/ and the test fails.

mod common;

use std::time::{Duration, Instant};

use common::RawTar;
use image_format::fuzzing;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        // xorshift64*
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next() % n as u64) as usize
        }
    }
}

const INTERESTING: &[&[u8]] = &[
    b"..",
    b"/",
    b"../",
    b"\0",
    b"0",
    b"1",
    b"2",
    b"3",
    b"5",
    b"6",
    b"7",
    b"L",
    b"K",
    b"x",
    b"g",
    b"S",
    b"77777777777",
    b"99999999999",
    b"\xff\xff\xff\xff",
    b"{}",
    b"[]",
    b"\"",
    b"null",
    b"1e999",
    b"-1",
    b"18446744073709551616",
    b"\"schema_version\"",
    b"\"kind\"",
    b"ustar\x0000",
    b"ustar  \0",
];

fn mutate(rng: &mut Rng, corpus: &[Vec<u8>], input: &mut Vec<u8>) {
    let rounds = 1 + rng.below(8);
    for _ in 0..rounds {
        let len = input.len();
        match rng.below(9) {
            0 if len > 0 => {
                let i = rng.below(len);
                input[i] ^= 1 << rng.below(8);
            }
            1 if len > 0 => {
                let i = rng.below(len);
                input[i] = rng.next() as u8;
            }
            2 => {
                let tok = INTERESTING[rng.below(INTERESTING.len())];
                let i = rng.below(len + 1);
                if rng.below(2) == 0 || i + tok.len() > len {
                    input.splice(i..i, tok.iter().copied());
                } else {
                    input[i..i + tok.len()].copy_from_slice(tok);
                }
            }
            3 if len > 0 => {
                let a = rng.below(len);
                let b = (a + rng.below(1024)).min(len);
                input.drain(a..b);
            }
            4 if len > 0 => {
                let a = rng.below(len);
                let b = (a + rng.below(512)).min(len);
                let chunk = input[a..b].to_vec();
                let at = rng.below(input.len() + 1);
                input.splice(at..at, chunk);
            }
            5 => {
                // Splice in part of another corpus entry.
                let other = &corpus[rng.below(corpus.len())];
                if !other.is_empty() {
                    let a = rng.below(other.len());
                    let b = (a + rng.below(2048)).min(other.len());
                    let at = rng.below(input.len() + 1);
                    input.splice(at..at, other[a..b].iter().copied());
                }
            }
            6 if len >= 512 => {
                // Rewrite a tar header field at a block boundary: size, type, name.
                let blocks = len / 512;
                let base = rng.below(blocks) * 512;
                match rng.below(3) {
                    0 => input[base + 124..base + 136].copy_from_slice(b"77777777777\0"),
                    1 => input[base + 156] = INTERESTING[rng.below(INTERESTING.len())][0],
                    _ => input[base..base + 3].copy_from_slice(b"../"),
                }
            }
            7 => input.truncate(rng.below(len + 1)),
            _ => {
                let n = rng.below(64);
                for _ in 0..n {
                    input.push(rng.next() as u8);
                }
            }
        }
    }
    input.truncate(1 << 20);
}

fn env_u64(k: &str, d: u64) -> u64 {
    std::env::var(k)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(d)
}

fn archive_corpus() -> Vec<Vec<u8>> {
    let tmp = tempfile::tempdir().unwrap();
    let a = common::make_archive(tmp.path());
    let mut c = vec![std::fs::read(a).unwrap()];
    c.push(RawTar::new().file("../x", b"1").finish());
    c.push(
        RawTar::new()
            .entry(b"l", tar::EntryType::Symlink, b"", Some(b"../o"))
            .finish(),
    );
    c.push(
        RawTar::new()
            .entry(b"h", tar::EntryType::Link, b"", Some(b"/etc/passwd"))
            .finish(),
    );
    c.push(
        RawTar::new()
            .entry(b"c", tar::EntryType::Char, b"", None)
            .finish(),
    );
    c.push(RawTar::new().file("a", b"1").file("a", b"2").finish());
    c.push(
        RawTar::new()
            .entry(b"d", tar::EntryType::Directory, b"", None)
            .file("d/f", b"x")
            .entry(b"d/l", tar::EntryType::Symlink, b"", Some(b"f"))
            .entry(b"d/h", tar::EntryType::Link, b"", Some(b"d/f"))
            .finish(),
    );
    c.push(Vec::new());
    c
}

fn manifest_corpus() -> Vec<Vec<u8>> {
    let tmp = tempfile::tempdir().unwrap();
    let m = common::make_checkpoint_dir(tmp.path());
    vec![
        m.to_json(),
        serde_json::to_vec(&common::sample_manifest()).unwrap(),
        // A major version this build does not read, and a version 1 manifest.
        br#"{"kind":"gpu-ckpt.io/CheckpointManifest","schema_version":3}"#.to_vec(),
        version_1(&m),
        b"{}".to_vec(),
    ]
}

/// `m` as schema version 1 wrote it: a sha256 for every file.
fn version_1(m: &image_format::manifest::Manifest) -> Vec<u8> {
    let mut v: serde_json::Value = serde_json::from_slice(&m.to_json()).unwrap();
    v["schema_version"] = 1.into();
    for entry in v["files"].as_object_mut().unwrap().values_mut() {
        entry["sha256"] = "ab".repeat(32).into();
    }
    serde_json::to_vec(&v).unwrap()
}

fn run(name: &str, corpus: Vec<Vec<u8>>, target: &dyn Fn(&[u8])) -> u64 {
    let iters = env_u64("GPU_CKPT_FUZZ_ITERS", 3000);
    let secs = env_u64("GPU_CKPT_FUZZ_SECS", 20);
    let mut rng = Rng(env_u64("GPU_CKPT_FUZZ_SEED", 0x9e37_79b9_7f4a_7c15) | 1);
    let deadline = Instant::now() + Duration::from_secs(secs);
    for c in &corpus {
        target(c);
    }
    let mut n = 0;
    while n < iters && Instant::now() < deadline {
        let mut input = corpus[rng.below(corpus.len())].clone();
        mutate(&mut rng, &corpus, &mut input);
        let res = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| target(&input)));
        if res.is_err() {
            let dir =
                std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/fuzz-findings");
            let _ = std::fs::create_dir_all(&dir);
            let p = dir.join(format!("{name}-{n}.bin"));
            let _ = std::fs::write(&p, &input);
            panic!(
                "{name}: crash on iteration {n}; input saved to {}",
                p.display()
            );
        }
        n += 1;
    }
    eprintln!("{name}: {n} mutated inputs, no crash");
    n
}

#[test]
fn fuzz_archive_reader_bounded() {
    let tmp = tempfile::tempdir().unwrap();
    let outside = tmp.path().join("outside");
    std::fs::create_dir(&outside).unwrap();
    let work = tmp.path().join("work");
    std::fs::create_dir(&work).unwrap();
    let counter = std::cell::Cell::new(0u64);
    let n = run("archive_reader", archive_corpus(), &|data| {
        let i = counter.get();
        counter.set(i + 1);
        let t = work.join(format!("t{i}"));
        fuzzing::archive_reader(data, Some(&t));
        let _ = std::fs::remove_dir_all(&t);
    });
    assert!(n > 0);
    // Nothing was ever written outside the per-input targets.
    assert!(common::tree(&outside).is_empty());
    assert!(
        common::tree(tmp.path())
            .iter()
            .all(|p| p == "outside" || p == "work"),
        "{:?}",
        common::tree(tmp.path())
    );
}

#[test]
fn fuzz_manifest_parser_bounded() {
    assert!(
        run("manifest_parser", manifest_corpus(), &|d| {
            fuzzing::manifest_parser(d)
        }) > 0
    );
}
