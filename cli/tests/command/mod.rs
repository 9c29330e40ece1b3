//! Running the `gpu-ckpt` command of this build.
#![allow(dead_code)]

use std::process::Command;

/// `gpu-ckpt ARGS…` with the variables `unset` removed from its environment: exit code (-1 when
/// killed by a signal), stdout, stderr.
pub fn run(args: &[&str], unset: &[&str]) -> (i32, String, String) {
    let mut c = Command::new(env!("CARGO_BIN_EXE_gpu-ckpt"));
    c.args(args);
    for v in unset {
        c.env_remove(v);
    }
    let o = c.output().unwrap();
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}
