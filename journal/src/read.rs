//! The readers: every record on the node ([`read_all`]), and the records as they come
//! ([`Tailer`]).

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::record::{decode, Bad};
use crate::{fsutil, Record, Result, CURRENT_FILE, MAX_RECORD_BYTES, PREVIOUS_FILE};

/// Lines that were not taken for records.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Skipped {
    /// Lines cut short (a writer killed mid-write) or not JSON lines of ours.
    pub torn: u64,
    /// Whole lines whose crc differs, or that are no record.
    pub corrupt: u64,
}

impl Skipped {
    pub fn total(&self) -> u64 {
        self.torn + self.corrupt
    }

    fn count(&mut self, bad: Bad) {
        match bad {
            Bad::Torn => self.torn += 1,
            Bad::Corrupt => self.corrupt += 1,
        }
    }
}

impl std::ops::AddAssign for Skipped {
    fn add_assign(&mut self, o: Skipped) {
        self.torn += o.torn;
        self.corrupt += o.corrupt;
    }
}

/// Every record in the journal in `dir`, oldest first (the previous segment, then the current
/// one), and the lines skipped. A missing directory holds no records.
pub fn read_all(dir: &Path) -> Result<(Vec<Record>, Skipped)> {
    let mut out = Vec::new();
    let skipped = scan(dir, |r| out.push(r))?;
    Ok((out, skipped))
}

/// Each record of the journal in `dir` given to `each`, oldest first, one at a time (the
/// journal is never held in memory whole): what [`read_all`] collects.
pub fn scan(dir: &Path, mut each: impl FnMut(Record)) -> Result<Skipped> {
    let mut skipped = Skipped::default();
    let Some(dirfd) = fsutil::open_dir(dir, false)? else {
        return Ok(skipped);
    };
    // The current file first: a rotation between the two opens makes `.1` the file already
    // open, read once.
    let cur = fsutil::open_read(&dirfd, dir, CURRENT_FILE)?;
    let prev = fsutil::open_read(&dirfd, dir, PREVIOUS_FILE)?;
    let cur_id = match &cur {
        Some(f) => Some(fsutil::id_of(f, &dir.join(CURRENT_FILE))?),
        None => None,
    };
    for (f, name) in [(prev, PREVIOUS_FILE), (cur, CURRENT_FILE)] {
        let Some(mut f) = f else { continue };
        let path = dir.join(name);
        if name == PREVIOUS_FILE && Some(fsutil::id_of(&f, &path)?) == cur_id {
            continue;
        }
        let mut lines = Lines::default();
        lines.feed_from(&mut f, &path, &mut each)?;
        lines.finish(&mut each);
        skipped += lines.skipped;
    }
    Ok(skipped)
}

/// Splits bytes into lines and lines into records.
#[derive(Debug, Default)]
struct Lines {
    /// The bytes after the last `\n`.
    pending: Vec<u8>,
    /// Dropping bytes up to the next `\n`: a line longer than any record (counted when `true`),
    /// or the rest of a line a tail started in the middle of (`false`).
    discard: Option<bool>,
    skipped: Skipped,
}

impl Lines {
    fn feed_from(&mut self, f: &mut File, path: &Path, out: &mut impl FnMut(Record)) -> Result<()> {
        let mut buf = vec![0u8; 256 << 10];
        loop {
            let n = match f.read(&mut buf) {
                Ok(0) => return Ok(()),
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(crate::Error::io("reading", path, e)),
            };
            self.feed(&buf[..n], out);
        }
    }

    fn feed(&mut self, mut data: &[u8], out: &mut impl FnMut(Record)) {
        while let Some(nl) = data.iter().position(|&b| b == b'\n') {
            let (line, rest) = (&data[..nl], &data[nl + 1..]);
            data = rest;
            if let Some(count) = self.discard.take() {
                if count {
                    self.skipped.torn += 1;
                }
                self.pending.clear();
                continue;
            }
            if self.pending.is_empty() {
                self.line(line, out);
            } else {
                let mut whole = std::mem::take(&mut self.pending);
                whole.extend_from_slice(line);
                self.line(&whole, out);
            }
        }
        if self.discard.is_some() {
            return;
        }
        self.pending.extend_from_slice(data);
        if self.pending.len() > MAX_RECORD_BYTES {
            self.pending.clear();
            self.discard = Some(true);
        }
    }

    fn line(&mut self, line: &[u8], out: &mut impl FnMut(Record)) {
        if line.is_empty() {
            return;
        }
        match decode(line) {
            Ok(r) => out(r),
            Err(bad) => self.skipped.count(bad),
        }
    }

    /// The end of a file that will not grow: what is left is a last line without its `\n` (a
    /// record when whole, else torn).
    fn finish(&mut self, out: &mut impl FnMut(Record)) {
        if self.discard.take() == Some(true) {
            self.skipped.torn += 1;
        }
        let rest = std::mem::take(&mut self.pending);
        self.line(&rest, out);
    }
}

