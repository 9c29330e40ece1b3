//! The NVIDIA driver's user-space files a GPU process maps: which files they are, and their GNU
//! build id.
//!
//! A CUDA process maps `libcuda.so.<full driver version>` and sibling libraries from the host
//! (nvidia-container-toolkit bind-mounts them at the same path in the container). CRIU restores
//! a file mapping by its path and checks the file it finds there, so a checkpoint restores only
//! where the container gets the same files; `compat::driver_file_differences` is that rule, over
//! what the manifest's `DriverFile` records.
//!
//! The build id is read here by hand, from the ELF program headers' `PT_NOTE` segments, with every
//! offset and size bounded by the file's: the one ELF note is all that is needed, and the ELF
//! crates (`object`, `goblin`) would add a parser of every other ELF structure to every crate.

use std::io::{self, Read, Seek, SeekFrom};

/// Name prefixes of the driver's user-space libraries (nvidia-container-toolkit's list of the
/// driver's libraries: compute, NVML, debugger, video, OptiX, graphics). A driver file's name is
/// one of these followed by its version, `libcuda.so.580.65.06`, `libnvidia-ml.so.580.65.06`.
pub const DRIVER_FILE_PREFIXES: &[&str] = &[
    "libcuda.so.",
    "libcudadebugger.so.",
    "libnvidia-",
    "libnvcuvid.so.",
    "libnvoptix.so.",
    "libGLX_nvidia.so.",
    "libEGL_nvidia.so.",
    "libGLESv2_nvidia.so.",
    "libGLESv1_CM_nvidia.so.",
    "libvdpau_nvidia.so.",
];

/// Whether `path` (a mapped file's path) names one of the driver's user-space libraries.
pub fn is_driver_file(path: &str) -> bool {
    let name = path.rsplit('/').next().unwrap_or(path);
    DRIVER_FILE_PREFIXES.iter().any(|p| name.starts_with(p)) && name.contains(".so.")
}

/// The version a driver file's name carries (`580.65.06` of `libcuda.so.580.65.06`); `None` for
/// a name without one (`libcuda.so.1` is the loader's link, not the driver's file).
pub fn version_of(path: &str) -> Option<&str> {
    let name = path.rsplit('/').next().unwrap_or(path);
    let (_, v) = name.split_once(".so.")?;
    (v.matches('.').count() >= 1 && v.chars().all(|c| c.is_ascii_digit() || c == '.')).then_some(v)
}

/// The name a driver file has under another driver version: `libcuda.so.580.65.07` for
/// `libcuda.so.580.65.06` and `580.65.07` (the driver names every file by its full version).
pub fn name_under(path: &str, version: &str) -> Option<String> {
    let name = path.rsplit('/').next().unwrap_or(path);
    let (stem, _) = name.split_once(".so.")?;
    version_of(path)?;
    Some(format!("{stem}.so.{version}"))
}

/// Most bytes read from one file: its ELF header, the program headers looked at and its note
/// segments together. A build id note is 36 bytes and a library's note segments a few hundred;
/// a file that needs more is refused, so that a hostile ELF costs a few reads, not gigabytes.
pub const MAX_READ_BYTES: u64 = 64 << 10;
/// Most program headers looked at (a shared library has about ten).
const MAX_PHDRS: u64 = 256;
const PT_NOTE: u32 = 4;
const NT_GNU_BUILD_ID: u32 = 3;

