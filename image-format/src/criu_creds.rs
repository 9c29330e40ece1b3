//! What CRIU will restore each task as: the credentials and seccomp state it recorded in a
//! checkpoint's `core-<pid>.img` and `seccomp.img`.
//!
//! CRIU restores every task's uids, gids, groups, capability sets, secure bits, no_new_privs,
//! LSM label and seccomp filters from these images, not from the new container's spec
//! (reference/checkpoint-formats.md). Reading them lets a restore refuse a checkpoint whose
//! tasks would run beyond the new spec before CRIU starts.
//!
//! Layout (CRIU's `images/core.proto`, `creds.proto`, `seccomp.proto`): a `core-<pid>.img` per
//! thread is CRIU's common magic, `CORE_MAGIC`, then one size-prefixed `core_entry`. Its field 3
//! (`task_core_entry`, the thread-group leader only) has the `comm` (6) and the task state (1);
//! field 5 (`thread_core_entry`) has `creds` (10), `seccomp_mode` (11), `seccomp_filter` (12)
//! and the thread's `comm` (13). `creds_entry`: uid, gid, euid, egid, suid, sgid, fsuid, fsgid
//! (1-8), cap_inh, cap_prm, cap_eff, cap_bnd (9-12, two 32-bit words each), secbits (13),
//! groups (14), lsm_profile (15), no_new_privs (18), cap_amb (19). `seccomp.img` holds one
//! `seccomp_entry`: its repeated field 1 are `seccomp_filter`s (filter bytes 1, prev 2); a
//! thread's `seccomp_filter` is the index of one filter of its chain, linked through `prev`.
//!
//! Nothing here panics on hostile input: a malformed image is an error naming the file.

use std::path::Path;

use crate::criu_stats::first_entry;
use crate::error::{Error, Result};
use crate::protowire::{bytes_field, fields, varint, varint_field, Value};

/// CRIU's magic words (`criu/include/magic.h`).
const IMG_COMMON_MAGIC: u32 = 0x5456_4319;
const CORE_MAGIC: u32 = 0x5505_3847;
const SECCOMP_MAGIC: u32 = 0x6441_3049;
/// The largest core or seccomp image read (they are a few KiB).
const MAX_IMAGE_BYTES: u64 = 16 << 20;
/// The most threads a checkpoint's pre-check reads.
const MAX_TASKS: usize = 1 << 16;

/// `seccomp_mode` values (`SECCOMP_MODE_*`).
pub const SECCOMP_MODE_DISABLED: u32 = 0;
pub const SECCOMP_MODE_FILTER: u32 = 2;

/// One thread as CRIU recorded it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TaskRecord {
    /// The image file (`core-<pid>.img`).
    pub file: String,
    /// The thread id inside the checkpointed container (from the file name).
    pub pid: u32,
    pub comm: String,
    /// Credentials; `None` for a task CRIU restores without them (a zombie).
    pub creds: Option<Creds>,
    /// `SECCOMP_MODE_*`.
    pub seccomp_mode: u32,
    /// Index of the thread's filter chain in `seccomp.img`.
    pub seccomp_filter: Option<u32>,
}

/// A thread's credentials as CRIU restores them (ids as seen in the task's user namespace).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Creds {
    /// Real, effective, saved, filesystem.
    pub uids: [u32; 4],
    pub gids: [u32; 4],
    pub groups: Vec<u32>,
    pub cap_inh: u64,
    pub cap_prm: u64,
    pub cap_eff: u64,
    pub cap_bnd: u64,
    pub cap_amb: u64,
    pub secbits: u32,
    pub no_new_privs: bool,
    pub lsm_profile: Option<String>,
}

/// Every `core-<pid>.img` of a CRIU image directory, ordered by pid.
pub fn read_tasks(dir: &Path) -> Result<Vec<TaskRecord>> {
    let entries = std::fs::read_dir(dir).map_err(|e| Error::io("list", dir, e))?;
    let mut out = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| Error::io("list", dir, e))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix("core-")
            .and_then(|n| n.strip_suffix(".img"))
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        if out.len() >= MAX_TASKS {
            return Err(bad(&name, format!("more than {MAX_TASKS} tasks")));
        }
        let data = read_image(&dir.join(&name), &name)?;
        out.push(parse_core(&data, &name, pid)?);
    }
    out.sort_by_key(|t| t.pid);
    Ok(out)
}

/// The filters of `seccomp.img`, or an empty list when the checkpoint has none.
pub fn read_seccomp(dir: &Path) -> Result<SeccompFilters> {
    let path = dir.join("seccomp.img");
    if !path.exists() {
        return Ok(SeccompFilters::default());
    }
    let data = read_image(&path, "seccomp.img")?;
    parse_seccomp(&data, "seccomp.img")
}

