//! A template's identity: the BLAKE3 hash of a canonical JSON document listing everything that shapes its
//! root filesystem. Sources are named by content, never by host path, so moving a template directory keeps
//! its hash and editing one byte of one file changes it. The same document is what the ledger records as
//! the template's spec, so a ledger row and a cache directory always agree on what they mean.

use std::collections::BTreeMap;
use std::io::Read;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{IoCtx, Result, TemplateError};
use crate::spec::{Service, Source, TemplateSpec};

/// Bumped whenever the builder would make a different root filesystem from the same inputs.
pub const BUILDER_VERSION: u32 = 1;

/// The debootstrap variant every Debian template uses.
pub const DEBIAN_VARIANT: &str = "minbase";

/// Where the root filesystem comes from, by content.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum SourceId {
    Debian { suite: String, variant: String, mirror: String },
    Dir { content: String },
    OciArchive { content: String },
}

/// Everything that shapes a template's root filesystem.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Identity {
    pub builder: u32,
    pub name: String,
    pub source: SourceId,
    pub packages: Vec<String>,
    /// Destination -> content hash (file bytes and mode, or a tree hash).
    pub files: BTreeMap<String, String>,
    pub provision: Option<String>,
    pub services: Vec<Service>,
    /// The clade-agent binary installed at `/usr/lib/clade/clade-agent`, by content.
    pub agent: Option<String>,
    /// `[jail] no_new_privs = false` is part of what a base is booted with (its processes keep the flag
    /// through every mark), so it is part of the identity; the default leaves older hashes as they were.
    #[serde(default = "crate::spec::yes", skip_serializing_if = "is_yes")]
    pub no_new_privs: bool,
}

fn is_yes(b: &bool) -> bool {
    *b
}

impl Identity {
    /// Computes the identity of `spec` (reading every file it names) with an optional agent binary.
    pub fn of(spec: &TemplateSpec, agent: Option<&Path>) -> Result<Identity> {
        let source = match &spec.source {
            Source::Debian { suite, mirror } => {
                SourceId::Debian { suite: suite.clone(), variant: DEBIAN_VARIANT.into(), mirror: mirror.clone() }
            }
            Source::Dir { path } => SourceId::Dir { content: tree_hash(path, true)? },
            Source::OciArchive { path } => SourceId::OciArchive { content: file_hash(path)? },
        };
        let mut files = BTreeMap::new();
        for f in &spec.files {
            files.insert(f.dest.clone(), entry_hash(&f.src)?);
        }
        Ok(Identity {
            builder: BUILDER_VERSION,
            name: spec.name.clone(),
            source,
            packages: spec.packages.clone(),
            files,
            provision: spec.provision.as_deref().map(file_hash).transpose()?,
            services: spec.services.clone(),
            agent: agent.map(file_hash).transpose()?,
            no_new_privs: spec.jail.no_new_privs,
        })
    }

    /// The template's hash: 64 hex digits.
    pub fn hash(&self) -> String {
        // Serialising a struct of strings, vectors and BTreeMaps cannot fail and is deterministic.
        let doc = serde_json::to_vec(self).unwrap_or_default();
        blake3::hash(&doc).to_hex().to_string()
    }

    /// The document as JSON (what the ledger records).
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(self).unwrap_or(serde_json::Value::Null)
    }
}

/// BLAKE3 of a file's bytes, streamed.
pub fn file_hash(path: &Path) -> Result<String> {
    let mut f = std::fs::File::open(path).ctx("open", path)?;
    let mut h = blake3::Hasher::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).ctx("read", path)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finalize().to_hex().to_string())
}

/// The hash of a `files` source: a regular file (followed if a symlink) by bytes and permission bits, a
/// directory by its tree (ownership excluded: copied files are owned by root).
fn entry_hash(path: &Path) -> Result<String> {
    let md = std::fs::metadata(path).ctx("stat", path)?;
    if md.is_dir() {
        return tree_hash(path, false);
    }
    Ok(format!("{:o}:{}", md.permissions().mode() & 0o7777, file_hash(path)?))
}