/// The GNU build id (`NT_GNU_BUILD_ID`) of the ELF file `f`, as lower-case hex; `None` when `f`
/// is an ELF file without one. An error when `f` is not an ELF file, its headers point outside
/// it, or finding the note would read more than [`MAX_READ_BYTES`]. Only the ELF header, the
/// program headers and the `PT_NOTE` segments are read, and the first GNU build id note ends
/// the search.
pub fn read_build_id<R: Read + Seek>(f: &mut R) -> io::Result<Option<String>> {
    let size = f.seek(SeekFrom::End(0))?;
    let mut r = Bounded {
        f,
        size,
        left: MAX_READ_BYTES,
    };
    let ident = r.read_at(0, 64.min(size))?;
    if ident.len() < 52 || &ident[..4] != b"\x7fELF" {
        return Err(bad("not an ELF file"));
    }
    let wide = match ident[4] {
        1 => false,
        2 => true,
        _ => return Err(bad("unknown ELF class")),
    };
    let e = Endian(match ident[5] {
        1 => false,
        2 => true,
        _ => return Err(bad("unknown ELF byte order")),
    });
    if wide && ident.len() < 64 {
        return Err(bad("truncated ELF header"));
    }
    let (phoff, phentsize, phnum) = if wide {
        (
            e.u64(&ident[32..]),
            e.u16(&ident[54..]),
            e.u16(&ident[56..]),
        )
    } else {
        (
            u64::from(e.u32(&ident[28..])),
            e.u16(&ident[42..]),
            e.u16(&ident[44..]),
        )
    };
    // The fields read of each entry: up to p_align.
    let need: u64 = if wide { 56 } else { 32 };
    let (phentsize, phnum) = (u64::from(phentsize), u64::from(phnum).min(MAX_PHDRS));
    if phentsize < need {
        return Err(bad("program header entries too small"));
    }
    let table = phentsize
        .checked_mul(phnum)
        .and_then(|t| t.checked_add(phoff))
        .ok_or_else(|| bad("program headers overflow"))?;
    if table > size {
        return Err(bad("program headers past the end of the file"));
    }
    for i in 0..phnum {
        let ph = r.read_at(phoff + i * phentsize, need)?;
        if e.u32(&ph) != PT_NOTE {
            continue;
        }
        let (offset, filesz, align) = if wide {
            (e.u64(&ph[8..]), e.u64(&ph[32..]), e.u64(&ph[48..]))
        } else {
            (
                u64::from(e.u32(&ph[4..])),
                u64::from(e.u32(&ph[16..])),
                u64::from(e.u32(&ph[28..])),
            )
        };
        let notes = r.read_at(offset, filesz)?;
        if let Some(id) = find_build_id(&notes, e, if align == 8 { 8 } else { 4 }) {
            return Ok(Some(id));
        }
    }
    Ok(None)
}

/// Reads of a file within its size and a budget of bytes ([`MAX_READ_BYTES`]).
struct Bounded<'a, R> {
    f: &'a mut R,
    size: u64,
    left: u64,
}

impl<R: Read + Seek> Bounded<'_, R> {
    /// `len` bytes at `offset`: an error when they run past the end of the file or past what
    /// is left of the budget.
    fn read_at(&mut self, offset: u64, len: u64) -> io::Result<Vec<u8>> {
        if offset.checked_add(len).is_none_or(|end| end > self.size) {
            return Err(bad("note segment past the end of the file"));
        }
        if len > self.left {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "its ELF headers and notes are more than {MAX_READ_BYTES} bytes (a library's are a few hundred)"
                ),
            ));
        }
        self.left -= len;
        let mut buf = vec![0u8; len as usize];
        self.f.seek(SeekFrom::Start(offset))?;
        self.f.read_exact(&mut buf)?;
        Ok(buf)
    }
}

/// The build id among the notes of one segment (`align`: the segment's note alignment).
fn find_build_id(notes: &[u8], e: Endian, align: usize) -> Option<String> {
    let pad = |n: usize| n.div_ceil(align) * align;
    let mut at = 0usize;
    while at + 12 <= notes.len() {
        let namesz = e.u32(&notes[at..]) as usize;
        let descsz = e.u32(&notes[at + 4..]) as usize;
        let kind = e.u32(&notes[at + 8..]);
        let name_at = at + 12;
        let desc_at = name_at.checked_add(pad(namesz))?;
        let end = desc_at.checked_add(pad(descsz))?;
        if desc_at.checked_add(descsz)? > notes.len() {
            return None;
        }
        if kind == NT_GNU_BUILD_ID && &notes[name_at..name_at + namesz] == b"GNU\0" {
            let desc = &notes[desc_at..desc_at + descsz];
            return Some(desc.iter().map(|b| format!("{b:02x}")).collect());
        }
        at = end;
    }
    None
}

fn bad(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.to_string())
}

/// Big-endian (`true`) or little-endian reads of the ELF fields.
#[derive(Clone, Copy)]
struct Endian(bool);

