//! Every ELF the node installer ships (`make payload`: runtime-class/installer/payload.sh, in
//! target/payload/) against the payload's glibc floor, from the dynamic sections' version needs
//! (read with the `object` crate):
//!
//! - the five Rust binaries (`containerd-shim-gpu-ckpt-v1`, `gpu-ckpt`, `gpu-ckpt-hook` in the
//!   payload, `gpu-ckpt-node-installer` and `gpu-ckpt-agent` beside it) run with the node's glibc: they need only
//!   glibc's libraries, no symbol version above GLIBC_2.28 and no GLIBC_PRIVATE, and glibc's
//!   standard loader;
//! - gpu-ckpt's NCCL layer (`libgpu-ckpt-nccl.so`), which the shim preloads into the processes
//!   of containers that opt in, runs with the container's glibc: a library (no interpreter) that
//!   needs only glibc's libraries and libgcc_s.so.1, no symbol version above GLIBC_2.28 and no
//!   GLIBC_PRIVATE;
//! - CRIU (`criu/criu`) and every library in `criu/lib/` run with the bundled glibc: each library
//!   they need is bundled, and each symbol version they need is defined by the bundled library
//!   that they need it from; CRIU finds them through its RPATH `$ORIGIN/lib`, and its interpreter
//!   is the placeholder the installer replaces with the bundled loader's node path.
//!
//! A payload built with plain `cargo build` on a newer glibc (Debian 12: 2.36) fails here
//! (`__libc_start_main@GLIBC_2.34` and others). `GPU_CKPT_PAYLOAD_DIR` names another payload
//! directory than `<repo>/target/payload`.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{ensure, Context, Result};
use object::elf::{FileHeader64, DT_NEEDED, DT_RPATH, DT_RUNPATH, PT_INTERP};
use object::read::elf::{Dyn, FileHeader, ProgramHeader};
use object::Endianness;

/// The oldest glibc the Rust binaries run on (Debian 10, RHEL 8, Ubuntu 20.04 have newer ones).
const FLOOR: (u32, u32) = (2, 28);
/// glibc's own libraries: every node has them.
const GLIBC: &[&str] = &[
    "libc.so.6",
    "libm.so.6",
    "libdl.so.2",
    "libpthread.so.0",
    "librt.so.1",
    "libresolv.so.2",
    "libutil.so.1",
    "ld-linux-x86-64.so.2",
];
/// glibc's standard loader on x86-64: the Rust binaries' interpreter.
const SYSTEM_LOADER: &str = "/lib64/ld-linux-x86-64.so.2";
/// The placeholder payload.sh gives CRIU for interpreter.
const CRIU_INTERP_PLACEHOLDER: &str = "/gpu-ckpt-node-installer-sets-this-path-at-install";
/// The Rust programs in the payload, and the installer beside it.
const PROGRAMS: &[&str] = &["containerd-shim-gpu-ckpt-v1", "gpu-ckpt", "gpu-ckpt-hook"];
const INSTALLER: &str = "installer/gpu-ckpt-node-installer";
/// The node agent beside it (the chart's agent DaemonSet runs it from the image).
const AGENT: &str = "installer/gpu-ckpt-agent";
/// The NCCL layer in the payload.
const LAYER: &str = "payload/libgpu-ckpt-nccl.so";
/// GCC's runtime library, which the layer (a Rust cdylib: its unwinder) needs besides glibc's.
const LIBGCC: &str = "libgcc_s.so.1";

