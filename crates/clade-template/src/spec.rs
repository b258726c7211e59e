//! The template spec: a TOML file that says how to make a root filesystem and how the sandbox made from it
//! is shaped. Parsing is strict (`deny_unknown_fields`): a misspelt key is an error naming the key and its
//! line, never a silently ignored setting. Relative paths resolve against the spec's own directory, so a
//! template directory can be moved or checked out anywhere.

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Component, Path, PathBuf};

use serde::{Deserialize, Serialize};
use toml::Spanned;

use crate::error::{Result, TemplateError};

/// The Debian mirror used when a spec names none.
pub const DEFAULT_MIRROR: &str = "http://deb.debian.org/debian";
pub const DEFAULT_MEMORY_MIB: u32 = 512;
pub const DEFAULT_VCPUS: u32 = 1;
pub const DEFAULT_DISK_GIB: u32 = 4;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSpec {
    name: Spanned<String>,
    base: Option<Spanned<String>>,
    from: Option<Spanned<String>>,
    mirror: Option<Spanned<String>>,
    #[serde(default)]
    packages: Vec<Spanned<String>>,
    #[serde(default)]
    files: BTreeMap<String, Spanned<String>>,
    provision: Option<Spanned<String>>,
    #[serde(default)]
    services: Vec<Spanned<RawService>>,
    ready: Option<Spanned<RawReady>>,
    memory_mib: Option<Spanned<u32>>,
    vcpus: Option<Spanned<u32>>,
    disk_gib: Option<Spanned<u32>>,
    #[serde(default)]
    network: Network,
    #[serde(default)]
    jail: Jail,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawService {
    name: String,
    command: String,
    port: Option<u16>,
    ready: Option<RawReady>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawReady {
    port: Option<u16>,
    url: Option<String>,
    file: Option<String>,
}

/// Where the root filesystem comes from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Source {
    /// `base = "debian:<suite>"`: `debootstrap --variant=minbase <suite>` from `mirror`.
    Debian { suite: String, mirror: String },
    /// `from = "dir:PATH"`: a copy of a directory.
    Dir { path: PathBuf },
    /// `from = "oci-archive:PATH"`: a `docker save` tarball or an OCI image layout tarball.
    OciArchive { path: PathBuf },
}

/// A readiness probe: a listening TCP port, an `http://` URL answering 2xx, or a path that exists.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Ready {
    Port(u16),
    Url(String),
    File(String),
}

impl Ready {
    /// The agent's readiness target (`wait_ready`), for the base build.
    pub fn to_agent(&self) -> clade_agent::ReadyTarget {
        match self {
            Ready::Port(port) => clade_agent::ReadyTarget::Port { port: *port },
            Ready::Url(url) => clade_agent::ReadyTarget::Url { url: url.clone() },
            Ready::File(path) => clade_agent::ReadyTarget::File { path: path.clone() },
        }
    }
}

/// A long-running program the agent starts at boot, in spec order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Service {
    pub name: String,
    /// A shell command line (run by `/bin/sh -c`).
    pub command: String,
    /// When the service counts as started; `None`: as soon as it is spawned.
    pub ready: Option<Ready>,
}

/// `[network]`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Network {
    /// Whether the sandbox may open connections beyond the host (default: no).
    #[serde(default)]
    pub egress: bool,
}

/// `[jail]`: what a ct sandbox of the template may relax of clade's jail (docs/security.md).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Jail {
    /// Set `no_new_privs` (default: yes). `false` lets setuid programs such as `sudo` work: they gain the
    /// sandbox root's bounded capabilities inside its own user namespace, nothing of the host.
    #[serde(default = "yes")]
    pub no_new_privs: bool,
}

impl Default for Jail {
    fn default() -> Jail {
        Jail { no_new_privs: true }
    }
}

pub(crate) fn yes() -> bool {
    true
}

/// A file or directory copied into the root filesystem.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    /// Absolute path inside the root filesystem.
    pub dest: String,
    /// Absolute path on the host.
    pub src: PathBuf,
}

