//! Host paths as the installer sees them through `--root` (the host's `/` mounted into the
//! pod, e.g. `/host`) and as containerd sees them (`--host-root`, `/` on a real node).
//!
//! A path inside the root is resolved component by component with the root as `/`: a host
//! symlink such as `/var/run -> /run` points into the host, never into the installer's pod.

use std::path::{Component, Path, PathBuf};

use crate::error::{Error, Result};

/// How many symlinks one resolution follows before it gives up (as the kernel's ELOOP).
const MAX_LINKS: usize = 40;

/// The node's filesystem as seen from the installer and from containerd.
#[derive(Debug, Clone)]
pub struct HostFs {
    /// Where the host's `/` is mounted here.
    pub root: PathBuf,
    /// Where that same tree is for containerd (written into its configuration).
    pub host_root: PathBuf,
}

impl HostFs {
    pub fn new(root: &Path, host_root: &Path) -> Result<HostFs> {
        for (what, p) in [("--root", root), ("--host-root", host_root)] {
            check_abs(what, p)?;
        }
        Ok(HostFs {
            root: root.to_path_buf(),
            host_root: host_root.to_path_buf(),
        })
    }

    /// `host_path` (absolute, as on the node) as it is reachable here, symlinks resolved
    /// inside the root. The last component is resolved too when it is a symlink.
    pub fn resolve(&self, host_path: &Path) -> Result<PathBuf> {
        Ok(self.root.join(self.resolve_rel(host_path, true)?))
    }

    /// Like [`resolve`](Self::resolve), but the last component is left as it is (for a path
    /// the installer itself makes a symlink, or removes).
    pub fn resolve_parent(&self, host_path: &Path) -> Result<PathBuf> {
        Ok(self.root.join(self.resolve_rel(host_path, false)?))
    }

    /// `host_path` as containerd reads it (`--host-root` joined).
    pub fn for_containerd(&self, host_path: &Path) -> PathBuf {
        self.host_root.join(strip_root(host_path))
    }

    fn resolve_rel(&self, host_path: &Path, follow_last: bool) -> Result<PathBuf> {
        check_abs("path", host_path)?;
        let mut todo: Vec<PathBuf> = strip_root(host_path)
            .components()
            .rev()
            .map(|c| PathBuf::from(c.as_os_str()))
            .collect();
        let mut done = PathBuf::new();
        let mut links = 0;
        while let Some(part) = todo.pop() {
            if part.as_os_str() == ".." {
                done.pop();
                continue;
            }
            if part.as_os_str() == "." {
                continue;
            }
            let candidate = done.join(&part);
            let is_last = todo.is_empty();
            let here = self.root.join(&candidate);
            let meta = std::fs::symlink_metadata(&here);
            match meta {
                Ok(m) if m.file_type().is_symlink() && (follow_last || !is_last) => {
                    links += 1;
                    if links > MAX_LINKS {
                        return Err(Error::BadPath {
                            what: "path",
                            path: host_path.to_path_buf(),
                            why: "too many levels of symbolic links",
                        });
                    }
                    let target =
                        std::fs::read_link(&here).map_err(Error::io("read link", &here))?;
                    if target.is_absolute() {
                        done = PathBuf::new();
                    }
                    for c in strip_root(&target).components().rev() {
                        todo.push(PathBuf::from(c.as_os_str()));
                    }
                }
                _ => done = candidate,
            }
        }
        Ok(done)
    }
}

/// An absolute path without `..`: what every path option must be.
pub fn check_abs(what: &'static str, p: &Path) -> Result<()> {
    if !p.is_absolute() {
        return Err(Error::BadPath {
            what,
            path: p.to_path_buf(),
            why: "it must be absolute",
        });
    }
    if p.components().any(|c| c == Component::ParentDir) {
        return Err(Error::BadPath {
            what,
            path: p.to_path_buf(),
            why: "it must not contain `..`",
        });
    }
    Ok(())
}

fn strip_root(p: &Path) -> &Path {
    p.strip_prefix("/").unwrap_or(p)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    #[test]
    fn absolute_links_stay_inside_the_root() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path();
        std::fs::create_dir_all(root.join("run")).unwrap();
        std::fs::create_dir_all(root.join("var")).unwrap();
        symlink("/run", root.join("var/run")).unwrap();
        symlink("../../etc", root.join("run/up")).unwrap();
        let fs = HostFs::new(root, Path::new("/")).unwrap();
        assert_eq!(
            fs.resolve(Path::new("/var/run/x")).unwrap(),
            root.join("run/x")
        );
        // `..` cannot climb above the root.
        assert_eq!(
            fs.resolve(Path::new("/run/up/passwd")).unwrap(),
            root.join("etc/passwd")
        );
        assert_eq!(
            fs.resolve_parent(Path::new("/var/run")).unwrap(),
            root.join("var/run")
        );
        assert!(fs.resolve(Path::new("relative")).is_err());
        assert!(HostFs::new(Path::new("/a/../b"), Path::new("/")).is_err());
    }
}
