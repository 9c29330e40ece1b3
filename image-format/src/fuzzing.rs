//! Entry points shared by the cargo-fuzz targets (image-format/fuzz) and the bounded stable-Rust fuzz
//! harness (tests/fuzz_bounded.rs). Each must never panic, whatever the input; errors are fine.

use std::io::Cursor;

use crate::archive::{self, ExtractOptions};
use crate::digest::no_progress;
use crate::manifest::Manifest;
use crate::safe::Limits;

/// Small limits so that a fuzzer cannot make us allocate or write much.
pub const FUZZ_LIMITS: Limits = Limits {
    max_entry_bytes: 1 << 20,
    max_total_bytes: 4 << 20,
    max_entries: 1000,
};

/// The archive reader: header scan with metadata, streaming verify, and (when `extract_to` is given)
/// a real extraction into that directory, which must stay inside it.
pub fn archive_reader(data: &[u8], extract_to: Option<&std::path::Path>) {
    let _ = archive::read_info_from(Cursor::new(data), FUZZ_LIMITS);
    let _ = archive::verify_stream(
        Cursor::new(data),
        data.len() as u64,
        FUZZ_LIMITS,
        &mut no_progress,
    );
    if let Some(dir) = extract_to {
        let opts = ExtractOptions {
            limits: FUZZ_LIMITS,
            verify: false,
        };
        let _ = archive::extract_stream(
            Cursor::new(data),
            dir,
            opts,
            data.len() as u64,
            &mut no_progress,
        );
    }
}

/// The manifest parser; a manifest that parses must also serialize and parse back to itself.
pub fn manifest_parser(data: &[u8]) {
    if let Ok(m) = Manifest::from_json(data, "fuzz") {
        let again = Manifest::from_json(&m.to_json(), "fuzz-roundtrip");
        assert_eq!(
            again.ok().as_ref(),
            Some(&m),
            "manifest round trip changed it"
        );
    }
}
