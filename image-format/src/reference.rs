//! Image references and registry prefixes, parsed once, strictly, the same way everywhere the
//! product reads one (the CLI's `build --ref`, `pull`, the restore handler's registry sources
//! and its `RestoreSources` prefixes).
//!
//! The grammar is the distribution project's (`oci-spec`'s [`oci_spec::distribution::Reference`]
//! implements it): `host[:port]/component(/component)*[:tag][@digest]`, lowercase components of
//! `[a-z0-9]` joined by `.`, `_`, `__` or dashes. So a percent sign, a `..` component, userinfo
//! (`host@other`), a query or a fragment never parse. On top of the grammar:
//! - the registry is named, never implied (`name:1` is not Docker Hub's `library/name`);
//! - a tag is ASCII (the grammar's `\w` is Unicode in Rust's regex);
//! - a digest is `sha256:` and 64 lowercase hex digits: what a pull verifies the manifest
//!   against.

use oci_spec::distribution::Reference;

use crate::error::{Error, Result};

/// A parsed image reference: `registry/repository[:tag][@sha256:…]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageRef {
    registry: String,
    repository: String,
    tag: Option<String>,
    digest: Option<String>,
}

fn invalid(reference: &str, why: impl Into<String>) -> Error {
    Error::InvalidField {
        what: format!("reference {reference:?}"),
        field: "reference".into(),
        reason: why.into(),
    }
}

/// `host[:port]` checked: the grammar's domain, a port of 1 to 65535.
fn check_registry(registry: &str) -> std::result::Result<(), String> {
    let (host, port) = match registry.rsplit_once(':') {
        Some((h, p)) => (h, Some(p)),
        None => (registry, None),
    };
    let label_ok = |l: &str| {
        !l.is_empty()
            && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
            && !l.starts_with('-')
            && !l.ends_with('-')
    };
    if host.is_empty() || !host.split('.').all(label_ok) {
        return Err(format!("registry host {host:?} is not a host name"));
    }
    if let Some(p) = port {
        if !p.bytes().all(|b| b.is_ascii_digit()) || !matches!(p.parse::<u32>(), Ok(1..=65535)) {
            return Err(format!("registry port {p:?} is not a port number"));
        }
    }
    Ok(())
}

impl ImageRef {
    /// Parses `reference`, refusing anything outside the grammar and the rules above.
    pub fn parse(reference: &str) -> Result<ImageRef> {
        let parsed = Reference::try_from(reference).map_err(|e| {
            invalid(
                reference,
                format!("{e}: expected host[:port]/name[:tag][@sha256:digest] (lowercase name components, no percent-encoding, no '..', no user@host)"),
            )
        })?;
        // The grammar takes a first component without '.' or ':' (other than `localhost`) as
        // part of a Docker Hub name; here the registry is always named.
        let first = reference.split('/').next().unwrap_or_default();
        if !reference.contains('/') || parsed.registry() != first {
            return Err(invalid(
                reference,
                "no registry host: expected host[:port]/name[:tag] (a host has a '.' or a port, or is localhost)",
            ));
        }
        check_registry(first).map_err(|why| invalid(reference, why))?;
        let tag = parsed.tag().map(str::to_string);
        if let Some(t) = &tag {
            let ok = t.len() <= 128
                && t.bytes().enumerate().all(|(i, b)| {
                    b.is_ascii_alphanumeric() || b == b'_' || (i > 0 && (b == b'.' || b == b'-'))
                });
            if !ok {
                return Err(invalid(reference, format!("tag {t:?} is not a tag")));
            }
        }
        let digest = parsed.digest().map(str::to_string);
        if let Some(d) = &digest {
            if !d
                .strip_prefix("sha256:")
                .is_some_and(crate::manifest::is_sha256_hex)
            {
                return Err(invalid(
                    reference,
                    format!("digest {d:?} is not sha256: and 64 lowercase hex digits"),
                ));
            }
        }
        Ok(ImageRef {
            registry: first.to_string(),
            repository: parsed.repository().to_string(),
            tag,
            digest,
        })
    }

    /// `host[:port]` as written.
    pub fn registry(&self) -> &str {
        &self.registry
    }

    /// The repository path (`ckpt/counter`).
    pub fn repository(&self) -> &str {
        &self.repository
    }

    pub fn tag(&self) -> Option<&str> {
        self.tag.as_deref()
    }

    /// The `sha256:…` digest the reference pins, if it pins one.
    pub fn digest(&self) -> Option<&str> {
        self.digest.as_deref()
    }

    /// What the manifest is fetched by: the digest where there is one, else the tag
    /// (`latest` when none is written).
    pub fn manifest_reference(&self) -> &str {
        self.digest
            .as_deref()
            .or(self.tag.as_deref())
            .unwrap_or("latest")
    }

    /// Whether this reference lies under `prefix`: the same registry host (any case) and port,
    /// and the prefix's repository components as the first components of this one's (with more
    /// after them where the prefix ends in `/`).
    pub fn is_under(&self, prefix: &RegistryPrefix) -> bool {
        if !self.registry.eq_ignore_ascii_case(&prefix.registry) {
            return false;
        }
        let mine: Vec<&str> = self.repository.split('/').collect();
        mine.len() >= prefix.components.len() + usize::from(prefix.below)
            && mine.iter().zip(&prefix.components).all(|(m, p)| m == p)
    }
}

impl std::fmt::Display for ImageRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.registry, self.repository)?;
        if let Some(t) = &self.tag {
            write!(f, ":{t}")?;
        }
        if let Some(d) = &self.digest {
            write!(f, "@{d}")?;
        }
        Ok(())
    }
}

