//! Shared helpers for the test workloads: hand-rolled flag parsing, line output with explicit
//! flushes, the memory pattern used by `memhog`, and signal helpers for running as PID 1.
//!
//! Everything here is std + libc so that the binaries link fully static.

use std::collections::BTreeMap;
use std::fmt;
use std::io::Write;
use std::path::Path;

/// Exit status for a bad command line (BSD `EX_USAGE`).
pub const EXIT_USAGE: i32 = 64;

/// Size of one pattern page.
pub const PAGE_SIZE: usize = 4096;
/// 64-bit words in one pattern page.
pub const PAGE_WORDS: usize = PAGE_SIZE / 8;

// ---------------------------------------------------------------------------------------------
// Output
// ---------------------------------------------------------------------------------------------

/// Prints one line to stdout and flushes it. Write errors are ignored on purpose: a workload
/// keeps running when its stdout goes away (for example after a restore without a log).
pub fn say(line: &str) {
    let out = std::io::stdout();
    let mut out = out.lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// Prints one line to stderr and flushes it; errors are ignored.
pub fn warn(line: &str) {
    let err = std::io::stderr();
    let mut err = err.lock();
    let _ = writeln!(err, "{line}");
    let _ = err.flush();
}

/// Replaces `path` with a file holding `text` (written beside it, then renamed over it; no
/// fsync), so a reader sees the old text or the new, never an empty or half-written file.
pub fn write_file(path: &Path, text: &str) -> std::io::Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".new");
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path)
}

// ---------------------------------------------------------------------------------------------
// Flags
// ---------------------------------------------------------------------------------------------

/// A command-line error, rendered with the program's usage line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UsageError {
    /// What was wrong.
    pub message: String,
}

impl fmt::Display for UsageError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for UsageError {}

fn usage_err(message: impl Into<String>) -> UsageError {
    UsageError {
        message: message.into(),
    }
}

/// Parsed `--name value` flags.
#[derive(Debug, Clone, Default)]
pub struct Flags {
    values: BTreeMap<String, String>,
}

impl Flags {
    /// Parses `args` (without the program name). Every flag takes exactly one value, given as
    /// `--name value` or `--name=value`; only names in `known` are accepted; a flag may appear
    /// once. `-h`/`--help` is reported as the error `help`.
    pub fn parse<I, S>(args: I, known: &[&str]) -> Result<Flags, UsageError>
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let mut values = BTreeMap::new();
        let mut it = args.into_iter().map(Into::into);
        while let Some(arg) = it.next() {
            if arg == "-h" || arg == "--help" {
                return Err(usage_err("help"));
            }
            let Some(body) = arg.strip_prefix("--") else {
                return Err(usage_err(format!("unexpected argument {arg:?}")));
            };
            let (name, value) = match body.split_once('=') {
                Some((n, v)) => (n.to_string(), v.to_string()),
                None => {
                    let v = it
                        .next()
                        .ok_or_else(|| usage_err(format!("flag --{body} needs a value")))?;
                    (body.to_string(), v)
                }
            };
            if !known.contains(&name.as_str()) {
                return Err(usage_err(format!("unknown flag --{name}")));
            }
            if values.insert(name.clone(), value).is_some() {
                return Err(usage_err(format!("flag --{name} given twice")));
            }
        }
        Ok(Flags { values })
    }

    /// The raw value of `--name`, if given.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.values.get(name).map(String::as_str)
    }

    /// `--name` as a string, or `default`.
    pub fn string(&self, name: &str, default: &str) -> String {
        self.get(name).unwrap_or(default).to_string()
    }

    /// `--name` as an unsigned number (decimal, or hex with `0x`), or `default`.
    pub fn u64_or(&self, name: &str, default: u64) -> Result<u64, UsageError> {
        match self.get(name) {
            None => Ok(default),
            Some(v) => parse_u64(v)
                .ok_or_else(|| usage_err(format!("--{name}: {v:?} is not an unsigned number"))),
        }
    }

    /// `--name` as an unsigned number; an error when it is missing.
    pub fn u64_required(&self, name: &str) -> Result<u64, UsageError> {
        if self.get(name).is_none() {
            return Err(usage_err(format!("flag --{name} is required")));
        }
        self.u64_or(name, 0)
    }
}

/// Parses a decimal or `0x` hexadecimal unsigned number.
pub fn parse_u64(s: &str) -> Option<u64> {
    if let Some(h) = s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        u64::from_str_radix(h, 16).ok()
    } else {
        s.parse().ok()
    }
}

