//! The containerd drop-ins of both handlers. Their content is runtime-class/containerd/'s
//! files (the one source of truth, compiled in). Both register the runc type
//! (`io.containerd.runc.v2`, so that CRI asks the handler for its features) with the shim as
//! `runtime_path`, each by its own name: the installer sets `runtime_path` to the handler's
//! link in `--bin-dir` (whatever containerd's PATH holds), and runc's keys from the site
//! options (`BinaryName`, `SystemdCgroup`); gpu-ckpt's own keys are in the side file
//! `<runtime_path>.toml`, which the installer writes from the site options.

use toml_edit::{DocumentMut, Item, Table};

use crate::error::{Error, Result};

/// runc's keys for the drop-ins.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Runc {
    pub binary_name: Option<String>,
    pub systemd_cgroup: bool,
}

/// The runtime type both handlers are registered with.
pub const RUNTIME_TYPE: &str = "io.containerd.runc.v2";

/// The shim's binary name.
pub const SHIM_BINARY: &str = "containerd-shim-gpu-ckpt-v1";

/// One handler's drop-in source.
#[derive(Debug, Clone, Copy)]
pub struct Source {
    /// The CRI runtime handler (and RuntimeClass handler) it registers.
    pub handler: &'static str,
    /// The file name under `--dropin-dir`.
    pub file: &'static str,
    /// runtime-class/containerd/<file>.
    pub text: &'static str,
    /// The shim's name for this handler in `--bin-dir` (its `runtime_path`): the shim itself,
    /// or a link to it. Its side file is this name with `.toml`.
    pub binary: &'static str,
    /// The handler restores (`Mode = "restore"` in its side file).
    pub mode_restore: bool,
}

/// Both handlers: `gpu-ckpt` and `gpu-ckpt-restore` (`Mode = "restore"`).
pub const SOURCES: [Source; 2] = [
    Source {
        handler: "gpu-ckpt",
        file: "gpu-ckpt.toml",
        text: include_str!("../../containerd/gpu-ckpt.toml"),
        binary: SHIM_BINARY,
        mode_restore: false,
    },
    Source {
        handler: "gpu-ckpt-restore",
        file: "gpu-ckpt-restore.toml",
        text: include_str!("../../containerd/gpu-ckpt-restore.toml"),
        binary: "containerd-shim-gpu-ckpt-restore-v1",
        mode_restore: true,
    },
];

const HEADER: &str = "# Installed by gpu-ckpt-node-installer from runtime-class/containerd/; `gpu-ckpt-node-installer uninstall` removes it.\n";

/// The drop-in for `src` with `runtime_path` set to `shim_path` (the handler's name for the
/// shim as containerd sees it) and runc's keys from `runc`, the source's comments and layout
/// kept.
pub fn render(src: &Source, shim_path: &str, runc: &Runc) -> Result<String> {
    let err = |why: String| Error::DropIn {
        name: src.file.to_string(),
        why,
    };
    let mut doc: DocumentMut = src.text.parse().map_err(|e: toml_edit::TomlError| {
        err(format!("not valid TOML: {}", e.to_string().trim()))
    })?;
    let runtimes = [
        "plugins",
        "io.containerd.cri.v1.runtime",
        "containerd",
        "runtimes",
    ];
    let mut t: &mut Table = doc.as_table_mut();
    for key in runtimes.iter().chain(std::iter::once(&src.handler)) {
        t = t
            .get_mut(key)
            .and_then(Item::as_table_mut)
            .ok_or_else(|| {
                err(format!(
                    "no table plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.{} (missing `{key}`)",
                    src.handler
                ))
            })?;
    }
    match t.get("runtime_type").and_then(Item::as_str) {
        Some(RUNTIME_TYPE) => {}
        other => {
            return Err(err(format!(
                "handler {} has runtime_type {other:?}, expected {RUNTIME_TYPE:?}",
                src.handler
            )))
        }
    }
    t.insert("runtime_path", toml_edit::value(shim_path));
    let options = t
        .get_mut("options")
        .and_then(Item::as_table_mut)
        .ok_or_else(|| err(format!("handler {} has no options table", src.handler)))?;
    if let Some(b) = &runc.binary_name {
        options.insert("BinaryName", toml_edit::value(b.as_str()));
    }
    if runc.systemd_cgroup {
        options.insert("SystemdCgroup", toml_edit::value(true));
    }
    Ok(format!("{HEADER}{doc}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_handlers_render_with_the_installed_shim() {
        for src in &SOURCES {
            let path = format!("/usr/local/bin/{}", src.binary);
            let out = render(src, &path, &Runc::default()).unwrap();
            let doc: DocumentMut = out.parse().unwrap();
            let h = &doc["plugins"]["io.containerd.cri.v1.runtime"]["containerd"]["runtimes"]
                [src.handler];
            assert_eq!(h["runtime_path"].as_str(), Some(path.as_str()));
            assert_eq!(h["runtime_type"].as_str(), Some(RUNTIME_TYPE));
            // runc's keys only: gpu-ckpt's own are in the side file.
            assert!(h["options"].get("Mode").is_none(), "{}", src.file);
            // No runc path given: no BinaryName, runc from containerd's PATH.
            assert!(h["options"].get("BinaryName").is_none(), "{}", src.file);
            // Everything of the source is still there, comments included.
            for line in src.text.lines().filter(|l| l.trim_start().starts_with('#')) {
                assert!(out.contains(line), "{}: lost {line:?}", src.file);
            }
        }
        let runc = Runc {
            binary_name: Some("/usr/bin/runc".into()),
            systemd_cgroup: true,
        };
        let restore = render(&SOURCES[1], "/x", &runc).unwrap();
        let doc: DocumentMut = restore.parse().unwrap();
        let o = &doc["plugins"]["io.containerd.cri.v1.runtime"]["containerd"]["runtimes"]
            ["gpu-ckpt-restore"]["options"];
        assert_eq!(o["BinaryName"].as_str(), Some("/usr/bin/runc"));
        assert_eq!(o["SystemdCgroup"].as_bool(), Some(true));
    }
}
