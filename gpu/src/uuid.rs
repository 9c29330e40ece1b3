//! GPU UUIDs in NVML's form, and the old → new pairs a restore takes.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::GpuError;

/// A GPU's 16-byte UUID (`CUuuid`), printed as NVML prints it:
/// `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`, lowercase hex.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GpuUuid(pub [u8; 16]);

/// Bytes in each dash-separated group.
const GROUPS: [usize; 5] = [4, 2, 2, 2, 6];

impl fmt::Display for GpuUuid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("GPU")?;
        let mut bytes = self.0.iter();
        for n in GROUPS {
            f.write_str("-")?;
            for b in bytes.by_ref().take(n) {
                write!(f, "{b:02x}")?;
            }
        }
        Ok(())
    }
}

impl fmt::Debug for GpuUuid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl FromStr for GpuUuid {
    type Err = GpuError;

    /// Takes `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`, hex in either case.
    fn from_str(s: &str) -> Result<Self, GpuError> {
        let bad = |reason| GpuError::InvalidUuid {
            input: s.to_string(),
            reason,
        };
        let rest = s
            .strip_prefix("GPU-")
            .ok_or_else(|| bad("does not start with \"GPU-\""))?;
        let groups: Vec<&str> = rest.split('-').collect();
        if groups.len() != GROUPS.len() {
            return Err(bad(
                "expected 5 dash-separated groups (8-4-4-4-12 hex digits)",
            ));
        }
        let mut out = [0u8; 16];
        let mut at = 0;
        for (group, n) in groups.iter().zip(GROUPS) {
            if group.len() != 2 * n {
                return Err(bad("expected groups of 8-4-4-4-12 hex digits"));
            }
            for pair in group.as_bytes().chunks(2) {
                let hi = hex_digit(pair[0]).ok_or_else(|| bad("not a hex digit"))?;
                let lo = hex_digit(pair[1]).ok_or_else(|| bad("not a hex digit"))?;
                out[at] = hi << 4 | lo;
                at += 1;
            }
        }
        Ok(GpuUuid(out))
    }
}

fn hex_digit(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

impl Serialize for GpuUuid {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for GpuUuid {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// A GPU the process was checkpointed on, and the GPU to restore it onto.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct GpuPair {
    pub old: GpuUuid,
    pub new: GpuUuid,
}

impl GpuPair {
    /// Restoring onto the same GPU.
    pub fn is_identity(&self) -> bool {
        self.old == self.new
    }

    /// Parses `OLD=NEW[,OLD=NEW...]` (cuda-checkpoint's `--device-map`); empty gives no pairs.
    pub fn parse_map(s: &str) -> Result<Vec<GpuPair>, GpuError> {
        s.split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .map(|p| {
                let (old, new) = p.split_once('=').ok_or_else(|| {
                    GpuError::InvalidArgument(format!("device map entry {p:?} is not OLD=NEW"))
                })?;
                Ok(GpuPair {
                    old: old.trim().parse()?,
                    new: new.trim().parse()?,
                })
            })
            .collect()
    }
}

impl fmt::Display for GpuPair {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}={}", self.old, self.new)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: &str = "GPU-0123abcd-4567-89ef-fedc-ba9876543210";

    #[test]
    fn round_trip() {
        let u: GpuUuid = S.parse().unwrap();
        assert_eq!(
            u.0,
            [
                0x01, 0x23, 0xab, 0xcd, 0x45, 0x67, 0x89, 0xef, 0xfe, 0xdc, 0xba, 0x98, 0x76, 0x54,
                0x32, 0x10
            ]
        );
        assert_eq!(u.to_string(), S);
        assert_eq!(format!("{u:?}"), S);
        // Upper case is read, lower case printed.
        let up: GpuUuid = S.to_uppercase().parse().unwrap();
        assert_eq!(up, u);
        assert_eq!(
            GpuUuid([0xff; 16]).to_string(),
            "GPU-ffffffff-ffff-ffff-ffff-ffffffffffff"
        );
        assert_eq!(
            GpuUuid([0; 16]).to_string(),
            "GPU-00000000-0000-0000-0000-000000000000"
        );
    }

    #[test]
    fn bad_input() {
        for bad in [
            "",
            "GPU-",
            "0123abcd-4567-89ef-fedc-ba9876543210",
            "MIG-0123abcd-4567-89ef-fedc-ba9876543210",
            "gpu-0123abcd-4567-89ef-fedc-ba9876543210",
            "GPU-0123abcd-4567-89ef-fedc-ba987654321",
            "GPU-0123abcd-4567-89ef-fedc-ba98765432100",
            "GPU-0123abcd-4567-89ef-fedcba9876543210",
            "GPU-0123abcd-4567-89ef-fedc-ba98-76543210",
            "GPU-0123abcg-4567-89ef-fedc-ba9876543210",
            "GPU-0123abc-d4567-89ef-fedc-ba9876543210",
            "GPU-+123abcd-4567-89ef-fedc-ba9876543210",
            "GPU-0123abcd-4567-89ef-fedc-ba987654321é",
        ] {
            let e = bad.parse::<GpuUuid>().unwrap_err();
            assert!(matches!(e, GpuError::InvalidUuid { .. }), "{bad}: {e}");
            assert!(e.to_string().contains("invalid GPU UUID"), "{e}");
        }
    }

    #[test]
    fn serde_as_string() {
        let u: GpuUuid = S.parse().unwrap();
        let j = serde_json::to_string(&u).unwrap();
        assert_eq!(j, format!("\"{S}\""));
        assert_eq!(serde_json::from_str::<GpuUuid>(&j).unwrap(), u);
        assert!(serde_json::from_str::<GpuUuid>("\"GPU-nope\"").is_err());
        let p = GpuPair {
            old: u,
            new: GpuUuid([1; 16]),
        };
        let j = serde_json::to_string(&p).unwrap();
        assert_eq!(
            j,
            format!("{{\"old\":\"{S}\",\"new\":\"GPU-01010101-0101-0101-0101-010101010101\"}}")
        );
        assert_eq!(serde_json::from_str::<GpuPair>(&j).unwrap(), p);
    }

    #[test]
    fn device_map() {
        let other = "GPU-00000000-0000-0000-0000-000000000001";
        let pairs = GpuPair::parse_map(&format!("{S}={other}, {other}={S}")).unwrap();
        assert_eq!(pairs.len(), 2);
        assert_eq!(pairs[0].to_string(), format!("{S}={other}"));
        assert!(!pairs[1].is_identity());
        assert!(GpuPair::parse_map("").unwrap().is_empty());
        assert!(GpuPair::parse_map(S).is_err());
        assert!(GpuPair::parse_map(&format!("{S}=GPU-1")).is_err());
    }
}
