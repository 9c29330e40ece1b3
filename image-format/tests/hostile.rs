//! A corpus of hostile archives: each is refused with its own error naming the entry, by every reader
//! (header scan, streaming verify, extraction), and nothing is written outside the target directory
//! (nor, for refusals found in the first pass, inside it).

mod common;

use std::path::Path;

use common::{tree, RawTar};
use image_format::archive::{self, ExtractOptions};
use image_format::digest::no_progress;
use image_format::safe::Limits;
use image_format::Error;
use tar::EntryType;

struct Case {
    name: &'static str,
    data: Vec<u8>,
    /// Substring the error message must contain.
    want: &'static str,
    check: fn(&Error) -> bool,
}

fn small_limits() -> Limits {
    Limits {
        max_entry_bytes: 1 << 20,
        max_total_bytes: 3 << 20,
        max_entries: 100,
    }
}

fn abs_target() -> String {
    format!("/tmp/gpu-ckpt-hostile-{}", std::process::id())
}

fn cases() -> Vec<Case> {
    let abs = Box::leak(abs_target().into_boxed_str());
    let mut v = Vec::new();
    v.push(Case {
        name: "path traversal",
        data: RawTar::new()
            .file("config.dump", b"{}")
            .file("../x", b"evil")
            .finish(),
        want: "entry \"../x\": path traversal",
        check: |e| matches!(e, Error::PathTraversal { .. }),
    });
    v.push(Case {
        name: "nested path traversal",
        data: RawTar::new().file("checkpoint/../../y", b"evil").finish(),
        want: "entry \"checkpoint/../../y\": path traversal",
        check: |e| matches!(e, Error::PathTraversal { .. }),
    });
    v.push(Case {
        name: "absolute path",
        data: RawTar::new().file(abs, b"evil").finish(),
        want: "absolute paths are not allowed",
        check: |e| matches!(e, Error::AbsolutePath { .. }),
    });
    v.push(Case {
        name: "symlink escaping (relative)",
        data: RawTar::new()
            .entry(
                b"checkpoint/link",
                EntryType::Symlink,
                b"",
                Some(b"../../outside"),
            )
            .finish(),
        want: "entry \"checkpoint/link\": symlink to \"../../outside\" leaves the archive",
        check: |e| matches!(e, Error::SymlinkEscape { .. }),
    });
    v.push(Case {
        name: "symlink escaping (absolute)",
        data: RawTar::new()
            .entry(b"etc", EntryType::Symlink, b"", Some(b"/etc"))
            .file("etc/passwd", b"evil")
            .finish(),
        want: "entry \"etc\": symlink to \"/etc\" leaves the archive",
        check: |e| matches!(e, Error::SymlinkEscape { .. }),
    });
    v.push(Case {
        name: "symlink escaping through a shallower link",
        data: RawTar::new()
            .entry(b"a/b", EntryType::Symlink, b"", Some(b"x/../../.."))
            .finish(),
        want: "entry \"a/b\": symlink to \"x/../../..\" leaves the archive",
        check: |e| matches!(e, Error::SymlinkEscape { .. }),
    });
    v.push(Case {
        name: "write below an in-tree symlink",
        data: RawTar::new()
            .entry(b"d", EntryType::Directory, b"", None)
            .entry(b"l", EntryType::Symlink, b"", Some(b"d"))
            .file("l/x", b"through the link")
            .finish(),
        want: "entry \"l/x\": lies below symlink \"l\"",
        check: |e| matches!(e, Error::BelowSymlink { .. }),
    });
    v.push(Case {
        name: "hardlink escaping",
        data: RawTar::new()
            .entry(
                b"passwd",
                EntryType::Link,
                b"",
                Some(b"../../../../etc/passwd"),
            )
            .finish(),
        want: "entry \"passwd\": hard link to \"../../../../etc/passwd\" leaves the archive",
        check: |e| matches!(e, Error::HardlinkEscape { .. }),
    });
    v.push(Case {
        name: "hardlink absolute",
        data: RawTar::new()
            .entry(b"shadow", EntryType::Link, b"", Some(b"/etc/shadow"))
            .finish(),
        want: "entry \"shadow\": hard link to \"/etc/shadow\" leaves the archive",
        check: |e| matches!(e, Error::HardlinkEscape { .. }),
    });
    v.push(Case {
        name: "hardlink to nothing in the archive",
        data: RawTar::new()
            .entry(b"h", EntryType::Link, b"", Some(b"later"))
            .file("later", b"x")
            .finish(),
        want: "names no earlier regular file",
        check: |e| matches!(e, Error::HardlinkEscape { .. }),
    });
    v.push(Case {
        name: "character device",
        data: RawTar::new()
            .entry(b"checkpoint/null", EntryType::Char, b"", None)
            .finish(),
        want: "entry \"checkpoint/null\": character device entries are not allowed",
        check: |e| matches!(e, Error::ForbiddenType { .. }),
    });
    v.push(Case {
        name: "block device",
        data: RawTar::new()
            .entry(b"sda", EntryType::Block, b"", None)
            .finish(),
        want: "entry \"sda\": block device entries are not allowed",
        check: |e| matches!(e, Error::ForbiddenType { .. }),
    });
    v.push(Case {
        name: "fifo",
        data: RawTar::new()
            .entry(b"pipe", EntryType::Fifo, b"", None)
            .finish(),
        want: "entry \"pipe\": fifo entries are not allowed",
        check: |e| matches!(e, Error::ForbiddenType { .. }),
    });
    v.push(Case {
        name: "duplicate entry",
        data: RawTar::new()
            .file("config.dump", b"{}")
            .file("./config.dump", b"{\"second\":1}")
            .finish(),
        want: "entry \"./config.dump\": duplicate entry",
        check: |e| matches!(e, Error::DuplicateEntry { .. }),
    });
    v.push(Case {
        name: "file replacing a directory",
        data: RawTar::new()
            .file("checkpoint/a", b"1")
            .file("checkpoint", b"2")
            .finish(),
        want: "entry \"checkpoint\": duplicate entry",
        check: |e| matches!(e, Error::DuplicateEntry { .. }),
    });
    v.push(Case {
        name: "declared-size bomb",
        data: RawTar::new()
            .entry_sized(b"checkpoint/pages-1.img", EntryType::Regular, b"", 1 << 40, None)
            .finish(),
        want: "entry \"checkpoint/pages-1.img\": declared size 1099511627776 bytes exceeds the limit of 1048576 bytes",
        check: |e| matches!(e, Error::EntryTooLarge { .. }),
    });
    v.push(Case {
        name: "total-size bomb",
        data: {
            let mb = vec![0u8; 1 << 20];
            RawTar::new()
                .file("a", &mb)
                .file("b", &mb)
                .file("c", &mb)
                .file("d", &mb)
                .finish()
        },
        want: "entry \"d\": total size would reach 4194304 bytes, over the limit of 3145728 bytes",
        check: |e| matches!(e, Error::ArchiveTooLarge { .. }),
    });
    v
}

