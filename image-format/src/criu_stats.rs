//! CRIU's dump statistics (`stats-dump`), as checkpointctl shows them.
//!
//! The file is a CRIU image: two magic words, then one size-prefixed protobuf `stats_entry`
//! (`images/stats.proto`) whose field 1 is a `dump_stats_entry`.

use serde::Serialize;

use crate::error::{Error, Result};
use crate::protowire::{bytes_field, fields, Value};

/// What CRIU measured while dumping, in microseconds and pages.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct DumpStats {
    pub freezing_time: u64,
    pub frozen_time: u64,
    pub memdump_time: u64,
    pub memwrite_time: u64,
    pub pages_scanned: u64,
    pub pages_written: u64,
}

/// The first entry of a CRIU image file: after its magic words (two for `stats-dump` and the
/// images CRIU writes with its common magic, one for `inventory.img`), a little-endian u32
/// size and that many bytes of protobuf. On a short file, what is missing.
pub fn first_entry(data: &[u8], magic_words: usize) -> std::result::Result<&[u8], &'static str> {
    let body = data
        .get(4 * magic_words..)
        .ok_or("shorter than its magic")?;
    let len = body
        .get(..4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
        .ok_or("no entry size")?;
    body.get(4..4 + len).ok_or("entry shorter than its size")
}

/// Parses a `stats-dump` file; `what` names it in errors.
pub fn parse_dump_stats(data: &[u8], what: &str) -> Result<DumpStats> {
    let bad = |reason: &str| Error::InvalidField {
        what: what.to_string(),
        field: "stats-dump".into(),
        reason: reason.to_string(),
    };
    let entry = first_entry(data, 2).map_err(bad)?;
    let entry = fields(entry).ok_or_else(|| bad("malformed stats entry"))?;
    let dump = bytes_field(&entry, 1).ok_or_else(|| bad("no dump statistics"))?;
    let mut s = DumpStats::default();
    for (n, v) in fields(dump).ok_or_else(|| bad("malformed dump statistics"))? {
        if let Value::Varint(v) = v {
            match n {
                1 => s.freezing_time = v,
                2 => s.frozen_time = v,
                3 => s.memdump_time = v,
                4 => s.memwrite_time = v,
                5 => s.pages_scanned = v,
                7 => s.pages_written = v,
                _ => {}
            }
        }
    }
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protowire::put_varint;

    #[test]
    fn dump_statistics_are_read() {
        let mut dump = Vec::new();
        for (field, v) in [
            (1u64, 120u64),
            (2, 350_000),
            (3, 2000),
            (4, 90_000),
            (5, 262_144),
            (6, 0),
            (7, 262_100),
        ] {
            put_varint(&mut dump, field << 3);
            put_varint(&mut dump, v);
        }
        let mut entry = vec![0x0a];
        put_varint(&mut entry, dump.len() as u64);
        entry.extend_from_slice(&dump);
        let mut file = vec![0u8; 8];
        file.extend_from_slice(&(entry.len() as u32).to_le_bytes());
        file.extend_from_slice(&entry);
        let s = parse_dump_stats(&file, "stats-dump").unwrap();
        assert_eq!(s.frozen_time, 350_000);
        assert_eq!(s.pages_written, 262_100);
        assert_eq!(s.freezing_time, 120);
        assert!(parse_dump_stats(&file[..10], "stats-dump").is_err());
    }
}