/// Parses the process arguments with `known` flags; on error prints the message and `usage`
/// to stderr and exits with [`EXIT_USAGE`] (0 for `--help`, with the usage on stdout).
pub fn parse_or_exit(usage: &str, known: &[&str]) -> Flags {
    match Flags::parse(std::env::args().skip(1), known) {
        Ok(f) => f,
        Err(e) => exit_usage(usage, e),
    }
}

/// Prints a usage error and exits with [`EXIT_USAGE`] (or 0 with the usage for `help`).
pub fn exit_usage(usage: &str, e: UsageError) -> ! {
    if e.message == "help" {
        say(&format!("usage: {usage}"));
        std::process::exit(0);
    }
    let prog = std::env::args().next().unwrap_or_default();
    let prog = Path::new(&prog)
        .file_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    warn(&format!("{prog}: {e}"));
    warn(&format!("usage: {usage}"));
    std::process::exit(EXIT_USAGE);
}

// ---------------------------------------------------------------------------------------------
// Memory pattern
// ---------------------------------------------------------------------------------------------

/// One xorshift64 step (Marsaglia's 13/7/17 triple). Never returns 0 for a non-zero state.
#[inline]
pub fn xorshift64(state: &mut u64) -> u64 {
    let mut x = *state;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    *state = x;
    x
}

/// Initial generator state for page `page` under `seed`: `seed ^ page`, mixed so that nearby
/// pages start far apart, and never 0 (xorshift would stay at 0).
#[inline]
pub fn page_state(seed: u64, page: u64) -> u64 {
    let mut z = (seed ^ page).wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    if z == 0 {
        0x2545_f491_4f6c_dd1d
    } else {
        z
    }
}

/// Fills one page (`PAGE_WORDS` words) with the pattern of (`seed`, `page`).
pub fn fill_page(words: &mut [u64], seed: u64, page: u64) {
    let mut s = page_state(seed, page);
    for w in words.iter_mut() {
        *w = xorshift64(&mut s);
    }
}

/// True when one page holds exactly the pattern of (`seed`, `page`).
pub fn verify_page(words: &[u64], seed: u64, page: u64) -> bool {
    let mut s = page_state(seed, page);
    words.iter().all(|w| *w == xorshift64(&mut s))
}

/// Running checksum over page contents (FNV-1a style over 64-bit words).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Checksum(u64);

impl Default for Checksum {
    fn default() -> Self {
        Checksum(0xcbf2_9ce4_8422_2325)
    }
}

impl Checksum {
    /// Folds a page's words in.
    pub fn add(&mut self, words: &[u64]) {
        let mut h = self.0;
        for w in words {
            h = (h ^ *w).wrapping_mul(0x0000_0100_0000_01b3);
        }
        self.0 = h;
    }

    /// The value.
    pub fn value(&self) -> u64 {
        self.0
    }

    /// The value as 16 hex digits.
    pub fn hex(&self) -> String {
        format!("{:016x}", self.0)
    }
}

/// A buffer of whole pattern pages.
pub struct PatternBuffer {
    words: Vec<u64>,
    seed: u64,
}

/// The result of one verification pass.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PassResult {
    /// Pages checked.
    pub pages: usize,
    /// Checksum over all pages, in page order.
    pub checksum: Checksum,
    /// Pages that did not hold their pattern, in order.
    pub corrupt: Vec<usize>,
}

impl PatternBuffer {
    /// Allocates `pages` zeroed pages (lazily backed by the kernel).
    pub fn new(pages: usize, seed: u64) -> PatternBuffer {
        PatternBuffer {
            words: vec![0u64; pages * PAGE_WORDS],
            seed,
        }
    }

    /// Number of pages.
    pub fn pages(&self) -> usize {
        self.words.len() / PAGE_WORDS
    }

    /// The seed.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Fills every page with its pattern (this touches all memory); returns the checksum.
    pub fn fill(&mut self) -> Checksum {
        let mut sum = Checksum::default();
        let seed = self.seed;
        for (i, page) in self.words.chunks_exact_mut(PAGE_WORDS).enumerate() {
            fill_page(page, seed, i as u64);
            sum.add(page);
        }
        sum
    }

    /// Checks every page against its pattern.
    pub fn verify(&self) -> PassResult {
        let mut sum = Checksum::default();
        let mut corrupt = Vec::new();
        for (i, page) in self.words.chunks_exact(PAGE_WORDS).enumerate() {
            if !verify_page(page, self.seed, i as u64) {
                corrupt.push(i);
            }
            sum.add(page);
        }
        PassResult {
            pages: self.pages(),
            checksum: sum,
            corrupt,
        }
    }