fn run_case(c: &Case) {
    let tmp = tempfile::tempdir().unwrap();
    let work = tmp.path().join("work");
    std::fs::create_dir(&work).unwrap();
    std::fs::create_dir(tmp.path().join("outside")).unwrap();
    let src = tmp.path().join("hostile.tar");
    std::fs::write(&src, &c.data).unwrap();
    let before = tree(tmp.path());
    let target = work.join("target");

    // Header scan.
    let e = archive::read_info(&src, small_limits()).expect_err(c.name);
    assert!((c.check)(&e), "{}: wrong error from read_info: {e}", c.name);
    assert!(
        e.to_string().contains(c.want),
        "{}: message {:?} lacks {:?}",
        c.name,
        e.to_string(),
        c.want
    );

    // Streaming verify.
    let e = archive::verify_archive(&src, small_limits(), &mut no_progress).expect_err(c.name);
    assert!((c.check)(&e), "{}: wrong error from verify: {e}", c.name);

    // Two-pass extraction: refused before anything is written.
    let opts = ExtractOptions {
        limits: small_limits(),
        verify: false,
    };
    let e = archive::extract_archive(&src, &target, opts, &mut no_progress).expect_err(c.name);
    assert!((c.check)(&e), "{}: wrong error from extract: {e}", c.name);
    assert!(
        !target.exists(),
        "{}: target was created by a refused extraction",
        c.name
    );
    assert_eq!(
        tree(tmp.path()),
        before,
        "{}: something was written",
        c.name
    );

    // Single-pass (stream) extraction: may have written earlier entries inside the target, but
    // cleans them up, and never writes outside.
    let e =
        archive::extract_stream(&c.data[..], &target, opts, 0, &mut no_progress).expect_err(c.name);
    assert!(
        (c.check)(&e),
        "{}: wrong error from extract_stream: {e}",
        c.name
    );
    let after: Vec<String> = tree(tmp.path())
        .into_iter()
        .filter(|p| p != "work/target")
        .collect();
    assert_eq!(after, before, "{}: something was left behind", c.name);
    if target.exists() {
        assert!(
            tree(&target).is_empty(),
            "{}: target not cleaned: {:?}",
            c.name,
            tree(&target)
        );
    }
    assert!(
        !Path::new(&abs_target()).exists(),
        "{}: absolute path written",
        c.name
    );
}

