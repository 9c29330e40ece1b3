#![no_main]
//! The archive reader on arbitrary bytes: header scan, streaming verify, and extraction into a
//! fresh temporary directory. Must never panic; errors are expected.

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(tmp) = tempfile::tempdir() else { return };
    image_format::fuzzing::archive_reader(data, Some(&tmp.path().join("t")));
});
