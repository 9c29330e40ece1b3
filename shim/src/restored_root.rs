//! The restored init's root, opened from the host, and paths in it opened without leaving it
//! or following a link: what the checks and edits of a restored tree start from.

use std::os::fd::{BorrowedFd, OwnedFd};

use nix::{
    fcntl::{openat2, OFlag, OpenHow, ResolveFlag},
    sys::stat::Mode,
};

use crate::error::{Error, Result};

/// Opens `path` (absolute in the container) from `root` without leaving it and without
/// following any symlink; `O_PATH`.
pub fn open_in_root(root: BorrowedFd<'_>, path: &str) -> nix::Result<OwnedFd> {
    let rel = path.trim_start_matches('/');
    let rel = if rel.is_empty() { "." } else { rel };
    openat2(
        root,
        rel,
        OpenHow::new()
            .flags(OFlag::O_PATH | OFlag::O_CLOEXEC | OFlag::O_NOFOLLOW)
            .resolve(
                ResolveFlag::RESOLVE_IN_ROOT
                    | ResolveFlag::RESOLVE_NO_SYMLINKS
                    | ResolveFlag::RESOLVE_NO_MAGICLINKS,
            ),
    )
}

/// The restored init's root, from the host.
pub fn open_root(pid: i32) -> Result<OwnedFd> {
    let path = format!("/proc/{pid}/root");
    nix::fcntl::open(
        path.as_str(),
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| Error::io(format!("open {path} of the restored init"))(e.into()))
}
