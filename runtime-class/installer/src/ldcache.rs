//! The dynamic loader's cache (`/etc/ld.so.cache`) of another root: which file a library name
//! stands for there, for this machine's architecture. Read as glibc's `ldconfig` writes it
//! (the "glibc-ld.so.cache1.1" format, alone or after the old "ld.so-1.7.0" table): a
//! 48-byte header, 24-byte entries, and string offsets counted from the header's start.
//!
//! By hand because the installer needs only this lookup, and the crates that parse the cache
//! are single-release ones.

const MAGIC: &[u8] = b"glibc-ld.so.cache1.1";
const HEADER: usize = 48;
const ENTRY: usize = 24;

/// An ELF library for glibc (`FLAG_ELF_LIBC6`), in the low byte of an entry's flags.
const FLAG_ELF_LIBC6: i32 = 0x0003;
const FLAG_TYPE_MASK: i32 = 0x00ff;
const FLAG_ARCH_MASK: i32 = 0xff00;

/// The architecture flag of a 64-bit library of this machine (ldconfig's `FLAG_X8664_LIB64`,
/// `FLAG_AARCH64_LIB64`).
#[cfg(target_arch = "x86_64")]
const FLAG_ARCH: i32 = 0x0300;
#[cfg(target_arch = "aarch64")]
const FLAG_ARCH: i32 = 0x0a00;
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
const FLAG_ARCH: i32 = 0x0000;

fn u32_at(d: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(d.get(at..at + 4)?.try_into().ok()?))
}

fn str_at(d: &[u8], at: usize) -> Option<&str> {
    let rest = d.get(at..)?;
    let end = rest.iter().position(|b| *b == 0)?;
    std::str::from_utf8(&rest[..end]).ok()
}

/// The paths the cache `data` gives for library `name` (a soname such as
/// `libnvidia-ml.so.1`), for this machine's architecture, in the cache's order. Empty when
/// the cache is not one this reader knows (the caller then searches directories).
pub fn lookup(data: &[u8], name: &str) -> Vec<String> {
    let Some(base) = data.windows(MAGIC.len()).position(|w| w == MAGIC) else {
        return Vec::new();
    };
    let d = &data[base..];
    let Some(count) = u32_at(d, MAGIC.len()) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for i in 0..count as usize {
        let at = HEADER + i * ENTRY;
        let (Some(flags), Some(key), Some(value)) =
            (u32_at(d, at), u32_at(d, at + 4), u32_at(d, at + 8))
        else {
            break;
        };
        let flags = flags as i32;
        if flags & FLAG_TYPE_MASK != FLAG_ELF_LIBC6 || flags & FLAG_ARCH_MASK != FLAG_ARCH {
            continue;
        }
        if str_at(d, key as usize) == Some(name) {
            if let Some(v) = str_at(d, value as usize) {
                out.push(v.to_string());
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A cache as ldconfig writes it, with `entries` (flags, key, value).
    fn cache(entries: &[(i32, &str, &str)], old_table_first: bool) -> Vec<u8> {
        let mut strings = Vec::new();
        let strings_at = HEADER + entries.len() * ENTRY;
        let mut table = Vec::new();
        for (flags, k, v) in entries {
            let key = strings_at + strings.len();
            strings.extend_from_slice(k.as_bytes());
            strings.push(0);
            let value = strings_at + strings.len();
            strings.extend_from_slice(v.as_bytes());
            strings.push(0);
            table.extend_from_slice(&flags.to_le_bytes());
            table.extend_from_slice(&(key as u32).to_le_bytes());
            table.extend_from_slice(&(value as u32).to_le_bytes());
            table.extend_from_slice(&[0u8; 12]);
        }
        let mut out = Vec::new();
        if old_table_first {
            out.extend_from_slice(b"ld.so-1.7.0\0");
            out.extend_from_slice(&0u32.to_le_bytes());
        }
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&(entries.len() as u32).to_le_bytes());
        out.extend_from_slice(&(strings.len() as u32).to_le_bytes());
        out.resize(out.len() + HEADER - MAGIC.len() - 8, 0);
        out.extend_from_slice(&table);
        out.extend_from_slice(&strings);
        out
    }

    #[test]
    fn finds_the_library_of_this_architecture() {
        let lib = FLAG_ELF_LIBC6 | FLAG_ARCH;
        let other_arch = FLAG_ELF_LIBC6 | 0x0800;
        for old in [false, true] {
            let c = cache(
                &[
                    (lib, "libz.so.1", "/lib/libz.so.1"),
                    (
                        other_arch,
                        "libnvidia-ml.so.1",
                        "/usr/lib32/libnvidia-ml.so.1",
                    ),
                    (lib, "libnvidia-ml.so.1", "/usr/lib64/libnvidia-ml.so.1"),
                ],
                old,
            );
            assert_eq!(
                lookup(&c, "libnvidia-ml.so.1"),
                ["/usr/lib64/libnvidia-ml.so.1"]
            );
            assert!(lookup(&c, "libcuda.so.1").is_empty());
        }
        assert!(lookup(b"not a cache", "libz.so.1").is_empty());
        // Cut short: what is there is read, nothing past the end.
        let c = cache(&[(lib, "libz.so.1", "/lib/libz.so.1")], false);
        assert!(lookup(&c[..HEADER + 10], "libz.so.1").is_empty());
    }

    #[test]
    fn reads_this_machines_cache() {
        // The machine's own cache, as ldconfig wrote it: libc is in it, at a file that exists.
        let Ok(data) = std::fs::read("/etc/ld.so.cache") else {
            panic!("this machine has no /etc/ld.so.cache");
        };
        let found = lookup(&data, "libc.so.6");
        assert!(!found.is_empty(), "libc.so.6 is not in /etc/ld.so.cache");
        for p in found {
            assert!(std::path::Path::new(&p).exists(), "{p}");
        }
    }
}