/// What the dynamic loader needs to know of one ELF file.
#[derive(Debug, Default)]
struct Dynamic {
    interpreter: Option<String>,
    needed: Vec<String>,
    rpath: Vec<String>,
    /// (library, version) pairs of `.gnu.version_r`.
    version_needs: Vec<(String, String)>,
    /// The versions `.gnu.version_d` defines.
    version_defs: BTreeSet<String>,
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// The file's dynamic section, version needs and definitions, and interpreter; `None` for a file
/// that is not an ELF file.
fn dynamic(path: &Path) -> Result<Option<Dynamic>> {
    let data = fs::read(path).with_context(|| format!("read {}", path.display()))?;
    if !data.starts_with(b"\x7fELF") {
        return Ok(None);
    }
    let data = &data[..];
    let what = |e: object::Error| anyhow::anyhow!("{}: {e}", path.display());
    let header = FileHeader64::<Endianness>::parse(data).map_err(what)?;
    let endian = header.endian().map_err(what)?;
    let mut out = Dynamic::default();
    for ph in header.program_headers(endian, data).map_err(what)? {
        if ph.p_type(endian) == PT_INTERP {
            let raw = ph.data(endian, data).map_err(|()| {
                anyhow::anyhow!("{}: the interpreter lies outside the file", path.display())
            })?;
            let end = raw.iter().position(|&b| b == 0).unwrap_or(raw.len());
            out.interpreter = Some(text(&raw[..end]));
        }
    }
    let sections = header.sections(endian, data).map_err(what)?;
    if let Some((entries, strtab)) = sections.dynamic(endian, data).map_err(what)? {
        let strings = sections.strings(endian, data, strtab).map_err(what)?;
        for d in entries {
            let tag = d.tag32(endian);
            let list = match tag {
                Some(DT_NEEDED) => &mut out.needed,
                Some(DT_RPATH) | Some(DT_RUNPATH) => &mut out.rpath,
                _ => continue,
            };
            list.push(text(d.string(endian, strings).map_err(what)?));
        }
    }
    if let Some((mut needs, strtab)) = sections.gnu_verneed(endian, data).map_err(what)? {
        let strings = sections.strings(endian, data, strtab).map_err(what)?;
        while let Some((need, mut aux)) = needs.next().map_err(what)? {
            let file = text(need.file(endian, strings).map_err(what)?);
            while let Some(a) = aux.next().map_err(what)? {
                let version = text(a.name(endian, strings).map_err(what)?);
                out.version_needs.push((file.clone(), version));
            }
        }
    }
    if let Some((mut defs, strtab)) = sections.gnu_verdef(endian, data).map_err(what)? {
        let strings = sections.strings(endian, data, strtab).map_err(what)?;
        while let Some((_, mut aux)) = defs.next().map_err(what)? {
            // The first name is the version itself; the others are its parents.
            if let Some(a) = aux.next().map_err(what)? {
                out.version_defs
                    .insert(text(a.name(endian, strings).map_err(what)?));
            }
        }
    }
    Ok(Some(out))
}

/// `GLIBC_2.28` -> (2, 28); `GLIBC_2.2.5` -> (2, 2).
fn glibc_version(v: &str) -> Option<(u32, u32)> {
    let mut parts = v.strip_prefix("GLIBC_")?.split('.');
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    Some((major, minor))
}

/// What is wrong with a binary that runs with the node's glibc.
fn host_resolved_problems(name: &str, d: &Dynamic) -> Vec<String> {
    let mut out = Vec::new();
    if d.interpreter.as_deref() != Some(SYSTEM_LOADER) {
        out.push(format!(
            "{name}: interpreter {:?}, not {SYSTEM_LOADER}",
            d.interpreter
        ));
    }
    for lib in &d.needed {
        if !GLIBC.contains(&lib.as_str()) {
            out.push(format!(
                "{name}: needs {lib}, which is not glibc's and not in the payload"
            ));
        }
    }
    for (lib, version) in &d.version_needs {
        match glibc_version(version) {
            Some(v) if v <= FLOOR => {}
            Some(_) => out.push(format!(
                "{name}: needs {version} of {lib}, above the floor GLIBC_{}.{}",
                FLOOR.0, FLOOR.1
            )),
            None => out.push(format!(
                "{name}: needs version {version} of {lib}, not a public glibc version"
            )),
        }
    }
    out
}

/// What is wrong with the NCCL layer, a library loaded into a container's processes with the
/// container's glibc.
fn layer_problems(name: &str, d: &Dynamic) -> Vec<String> {
    let mut out = Vec::new();
    if let Some(i) = &d.interpreter {
        out.push(format!("{name}: has interpreter {i:?}: not a library"));
    }
    for lib in &d.needed {
        if !GLIBC.contains(&lib.as_str()) && lib != LIBGCC {
            out.push(format!(
                "{name}: needs {lib}, which is neither glibc's nor {LIBGCC}"
            ));
        }
    }
    for (lib, version) in &d.version_needs {
        if lib == LIBGCC && version.starts_with("GCC_") {
            continue;
        }
        match glibc_version(version) {
            Some(v) if v <= FLOOR => {}
            _ => out.push(format!(
                "{name}: needs {version} of {lib}, not a glibc version up to the floor GLIBC_{}.{}",
                FLOOR.0, FLOOR.1
            )),
        }
    }
    out
}

/// What is wrong with CRIU or one of its bundled libraries, `bundled` being every file of
/// criu/lib by name.
fn bundled_problems(name: &str, d: &Dynamic, bundled: &BTreeMap<String, Dynamic>) -> Vec<String> {
    let mut out = Vec::new();
    for lib in &d.needed {
        if !bundled.contains_key(lib) {
            out.push(format!("{name}: needs {lib}, which criu/lib does not hold"));
        }
    }
    for (lib, version) in &d.version_needs {
        match bundled.get(lib) {
            Some(def) if def.version_defs.contains(version) => {}
            Some(_) => out.push(format!(
                "{name}: needs {version} of {lib}, which the bundled {lib} does not define"
            )),
            None => out.push(format!(
                "{name}: needs {version} of {lib}, which criu/lib does not hold"
            )),
        }
    }
    out
}

fn payload_dir() -> PathBuf {
    std::env::var_os("GPU_CKPT_PAYLOAD_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/payload"))
}

