//! Ids, times and the node's name for records.

use std::time::{Duration, SystemTime};

/// 16 hex digits from the kernel's random source (from the time and the pid where that fails).
pub fn new_id() -> String {
    let mut b = [0u8; 8];
    if getrandom::fill(&mut b).is_err() {
        let now = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default();
        let seed = format!("{}:{}", now.as_nanos(), std::process::id());
        b.copy_from_slice(&blake3::hash(seed.as_bytes()).as_bytes()[..8]);
    }
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// `t` in RFC 3339, UTC, milliseconds: `2026-01-02T03:04:05.678Z`.
pub fn rfc3339(t: SystemTime) -> String {
    humantime::format_rfc3339_millis(t).to_string()
}

/// Now, as [`rfc3339`].
pub fn now_rfc3339() -> String {
    rfc3339(SystemTime::now())
}

/// An RFC 3339 time: `Z` or a numeric offset (`+02:00`), fractions of a second optional.
pub fn parse_time(s: &str) -> Option<SystemTime> {
    let s = s.trim();
    if let Some(z) = s.strip_suffix('Z').or_else(|| s.strip_suffix('z')) {
        return humantime::parse_rfc3339_weak(&format!("{z}Z")).ok();
    }
    // `...+HH:MM` / `...-HH:MM`: the time at UTC, shifted back by the offset.
    let at = s.len().checked_sub(6)?;
    if !s.is_char_boundary(at) {
        return None;
    }
    let (head, off) = s.split_at(at);
    let sign = match off.as_bytes()[0] {
        b'+' => 1i64,
        b'-' => -1,
        _ => return None,
    };
    let (h, m) = off[1..].split_once(':')?;
    if h.len() != 2 || m.len() != 2 {
        return None;
    }
    let (h, m): (u64, u64) = (h.parse().ok()?, m.parse().ok()?);
    if h > 23 || m > 59 {
        return None;
    }
    let local = humantime::parse_rfc3339_weak(&format!("{head}Z")).ok()?;
    let shift = Duration::from_secs(h * 3600 + m * 60);
    if sign > 0 {
        local.checked_sub(shift)
    } else {
        local.checked_add(shift)
    }
}

/// The node's host name (`/proc/sys/kernel/hostname`), or `unknown`.
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "unknown".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_16_hex_and_differ() {
        let a = new_id();
        assert_eq!(a.len(), 16);
        assert!(a.bytes().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(a, new_id());
    }

    #[test]
    fn times_round_trip_with_offsets() {
        let t = SystemTime::UNIX_EPOCH + Duration::from_millis(1_767_323_045_678);
        let s = rfc3339(t);
        assert_eq!(s, "2026-01-02T03:04:05.678Z");
        assert_eq!(parse_time(&s), Some(t));
        assert_eq!(
            parse_time("2026-01-02T05:04:05.678+02:00"),
            Some(t),
            "an offset east"
        );
        assert_eq!(parse_time("2026-01-01T22:04:05.678-05:00"), Some(t));
        assert_eq!(
            parse_time("2026-01-02T03:04:05Z"),
            Some(t - Duration::from_millis(678))
        );
        assert_eq!(parse_time("yesterday"), None);
        assert_eq!(parse_time("2026-01-02T03:04:05+2:00"), None);
    }
}
