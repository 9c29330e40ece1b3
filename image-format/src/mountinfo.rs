//! Mount tables: the kernel's (`/proc/<pid>/mountinfo`) and the one CRIU recorded in a
//! checkpoint (`mountpoints-<id>.img`).
//!
//! The kernel's table is what a restore is held to at `pre-resume`; CRIU's is what it will
//! restore, read before CRIU starts. Both give mountpoints relative to the task's root.
//!
//! `mountpoints-<id>.img` (CRIU's `images/mnt.proto`): CRIU's common magic, `MNTS_MAGIC`, then
//! size-prefixed `mnt_entry` messages: fstype (1), mnt_id (2), root_dev (3), parent_mnt_id (4),
//! flags (5, `MS_*`), root (6), mountpoint (7, relative to the root, starting with `/` or
//! `./`), source (8), options (9), ext_mount (15), ext_key (20).
//!
//! Nothing here panics on hostile input: a malformed table is an error naming the file.

use std::path::Path;

use crate::criu_creds::{bad, check_magic, read_image};
use crate::error::{Error, Result};
use crate::protowire::{bytes_field, fields, varint_field};

/// CRIU's magic for mount images (`criu/include/magic.h`).
const MNTS_MAGIC: u32 = 0x5556_3928;
/// The most mounts read from one image.
const MAX_MOUNTS: usize = 1 << 16;

/// One line of a mountinfo table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountInfo {
    pub id: u32,
    pub parent: u32,
    /// `major:minor` of the filesystem.
    pub dev: String,
    /// The mount's root within its filesystem.
    pub root: String,
    /// Where it is mounted, relative to the reading task's root, normalized.
    pub mountpoint: String,
    /// Per-mount options (`rw`/`ro`, `nosuid`, `nodev`, `noexec`, atime options).
    pub options: Vec<String>,
    pub fstype: String,
    pub source: String,
    /// Per-superblock options, each unescaped (overlay's `upperdir=…`).
    pub super_options: Vec<String>,
}

impl MountInfo {
    /// Whether the per-mount options include `opt` (`ro`, `nosuid`, ...).
    pub fn has(&self, opt: &str) -> bool {
        self.options.iter().any(|o| o == opt)
    }
}

/// mountinfo's octal escapes (`\040` for a space, `\011`, `\012`, `\134`) undone.
pub fn unescape(field: &str) -> String {
    let b = field.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 4 <= b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            let v = u32::from(b[i + 1] - b'0') * 64
                + u32::from(b[i + 2] - b'0') * 8
                + u32::from(b[i + 3] - b'0');
            if let Ok(v) = u8::try_from(v) {
                out.push(v);
                i += 4;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// `/a//b/`, `./a/b` → `/a/b`; `.`, `./`, `` → `/`.
pub fn normalize(path: &str) -> String {
    let parts: Vec<&str> = path
        .split('/')
        .filter(|p| !p.is_empty() && *p != ".")
        .collect();
    format!("/{}", parts.join("/"))
}

/// Parses a mountinfo text (`what` names it in errors), in the kernel's order.
pub fn parse(text: &str, what: &str) -> Result<Vec<MountInfo>> {
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            parse_line(l).ok_or_else(|| Error::InvalidField {
                what: what.to_string(),
                field: "mountinfo".into(),
                reason: format!("malformed line {l:?}"),
            })
        })
        .collect()
}

/// One mountinfo line: `id parent major:minor root mountpoint options [optional...] - fstype
/// source super-options`.
fn parse_line(line: &str) -> Option<MountInfo> {
    let fields: Vec<&str> = line.split(' ').collect();
    let sep = fields.iter().position(|f| *f == "-")?;
    if sep < 6 {
        return None;
    }
    Some(MountInfo {
        id: fields[0].parse().ok()?,
        parent: fields[1].parse().ok()?,
        dev: fields[2].to_string(),
        root: unescape(fields[3]),
        mountpoint: normalize(&unescape(fields[4])),
        options: fields[5].split(',').map(str::to_string).collect(),
        fstype: fields
            .get(sep + 1)
            .filter(|f| !f.is_empty())
            .map(|f| unescape(f))?,
        source: fields.get(sep + 2).map(|f| unescape(f)).unwrap_or_default(),
        super_options: fields
            .get(sep + 3)
            .map(|f| f.split(',').map(unescape).collect())
            .unwrap_or_default(),
    })
}

/// One mount as CRIU recorded it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CriuMount {
    /// The image file (`mountpoints-<id>.img`).
    pub file: String,
    pub mnt_id: u32,
    /// Relative to the task's root, normalized.
    pub mountpoint: String,
    /// `MS_*` flags.
    pub flags: u64,
    pub root: String,
    pub source: String,
    /// Restored from a path outside the checkpoint (`ext-mount-map`).
    pub external: bool,
}

/// Every mount of every `mountpoints-<id>.img` of a CRIU image directory.
pub fn read_criu_mounts(dir: &Path) -> Result<Vec<CriuMount>> {
    let entries = std::fs::read_dir(dir).map_err(|e| Error::io("list", dir, e))?;
    let mut names: Vec<String> = entries
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("mountpoints-") && n.ends_with(".img"))
        .collect();
    names.sort();
    let mut out = Vec::new();
    for name in names {
        let data = read_image(&dir.join(&name), &name)?;
        out.extend(parse_criu_mounts(&data, &name)?);
        if out.len() > MAX_MOUNTS {
            return Err(bad(&name, format!("more than {MAX_MOUNTS} mounts")));
        }
    }
    Ok(out)
}