#[test]
fn every_hostile_archive_is_refused_with_its_own_message() {
    let cases = cases();
    let mut messages = std::collections::HashSet::new();
    for c in &cases {
        run_case(c);
        assert!(
            messages.insert(c.want),
            "two cases share a message: {}",
            c.want
        );
    }
}

#[test]
fn wrong_digest_in_manifest_is_refused_and_cleaned_up() {
    let tmp = tempfile::tempdir().unwrap();
    let good = common::make_archive(tmp.path());
    // Rewrite the archive with one CRIU image changed after the manifest was made. core-1.img
    // comes before the manifest in the archive: both digests are computed, BLAKE3 is checked.
    let ck = tmp.path().join("ckdir");
    std::fs::write(ck.join("core-1.img"), b"core of pid 2").unwrap();
    let bad = tmp.path().join("bad.tar");
    let spec = archive::ArchiveSpec {
        checkpoint_dir: Some(ck.clone()),
        config_dump: Some(common::config_dump()),
        spec_dump: Some(common::spec_dump_containerd()),
        ..Default::default()
    };
    archive::write_archive(&spec, &bad).unwrap();
    let e = archive::verify_archive(&bad, Limits::default(), &mut no_progress).unwrap_err();
    match &e {
        Error::DigestMismatch { name, .. } => assert_eq!(name, "core-1.img"),
        other => panic!("wrong error: {other}"),
    }
    assert!(
        e.to_string()
            .starts_with("file \"core-1.img\": blake3 mismatch"),
        "{e}"
    );

    let target = tmp.path().join("target");
    let opts = ExtractOptions {
        limits: Limits::default(),
        verify: true,
    };
    let e = archive::extract_archive(&bad, &target, opts, &mut no_progress).unwrap_err();
    assert!(matches!(e, Error::DigestMismatch { .. }), "{e}");
    assert!(
        tree(&target).is_empty(),
        "mismatching extraction left {:?}",
        tree(&target)
    );

    // A page image, which comes after the manifest in the archive, is checked against its
    // BLAKE3, by verify and by a verifying extraction alike.
    std::fs::write(ck.join("core-1.img"), b"core of pid 1").unwrap();
    let mut pages = std::fs::read(ck.join("pages-1.img")).unwrap();
    pages[4096] ^= 0x80;
    std::fs::write(ck.join("pages-1.img"), &pages).unwrap();
    archive::write_archive(&spec, &bad).unwrap();
    let e = archive::verify_archive(&bad, Limits::default(), &mut no_progress).unwrap_err();
    assert!(
        e.to_string()
            .starts_with("file \"pages-1.img\": blake3 mismatch"),
        "{e}"
    );
    let e = archive::extract_archive(&bad, &target, opts, &mut no_progress).unwrap_err();
    assert!(
        e.to_string()
            .starts_with("file \"pages-1.img\": blake3 mismatch"),
        "{e}"
    );
    pages[4096] ^= 0x80;
    std::fs::write(ck.join("pages-1.img"), &pages).unwrap();

    // Size change is reported as such.
    std::fs::write(ck.join("core-1.img"), b"core of pid 1 and more").unwrap();
    archive::write_archive(&spec, &bad).unwrap();
    let e = archive::verify_archive(&bad, Limits::default(), &mut no_progress).unwrap_err();
    assert!(matches!(e, Error::SizeMismatch { .. }), "{e}");

    // An extra file in checkpoint/ is reported by name.
    std::fs::write(ck.join("core-1.img"), b"core of pid 1").unwrap();
    std::fs::write(ck.join("smuggled.img"), b"x").unwrap();
    archive::write_archive(&spec, &bad).unwrap();
    let e = archive::verify_archive(&bad, Limits::default(), &mut no_progress).unwrap_err();
    assert_eq!(
        e.to_string(),
        "file \"smuggled.img\": present but not listed in the manifest"
    );

    // And the untouched archive verifies.
    archive::verify_archive(&good, Limits::default(), &mut no_progress).unwrap();
}

