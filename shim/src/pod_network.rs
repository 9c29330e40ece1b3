//! A container's network addresses across a checkpoint: recorded at the checkpoint (the signed
//! manifest's `container.addresses`), and held at a restore that brings established TCP
//! connections back: those sockets are bound to the addresses of the namespace they were
//! dumped in, so they restore only into a namespace that has every recorded address.
//!
//! The addresses are read from inside the namespace: a thread of its own joins it (`setns`)
//! and reads the kernel's tables through `/proc/thread-self/net` (IPv4: `fib_trie`'s local
//! host routes; IPv6: `if_inet6`). The namespace is opened from the kernel's handle of the
//! checkpointed process (`/proc/<pid>/ns/net`) or, at a restore, from the path containerd put
//! in the spec (the sandbox's `/proc/<pid>/ns/net`, or a bind mount under `/var/run/netns`),
//! which only a network namespace passes (`setns` with `CLONE_NEWNET`); nothing in a
//! container's files is read.

use std::{
    collections::BTreeSet,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    os::fd::OwnedFd,
    path::Path,
};

use nix::{
    fcntl::{open, OFlag},
    sched::{setns, CloneFlags},
    sys::stat::Mode,
};
use oci_spec::runtime::{LinuxNamespaceType, Spec};
use tracing::info;

use crate::error::{Error, Result};

/// The addresses of the network namespace `ns` (loopback and link-local left out: every
/// namespace has the one, and the other is per link), sorted.
pub fn addresses_of(ns: OwnedFd, what: &str) -> Result<Vec<String>> {
    let what = what.to_string();
    let thread = std::thread::Builder::new()
        .name("netns-addresses".into())
        .spawn(move || -> Result<Vec<String>> {
            // This thread only: it ends right after, and no other thread is moved.
            setns(&ns, CloneFlags::CLONE_NEWNET).map_err(|e| {
                Error::FailedPrecondition(format!("join the network namespace of {what}: {e}"))
            })?;
            let read = |name: &str| {
                let path = format!("/proc/thread-self/net/{name}");
                std::fs::read_to_string(&path).map_err(Error::io(format!(
                    "read {path} in the network namespace of {what}"
                )))
            };
            let v4 = read("fib_trie")?;
            // No IPv6 in the namespace (or the kernel): no if_inet6.
            let v6 = read("if_inet6").unwrap_or_default();
            let mut all: BTreeSet<IpAddr> = local_ipv4(&v4).into_iter().map(IpAddr::V4).collect();
            all.extend(global_ipv6(&v6).into_iter().map(IpAddr::V6));
            Ok(all.into_iter().map(|a| a.to_string()).collect())
        })
        .map_err(Error::io("start the thread that reads a network namespace"))?;
    thread.join().map_err(|_| {
        Error::FailedPrecondition("the thread that reads a network namespace panicked".into())
    })?
}

/// The addresses of process `pid`'s network namespace.
pub fn addresses_of_pid(pid: i32) -> Result<Vec<String>> {
    let path = format!("/proc/{pid}/ns/net");
    let fd = open(
        Path::new(&path),
        OFlag::O_RDONLY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| Error::FailedPrecondition(format!("open {path}: {e}")))?;
    addresses_of(fd, &format!("pid {pid}"))
}

/// The network namespace a container of `spec` will run in, when it is not one of its own:
/// `Some((addresses, which))` for a namespace it joins (the spec's path) or the host's (no
/// network namespace in the spec: the shim's own, which runc passes on); `None` when runc
/// creates one for it, which CRIU restores with its addresses.
pub fn addresses_for_spec(spec: &Spec) -> Result<Option<(Vec<String>, String)>> {
    let entry = spec
        .linux()
        .as_ref()
        .and_then(|l| l.namespaces().as_ref())
        .and_then(|ns| ns.iter().find(|n| n.typ() == LinuxNamespaceType::Network));
    let (path, which) = match entry {
        Some(n) => match n.path() {
            Some(p) => (p.clone(), format!("network namespace {}", p.display())),
            None => return Ok(None),
        },
        None => (
            Path::new("/proc/self/ns/net").to_path_buf(),
            "the host's network namespace".to_string(),
        ),
    };
    // The path is containerd's, not the container's: the sandbox's `/proc/<pid>/ns/net` (a
    // kernel link to the namespace itself) or a bind mount of it under `/var/run/netns`.
    // Whatever it resolves to, `setns` joins only a network namespace.
    let fd = open(
        path.as_path(),
        OFlag::O_RDONLY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| Error::FailedPrecondition(format!("open {which}: {e}")))?;
    Ok(Some((addresses_of(fd, &which)?, which)))
}