/// The filters of a `seccomp.img`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SeccompFilters {
    /// (BPF program bytes, `prev` index).
    pub filters: Vec<(Vec<u8>, Option<u32>)>,
}

impl SeccompFilters {
    /// The filters of the chain that starts at `index`, in the order the links give; `None`
    /// when an index is out of range or the links loop.
    pub fn chain(&self, index: u32) -> Option<Vec<&[u8]>> {
        let mut out = Vec::new();
        let mut at = Some(index);
        while let Some(i) = at {
            let (bytes, prev) = self.filters.get(i as usize)?;
            if out.len() >= self.filters.len() {
                return None;
            }
            out.push(bytes.as_slice());
            at = *prev;
        }
        Some(out)
    }
}

pub(crate) fn read_image(path: &Path, name: &str) -> Result<Vec<u8>> {
    let meta = std::fs::symlink_metadata(path).map_err(|e| Error::io("stat", path, e))?;
    if !meta.is_file() {
        return Err(bad(name, "not a regular file".into()));
    }
    if meta.len() > MAX_IMAGE_BYTES {
        return Err(bad(name, format!("larger than {MAX_IMAGE_BYTES} bytes")));
    }
    std::fs::read(path).map_err(|e| Error::io("read", path, e))
}

pub(crate) fn bad(name: &str, reason: String) -> Error {
    Error::InvalidField {
        what: name.to_string(),
        field: "CRIU image".into(),
        reason,
    }
}