#[test]
fn every_shipped_elf_needs_at_most_the_glibc_floor() -> Result<()> {
    let dir = payload_dir();
    let hint = "build it with `make payload`";
    let mut problems = Vec::new();

    // The Rust binaries, and nothing else outside criu/ that is an ELF file.
    let mut host_resolved: BTreeSet<String> = BTreeSet::new();
    for e in fs::read_dir(dir.join("payload"))
        .with_context(|| format!("{}/payload is missing: {hint}", dir.display()))?
    {
        let p = e?.path();
        if p.is_file() && dynamic(&p)?.is_some() {
            host_resolved.insert(format!(
                "payload/{}",
                p.file_name().unwrap_or_default().to_string_lossy()
            ));
        }
    }
    host_resolved.insert(INSTALLER.into());
    host_resolved.insert(AGENT.into());
    ensure!(
        host_resolved.remove(LAYER),
        "the payload holds no NCCL layer ({LAYER}): {host_resolved:?}"
    );
    let expected: BTreeSet<String> = PROGRAMS
        .iter()
        .map(|p| format!("payload/{p}"))
        .chain([INSTALLER.to_string(), AGENT.to_string()])
        .collect();
    ensure!(
        host_resolved == expected,
        "the payload's programs are {host_resolved:?}, expected {expected:?}"
    );
    let layer = dir.join(LAYER);
    let d = dynamic(&layer)?.with_context(|| format!("{} is not an ELF file", layer.display()))?;
    println!("{LAYER}: needs {:?}", d.needed);
    problems.extend(layer_problems(LAYER, &d));
    for name in &expected {
        let p = dir.join(name);
        let d = dynamic(&p)?.with_context(|| format!("{} is not an ELF file", p.display()))?;
        let newest = d
            .version_needs
            .iter()
            .filter_map(|(_, v)| glibc_version(v))
            .max();
        println!(
            "{name}: needs {:?}, newest glibc version {newest:?}",
            d.needed
        );
        problems.extend(host_resolved_problems(name, &d));
    }

    // CRIU and what it carries.
    let lib = dir.join("payload/criu/lib");
    let mut bundled = BTreeMap::new();
    for e in fs::read_dir(&lib).with_context(|| format!("{} is missing: {hint}", lib.display()))? {
        let p = e?.path();
        let name = p
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .into_owned();
        let d = dynamic(&p)?.with_context(|| format!("{} is not an ELF file", p.display()))?;
        bundled.insert(name, d);
    }
    for glibc in ["libc.so.6", "ld-linux-x86-64.so.2"] {
        ensure!(
            bundled.contains_key(glibc),
            "criu/lib holds no {glibc}: {:?}",
            bundled.keys()
        );
    }
    let criu_path = dir.join("payload/criu/criu");
    let criu = dynamic(&criu_path)?
        .with_context(|| format!("{} is not an ELF file", criu_path.display()))?;
    ensure!(
        criu.interpreter
            .as_deref()
            .is_some_and(|i| i.starts_with(CRIU_INTERP_PLACEHOLDER)),
        "criu's interpreter is {:?}, not payload.sh's placeholder",
        criu.interpreter
    );
    ensure!(
        criu.rpath == ["$ORIGIN/lib"],
        "criu's RPATH is {:?}",
        criu.rpath
    );
    println!(
        "criu/criu: needs {:?} from criu/lib ({} files)",
        criu.needed,
        bundled.len()
    );
    problems.extend(bundled_problems("criu/criu", &criu, &bundled));
    for (name, d) in &bundled {
        problems.extend(bundled_problems(&format!("criu/lib/{name}"), d, &bundled));
    }
    ensure!(
        problems.is_empty(),
        "{} problem(s) in the payload {}:\n{}",
        problems.len(),
        dir.display(),
        problems.join("\n")
    );
    Ok(())
}

#[test]
fn the_layer_may_need_libgcc_but_nothing_newer_than_the_floor() {
    let layer = |needed: &[&str], needs: &[(&str, &str)]| Dynamic {
        needed: needed.iter().map(|s| s.to_string()).collect(),
        version_needs: needs
            .iter()
            .map(|(l, v)| (l.to_string(), v.to_string()))
            .collect(),
        ..Default::default()
    };
    let ok = layer(
        &["libgcc_s.so.1", "libc.so.6"],
        &[("libgcc_s.so.1", "GCC_3.0"), ("libc.so.6", "GLIBC_2.28")],
    );
    assert!(layer_problems("l", &ok).is_empty());
    let newer = layer(&["libc.so.6"], &[("libc.so.6", "GLIBC_2.34")]);
    assert_eq!(layer_problems("l", &newer).len(), 1);
    let other = layer(&["libstdc++.so.6"], &[]);
    assert_eq!(layer_problems("l", &other).len(), 1);
    let program = Dynamic {
        interpreter: Some(SYSTEM_LOADER.into()),
        ..Default::default()
    };
    assert_eq!(layer_problems("l", &program).len(), 1);
}

#[test]
fn glibc_versions_compare_by_major_and_minor() {
    assert_eq!(glibc_version("GLIBC_2.2.5"), Some((2, 2)));
    assert_eq!(glibc_version("GLIBC_2.28"), Some((2, 28)));
    assert!(glibc_version("GLIBC_2.34").is_some_and(|v| v > FLOOR));
    assert_eq!(glibc_version("GLIBC_PRIVATE"), None);
    assert_eq!(glibc_version("GCC_3.0"), None);
}