/// Refuses a restore of established TCP connections into a namespace (`which`, with
/// addresses `here`) that lacks an address the checkpoint recorded (`recorded`; `None` for a
/// checkpoint from before the record). The error names both sets of addresses.
pub fn check_established(recorded: Option<&[String]>, here: &[String], which: &str) -> Result<()> {
    let Some(recorded) = recorded else {
        return Err(Error::FailedPrecondition(format!(
            "the checkpoint holds established TCP connections (gpu-ckpt.io/tcp: established) and its manifest does not record the addresses they are bound to (taken by an older gpu-ckpt), so they cannot be held to {which}'s; restore it with gpu-ckpt.io/tcp: close"
        )));
    };
    let missing: Vec<&String> = recorded.iter().filter(|a| !here.contains(a)).collect();
    if missing.is_empty() {
        info!(addresses = ?recorded, %which, "established TCP connections restore on the addresses they were dumped on");
        return Ok(());
    }
    let list = |v: &[String]| {
        if v.is_empty() {
            "none but loopback".to_string()
        } else {
            v.join(", ")
        }
    };
    Err(Error::FailedPrecondition(format!(
        "the checkpoint holds established TCP connections (gpu-ckpt.io/tcp: established) on the pod's addresses {}, and {which} has {} ({} missing): they restore only where the pod's IP is the one the checkpoint recorded; restore it with gpu-ckpt.io/tcp: close to have them closed",
        list(recorded),
        list(here),
        missing.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(", ")
    )))
}

/// The local IPv4 addresses of `/proc/net/fib_trie`: each `|-- ADDR` followed by a
/// `/32 host LOCAL` route; loopback (127/8) left out.
fn local_ipv4(fib_trie: &str) -> BTreeSet<Ipv4Addr> {
    let mut out = BTreeSet::new();
    let mut last: Option<Ipv4Addr> = None;
    for line in fib_trie.lines().map(str::trim) {
        if let Some(addr) = line.strip_prefix("|-- ") {
            last = addr.trim().parse().ok();
        } else if line.starts_with("/32 host LOCAL") {
            if let Some(a) = last.filter(|a| !a.is_loopback()) {
                out.insert(a);
            }
        }
    }
    out
}

/// The addresses of `/proc/net/if_inet6` of global (or site) scope: loopback (host scope,
/// 0x10) and link-local (0x20) left out.
fn global_ipv6(if_inet6: &str) -> BTreeSet<Ipv6Addr> {
    if_inet6
        .lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let (hex, scope) = (fields.first()?, fields.get(3)?);
            let scope = u8::from_str_radix(scope, 16).ok()?;
            if scope == 0x10 || scope == 0x20 || hex.len() != 32 {
                return None;
            }
            let bits = u128::from_str_radix(hex, 16).ok()?;
            Some(Ipv6Addr::from(bits))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const FIB_TRIE: &str = "Main:
  +-- 0.0.0.0/0 3 0 5
     |-- 0.0.0.0
        /0 universe UNICAST
     +-- 10.88.0.0/16 2 0 2
        +-- 10.88.0.0/30 2 0 2
           |-- 10.88.0.0
              /16 link UNICAST
           |-- 10.88.0.3
              /32 host LOCAL
        |-- 10.88.255.255
           /32 link BROADCAST
     +-- 127.0.0.0/8 2 0 2
        |-- 127.0.0.1
           /32 host LOCAL
Local:
  +-- 0.0.0.0/0 3 0 5
     |-- 10.88.0.3
        /32 host LOCAL
";

    const IF_INET6: &str = "\
00000000000000000000000000000001 01 80 10 80       lo
fe80000000000000a8c1abfffe0c0d0e 02 40 20 80     eth0
fd000000000000000000000000000007 02 40 00 80     eth0
";

    #[test]
    fn local_addresses_are_read_from_the_kernels_tables() {
        assert_eq!(
            local_ipv4(FIB_TRIE).into_iter().collect::<Vec<_>>(),
            vec![Ipv4Addr::new(10, 88, 0, 3)]
        );
        assert_eq!(
            global_ipv6(IF_INET6).into_iter().collect::<Vec<_>>(),
            vec!["fd00::7".parse::<Ipv6Addr>().unwrap()]
        );
    }

    #[test]
    fn this_threads_namespace_is_read() {
        // The host's loopback is left out; whatever else it has is sorted and unique.
        let mine = addresses_of_pid(std::process::id() as i32).unwrap();
        assert!(
            !mine.iter().any(|a| a == "127.0.0.1" || a == "::1"),
            "{mine:?}"
        );
        let mut sorted = mine.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(mine.len(), sorted.len());
    }

    #[test]
    fn established_connections_need_every_recorded_address() {
        let rec = vec!["10.88.0.3".to_string()];
        assert!(check_established(Some(&rec), &["10.88.0.3".into()], "ns").is_ok());
        assert!(check_established(Some(&[]), &[], "ns").is_ok());
        let e = check_established(Some(&rec), &["10.88.0.9".into()], "network namespace /x")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("addresses 10.88.0.3, and network namespace /x has 10.88.0.9"),
            "{e}"
        );
        let e = check_established(None, &[], "ns").unwrap_err().to_string();
        assert!(e.contains("does not record the addresses"), "{e}");
    }
}