pub(crate) fn check_magic(data: &[u8], name: &str, magic: u32) -> Result<()> {
    let word = |i: usize| {
        data.get(4 * i..4 * i + 4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    };
    if word(0) != Some(IMG_COMMON_MAGIC) || word(1) != Some(magic) {
        return Err(bad(name, "wrong magic".into()));
    }
    Ok(())
}

/// Parses one `core-<pid>.img`.
pub fn parse_core(data: &[u8], name: &str, pid: u32) -> Result<TaskRecord> {
    check_magic(data, name, CORE_MAGIC)?;
    let entry = first_entry(data, 2).map_err(|e| bad(name, e.into()))?;
    let core = fields(entry).ok_or_else(|| bad(name, "malformed core entry".into()))?;
    let malformed = |what: &str| bad(name, format!("malformed {what}"));
    let tc = match bytes_field(&core, 3) {
        Some(b) => Some(fields(b).ok_or_else(|| malformed("task core"))?),
        None => None,
    };
    let thread = match bytes_field(&core, 5) {
        Some(b) => Some(fields(b).ok_or_else(|| malformed("thread core"))?),
        None => None,
    };
    let mut rec = TaskRecord {
        file: name.to_string(),
        pid,
        ..Default::default()
    };
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    if let Some(comm) = thread.as_ref().and_then(|t| bytes_field(t, 13)) {
        rec.comm = text(comm);
    } else if let Some(comm) = tc.as_ref().and_then(|t| bytes_field(t, 6)) {
        rec.comm = text(comm);
    }
    // The thread's seccomp state, else the old per-task fields (`old_seccomp_*`).
    let (mode, filter) = match &thread {
        Some(t) if varint_field(t, 11).is_some() => (varint_field(t, 11), varint_field(t, 12)),
        _ => (
            tc.as_ref().and_then(|t| varint_field(t, 11)),
            tc.as_ref().and_then(|t| varint_field(t, 12)),
        ),
    };
    rec.seccomp_mode = u32::try_from(mode.unwrap_or(0)).map_err(|_| malformed("seccomp mode"))?;
    rec.seccomp_filter = filter
        .map(u32::try_from)
        .transpose()
        .map_err(|_| malformed("seccomp filter"))?;
    if let Some(creds) = thread.as_ref().and_then(|t| bytes_field(t, 10)) {
        rec.creds = Some(parse_creds(creds).ok_or_else(|| malformed("creds"))?);
    }
    Ok(rec)
}

fn parse_creds(msg: &[u8]) -> Option<Creds> {
    let f = fields(msg)?;
    let id = |n: u64| varint_field(&f, n).and_then(|v| u32::try_from(v).ok());
    let caps = |n: u64| -> Option<u64> {
        let words = repeated_u32(&f, n)?;
        if words.len() > 2 {
            return None;
        }
        Some(
            words
                .iter()
                .enumerate()
                .fold(0u64, |acc, (i, w)| acc | (u64::from(*w) << (32 * i))),
        )
    };
    Some(Creds {
        uids: [id(1)?, id(3)?, id(5)?, id(7)?],
        gids: [id(2)?, id(4)?, id(6)?, id(8)?],
        cap_inh: caps(9)?,
        cap_prm: caps(10)?,
        cap_eff: caps(11)?,
        cap_bnd: caps(12)?,
        secbits: id(13).unwrap_or(0),
        groups: repeated_u32(&f, 14)?,
        lsm_profile: bytes_field(&f, 15).map(|b| String::from_utf8_lossy(b).into_owned()),
        no_new_privs: varint_field(&f, 18).unwrap_or(0) != 0,
        cap_amb: caps(19)?,
    })
}

/// Every value of the repeated uint32 field `n`, packed or not.
fn repeated_u32(f: &[(u64, Value<'_>)], n: u64) -> Option<Vec<u32>> {
    let mut out = Vec::new();
    for (k, v) in f {
        if *k != n {
            continue;
        }
        match v {
            Value::Varint(x) => out.push(u32::try_from(*x).ok()?),
            Value::Bytes(packed) => {
                let mut rest: &[u8] = packed;
                while !rest.is_empty() {
                    let (x, used) = varint(rest)?;
                    out.push(u32::try_from(x).ok()?);
                    rest = &rest[used..];
                }
            }
        }
        if out.len() > 1 << 16 {
            return None;
        }
    }
    Some(out)
}

/// Parses a `seccomp.img`.
pub fn parse_seccomp(data: &[u8], name: &str) -> Result<SeccompFilters> {
    check_magic(data, name, SECCOMP_MAGIC)?;
    let entry = first_entry(data, 2).map_err(|e| bad(name, e.into()))?;
    let f = fields(entry).ok_or_else(|| bad(name, "malformed seccomp entry".into()))?;
    let mut out = SeccompFilters::default();
    for (k, v) in &f {
        let (1, Value::Bytes(b)) = (k, v) else {
            continue;
        };
        let filter = fields(b).ok_or_else(|| bad(name, "malformed seccomp filter".into()))?;
        let bytes = bytes_field(&filter, 1)
            .ok_or_else(|| bad(name, "seccomp filter without a program".into()))?;
        let prev = varint_field(&filter, 2)
            .map(u32::try_from)
            .transpose()
            .map_err(|_| bad(name, "seccomp filter link out of range".into()))?;
        out.filters.push((bytes.to_vec(), prev));
    }
    Ok(out)
}

/// Builders of CRIU images as CRIU writes them, for tests here and in the shim.
#[doc(hidden)]
pub mod test_images {
    use super::{CORE_MAGIC, IMG_COMMON_MAGIC, SECCOMP_MAGIC};
    use crate::protowire::put_varint;

    fn varint_f(out: &mut Vec<u8>, n: u64, v: u64) {
        put_varint(out, n << 3);
        put_varint(out, v);
    }

    fn bytes_f(out: &mut Vec<u8>, n: u64, b: &[u8]) {
        put_varint(out, (n << 3) | 2);
        put_varint(out, b.len() as u64);
        out.extend_from_slice(b);
    }

    fn image(magic: u32, entry: &[u8]) -> Vec<u8> {
        let mut file = IMG_COMMON_MAGIC.to_le_bytes().to_vec();
        file.extend_from_slice(&magic.to_le_bytes());
        file.extend_from_slice(&(entry.len() as u32).to_le_bytes());
        file.extend_from_slice(entry);
        file
    }

    /// A core image as CRIU writes it: caps as unpacked repeated words, `packed` for the
    /// groups to show both encodings are read.
    pub fn core_image(uid: u32, cap_bnd: u64, nnp: bool, seccomp: Option<u32>) -> Vec<u8> {
        core_image_with_caps(uid, cap_bnd, cap_bnd, &[10, 1000], nnp, seccomp)
    }

    /// [`core_image`] with permitted and effective `cap_prm` (the bounding set `cap_bnd`) and
    /// the supplementary groups `groups`.
    pub fn core_image_with_caps(
        uid: u32,
        cap_prm: u64,
        cap_bnd: u64,
        groups: &[u32],
        nnp: bool,
        seccomp: Option<u32>,
    ) -> Vec<u8> {
        let mut creds = Vec::new();
        for (n, v) in [(1, uid), (2, uid), (3, uid), (4, uid), (5, uid), (6, uid)] {
            varint_f(&mut creds, n, v.into());
        }
        varint_f(&mut creds, 7, uid.into());
        varint_f(&mut creds, 8, uid.into());
        for n in [9u64, 10, 11, 12] {
            let v = match n {
                9 => 0,
                12 => cap_bnd,
                _ => cap_prm,
            };
            varint_f(&mut creds, n, v & 0xffff_ffff);
            varint_f(&mut creds, n, v >> 32);
        }
        varint_f(&mut creds, 13, 0);
        let mut packed = Vec::new();
        for g in groups {
            put_varint(&mut packed, (*g).into());
        }
        bytes_f(&mut creds, 14, &packed);
        if nnp {
            varint_f(&mut creds, 18, 1);
        }
        varint_f(&mut creds, 19, 0);
        varint_f(&mut creds, 19, 0);
        let mut thread = Vec::new();
        varint_f(&mut thread, 1, 0);
        bytes_f(&mut thread, 10, &creds);
        if let Some(f) = seccomp {
            varint_f(&mut thread, 11, 2);
            varint_f(&mut thread, 12, f.into());
        }
        bytes_f(&mut thread, 13, b"counter");
        let mut tc = Vec::new();
        varint_f(&mut tc, 1, 1);
        bytes_f(&mut tc, 6, b"counter");
        let mut core = Vec::new();
        varint_f(&mut core, 1, 1);
        bytes_f(&mut core, 3, &tc);
        bytes_f(&mut core, 5, &thread);
        image(CORE_MAGIC, &core)
    }

    pub fn seccomp_image(filters: &[(&[u8], Option<u32>)]) -> Vec<u8> {
        let mut entry = Vec::new();
        for (bytes, prev) in filters {
            let mut f = Vec::new();
            bytes_f(&mut f, 1, bytes);
            if let Some(p) = prev {
                varint_f(&mut f, 2, (*p).into());
            }
            bytes_f(&mut entry, 1, &f);
        }
        image(SECCOMP_MAGIC, &entry)
    }
}

#[cfg(test)]
mod tests {
    use super::test_images::*;
    use super::*;

    #[test]
    fn creds_and_seccomp_are_read() {
        let data = core_image(1000, 0xa804_25fb, true, Some(1));
        let t = parse_core(&data, "core-1.img", 1).unwrap();
        assert_eq!(t.comm, "counter");
        assert_eq!(t.seccomp_mode, SECCOMP_MODE_FILTER);
        assert_eq!(t.seccomp_filter, Some(1));
        let c = t.creds.unwrap();
        assert_eq!(c.uids, [1000; 4]);
        assert_eq!(c.gids, [1000; 4]);
        assert_eq!(c.groups, vec![10, 1000]);
        assert_eq!(c.cap_bnd, 0xa804_25fb);
        assert_eq!(c.cap_inh, 0);
        assert!(c.no_new_privs);

        let root = parse_core(&core_image(0, 0x1_ffff_ffff, false, None), "core-7.img", 7);
        let root = root.unwrap();
        assert_eq!(root.seccomp_mode, SECCOMP_MODE_DISABLED);
        assert_eq!(root.creds.unwrap().cap_bnd, 0x1_ffff_ffff);
    }

    #[test]
    fn malformed_images_are_errors_not_panics() {
        let data = core_image(1000, 0xa804_25fb, true, Some(0));
        for cut in 0..data.len() {
            let _ = parse_core(&data[..cut], "core-1.img", 1);
        }
        assert!(parse_core(&data[..data.len() - 3], "core-1.img", 1).is_err());
        let mut wrong = data.clone();
        wrong[4] ^= 1;
        let err = parse_core(&wrong, "core-1.img", 1).unwrap_err().to_string();
        assert!(err.contains("core-1.img") && err.contains("magic"), "{err}");
    }

    #[test]
    fn seccomp_chains_follow_their_links() {
        let data = seccomp_image(&[(b"newest", None), (b"oldest", Some(0)), (b"other", None)]);
        let s = parse_seccomp(&data, "seccomp.img").unwrap();
        assert_eq!(s.chain(1).unwrap(), vec![&b"oldest"[..], &b"newest"[..]]);
        assert_eq!(s.chain(2).unwrap().len(), 1);
        assert!(s.chain(3).is_none());
        let looped = seccomp_image(&[(b"a", Some(1)), (b"b", Some(0))]);
        assert!(parse_seccomp(&looped, "seccomp.img")
            .unwrap()
            .chain(0)
            .is_none());
    }

    #[test]
    fn a_directory_is_read_in_pid_order() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("core-12.img"),
            core_image(0, 1, false, None),
        )
        .unwrap();
        std::fs::write(dir.path().join("core-1.img"), core_image(0, 1, false, None)).unwrap();
        std::fs::write(dir.path().join("core-x.img"), b"ignored").unwrap();
        std::fs::write(dir.path().join("pstree.img"), b"ignored").unwrap();
        let t = read_tasks(dir.path()).unwrap();
        assert_eq!(t.iter().map(|t| t.pid).collect::<Vec<_>>(), vec![1, 12]);
        assert!(read_seccomp(dir.path()).unwrap().filters.is_empty());
    }
}
