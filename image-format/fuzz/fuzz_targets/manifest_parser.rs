#![no_main]
//! The manifest parser on arbitrary bytes; a manifest that parses must round-trip.

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    image_format::fuzzing::manifest_parser(data);
});
