//! The containerd drop-ins of both handlers. Their content is runtime-class/containerd/'s
//! files (the one source of truth, compiled in); the installer adds only the path it installed
//! the shim to (`runtime_path`), so containerd starts that binary whatever its PATH holds.

use toml_edit::{DocumentMut, Item, Table};

use crate::error::{Error, Result};

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
}

/// Both handlers: `gpu-ckpt` and `gpu-ckpt-restore` (`Mode = "restore"`).
pub const SOURCES: [Source; 2] = [
    Source {
        handler: "gpu-ckpt",
        file: "gpu-ckpt.toml",
        text: include_str!("../../containerd/gpu-ckpt.toml"),
    },
    Source {
        handler: "gpu-ckpt-restore",
        file: "gpu-ckpt-restore.toml",
        text: include_str!("../../containerd/gpu-ckpt-restore.toml"),
    },
];

const HEADER: &str = "# Installed by gpu-ckpt-node-installer from runtime-class/containerd/; `gpu-ckpt-node-installer uninstall` removes it.\n";

/// The drop-in for `src` with `runtime_path` set to `shim_path` (the shim as containerd sees
/// it), the source's comments and layout kept.
pub fn render(src: &Source, shim_path: &str) -> Result<String> {
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
        Some(_) => {}
        None => return Err(err(format!("handler {} has no runtime_type", src.handler))),
    }
    t.insert("runtime_path", toml_edit::value(shim_path));
    Ok(format!("{HEADER}{doc}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_handlers_render_with_the_installed_shim() {
        for src in &SOURCES {
            let out = render(src, "/usr/local/bin/containerd-shim-gpu-ckpt-v1").unwrap();
            let doc: DocumentMut = out.parse().unwrap();
            let h = &doc["plugins"]["io.containerd.cri.v1.runtime"]["containerd"]["runtimes"]
                [src.handler];
            assert_eq!(
                h["runtime_path"].as_str(),
                Some("/usr/local/bin/containerd-shim-gpu-ckpt-v1")
            );
            assert_eq!(
                h["runtime_type"].as_str(),
                Some("io.containerd.gpu-ckpt.v1")
            );
            // Everything of the source is still there, comments included.
            for line in src.text.lines().filter(|l| l.trim_start().starts_with('#')) {
                assert!(out.contains(line), "{}: lost {line:?}", src.file);
            }
        }
        let restore = render(&SOURCES[1], "/x").unwrap();
        let doc: DocumentMut = restore.parse().unwrap();
        assert_eq!(
            doc["plugins"]["io.containerd.cri.v1.runtime"]["containerd"]["runtimes"]
                ["gpu-ckpt-restore"]["options"]["Mode"]
                .as_str(),
            Some("restore")
        );
    }
}