/// Follows the journal in a directory: each [`poll`](Tailer::poll) returns the records appended
/// since the last one, across a rotation (the file it follows is kept open; when the current
/// file is another one, the rest of the old one is read, then the new one from its start; a
/// segment rotated in and out between two polls is read from `.1` when it is still there).
#[derive(Debug)]
pub struct Tailer {
    dir: PathBuf,
    /// The file followed and its (device, inode).
    file: Option<(File, (u64, u64))>,
    lines: Lines,
    /// The first poll reads `.1` first (a tail from the start).
    read_previous: bool,
}

impl Tailer {
    /// A tail of the journal in `dir`: from its end (`from_end`: only records appended after
    /// now) or from its oldest record. The directory may not exist yet.
    pub fn new(dir: &Path, from_end: bool) -> Result<Tailer> {
        let mut t = Tailer {
            dir: dir.to_path_buf(),
            file: None,
            lines: Lines::default(),
            read_previous: !from_end,
        };
        if from_end {
            if let Some(dirfd) = fsutil::open_dir(dir, false)? {
                let path = dir.join(CURRENT_FILE);
                if let Some(mut f) = fsutil::open_read(&dirfd, dir, CURRENT_FILE)? {
                    let end = f
                        .seek(SeekFrom::End(0))
                        .map_err(|e| crate::Error::io("reading", &path, e))?;
                    // In the middle of a line (being written, or torn): its rest is not ours.
                    if end > 0 {
                        let mut last = [0u8; 1];
                        std::os::unix::fs::FileExt::read_exact_at(&f, &mut last, end - 1)
                            .map_err(|e| crate::Error::io("reading", &path, e))?;
                        if last[0] != b'\n' {
                            t.lines.discard = Some(false);
                        }
                    }
                    let id = fsutil::id_of(&f, &path)?;
                    t.file = Some((f, id));
                }
            }
        }
        Ok(t)
    }

    /// Lines skipped so far (torn or corrupt).
    pub fn skipped(&self) -> Skipped {
        self.lines.skipped
    }

    /// The records appended since the last poll, oldest first.
    pub fn poll(&mut self) -> Result<Vec<Record>> {
        let mut out = Vec::new();
        let Some(dirfd) = fsutil::open_dir(&self.dir, false)? else {
            return Ok(out);
        };
        let cur_path = self.dir.join(CURRENT_FILE);
        let prev_path = self.dir.join(PREVIOUS_FILE);
        if std::mem::take(&mut self.read_previous) {
            // The current file first, as in read_all.
            let cur = fsutil::open_read(&dirfd, &self.dir, CURRENT_FILE)?;
            let cur_id = match &cur {
                Some(f) => Some(fsutil::id_of(f, &cur_path)?),
                None => None,
            };
            if let Some(mut prev) = fsutil::open_read(&dirfd, &self.dir, PREVIOUS_FILE)? {
                if Some(fsutil::id_of(&prev, &prev_path)?) != cur_id {
                    self.read_whole(&mut prev, &prev_path, &mut |r| out.push(r))?;
                }
            }
            if let (Some(f), Some(id)) = (cur, cur_id) {
                self.file = Some((f, id));
            }
        }
        loop {
            if let Some((f, _)) = &mut self.file {
                self.lines.feed_from(f, &cur_path, &mut |r| out.push(r))?;
            }
            let now = fsutil::id_at(&dirfd, &self.dir, CURRENT_FILE)?;
            let old = self.file.as_ref().map(|(_, id)| *id);
            let Some(now) = now else { break };
            if Some(now) == old {
                break;
            }
            // Rotated: the old file is whole; what is left of it is a torn line.
            if old.is_some() {
                self.lines.finish(&mut |r| out.push(r));
                self.lines.discard = None;
                // A segment that came and went into `.1` between two polls.
                if let Some(mut prev) = fsutil::open_read(&dirfd, &self.dir, PREVIOUS_FILE)? {
                    let pid = fsutil::id_of(&prev, &prev_path)?;
                    if Some(pid) != old && pid != now {
                        self.read_whole(&mut prev, &prev_path, &mut |r| out.push(r))?;
                    }
                }
            }
            match fsutil::open_read(&dirfd, &self.dir, CURRENT_FILE)? {
                Some(f) => {
                    let id = fsutil::id_of(&f, &cur_path)?;
                    self.file = Some((f, id));
                }
                None => {
                    self.file = None;
                    break;
                }
            }
        }
        Ok(out)
    }

    fn read_whole(
        &mut self,
        f: &mut File,
        path: &Path,
        out: &mut impl FnMut(Record),
    ) -> Result<()> {
        let mut lines = Lines::default();
        lines.feed_from(f, path, out)?;
        lines.finish(out);
        self.lines.skipped += lines.skipped;
        Ok(())
    }
}