#[test]
fn in_tree_links_are_allowed_and_extracted_without_following() {
    let data = RawTar::new()
        .entry(b"d", EntryType::Directory, b"", None)
        .file("d/f", b"data")
        .entry(b"d/l", EntryType::Symlink, b"", Some(b"f"))
        .entry(b"up", EntryType::Symlink, b"", Some(b"d/f"))
        .entry(b"d/h", EntryType::Link, b"", Some(b"d/f"))
        .finish();
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("ok.tar");
    std::fs::write(&src, &data).unwrap();
    let target = tmp.path().join("t");
    archive::extract_archive(&src, &target, ExtractOptions::default(), &mut no_progress).unwrap();
    assert_eq!(std::fs::read(target.join("d/h")).unwrap(), b"data");
    assert_eq!(
        std::fs::read_link(target.join("d/l")).unwrap(),
        Path::new("f")
    );
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(target.join("d/f"))
        .unwrap()
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(mode, 0o600);
    let mode = std::fs::metadata(target.join("d"))
        .unwrap()
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(mode, 0o700);
}

#[test]
fn a_planted_symlink_in_the_target_is_not_followed() {
    let tmp = tempfile::tempdir().unwrap();
    let outside = tmp.path().join("outside");
    std::fs::create_dir(&outside).unwrap();
    let target = tmp.path().join("t");
    std::fs::create_dir(&target).unwrap();
    std::os::unix::fs::symlink(&outside, target.join("checkpoint")).unwrap();
    let data = RawTar::new().file("checkpoint/x", b"evil").finish();
    let src = tmp.path().join("a.tar");
    std::fs::write(&src, &data).unwrap();
    let e = archive::extract_archive(&src, &target, ExtractOptions::default(), &mut no_progress)
        .unwrap_err();
    assert!(matches!(e, Error::Io { .. }), "{e}");
    assert!(tree(&outside).is_empty(), "wrote through a planted symlink");
}

/// An archive written by another tool may put the manifest last: the page images, listed with
/// BLAKE3 only, are then hashed before their entry is known, and still checked.
#[test]
fn page_images_before_the_manifest_are_checked_against_blake3() {
    let tmp = tempfile::tempdir().unwrap();
    let ck = tmp.path().join("ck");
    common::make_checkpoint_dir(&ck);
    let write = |pages: &[u8]| {
        let mut t = common::RawTar::new();
        t.entry(b"checkpoint/", tar::EntryType::Directory, b"", None);
        t.file("checkpoint/pages-1.img", pages);
        for name in [
            "core-1.img",
            "gpu-state-0.bin",
            "inventory.img",
            "pagemap-1.img",
        ] {
            t.file(
                &format!("checkpoint/{name}"),
                &std::fs::read(ck.join(name)).unwrap(),
            );
        }
        t.file(
            "checkpoint/gpu-ckpt-manifest.json",
            &std::fs::read(ck.join("gpu-ckpt-manifest.json")).unwrap(),
        );
        let p = tmp.path().join("late-manifest.tar");
        std::fs::write(&p, t.finish()).unwrap();
        p
    };
    let mut pages = std::fs::read(ck.join("pages-1.img")).unwrap();
    let good = write(&pages);
    let report = archive::verify_archive(&good, Limits::default(), &mut no_progress).unwrap();
    assert_eq!(report.files_verified, 5);
    pages[12_345] ^= 1;
    let bad = write(&pages);
    let e = archive::verify_archive(&bad, Limits::default(), &mut no_progress).unwrap_err();
    assert!(
        e.to_string()
            .starts_with("file \"pages-1.img\": blake3 mismatch"),
        "{e}"
    );
}