/// Parses one `mountpoints-<id>.img`.
pub fn parse_criu_mounts(data: &[u8], name: &str) -> Result<Vec<CriuMount>> {
    check_magic(data, name, MNTS_MAGIC)?;
    let mut out = Vec::new();
    let mut rest = &data[8..];
    while !rest.is_empty() {
        let len = rest
            .get(..4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
            .ok_or_else(|| bad(name, "truncated entry size".into()))?;
        let entry = rest
            .get(4..4 + len)
            .ok_or_else(|| bad(name, "entry shorter than its size".into()))?;
        rest = &rest[4 + len..];
        let f = fields(entry).ok_or_else(|| bad(name, "malformed mount entry".into()))?;
        let text = |n: u64| {
            bytes_field(&f, n)
                .map(|b| String::from_utf8_lossy(b).into_owned())
                .unwrap_or_default()
        };
        let mountpoint = bytes_field(&f, 7)
            .ok_or_else(|| bad(name, "a mount entry without a mountpoint".into()))?;
        out.push(CriuMount {
            file: name.to_string(),
            mnt_id: varint_field(&f, 2).unwrap_or(0) as u32,
            mountpoint: normalize(&String::from_utf8_lossy(mountpoint)),
            flags: varint_field(&f, 5).unwrap_or(0),
            root: text(6),
            source: text(8),
            external: varint_field(&f, 15).unwrap_or(0) != 0 || bytes_field(&f, 20).is_some(),
        });
        if out.len() > MAX_MOUNTS {
            return Err(bad(name, format!("more than {MAX_MOUNTS} mounts")));
        }
    }
    Ok(out)
}

/// A `mountpoints-<id>.img` as CRIU writes it, for tests here and in the shim.
#[doc(hidden)]
pub mod test_images {
    use super::MNTS_MAGIC;
    use crate::protowire::put_varint;

    fn field(out: &mut Vec<u8>, n: u64, bytes: &[u8]) {
        put_varint(out, n << 3 | 2);
        put_varint(out, bytes.len() as u64);
        out.extend_from_slice(bytes);
    }

    /// One entry per (mountpoint, `MS_*` flags).
    pub fn mounts_image(mounts: &[(&str, u64)]) -> Vec<u8> {
        let mut data = Vec::new();
        data.extend_from_slice(&0x5456_4319u32.to_le_bytes());
        data.extend_from_slice(&MNTS_MAGIC.to_le_bytes());
        for (i, (mp, flags)) in mounts.iter().enumerate() {
            let mut e = Vec::new();
            put_varint(&mut e, 2 << 3);
            put_varint(&mut e, i as u64 + 1);
            put_varint(&mut e, 5 << 3);
            put_varint(&mut e, *flags);
            field(&mut e, 6, b"/");
            field(&mut e, 7, mp.as_bytes());
            field(&mut e, 8, b"none");
            data.extend_from_slice(&(e.len() as u32).to_le_bytes());
            data.extend_from_slice(&e);
        }
        data
    }
}

#[cfg(test)]
mod tests {
    use super::test_images::mounts_image as image;
    use super::*;

    #[test]
    fn unescapes_and_normalizes() {
        assert_eq!(unescape("/a\\040b"), "/a b");
        assert_eq!(unescape("/a\\040"), "/a ");
        assert_eq!(unescape("/plain"), "/plain");
        assert_eq!(unescape("/x\\"), "/x\\");
        assert_eq!(unescape("/x\\09"), "/x\\09");
        assert_eq!(normalize("./data/"), "/data");
        assert_eq!(normalize("./"), "/");
        assert_eq!(normalize("/a//b"), "/a/b");
    }

    #[test]
    fn parses_mountinfo_lines() {
        let text = "\
600 500 0:50 / / ro,relatime - overlay overlay rw,lowerdir=/l,upperdir=/u\\054p\\040x
605 600 8:1 /tmp/with\\040space /data rw,nosuid,nodev shared:5 master:2 - ext4 /dev/sda1 rw
";
        let m = parse(text, "t").unwrap();
        assert_eq!(m.len(), 2);
        assert!(m[0].has("ro") && m[0].mountpoint == "/" && m[0].fstype == "overlay");
        assert_eq!(m[0].super_options, ["rw", "lowerdir=/l", "upperdir=/u,p x"]);
        assert_eq!(m[1].root, "/tmp/with space");
        assert_eq!(m[1].mountpoint, "/data");
        assert!(m[1].has("nosuid") && m[1].has("nodev") && !m[1].has("ro"));
        assert_eq!(
            (m[1].fstype.as_str(), m[1].source.as_str()),
            ("ext4", "/dev/sda1")
        );
        assert!(parse("600 500 0:50", "t").is_err());
        assert!(parse("600 500 0:50 / / rw - ", "t").is_err());
    }

    #[test]
    fn reads_criu_mount_images() {
        let data = image(&[("./", 1), ("./data", 0), ("/proc", 14)]);
        let m = parse_criu_mounts(&data, "mountpoints-12.img").unwrap();
        let got: Vec<_> = m.iter().map(|m| (m.mountpoint.as_str(), m.flags)).collect();
        assert_eq!(got, [("/", 1), ("/data", 0), ("/proc", 14)]);
        // Truncated, wrong magic: errors, no panic.
        for n in 0..data.len() {
            let _ = parse_criu_mounts(&data[..n], "x");
        }
        assert!(parse_criu_mounts(&data[..data.len() - 1], "x").is_err());
        let mut wrong = data.clone();
        wrong[4] ^= 1;
        assert!(parse_criu_mounts(&wrong, "x").is_err());
        let t = tempfile::tempdir().unwrap();
        std::fs::write(t.path().join("mountpoints-12.img"), &data).unwrap();
        assert_eq!(read_criu_mounts(t.path()).unwrap().len(), 3);
    }
}
