//! Checkpoints on disk: what the node keeps under its checkpoint directories.
//!
//! A checkpoint is a directory holding a gpu-ckpt manifest (`gpu-ckpt-manifest.json`: a
//! checkpoint the shim wrote at a `--image-path`, `CriuImagePath` or the restore handler's
//! unpacked copy) or an archive file (`*.tar`, `*.tar.gz`, `*.tgz`: the kubelet's
//! `checkpoint-<pod>_<namespace>-<container>-<time>.tar`, `gpu-ckpt build`'s archives). Its bytes
//! are the sizes of the regular files in it (an archive: its size). The walk follows no symlink
//! (`symlink_metadata`; a link is neither counted nor entered) and is bounded in depth and in
//! entries, so a huge or hostile tree costs a scrape at most that many `lstat`s.

use std::fs;
use std::path::Path;

use image_format::MANIFEST_FILE;

/// The deepest directory level entered below a checkpoint directory.
pub const MAX_DEPTH: usize = 8;
/// The most directory entries looked at in one scan, over every directory.
pub const MAX_ENTRIES: usize = 200_000;

/// What one scan found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DiskUsage {
    pub checkpoints: u64,
    pub bytes: u64,
    /// The scan stopped at [`MAX_ENTRIES`] (the figures are a lower bound).
    pub truncated: bool,
}

/// Whether `name` is a checkpoint archive's file name.
pub fn is_archive(name: &str) -> bool {
    name.ends_with(".tar") || name.ends_with(".tar.gz") || name.ends_with(".tgz")
}

struct Walk {
    seen: usize,
    max_entries: usize,
    usage: DiskUsage,
}

impl Walk {
    /// Entries of `dir` (not followed if a link), each counted against the bound; `None` when
    /// it cannot be read or the bound is reached.
    fn entries(&mut self, dir: &Path) -> Option<Vec<fs::DirEntry>> {
        let rd = fs::read_dir(dir).ok()?;
        let mut out = Vec::new();
        for e in rd.flatten() {
            if self.seen >= self.max_entries {
                self.usage.truncated = true;
                break;
            }
            self.seen += 1;
            out.push(e);
        }
        Some(out)
    }

    /// The bytes of the regular files below `dir` (a checkpoint directory).
    fn dir_bytes(&mut self, dir: &Path, depth: usize) -> u64 {
        let mut total = 0u64;
        let Some(entries) = self.entries(dir) else {
            return 0;
        };
        for e in entries {
            let Ok(m) = fs::symlink_metadata(e.path()) else {
                continue;
            };
            if m.is_file() {
                total = total.saturating_add(m.len());
            } else if m.is_dir() && depth < MAX_DEPTH {
                total = total.saturating_add(self.dir_bytes(&e.path(), depth + 1));
            }
        }
        total
    }

    fn scan(&mut self, dir: &Path, depth: usize) {
        let Some(entries) = self.entries(dir) else {
            return;
        };
        if entries.iter().any(|e| e.file_name() == MANIFEST_FILE) {
            // This directory is a checkpoint: count it once, with everything in it.
            let bytes = entries
                .iter()
                .filter_map(|e| fs::symlink_metadata(e.path()).ok())
                .filter(|m| m.is_file())
                .map(|m| m.len())
                .fold(0u64, u64::saturating_add);
            let below: u64 = entries
                .iter()
                .filter(|e| fs::symlink_metadata(e.path()).is_ok_and(|m| m.is_dir()))
                .map(|e| {
                    if depth < MAX_DEPTH {
                        self.dir_bytes(&e.path(), depth + 1)
                    } else {
                        0
                    }
                })
                .fold(0u64, u64::saturating_add);
            self.usage.checkpoints += 1;
            self.usage.bytes = self.usage.bytes.saturating_add(bytes.saturating_add(below));
            return;
        }
        for e in entries {
            let Ok(m) = fs::symlink_metadata(e.path()) else {
                continue;
            };
            if m.is_file() && is_archive(&e.file_name().to_string_lossy()) {
                self.usage.checkpoints += 1;
                self.usage.bytes = self.usage.bytes.saturating_add(m.len());
            } else if m.is_dir() && depth < MAX_DEPTH {
                self.scan(&e.path(), depth + 1);
            }
        }
    }
}

/// The checkpoints under `dirs` (each not followed if it is itself a link; a missing one
/// counts nothing), at most `max_entries` directory entries looked at in all.
pub fn scan_bounded(dirs: &[impl AsRef<Path>], max_entries: usize) -> DiskUsage {
    let mut w = Walk {
        seen: 0,
        max_entries,
        usage: DiskUsage::default(),
    };
    for d in dirs {
        let d = d.as_ref();
        if fs::symlink_metadata(d).is_ok_and(|m| m.is_dir()) {
            w.scan(d, 0);
        }
    }
    w.usage
}

/// [`scan_bounded`] with [`MAX_ENTRIES`].
pub fn scan(dirs: &[impl AsRef<Path>]) -> DiskUsage {
    scan_bounded(dirs, MAX_ENTRIES)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(p: &Path, n: usize) {
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        fs::write(p, vec![7u8; n]).unwrap();
    }

    #[test]
    fn counts_manifest_directories_and_archives_without_following_links() {
        let t = tempfile::tempdir().unwrap();
        let root = t.path().join("ckpts");
        // A kubelet archive and a gzipped one.
        write(&root.join("checkpoint-p_ns-c-2026.tar"), 1000);
        write(&root.join("sub/old.tar.gz"), 200);
        // A checkpoint directory with a nested CRIU directory: counted once, with every file.
        write(&root.join("img1").join(MANIFEST_FILE), 10);
        write(&root.join("img1/checkpoint/pages-1.img"), 4096);
        write(&root.join("img1/checkpoint/inner.tar"), 50);
        // Not checkpoints: a directory without a manifest, a stray file.
        write(&root.join("partial/pages-1.img"), 999);
        write(&root.join("notes.txt"), 5);
        // A link to a checkpoint outside: neither counted nor followed.
        write(&t.path().join("outside/big.tar"), 1 << 20);
        write(&t.path().join("outside2").join(MANIFEST_FILE), 1);
        std::os::unix::fs::symlink(t.path().join("outside/big.tar"), root.join("link.tar"))
            .unwrap();
        std::os::unix::fs::symlink(t.path().join("outside2"), root.join("linkdir")).unwrap();
        let u = scan(&[&root, &t.path().join("missing")]);
        assert_eq!(u.checkpoints, 3, "{u:?}");
        assert_eq!(u.bytes, 1000 + 200 + 10 + 4096 + 50, "{u:?}");
        assert!(!u.truncated);
        // A link given as the directory itself is not entered.
        std::os::unix::fs::symlink(&root, t.path().join("rootlink")).unwrap();
        assert_eq!(scan(&[t.path().join("rootlink")]), DiskUsage::default());
    }

    #[test]
    fn the_walk_is_bounded() {
        let t = tempfile::tempdir().unwrap();
        for i in 0..50 {
            write(&t.path().join(format!("a{i}.tar")), 1);
        }
        let u = scan_bounded(&[t.path()], 10);
        assert!(u.truncated);
        assert!(u.checkpoints <= 10, "{u:?}");
    }
}