/// A parsed, validated spec with every path resolved.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TemplateSpec {
    pub name: String,
    /// The spec file itself.
    pub path: PathBuf,
    pub source: Source,
    /// Sorted, without duplicates.
    pub packages: Vec<String>,
    /// Sorted by destination.
    pub files: Vec<FileEntry>,
    pub provision: Option<PathBuf>,
    pub services: Vec<Service>,
    pub ready: Option<Ready>,
    pub memory_mib: u32,
    pub vcpus: u32,
    pub disk_gib: u32,
    pub network: Network,
    pub jail: Jail,
}

/// Line (1-based) of a byte offset.
fn line_of(text: &str, span: Range<usize>) -> usize {
    text[..span.start.min(text.len())].matches('\n').count() + 1
}

fn valid_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 64
        && s.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        && !s.starts_with(['.', '-'])
}

/// Debian policy: lower case letters, digits, `+ - .`, starting with a letter or digit; an optional
/// `=version` or `/suite` suffix is passed through to apt.
fn valid_package(s: &str) -> bool {
    let name = s.split(['=', '/']).next().unwrap_or("");
    let rest = &s[name.len()..];
    name.len() >= 2
        && name.starts_with(|c: char| c.is_ascii_lowercase() || c.is_ascii_digit())
        && name.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '+' | '-' | '.'))
        && rest.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '=' | '/' | '+' | '-' | '.' | '~' | ':'))
}

/// An absolute destination without `..`, normalised (no trailing slash, no `.`).
fn normal_dest(dest: &str) -> Option<String> {
    let p = Path::new(dest);
    if !p.is_absolute() {
        return None;
    }
    let mut out = String::new();
    for c in p.components() {
        match c {
            Component::RootDir | Component::CurDir => {}
            Component::Normal(s) => {
                out.push('/');
                out.push_str(s.to_str()?);
            }
            Component::ParentDir | Component::Prefix(_) => return None,
        }
    }
    (!out.is_empty()).then_some(out)
}

impl TemplateSpec {
    /// Reads and validates a spec file.
    pub fn load(path: &Path) -> Result<TemplateSpec> {
        let text =
            std::fs::read_to_string(path).map_err(|source| TemplateError::ReadSpec { path: path.into(), source })?;
        let abs = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
        Self::parse(&text, &abs)
    }