    /// The memory as bytes (for tests and fault injection).
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        let len = self.words.len() * 8;
        // SAFETY: u64 has no invalid bit patterns and a stricter alignment than u8; the slice
        // covers exactly the vector's initialised elements and borrows it mutably.
        unsafe { std::slice::from_raw_parts_mut(self.words.as_mut_ptr().cast::<u8>(), len) }
    }
}

// ---------------------------------------------------------------------------------------------
// Signals
// ---------------------------------------------------------------------------------------------

extern "C" fn exit_by_signal(sig: libc::c_int) {
    // SAFETY: _exit is async-signal-safe.
    unsafe { libc::_exit(128 + sig) }
}

/// Makes SIGTERM and SIGINT end the process when it runs as PID 1 of a PID namespace.
///
/// The kernel ignores a signal with the default disposition sent to a namespace's init
/// process, so a PID-1 workload that keeps the default would never die by SIGTERM. There the
/// process exits with `128 + signal`, which is the status containerd reports for a death by
/// that signal. Elsewhere nothing changes: the default disposition kills the process.
pub fn terminate_on_signals_as_pid1() {
    // SAFETY: getpid has no preconditions.
    if unsafe { libc::getpid() } != 1 {
        return;
    }
    for sig in [libc::SIGTERM, libc::SIGINT] {
        // SAFETY: a zeroed sigaction with an async-signal-safe handler is valid.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = exit_by_signal as *const () as libc::sighandler_t;
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(sig, &sa, std::ptr::null_mut());
        }
    }
}

/// Sleeps `ms` milliseconds.
pub fn sleep_ms(ms: u64) {
    std::thread::sleep(std::time::Duration::from_millis(ms));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fill_then_verify_passes() {
        let mut b = PatternBuffer::new(64, 42);
        let filled = b.fill();
        let pass = b.verify();
        assert_eq!(pass.pages, 64);
        assert!(pass.corrupt.is_empty());
        assert_eq!(pass.checksum, filled);
        // Deterministic: the same seed gives the same checksum; another seed does not.
        let mut again = PatternBuffer::new(64, 42);
        assert_eq!(again.fill(), filled);
        let mut other = PatternBuffer::new(64, 43);
        assert_ne!(other.fill(), filled);
    }

    #[test]
    fn flipped_byte_is_detected() {
        let mut b = PatternBuffer::new(16, 7);
        let filled = b.fill();
        // Every byte position of a page, in a few pages, is covered by a word check.
        for &(page, off) in &[(0usize, 0usize), (3, 1), (9, 4095), (15, 2048)] {
            let i = page * PAGE_SIZE + off;
            b.bytes_mut()[i] ^= 0x01;
            let pass = b.verify();
            assert_eq!(pass.corrupt, vec![page], "flip at page {page} offset {off}");
            assert_ne!(pass.checksum, filled);
            b.bytes_mut()[i] ^= 0x01;
            assert!(b.verify().corrupt.is_empty());
        }
    }

    #[test]
    fn pages_differ_and_zero_state_is_avoided() {
        let mut a = vec![0u64; PAGE_WORDS];
        let mut c = vec![0u64; PAGE_WORDS];
        fill_page(&mut a, 0, 0);
        fill_page(&mut c, 0, 1);
        assert_ne!(a, c);
        assert!(a.iter().all(|w| *w != 0));
        assert!(verify_page(&a, 0, 0));
        assert!(!verify_page(&a, 0, 1));
        // A zeroed page never verifies.
        assert!(!verify_page(&vec![0u64; PAGE_WORDS], 5, 5));
    }

    #[test]
    fn flags_parse() {
        let f = Flags::parse(["--mib", "4", "--seed=0x10"], &["mib", "seed"]).unwrap();
        assert_eq!(f.u64_required("mib").unwrap(), 4);
        assert_eq!(f.u64_or("seed", 0).unwrap(), 16);
        assert_eq!(f.u64_or("interval-ms", 9).unwrap(), 9);
        assert!(Flags::parse(["--bogus", "1"], &["mib"])
            .unwrap_err()
            .message
            .contains("--bogus"));
        assert!(Flags::parse(["--mib"], &["mib"])
            .unwrap_err()
            .message
            .contains("needs a value"));
        assert!(Flags::parse(["stray"], &["mib"]).is_err());
        assert!(Flags::parse(["--mib", "1", "--mib", "2"], &["mib"]).is_err());
        let f = Flags::parse(["--mib", "x"], &["mib"]).unwrap();
        assert!(f.u64_required("mib").is_err());
        assert!(Flags::parse(Vec::<String>::new(), &["mib"])
            .unwrap()
            .u64_required("mib")
            .is_err());
    }
}