impl Endian {
    fn u16(self, b: &[u8]) -> u16 {
        let a = [b[0], b[1]];
        if self.0 {
            u16::from_be_bytes(a)
        } else {
            u16::from_le_bytes(a)
        }
    }
    fn u32(self, b: &[u8]) -> u32 {
        let a = [b[0], b[1], b[2], b[3]];
        if self.0 {
            u32::from_be_bytes(a)
        } else {
            u32::from_le_bytes(a)
        }
    }
    fn u64(self, b: &[u8]) -> u64 {
        let mut a = [0u8; 8];
        a.copy_from_slice(&b[..8]);
        if self.0 {
            u64::from_be_bytes(a)
        } else {
            u64::from_le_bytes(a)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Cursor;

    /// A little-endian ELF64 file with one PT_NOTE segment holding `notes`.
    fn elf64(notes: &[u8]) -> Vec<u8> {
        let mut f = vec![0u8; 64 + 56];
        f[..4].copy_from_slice(b"\x7fELF");
        f[4] = 2;
        f[5] = 1;
        f[32..40].copy_from_slice(&64u64.to_le_bytes()); // e_phoff
        f[54..56].copy_from_slice(&56u16.to_le_bytes()); // e_phentsize
        f[56..58].copy_from_slice(&1u16.to_le_bytes()); // e_phnum
        let ph = &mut f[64..];
        ph[..4].copy_from_slice(&PT_NOTE.to_le_bytes());
        ph[8..16].copy_from_slice(&120u64.to_le_bytes()); // p_offset
        ph[32..40].copy_from_slice(&(notes.len() as u64).to_le_bytes()); // p_filesz
        ph[48..56].copy_from_slice(&4u64.to_le_bytes()); // p_align
        f.extend_from_slice(notes);
        f
    }

    fn note(kind: u32, name: &[u8], desc: &[u8]) -> Vec<u8> {
        let mut n = Vec::new();
        n.extend_from_slice(&(name.len() as u32).to_le_bytes());
        n.extend_from_slice(&(desc.len() as u32).to_le_bytes());
        n.extend_from_slice(&kind.to_le_bytes());
        n.extend_from_slice(name);
        n.resize(n.len().div_ceil(4) * 4, 0);
        n.extend_from_slice(desc);
        n.resize(n.len().div_ceil(4) * 4, 0);
        n
    }

    #[test]
    fn reads_the_gnu_build_id_after_other_notes() {
        let mut notes = note(1, b"GNU\0", &[0; 16]); // NT_GNU_ABI_TAG
        notes.extend(note(
            NT_GNU_BUILD_ID,
            b"GNU\0",
            &[0xc0, 0x4d, 0x6c, 0x4d, 0x01],
        ));
        let id = read_build_id(&mut Cursor::new(elf64(&notes))).unwrap();
        assert_eq!(id.as_deref(), Some("c04d6c4d01"));
        // Another vendor's note of type 3 is not the build id.
        let other = note(NT_GNU_BUILD_ID, b"Go\0\0", &[1, 2]);
        assert_eq!(
            read_build_id(&mut Cursor::new(elf64(&other))).unwrap(),
            None
        );
    }

    #[test]
    fn reads_this_test_binary() {
        let exe = std::env::current_exe().unwrap();
        let mut f = std::fs::File::open(exe).unwrap();
        // Linked with --build-id by the toolchain's default, or without: either reads.
        if let Some(id) = read_build_id(&mut f).unwrap() {
            assert!(
                id.len() >= 16 && id.chars().all(|c| c.is_ascii_hexdigit()),
                "{id}"
            );
        }
    }

    #[test]
    fn refuses_what_points_outside_the_file() {
        assert!(read_build_id(&mut Cursor::new(
            b"not elf at all, but long enough to read a header from it; really".to_vec()
        ))
        .is_err());
        let mut f = elf64(&note(NT_GNU_BUILD_ID, b"GNU\0", &[1; 20]));
        // The segment claims more bytes than the file has.
        f[64 + 32..64 + 40].copy_from_slice(&4096u64.to_le_bytes());
        assert!(read_build_id(&mut Cursor::new(f.clone())).is_err());
        // The program headers start past the end.
        f[32..40].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(read_build_id(&mut Cursor::new(f.clone())).is_err());
        // A note whose descriptor runs past its segment: no build id, no panic.
        let mut n = note(NT_GNU_BUILD_ID, b"GNU\0", &[1; 20]);
        n[4..8].copy_from_slice(&1000u32.to_le_bytes());
        assert_eq!(read_build_id(&mut Cursor::new(elf64(&n))).unwrap(), None);
        assert!(read_build_id(&mut Cursor::new(Vec::new())).is_err());
    }

    /// Counts the bytes read through it.
    struct Counting<R> {
        inner: R,
        read: u64,
    }

    impl<R: Read> Read for Counting<R> {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            let n = self.inner.read(buf)?;
            self.read += n as u64;
            Ok(n)
        }
    }

    impl<R: Seek> Seek for Counting<R> {
        fn seek(&mut self, pos: SeekFrom) -> io::Result<u64> {
            self.inner.seek(pos)
        }
    }

    /// A little-endian ELF64 file with `count` program headers, each a PT_NOTE segment of
    /// `seg` bytes at the same offset (the notes: `notes`, then zeros).
    fn elf64_many(count: u16, seg: u64, notes: &[u8]) -> Vec<u8> {
        let table = 64 + 56 * u64::from(count);
        let mut f = vec![0u8; table as usize];
        f[..4].copy_from_slice(b"\x7fELF");
        f[4] = 2;
        f[5] = 1;
        f[32..40].copy_from_slice(&64u64.to_le_bytes());
        f[54..56].copy_from_slice(&56u16.to_le_bytes());
        f[56..58].copy_from_slice(&count.to_le_bytes());
        for i in 0..usize::from(count) {
            let ph = &mut f[64 + 56 * i..];
            ph[..4].copy_from_slice(&PT_NOTE.to_le_bytes());
            ph[8..16].copy_from_slice(&table.to_le_bytes());
            ph[32..40].copy_from_slice(&seg.to_le_bytes());
            ph[48..56].copy_from_slice(&4u64.to_le_bytes());
        }
        f.extend_from_slice(notes);
        f.resize((table + seg) as usize, 0);
        f
    }

    #[test]
    fn a_hostile_file_costs_at_most_the_read_budget() {
        // 65535 note segments of 1 MiB each, none with a build id: the old reader read 4 GiB.
        let mut f = Counting {
            inner: Cursor::new(elf64_many(u16::MAX, 1 << 20, &[])),
            read: 0,
        };
        let err = read_build_id(&mut f).unwrap_err();
        assert!(err.to_string().contains("more than 65536 bytes"), "{err}");
        assert!(f.read <= MAX_READ_BYTES, "read {} bytes", f.read);
        // Many small segments without a build id: the budget ends the search too.
        let mut f = Counting {
            inner: Cursor::new(elf64_many(u16::MAX, 1024, &[])),
            read: 0,
        };
        assert!(read_build_id(&mut f).is_err());
        assert!(f.read <= MAX_READ_BYTES, "read {} bytes", f.read);
        // Only the first MAX_PHDRS program headers are looked at.
        let mut f = Counting {
            inner: Cursor::new(elf64_many(u16::MAX, 0, &[])),
            read: 0,
        };
        assert_eq!(read_build_id(&mut f).unwrap(), None);
        assert_eq!(f.read, 64 + 56 * MAX_PHDRS);
    }

    #[test]
    fn the_first_build_id_note_ends_the_search() {
        let mut notes = note(NT_GNU_BUILD_ID, b"GNU\0", &[0xaa; 20]);
        notes.extend(note(NT_GNU_BUILD_ID, b"GNU\0", &[0xbb; 20]));
        // Two thousand segments, each holding both notes: one segment read, the first note's id.
        let mut f = Counting {
            inner: Cursor::new(elf64_many(2000, notes.len() as u64, &notes)),
            read: 0,
        };
        assert_eq!(read_build_id(&mut f).unwrap(), Some("aa".repeat(20)));
        assert_eq!(f.read, 64 + 56 + notes.len() as u64);
    }

    #[test]
    fn driver_file_names() {
        for p in [
            "/usr/lib/x86_64-linux-gnu/libcuda.so.580.65.06",
            "/usr/lib64/libnvidia-ml.so.580.65.06",
            "libnvidia-ptxjitcompiler.so.580.65.06",
            "/usr/lib/x86_64-linux-gnu/libcuda.so.1",
        ] {
            assert!(is_driver_file(p), "{p}");
        }
        for p in [
            "/usr/lib/x86_64-linux-gnu/libc.so.6",
            "/usr/lib/libcudart.so.13.0.48",
            "/usr/lib/libnvidia-ml.py",
            "/opt/libcuda.so",
        ] {
            assert!(!is_driver_file(p), "{p}");
        }
        assert_eq!(version_of("/x/libcuda.so.580.65.06"), Some("580.65.06"));
        assert_eq!(version_of("/x/libcuda.so.1"), None);
        assert_eq!(
            name_under("/x/libnvidia-ml.so.580.65.06", "580.65.07").as_deref(),
            Some("libnvidia-ml.so.580.65.07")
        );
        assert_eq!(name_under("/x/libcuda.so.1", "580.65.07"), None);
    }
}
