//! containerd's configuration: the `imports` entries that reach the drop-ins, edited with
//! `toml_edit` so that the rest of the file (the user's formatting and comments) stays as it is.

use std::path::Path;

use toml_edit::{Array, DocumentMut, Item, Value};

use crate::error::{Error, Result};

/// The configuration a node without `config.toml` gets: containerd's defaults plus our imports.
const NEW_CONFIG_HEAD: &str =
    "# Written by gpu-ckpt-node-installer: containerd had no configuration file.\nversion = 3\n";

fn parse(path: &Path, text: &str) -> Result<DocumentMut> {
    text.parse::<DocumentMut>().map_err(|e| Error::Config {
        path: path.to_path_buf(),
        why: format!("not valid TOML: {}", e.to_string().trim()),
    })
}

fn imports_array<'d>(path: &Path, doc: &'d mut DocumentMut) -> Result<Option<&'d mut Array>> {
    let kind = match doc.get("imports") {
        None => return Ok(None),
        Some(item) if item.is_array() => None,
        Some(item) => Some(item.type_name()),
    };
    if let Some(kind) = kind {
        return Err(Error::Config {
            path: path.to_path_buf(),
            why: format!("`imports` is a {kind}, not an array of paths"),
        });
    }
    Ok(doc.get_mut("imports").and_then(Item::as_array_mut))
}

fn contains(a: &Array, entry: &str) -> bool {
    a.iter().any(|v| v.as_str() == Some(entry))
}

/// The configuration with every entry of `entries` in its `imports` (appended, in order, to
/// an existing array, or a new `imports` key), or `None` when all are there already.
/// `current` is `None` when the file does not exist.
pub fn add_imports(
    path: &Path,
    current: Option<&str>,
    entries: &[String],
) -> Result<Option<String>> {
    let text = current.unwrap_or(NEW_CONFIG_HEAD);
    let mut doc = parse(path, text)?;
    if let Some(v) = doc.get("version").and_then(Item::as_integer) {
        if v < 2 {
            return Err(Error::Config {
                path: path.to_path_buf(),
                why: format!(
                    "config version {v} is too old for containerd 2.x: migrate it (`containerd config migrate`) first"
                ),
            });
        }
    }
    let missing: Vec<&String> = match imports_array(path, &mut doc)? {
        Some(a) => entries.iter().filter(|e| !contains(a, e)).collect(),
        None => entries.iter().collect(),
    };
    if missing.is_empty() && current.is_some() {
        return Ok(None);
    }
    match imports_array(path, &mut doc)? {
        Some(a) => {
            for e in missing {
                a.push(e.as_str());
            }
        }
        None => {
            let mut a = Array::new();
            for e in missing {
                a.push(e.as_str());
            }
            // A new top-level key goes after the existing ones (`version`, `root`, ...), before
            // the first table, as containerd's own files have it.
            doc.insert("imports", Item::Value(Value::Array(a)));
        }
    }
    Ok(Some(doc.to_string()))
}

/// The configuration without `entries` in its `imports` (the key goes when it is left empty
/// and the installer made it), or `None` when none of them is there.
pub fn remove_imports(path: &Path, current: &str, entries: &[String]) -> Result<Option<String>> {
    let mut doc = parse(path, current)?;
    let Some(a) = imports_array(path, &mut doc)? else {
        return Ok(None);
    };
    let before = a.len();
    a.retain(|v| !v.as_str().is_some_and(|s| entries.iter().any(|e| e == s)));
    if a.len() == before {
        return Ok(None);
    }
    if a.is_empty() {
        doc.remove("imports");
    }
    Ok(Some(doc.to_string()))
}

/// Whether `text` imports `entry`.
pub fn imports(path: &Path, text: &str, entry: &str) -> Result<bool> {
    let mut doc = parse(path, text)?;
    Ok(imports_array(path, &mut doc)?.is_some_and(|a| contains(a, entry)))
}

#[cfg(test)]
mod tests {
    use super::*;

    const USER: &str = "# my node\nversion = 3\nroot = \"/var/lib/containerd\"   # big disk\n\n[grpc]\n  address = \"/run/containerd/containerd.sock\"\n";

    fn p() -> &'static Path {
        Path::new("/etc/containerd/config.toml")
    }

    #[test]
    fn adds_imports_keeping_everything_else() {
        let e = vec!["/etc/containerd/conf.d/gpu-ckpt.toml".to_string()];
        let out = add_imports(p(), Some(USER), &e).unwrap().unwrap();
        assert!(out
            .starts_with("# my node\nversion = 3\nroot = \"/var/lib/containerd\"   # big disk\n"));
        assert!(out.contains("imports = [\"/etc/containerd/conf.d/gpu-ckpt.toml\"]\n"));
        assert!(out.contains("\n[grpc]\n  address = \"/run/containerd/containerd.sock\"\n"));
        // The key sits before the first table, where containerd reads top-level keys.
        assert!(out.find("imports").unwrap() < out.find("[grpc]").unwrap());
        // Nothing new a second time.
        assert_eq!(add_imports(p(), Some(&out), &e).unwrap(), None);
        // Removing gives back the original bytes.
        assert_eq!(remove_imports(p(), &out, &e).unwrap().unwrap(), USER);
    }

    #[test]
    fn appends_to_an_existing_array_and_removes_only_its_own() {
        let text = "version = 3\nimports = [\"/etc/containerd/other.toml\"] # theirs\n";
        let e = vec!["/d/a.toml".to_string(), "/d/b.toml".to_string()];
        let out = add_imports(p(), Some(text), &e).unwrap().unwrap();
        assert!(imports(p(), &out, "/d/a.toml").unwrap());
        assert!(imports(p(), &out, "/etc/containerd/other.toml").unwrap());
        assert!(out.contains("# theirs"));
        let back = remove_imports(p(), &out, &e).unwrap().unwrap();
        assert!(back.contains("\"/etc/containerd/other.toml\""));
        assert!(!back.contains("/d/a.toml"));
        assert!(back.contains("# theirs"));
    }

    #[test]
    fn a_missing_file_gets_a_new_one_and_bad_ones_are_named() {
        let e = vec!["/d/a.toml".to_string()];
        let out = add_imports(p(), None, &e).unwrap().unwrap();
        assert!(out.contains("version = 3"));
        assert!(imports(p(), &out, "/d/a.toml").unwrap());
        let err = add_imports(p(), Some("imports = \"x\""), &e).unwrap_err();
        assert!(err.to_string().contains("`imports` is a string"), "{err}");
        let err = add_imports(p(), Some("version = 1\n"), &e).unwrap_err();
        assert!(err.to_string().contains("config version 1"), "{err}");
        let err = add_imports(p(), Some("[a\n"), &e).unwrap_err();
        assert!(
            err.to_string()
                .contains("/etc/containerd/config.toml: not valid TOML"),
            "{err}"
        );
    }
}
