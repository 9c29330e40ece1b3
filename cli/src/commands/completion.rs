//! `gpu-ckpt completion SHELL`: the shell's completion script (clap_complete), on stdout.

use std::io::Write;

#[derive(clap::Args, Debug)]
pub struct CompletionArgs {
    /// The shell: bash, zsh, fish (also elvish, powershell).
    #[arg(value_enum)]
    pub shell: clap_complete::Shell,
}

/// Writes the script for `cmd` (the whole command line's definition).
pub fn write(a: &CompletionArgs, cmd: &mut clap::Command, out: &mut dyn Write) {
    clap_complete::generate(a.shell, cmd, "gpu-ckpt", out);
}