/// The restore's extraction writes only what the admitted manifest lists: members beside
/// `checkpoint/` are skipped (the engine's `rootfs-diff.tar` only when asked for), and an
/// unlisted file, a link or a file of another size than listed in `checkpoint/` refuses the
/// archive before anything is written.
#[test]
fn only_listed_members_are_extracted_at_their_listed_sizes() {
    let tmp = tempfile::tempdir().unwrap();
    let good = common::make_archive(tmp.path());
    let info = archive::read_info(&good, Limits::default()).unwrap();
    let (manifest, json) = (info.manifest.unwrap(), info.manifest_json.unwrap());
    let listed = |also: &'static [&'static str]| archive::Listed {
        manifest_json: &json,
        manifest: &manifest,
        also,
    };
    let extract = |src: &Path, target: &Path, l: &archive::Listed<'_>| {
        let f = std::fs::File::open(src).unwrap();
        archive::extract_listed(&f, target, Limits::default(), l, &mut no_progress)
    };
    let target = tmp.path().join("t");
    extract(&good, &target, &listed(&[])).unwrap();
    let mut want: Vec<String> = manifest
        .files
        .keys()
        .map(|n| format!("checkpoint/{n}"))
        .collect();
    want.push("checkpoint".into());
    want.push("checkpoint/gpu-ckpt-manifest.json".into());
    want.sort();
    assert_eq!(tree(&target), want);
    let target = tmp.path().join("t2");
    extract(&good, &target, &listed(&["rootfs-diff.tar"])).unwrap();
    assert!(target.join("rootfs-diff.tar").is_file());
    assert!(!target.join("container.log").exists());

    // The good archive copied as `name`, each member's data through `edit`, then `add`'s
    // members appended; the signed manifest untouched.
    let copy = |name: &str, edit: &dyn Fn(&[u8], &mut Vec<u8>), add: &dyn Fn(&mut RawTar)| {
        let mut t = RawTar::new();
        let mut ar = tar::Archive::new(std::fs::File::open(&good).unwrap());
        for e in ar.entries().unwrap() {
            let mut e = e.unwrap();
            let mut data = Vec::new();
            std::io::Read::read_to_end(&mut e, &mut data).unwrap();
            let path = e.path_bytes().into_owned();
            edit(&path, &mut data);
            t.entry(&path, e.header().entry_type(), &data, None);
        }
        add(&mut t);
        let p = tmp.path().join(name);
        std::fs::write(&p, t.finish()).unwrap();
        p
    };
    let with = |name: &str, add: &dyn Fn(&mut RawTar)| copy(name, &|_, _| {}, add);
    let extra = with("extra.tar", &|t| {
        t.file("payload.bin", &[0x5a; 70_000]);
    });
    let target = tmp.path().join("t3");
    extract(&extra, &target, &listed(&[])).unwrap();
    assert!(!target.join("payload.bin").exists());
    for (name, add, needle) in [
        (
            "unlisted.tar",
            &(|t: &mut RawTar| {
                t.file("checkpoint/payload.img", b"x");
            }) as &dyn Fn(&mut RawTar),
            "file \"payload.img\": present but not listed in the manifest",
        ),
        (
            "link.tar",
            &|t: &mut RawTar| {
                t.entry(
                    b"checkpoint/gpu-ckpt-rootfs-changes.tar",
                    EntryType::Symlink,
                    b"",
                    Some(b"../rootfs-diff.tar"),
                );
            },
            "entry \"checkpoint/gpu-ckpt-rootfs-changes.tar\": checkpoint/ symbolic link entries are not allowed",
        ),
        (
            "nested.tar",
            &|t: &mut RawTar| {
                t.file("checkpoint/d/payload.img", b"x");
            },
            "entry \"checkpoint/d/payload.img\": nested checkpoint/ entries are not allowed",
        ),
    ] {
        let src = with(name, add);
        let target = tmp.path().join(format!("{name}.d"));
        let e = extract(&src, &target, &listed(&[])).unwrap_err();
        assert_eq!(e.to_string(), needle, "{name}");
        assert!(!target.exists() || tree(&target).is_empty(), "{name}: wrote {:?}", tree(&target));
        // The general extraction refuses links and nesting in checkpoint/ as well.
        if name != "unlisted.tar" {
            let e = archive::extract_archive(&src, &target, ExtractOptions::default(), &mut no_progress)
                .unwrap_err();
            assert_eq!(e.to_string(), needle, "{name}: extract_archive");
        }
    }

    // A listed file grown past its listed size: refused naming both sizes, nothing written.
    let (name, size) = manifest
        .files
        .iter()
        .map(|(n, f)| (n.clone(), f.size))
        .next()
        .unwrap();
    let grown = copy(
        "grown.tar",
        &|path, data| {
            if path == format!("checkpoint/{name}").as_bytes() {
                data.extend_from_slice(&[0x5a; 4096]);
            }
        },
        &|_| {},
    );
    let target = tmp.path().join("t4");
    let e = extract(&grown, &target, &listed(&[])).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "file {name:?}: size mismatch: manifest says {size} bytes, found {} bytes",
            size + 4096
        )
    );
    assert!(!target.exists() || tree(&target).is_empty());

    // A manifest other than the admitted one (changed between the two reads): refused.
    let mut other = json.clone();
    other.push(b'\n');
    let l = archive::Listed {
        manifest_json: &other,
        manifest: &manifest,
        also: &[],
    };
    let e = extract(&good, &tmp.path().join("t5"), &l).unwrap_err();
    assert!(matches!(e, Error::ChangedSinceChecked { .. }), "{e}");
}