/// A registry prefix of `RestoreSources`: `host[:port]/` (any repository there),
/// `host[:port]/path/…/` (the repositories below `path/…`) or `host[:port]/path` (that
/// repository and those below it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegistryPrefix {
    registry: String,
    components: Vec<String>,
    /// Written with a trailing `/`: only repositories below the components.
    below: bool,
}

impl RegistryPrefix {
    /// Parses a prefix, held to the same grammar as a reference's registry and repository
    /// (a trailing `/` is optional; a tag or digest is not a prefix).
    pub fn parse(prefix: &str) -> Result<RegistryPrefix> {
        let bad = |why: String| Error::InvalidField {
            what: format!("registry prefix {prefix:?}"),
            field: "RestoreSources".into(),
            reason: why,
        };
        let trimmed = prefix.strip_suffix('/').unwrap_or(prefix);
        let (registry, path) = trimmed.split_once('/').unwrap_or((trimmed, ""));
        if path.is_empty() {
            check_registry(registry).map_err(bad)?;
            return Ok(RegistryPrefix {
                registry: registry.to_string(),
                components: Vec::new(),
                below: false,
            });
        }
        // The grammar for the rest: parse it as a reference with no tag.
        if path.contains([':', '@']) {
            return Err(bad("a prefix names no tag or digest".into()));
        }
        let r = ImageRef::parse(trimmed).map_err(|e| bad(e.to_string()))?;
        Ok(RegistryPrefix {
            registry: r.registry,
            components: r.repository.split('/').map(str::to_string).collect(),
            below: prefix.ends_with('/'),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const D: &str = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    #[test]
    fn references_that_parse() {
        let r = ImageRef::parse("localhost:5000/ckpt/counter:1").unwrap();
        assert_eq!(
            (r.registry(), r.repository(), r.tag(), r.digest()),
            ("localhost:5000", "ckpt/counter", Some("1"), None)
        );
        assert_eq!(r.manifest_reference(), "1");
        let r = ImageRef::parse("reg.example.com/app").unwrap();
        assert_eq!(r.manifest_reference(), "latest");
        let r = ImageRef::parse(&format!("reg.example.com/app@{D}")).unwrap();
        assert_eq!(
            (r.repository(), r.tag(), r.digest()),
            ("app", None, Some(D))
        );
        assert_eq!(r.manifest_reference(), D);
        assert_eq!(r.to_string(), format!("reg.example.com/app@{D}"));
        let r = ImageRef::parse(&format!("reg.example.com/a/b:v1.2@{D}")).unwrap();
        assert_eq!((r.tag(), r.manifest_reference()), (Some("v1.2"), D));
    }

    #[test]
    fn references_that_do_not() {
        for bad in [
            "registry.example.com/ckpt/%2e%2e/other/app:1",
            "registry.example.com/ckpt/../other/app:1",
            "registry.example.com@evil:443/x",
            "registry.example.com@evil.example:443/ckpt/x:1",
            "user:pw@registry.example.com/x:1",
            "registry.example.com/ckpt/x:1?x=y",
            "registry.example.com/ckpt/x:1#f",
            "registry.example.com/Ckpt/x:1",
            "registry.example.com//x:1",
            "registry.example.com/x:t\u{e9}",
            "registry.example.com/x@sha256:abc",
            "registry.example.com/x@sha512:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
            "registry.example.com:99999/x:1",
            "counter:1",
            "ckpt/counter:1",
            "",
            "registry.example.com/",
        ] {
            let e = ImageRef::parse(bad).unwrap_err().to_string();
            assert!(e.contains("reference"), "{bad}: {e}");
        }
    }

    #[test]
    fn prefixes_match_component_by_component() {
        let p = RegistryPrefix::parse("registry.example.com/ckpt/").unwrap();
        let under = |r: &str| ImageRef::parse(r).unwrap().is_under(&p);
        assert!(under("registry.example.com/ckpt/c:1"));
        assert!(under("registry.example.com/ckpt/a/b:1"));
        assert!(under("REGISTRY.example.com/ckpt/c:1"));
        assert!(under(&format!("registry.example.com/ckpt/c@{D}")));
        assert!(!under("registry.example.com/ckptx/c:1"));
        // Below `ckpt/`, not `ckpt` itself; a prefix without the `/` takes both.
        assert!(!under("registry.example.com/ckpt:1"));
        let bare = RegistryPrefix::parse("registry.example.com/ckpt").unwrap();
        for r in [
            "registry.example.com/ckpt:1",
            "registry.example.com/ckpt/c:1",
        ] {
            assert!(ImageRef::parse(r).unwrap().is_under(&bare), "{r}");
        }
        assert!(!under("registry.example.com:443/ckpt/c:1"));
        assert!(!under("registry.example.com.evil/ckpt/c:1"));
        assert!(!under("other.example.com/ckpt/c:1"));
        let host = RegistryPrefix::parse("registry.example.com/").unwrap();
        assert!(ImageRef::parse("registry.example.com/x:1")
            .unwrap()
            .is_under(&host));
        assert!(!ImageRef::parse("registry.example.com:5000/x:1")
            .unwrap()
            .is_under(&host));
        for bad in [
            "registry.example.com/ckpt/%2e%2e/",
            "registry.example.com/../",
            "registry.example.com@evil/",
            "registry.example.com/ckpt:1/",
            "/",
        ] {
            assert!(RegistryPrefix::parse(bad).is_err(), "{bad}");
        }
    }
}