    /// Parses spec text as if it were the file at `path` (paths resolve against its directory).
    pub fn parse(text: &str, path: &Path) -> Result<TemplateSpec> {
        let raw: RawSpec =
            toml::from_str(text).map_err(|e| TemplateError::Parse { path: path.into(), message: e.to_string() })?;
        let dir = path.parent().map(Path::to_path_buf).unwrap_or_default();
        let invalid = |span: Range<usize>, message: String| TemplateError::Invalid {
            path: path.into(),
            line: line_of(text, span),
            message,
        };
        let existing = |key: String, v: &Spanned<String>| -> Result<PathBuf> {
            let file = dir.join(v.get_ref());
            if std::fs::symlink_metadata(&file).is_err() {
                return Err(TemplateError::MissingFile { spec: path.into(), line: line_of(text, v.span()), key, file });
            }
            Ok(file)
        };

        if !valid_name(raw.name.get_ref()) {
            return Err(invalid(
                raw.name.span(),
                format!("name {:?}: use letters, digits, `-`, `_`, `.` (at most 64)", raw.name.get_ref()),
            ));
        }

        let source = match (&raw.base, &raw.from) {
            (Some(b), None) => {
                let suite = b.get_ref().strip_prefix("debian:").filter(|s| valid_name(s)).ok_or_else(|| {
                    invalid(
                        b.span(),
                        format!("base {:?}: the only base is `debian:<suite>`, e.g. `debian:bookworm`", b.get_ref()),
                    )
                })?;
                let mirror = raw.mirror.as_ref().map(|m| m.get_ref().clone()).unwrap_or_else(|| DEFAULT_MIRROR.into());
                if let Some(m) = &raw.mirror {
                    if !(m.get_ref().starts_with("http://")
                        || m.get_ref().starts_with("https://")
                        || m.get_ref().starts_with("file:/"))
                        || m.get_ref().chars().any(char::is_whitespace)
                    {
                        return Err(invalid(
                            m.span(),
                            format!("mirror {:?}: give an http://, https:// or file:/ URL", m.get_ref()),
                        ));
                    }
                }
                Source::Debian { suite: suite.to_string(), mirror }
            }
            (None, Some(f)) => {
                let v = f.get_ref();
                if let Some(p) = v.strip_prefix("dir:") {
                    let file = existing("from".into(), &Spanned::new(f.span(), p.to_string()))?;
                    if !file.is_dir() {
                        return Err(invalid(f.span(), format!("from: {} is not a directory", file.display())));
                    }
                    Source::Dir { path: file }
                } else if let Some(p) = v.strip_prefix("oci-archive:") {
                    let file = existing("from".into(), &Spanned::new(f.span(), p.to_string()))?;
                    Source::OciArchive { path: file }
                } else {
                    return Err(invalid(f.span(), format!("from {v:?}: use `dir:PATH` or `oci-archive:PATH`")));
                }
            }
            (Some(_), Some(f)) => return Err(invalid(f.span(), "give either `base` or `from`, not both".into())),
            (None, None) => {
                return Err(invalid(
                    raw.name.span(),
                    "no root filesystem: add `base = \"debian:bookworm\"` or `from = ...`".into(),
                ))
            }
        };
        if let (Some(m), false) = (&raw.mirror, matches!(source, Source::Debian { .. })) {
            return Err(invalid(m.span(), "`mirror` applies only to `base = \"debian:...\"`".into()));
        }

        let mut packages = Vec::new();
        for p in &raw.packages {
            if !valid_package(p.get_ref()) {
                return Err(invalid(p.span(), format!("package {:?} is not a valid Debian package name", p.get_ref())));
            }
            packages.push(p.get_ref().clone());
        }
        packages.sort();
        packages.dedup();

        let mut files = Vec::new();
        for (dest, src) in &raw.files {
            let d = normal_dest(dest).ok_or_else(|| {
                invalid(src.span(), format!("files: destination {dest:?} must be an absolute path without `..`"))
            })?;
            let src = existing(format!("files.\"{dest}\""), src)?;
            files.push(FileEntry { dest: d, src });
        }
        files.sort_by(|a, b| a.dest.cmp(&b.dest));

        let provision = match &raw.provision {
            Some(p) => {
                let f = existing("provision".into(), p)?;
                if !f.is_file() {
                    return Err(invalid(p.span(), format!("provision: {} is not a file", f.display())));
                }
                Some(f)
            }
            None => None,
        };

        let ready_of = |r: &RawReady, span: Range<usize>| -> Result<Ready> {
            match (r.port, &r.url, &r.file) {
                (Some(0), None, None) => Err(invalid(span, "ready: port 0 is not a port".into())),
                (Some(p), None, None) => Ok(Ready::Port(p)),
                (None, Some(u), None) if u.starts_with("http://") => Ok(Ready::Url(u.clone())),
                (None, Some(u), None) => Err(invalid(span, format!("ready: url {u:?} must start with http://"))),
                (None, None, Some(f)) if f.starts_with('/') => Ok(Ready::File(f.clone())),
                (None, None, Some(f)) => {
                    Err(invalid(span, format!("ready: file {f:?} must be an absolute path in the sandbox")))
                }
                _ => Err(invalid(span, "ready: give exactly one of `port`, `url`, `file`".into())),
            }
        };

        let mut services: Vec<Service> = Vec::new();
        for s in &raw.services {
            let span = s.span();
            let r = s.get_ref();
            if !valid_name(&r.name) {
                return Err(invalid(span, format!("service name {:?}: use letters, digits, `-`, `_`, `.`", r.name)));
            }
            if services.iter().any(|o| o.name == r.name) {
                return Err(invalid(span, format!("service {:?} is declared twice", r.name)));
            }
            if r.command.trim().is_empty() {
                return Err(invalid(span, format!("service {:?} has an empty command", r.name)));
            }
            let ready = match (r.port, &r.ready) {
                (Some(_), Some(_)) => {
                    return Err(invalid(span, format!("service {:?}: give `port` or `ready`, not both", r.name)))
                }
                (Some(p), None) => Some(ready_of(&RawReady { port: Some(p), url: None, file: None }, span)?),
                (None, Some(rr)) => Some(ready_of(rr, span)?),
                (None, None) => None,
            };
            services.push(Service { name: r.name.clone(), command: r.command.clone(), ready });
        }

        let ready = raw.ready.as_ref().map(|r| ready_of(r.get_ref(), r.span())).transpose()?;
        let positive = |v: &Option<Spanned<u32>>, key: &str, default: u32| -> Result<u32> {
            match v {
                None => Ok(default),
                Some(s) if *s.get_ref() == 0 => Err(invalid(s.span(), format!("{key} must be at least 1"))),
                Some(s) => Ok(*s.get_ref()),
            }
        };
        Ok(TemplateSpec {
            name: raw.name.into_inner(),
            path: path.into(),
            source,
            packages,
            files,
            provision,
            services,
            ready,
            memory_mib: positive(&raw.memory_mib, "memory_mib", DEFAULT_MEMORY_MIB)?,
            vcpus: positive(&raw.vcpus, "vcpus", DEFAULT_VCPUS)?,
            disk_gib: positive(&raw.disk_gib, "disk_gib", DEFAULT_DISK_GIB)?,
            network: raw.network,
            jail: raw.jail,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_in(dir: &Path, text: &str) -> Result<TemplateSpec> {
        TemplateSpec::parse(text, &dir.join("template.toml"))
    }

    #[test]
    fn full_spec_resolves_paths_and_sorts() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("a.txt"), "a").unwrap();
        std::fs::write(d.path().join("p.sh"), "true").unwrap();
        let s = parse_in(
            d.path(),
            r#"
name = "t1"
base = "debian:bookworm"
packages = ["python3", "curl", "python3"]
files = { "/etc/a.txt" = "a.txt", "/opt/x/" = "a.txt" }
provision = "p.sh"
services = [{ name = "web", command = "python3 -m http.server 8000", port = 8000 },
            { name = "flag", command = "touch /tmp/f", ready = { file = "/tmp/f" } }]
ready = { url = "http://127.0.0.1:8000/" }
memory_mib = 1024
disk_gib = 2
[network]
egress = true
[jail]
no_new_privs = false
"#,
        )
        .unwrap();
        assert_eq!(s.packages, vec!["curl", "python3"]);
        assert!(!s.jail.no_new_privs, "[jail] no_new_privs = false is read");
        assert_eq!(s.source, Source::Debian { suite: "bookworm".into(), mirror: DEFAULT_MIRROR.into() });
        assert_eq!(s.files[0].dest, "/etc/a.txt");
        assert_eq!(s.files[1].dest, "/opt/x");
        assert_eq!(s.files[0].src, d.path().join("a.txt"));
        assert_eq!(s.provision.as_deref(), Some(d.path().join("p.sh").as_path()));
        assert_eq!(s.services[0].ready, Some(Ready::Port(8000)));
        assert_eq!(s.services[1].ready, Some(Ready::File("/tmp/f".into())));
        assert_eq!(s.ready, Some(Ready::Url("http://127.0.0.1:8000/".into())));
        assert_eq!(
            s.ready.as_ref().unwrap().to_agent(),
            clade_agent::ReadyTarget::Url { url: "http://127.0.0.1:8000/".into() }
        );
        assert_eq!((s.memory_mib, s.vcpus, s.disk_gib, s.network.egress), (1024, DEFAULT_VCPUS, 2, true));
    }

    #[test]
    fn unknown_key_names_key_and_line() {
        let d = tempfile::tempdir().unwrap();
        let e = parse_in(d.path(), "name = \"x\"\nbase = \"debian:bookworm\"\npackage = [\"vim\"]\n").unwrap_err();
        let m = e.to_string();
        assert!(m.contains("line 3") && m.contains("package"), "{m}");
        let e =
            parse_in(d.path(), "name = \"x\"\nbase = \"debian:bookworm\"\n\n[network]\negres = true\n").unwrap_err();
        let m = e.to_string();
        assert!(m.contains("line 5") && m.contains("egres"), "{m}");
        let e = parse_in(d.path(), "name = \"x\"\nbase = \"debian:bookworm\"\nready = { prot = 1 }\n").unwrap_err();
        assert!(e.to_string().contains("line 3") && e.to_string().contains("prot"), "{e}");
    }

    #[test]
    fn bad_toml_names_line() {
        let d = tempfile::tempdir().unwrap();
        let e = parse_in(d.path(), "name = \"x\"\n\nbase = debian\n").unwrap_err();
        assert!(matches!(e, TemplateError::Parse { .. }));
        assert!(e.to_string().contains("line 3"), "{e}");
    }

    #[test]
    fn missing_file_names_file_key_and_line() {
        let d = tempfile::tempdir().unwrap();
        let e =
            parse_in(d.path(), "name = \"x\"\nbase = \"debian:bookworm\"\n\nfiles = { \"/etc/motd\" = \"motd\" }\n")
                .unwrap_err();
        match &e {
            TemplateError::MissingFile { line, key, file, .. } => {
                assert_eq!(*line, 4);
                assert_eq!(key, "files.\"/etc/motd\"");
                assert_eq!(file, &d.path().join("motd"));
            }
            other => panic!("{other}"),
        }
        assert!(e.to_string().contains(":4:"), "{e}");
        let e = parse_in(d.path(), "name = \"x\"\nbase = \"debian:bookworm\"\nprovision = \"nope.sh\"\n").unwrap_err();
        assert!(e.to_string().contains("nope.sh") && e.to_string().contains(":3:"), "{e}");
        let e = parse_in(d.path(), "name = \"x\"\nfrom = \"oci-archive:img.tar\"\n").unwrap_err();
        assert!(e.to_string().contains("img.tar"), "{e}");
    }

    #[test]
    fn invalid_values_are_refused_with_line() {
        let d = tempfile::tempdir().unwrap();
        let cases = [
            ("name = \"x\"\n", "no root filesystem"),
            ("name = \"x\"\nbase = \"ubuntu:jammy\"\n", "debian:<suite>"),
            ("name = \"x\"\nbase = \"debian:bookworm\"\nfrom = \"dir:.\"\n", "not both"),
            ("name = \"x\"\nbase = \"debian:bookworm\"\npackages = [\"-oAPT::x\"]\n", "not a valid Debian package"),
            ("name = \"x\"\nbase = \"debian:bookworm\"\nfiles = { \"rel\" = \"template.toml\" }\n", "absolute"),
            ("name = \"x\"\nbase = \"debian:bookworm\"\nready = { port = 1, file = \"/x\" }\n", "exactly one"),
            ("name = \"x\"\nbase = \"debian:bookworm\"\ndisk_gib = 0\n", "disk_gib"),
            ("name = \"../x\"\nbase = \"debian:bookworm\"\n", "name"),
            ("name = \"x\"\nfrom = \"dir:.\"\nmirror = \"http://m\"\n", "mirror"),
        ];
        std::fs::write(d.path().join("template.toml"), "").unwrap();
        for (text, want) in cases {
            let e = parse_in(d.path(), text).unwrap_err();
            assert!(e.to_string().contains(want), "{text:?}: {e}");
            assert!(matches!(e, TemplateError::Invalid { line, .. } if line >= 1), "{text:?}: {e}");
        }
    }
}