/// A directory tree's hash: every entry by relative path, type, permission bits, (optionally) owner, and
/// content or link target, in sorted order. Symlinks are not followed.
pub fn tree_hash(root: &Path, with_owner: bool) -> Result<String> {
    let mut h = blake3::Hasher::new();
    for entry in walkdir::WalkDir::new(root).follow_links(false).sort_by_file_name() {
        let entry = entry.map_err(|e| TemplateError::Source {
            path: e.path().unwrap_or(root).to_path_buf(),
            message: format!("cannot walk: {e}"),
        })?;
        let p = entry.path();
        let rel = p.strip_prefix(root).unwrap_or(p);
        let md =
            entry.metadata().map_err(|e| TemplateError::Source { path: p.into(), message: format!("stat: {e}") })?;
        let ft = md.file_type();
        let kind = if ft.is_dir() {
            "d"
        } else if ft.is_file() {
            "f"
        } else if ft.is_symlink() {
            "l"
        } else {
            "s"
        };
        let mut line = format!("{kind} {:o}", md.mode() & 0o7777);
        if with_owner {
            line.push_str(&format!(" {}:{}", md.uid(), md.gid()));
        }
        if ft.is_file() {
            line.push(' ');
            line.push_str(&file_hash(p)?);
        } else if ft.is_symlink() {
            let t = std::fs::read_link(p).ctx("readlink", p)?;
            line.push_str(&format!(" -> {}", t.display()));
        } else if !ft.is_dir() {
            line.push_str(&format!(" rdev {}", md.rdev()));
        }
        let name = rel.as_os_str().as_encoded_bytes();
        h.update(&(name.len() as u64).to_le_bytes());
        h.update(name);
        h.update(&(line.len() as u64).to_le_bytes());
        h.update(line.as_bytes());
    }
    Ok(h.finalize().to_hex().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec_in(dir: &Path, extra: &str) -> TemplateSpec {
        let text = format!("name = \"t\"\nbase = \"debian:bookworm\"\nfiles = {{ \"/etc/a\" = \"a\", \"/opt/d\" = \"d\" }}\nprovision = \"p.sh\"\n{extra}");
        TemplateSpec::parse(&text, &dir.join("template.toml")).unwrap()
    }

    fn setup() -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("a"), "hello").unwrap();
        std::fs::write(d.path().join("p.sh"), "echo hi").unwrap();
        std::fs::create_dir(d.path().join("d")).unwrap();
        std::fs::write(d.path().join("d/x"), "x").unwrap();
        d
    }

    #[test]
    fn stable_and_path_independent() {
        let d1 = setup();
        let d2 = setup();
        let a = Identity::of(&spec_in(d1.path(), ""), None).unwrap().hash();
        assert_eq!(a, Identity::of(&spec_in(d1.path(), ""), None).unwrap().hash());
        assert_eq!(
            a,
            Identity::of(&spec_in(d2.path(), ""), None).unwrap().hash(),
            "moving the template keeps its hash"
        );
        assert_eq!(a.len(), 64);
        // Resources do not shape the root filesystem.
        assert_eq!(a, Identity::of(&spec_in(d1.path(), "memory_mib = 2048\n"), None).unwrap().hash());
    }

    #[test]
    fn changes_with_every_input() {
        let d = setup();
        let base = Identity::of(&spec_in(d.path(), ""), None).unwrap().hash();
        let mut seen = vec![base.clone()];
        let mut check = |h: String, what: &str| {
            assert!(!seen.contains(&h), "{what} did not change the hash");
            seen.push(h);
        };
        check(Identity::of(&spec_in(d.path(), "packages = [\"python3\"]\n"), None).unwrap().hash(), "packages");
        check(Identity::of(&spec_in(d.path(), "mirror = \"http://m/debian\"\n"), None).unwrap().hash(), "mirror");
        check(
            Identity::of(&spec_in(d.path(), "services = [{ name = \"s\", command = \"true\" }]\n"), None)
                .unwrap()
                .hash(),
            "services",
        );
        std::fs::write(d.path().join("agent"), "bin").unwrap();
        check(Identity::of(&spec_in(d.path(), ""), Some(&d.path().join("agent"))).unwrap().hash(), "agent");
        std::fs::write(d.path().join("a"), "hellO").unwrap();
        check(Identity::of(&spec_in(d.path(), ""), None).unwrap().hash(), "file content");
        std::fs::set_permissions(d.path().join("a"), std::fs::Permissions::from_mode(0o755)).unwrap();
        check(Identity::of(&spec_in(d.path(), ""), None).unwrap().hash(), "file mode");
        std::fs::write(d.path().join("d/y"), "y").unwrap();
        check(Identity::of(&spec_in(d.path(), ""), None).unwrap().hash(), "a file in a directory source");
        std::fs::write(d.path().join("p.sh"), "echo ho").unwrap();
        check(Identity::of(&spec_in(d.path(), ""), None).unwrap().hash(), "provision");
        // And back: same inputs, same hash as the last one.
        let last = Identity::of(&spec_in(d.path(), ""), None).unwrap().hash();
        assert_eq!(&last, seen.last().unwrap());
    }

    #[test]
    fn package_order_does_not_matter() {
        let d = setup();
        let a = Identity::of(&spec_in(d.path(), "packages = [\"less\", \"bash\"]\n"), None).unwrap().hash();
        let b = Identity::of(&spec_in(d.path(), "packages = [\"bash\", \"less\", \"bash\"]\n"), None).unwrap().hash();
        assert_eq!(a, b);
    }
}
