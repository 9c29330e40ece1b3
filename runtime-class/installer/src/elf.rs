//! The interpreter (`PT_INTERP`) of the payload's CRIU, set at install time.
//!
//! CRIU travels with the glibc it was built against (its libraries and `ld-linux-x86-64.so.2` in
//! `criu/lib/`, found through its RPATH `$ORIGIN/lib`). The kernel takes the interpreter only as
//! an absolute path, which depends on the node's `--lib-dir`; so the payload's `criu` carries a
//! placeholder of fixed size (runtime-class/installer/payload.sh) and the installer writes the
//! node's path of the bundled loader into it, in place. The `object` crate reads the program
//! headers; the write is a byte copy into the segment they name (no crate edits an ELF file in
//! place: patchelf is a program, and `object`'s writer builds whole files).

use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use object::elf::{FileHeader64, PT_INTERP};
use object::read::elf::{FileHeader, ProgramHeader};
use object::Endianness;

/// Where the interpreter's path is in `elf`: its offset and size (with the NUL).
fn interp_field(elf: &[u8]) -> Result<(usize, usize), String> {
    let header = FileHeader64::<Endianness>::parse(elf)
        .map_err(|e| format!("not a 64-bit ELF file ({e})"))?;
    let endian = header
        .endian()
        .map_err(|e| format!("not a 64-bit ELF file ({e})"))?;
    let phdrs = header
        .program_headers(endian, elf)
        .map_err(|e| format!("unreadable program headers ({e})"))?;
    let ph = phdrs
        .iter()
        .find(|p| p.p_type(endian) == PT_INTERP)
        .ok_or("no interpreter (PT_INTERP): not a dynamically linked executable")?;
    let offset = usize::try_from(ph.p_offset(endian)).map_err(|e| e.to_string())?;
    let size = usize::try_from(ph.p_filesz(endian)).map_err(|e| e.to_string())?;
    if offset.checked_add(size).is_none_or(|end| end > elf.len()) {
        return Err("the interpreter's segment lies outside the file".into());
    }
    Ok((offset, size))
}

/// `elf`'s interpreter path.
pub fn interpreter(elf: &[u8]) -> Result<PathBuf, String> {
    let (offset, size) = interp_field(elf)?;
    let field = &elf[offset..offset + size];
    let end = field.iter().position(|&b| b == 0).unwrap_or(field.len());
    Ok(PathBuf::from(std::ffi::OsStr::from_bytes(&field[..end])))
}

/// A copy of `elf` whose interpreter is `loader`; the rest of the segment is zeroed. Refused when
/// `loader` (with its NUL) does not fit the segment the payload made.
pub fn with_interpreter(elf: &[u8], loader: &Path) -> Result<Vec<u8>, String> {
    let (offset, size) = interp_field(elf)?;
    let path = loader.as_os_str().as_bytes();
    if path.len() >= size {
        return Err(format!(
            "the loader's path {} is {} bytes, and the interpreter field holds {} with its NUL (choose a shorter --lib-dir)",
            loader.display(),
            path.len(),
            size
        ));
    }
    let mut out = elf.to_vec();
    let field = &mut out[offset..offset + size];
    field.fill(0);
    field[..path.len()].copy_from_slice(path);
    Ok(out)
}
