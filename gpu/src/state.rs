//! `CUprocessState`, kept raw: newer drivers add states.

use std::borrow::Cow;
use std::fmt;

use serde::{Deserialize, Serialize};

/// A process's checkpoint state as `cuCheckpointProcessGetState` returns it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ProcessState(pub u32);

impl ProcessState {
    pub const RUNNING: ProcessState = ProcessState(0);
    pub const LOCKED: ProcessState = ProcessState(1);
    pub const CHECKPOINTED: ProcessState = ProcessState(2);
    /// An uncorrectable error during checkpoint or restore.
    pub const FAILED: ProcessState = ProcessState(3);
    /// Custom storage (CUDA 13.4): checkpoint under way.
    pub const CHECKPOINTING: ProcessState = ProcessState(4);
    /// Custom storage (CUDA 13.4): restore under way.
    pub const RESTORING: ProcessState = ProcessState(5);

    /// "running", "locked", "checkpointed", "failed", "checkpointing", "restoring", else
    /// "unknown(N)".
    pub fn name(self) -> Cow<'static, str> {
        match self.0 {
            0 => "running".into(),
            1 => "locked".into(),
            2 => "checkpointed".into(),
            3 => "failed".into(),
            4 => "checkpointing".into(),
            5 => "restoring".into(),
            n => format!("unknown({n})").into(),
        }
    }
}

impl fmt::Display for ProcessState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert_eq!(ProcessState::RUNNING.name(), "running");
        assert_eq!(ProcessState::LOCKED.name(), "locked");
        assert_eq!(ProcessState::CHECKPOINTED.name(), "checkpointed");
        assert_eq!(ProcessState::FAILED.name(), "failed");
        assert_eq!(ProcessState::CHECKPOINTING.name(), "checkpointing");
        assert_eq!(ProcessState::RESTORING.name(), "restoring");
        assert_eq!(ProcessState(6).name(), "unknown(6)");
        assert_eq!(ProcessState(u32::MAX).to_string(), "unknown(4294967295)");
        assert_eq!(ProcessState(2), ProcessState::CHECKPOINTED);
    }

    #[test]
    fn serde_is_the_raw_number() {
        assert_eq!(serde_json::to_string(&ProcessState(7)).unwrap(), "7");
        let s: ProcessState = serde_json::from_str("1").unwrap();
        assert_eq!(s, ProcessState::LOCKED);
    }
}
