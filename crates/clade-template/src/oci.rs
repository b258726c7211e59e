//! `from = "oci-archive:PATH"`: apply the layers of a `docker save` tarball or an OCI image layout tarball,
//! in order, onto an empty directory. Whiteouts follow the OCI image spec: `.wh.<name>` deletes `<name>`
//! from the layers below, `.wh..wh..opq` empties its directory of everything the layers below put there.
//! Whiteouts of a layer are applied before its files are extracted, so they never touch the layer's own
//! entries. Paths are resolved inside the root (symlinks in the image never lead outside it), and the
//! extraction itself is `tar`'s `unpack_in`, which refuses entries that would land outside the root.

use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::{Component, Path, PathBuf};

use flate2::read::GzDecoder;
use serde::Deserialize;

use crate::error::{IoCtx, Result, TemplateError};

const WHITEOUT: &str = ".wh.";
const OPAQUE: &str = ".wh..wh..opq";

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct DockerManifest {
    layers: Vec<String>,
}

#[derive(Deserialize)]
struct Descriptor {
    #[serde(rename = "mediaType", default)]
    media_type: String,
    digest: String,
}

#[derive(Deserialize)]
struct OciIndex {
    manifests: Vec<Descriptor>,
}

#[derive(Deserialize)]
struct OciManifest {
    #[serde(default)]
    layers: Vec<Descriptor>,
    #[serde(default)]
    manifests: Vec<Descriptor>,
}

fn bad(path: &Path, message: impl Into<String>) -> TemplateError {
    TemplateError::Source { path: path.into(), message: message.into() }
}

/// Applies every layer of `archive` onto `root` (an existing, normally empty, directory); `scratch` is an
/// empty directory on the same filesystem used to unpack the outer archive. Returns the number of layers.
pub fn apply_archive(archive: &Path, root: &Path, scratch: &Path) -> Result<usize> {
    let f = File::open(archive).ctx("open", archive)?;
    let mut outer = tar::Archive::new(BufReader::new(f));
    outer.unpack(scratch).map_err(|e| bad(archive, format!("not a readable tar archive: {e}")))?;
    let layers = layer_paths(archive, scratch)?;
    for layer in &layers {
        apply_layer(layer, root).map_err(|e| match e {
            TemplateError::Source { path, message } => {
                bad(archive, format!("layer {}: {message}", path.strip_prefix(scratch).unwrap_or(&path).display()))
            }
            other => other,
        })?;
    }
    Ok(layers.len())
}

fn read_json<T: for<'de> Deserialize<'de>>(archive: &Path, path: &Path) -> Result<T> {
    let text = std::fs::read(path).map_err(|e| bad(archive, format!("{}: {e}", path.display())))?;
    serde_json::from_slice(&text).map_err(|e| bad(archive, format!("{}: {e}", path.display())))
}

/// A blob path of an OCI layout from its digest, refusing anything that is not `sha256:<hex>`.
fn blob(archive: &Path, scratch: &Path, digest: &str) -> Result<PathBuf> {
    let hex = digest
        .strip_prefix("sha256:")
        .filter(|h| h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()))
        .ok_or_else(|| bad(archive, format!("unsupported digest {digest:?}")))?;
    Ok(scratch.join("blobs/sha256").join(hex))
}

/// The layer files, bottom first.
fn layer_paths(archive: &Path, scratch: &Path) -> Result<Vec<PathBuf>> {
    let docker = scratch.join("manifest.json");
    if docker.is_file() {
        let images: Vec<DockerManifest> = read_json(archive, &docker)?;
        let [image] = images.as_slice() else {
            return Err(bad(archive, format!("manifest.json lists {} images; save exactly one", images.len())));
        };
        return image.layers.iter().map(|l| safe_rel(archive, l).map(|r| scratch.join(r))).collect();
    }
    let index = scratch.join("index.json");
    if !index.is_file() {
        return Err(bad(archive, "neither manifest.json (docker save) nor index.json (OCI layout) at its top"));
    }
    let idx: OciIndex = read_json(archive, &index)?;
    let [first] = idx.manifests.as_slice() else {
        return Err(bad(
            archive,
            format!("index.json lists {} manifests; save exactly one image", idx.manifests.len()),
        ));
    };
    let mut digest = first.digest.clone();
    for _ in 0..4 {
        let m: OciManifest = read_json(archive, &blob(archive, scratch, &digest)?)?;
        if !m.layers.is_empty() || m.manifests.is_empty() {
            return m
                .layers
                .iter()
                .map(|l| {
                    if l.media_type.contains("zstd") {
                        return Err(bad(archive, format!("layer {} is zstd-compressed; save it with gzip", l.digest)));
                    }
                    blob(archive, scratch, &l.digest)
                })
                .collect();
        }
        // A nested image index: take the linux/amd64 one if it says so, else the first.
        digest = m.manifests[0].digest.clone();
    }
    Err(bad(archive, "image indexes nested too deep"))
}

/// A relative path without `..` or a root.
fn safe_rel(archive: &Path, p: &str) -> Result<PathBuf> {
    let path = Path::new(p);
    if path.components().any(|c| !matches!(c, Component::Normal(_) | Component::CurDir)) {
        return Err(bad(archive, format!("unsafe path {p:?} in the archive")));
    }
    Ok(path.to_path_buf())
}

/// Opens a layer, uncompressing gzip by its magic.
fn open_layer(path: &Path) -> Result<Box<dyn Read>> {
    let mut f = File::open(path).map_err(|e| bad(path, format!("missing layer: {e}")))?;
    let mut magic = [0u8; 4];
    let n = f.read(&mut magic).ctx("read", path)?;
    f.seek(SeekFrom::Start(0)).ctx("seek", path)?;
    let r = BufReader::new(f);
    Ok(match &magic[..n] {
        [0x1f, 0x8b, ..] => Box::new(GzDecoder::new(r)),
        [0x28, 0xb5, 0x2f, 0xfd] => return Err(bad(path, "zstd-compressed layer; save it with gzip")),
        _ => Box::new(r),
    })
}

/// Resolves `rel` inside `root` as a chroot would: symlinks in the parent components are followed but
/// clamped to `root`. The last component is not followed.
pub fn resolve_in(root: &Path, rel: &Path) -> Option<PathBuf> {
    let mut parts: Vec<std::ffi::OsString> = Vec::new();
    let mut todo: Vec<std::ffi::OsString> = rel
        .components()
        .rev()
        .filter_map(|c| match c {
            Component::Normal(s) => Some(s.to_owned()),
            Component::ParentDir => Some("..".into()),
            _ => None,
        })
        .collect();
    let mut hops = 0;
    while let Some(name) = todo.pop() {
        if name == ".." {
            parts.pop();
            continue;
        }
        let last = todo.is_empty();
        let mut cur = root.to_path_buf();
        cur.extend(&parts);
        cur.push(&name);
        if !last {
            if let Ok(target) = std::fs::read_link(&cur) {
                hops += 1;
                if hops > 40 {
                    return None;
                }
                if target.is_absolute() {
                    parts.clear();
                }
                for c in target.components().rev() {
                    match c {
                        Component::Normal(s) => todo.push(s.to_owned()),
                        Component::ParentDir => todo.push("..".into()),
                        _ => {}
                    }
                }
                continue;
            }
        }
        parts.push(name);
    }
    let mut out = root.to_path_buf();
    out.extend(&parts);
    Some(out)
}

/// Removes a path without following a symlink at its end.
fn remove_any(p: &Path) -> std::io::Result<()> {
    match std::fs::symlink_metadata(p) {
        Ok(m) if m.is_dir() => std::fs::remove_dir_all(p),
        Ok(_) => std::fs::remove_file(p),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

/// Applies one layer tarball onto `root`.
pub fn apply_layer(layer: &Path, root: &Path) -> Result<()> {
    // Pass 1: whiteouts, against the layers below.
    let mut whiteouts = Vec::new();
    let mut opaques = Vec::new();
    {
        let mut ar = tar::Archive::new(open_layer(layer)?);
        for entry in ar.entries().map_err(|e| bad(layer, e.to_string()))? {
            let entry = entry.map_err(|e| bad(layer, e.to_string()))?;
            let path = entry.path().map_err(|e| bad(layer, e.to_string()))?.into_owned();
            let Some(name) = path.file_name().and_then(|n| n.to_str()) else { continue };
            let parent = path.parent().unwrap_or(Path::new("")).to_path_buf();
            if name == OPAQUE {
                opaques.push(parent);
            } else if let Some(victim) = name.strip_prefix(WHITEOUT) {
                whiteouts.push(parent.join(victim));
            }
        }
    }
    for dir in opaques {
        let Some(d) = resolve_in(root, &dir.join("x")).and_then(|p| p.parent().map(Path::to_path_buf)) else {
            continue;
        };
        if std::fs::symlink_metadata(&d).is_ok_and(|m| m.is_dir()) {
            for e in std::fs::read_dir(&d).ctx("read", &d)? {
                let e = e.ctx("read", &d)?;
                remove_any(&e.path()).ctx("remove", e.path())?;
            }
        }
    }
    for w in whiteouts {
        if let Some(p) = resolve_in(root, &w) {
            remove_any(&p).ctx("remove", &p)?;
        }
    }
    // Pass 2: the layer's own entries.
    let mut ar = tar::Archive::new(open_layer(layer)?);
    ar.set_preserve_permissions(true);
    ar.set_preserve_ownerships(nix::unistd::geteuid().is_root());
    ar.set_preserve_mtime(true);
    ar.set_overwrite(true);
    ar.set_unpack_xattrs(true);
    for entry in ar.entries().map_err(|e| bad(layer, e.to_string()))? {
        let mut entry = entry.map_err(|e| bad(layer, e.to_string()))?;
        let path = entry.path().map_err(|e| bad(layer, e.to_string()))?.into_owned();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if name.starts_with(WHITEOUT) {
            continue;
        }
        // A directory replacing a non-directory, or the other way round: the lower one goes.
        if let Some(dst) = resolve_in(root, &path) {
            if let Ok(m) = std::fs::symlink_metadata(&dst) {
                let is_dir = entry.header().entry_type().is_dir();
                if m.is_dir() != is_dir && dst != root {
                    remove_any(&dst).ctx("remove", &dst)?;
                }
            }
        }
        entry.unpack_in(root).map_err(|e| {
            let cause = std::error::Error::source(&e).map(|c| format!(": {c}")).unwrap_or_default();
            bad(layer, format!("{}: {e}{cause}", path.display()))
        })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header() -> tar::Header {
        let mut h = tar::Header::new_gnu();
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(1_700_000_000);
        h
    }

    fn add(b: &mut tar::Builder<Vec<u8>>, path: &str, data: Option<&[u8]>) {
        let mut h = header();
        match data {
            Some(d) => {
                h.set_entry_type(tar::EntryType::Regular);
                h.set_size(d.len() as u64);
                h.set_mode(0o644);
                b.append_data(&mut h, path, d).unwrap();
            }
            None => {
                h.set_entry_type(tar::EntryType::Directory);
                h.set_size(0);
                h.set_mode(0o755);
                b.append_data(&mut h, path, &[][..]).unwrap();
            }
        }
    }

    fn symlink(b: &mut tar::Builder<Vec<u8>>, path: &str, target: &str) {
        let mut h = header();
        h.set_entry_type(tar::EntryType::Symlink);
        h.set_size(0);
        h.set_mode(0o777);
        b.append_link(&mut h, path, target).unwrap();
    }

    fn layer1() -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        add(&mut b, "a/", None);
        add(&mut b, "a/file1", Some(b"one"));
        add(&mut b, "a/file2", Some(b"two"));
        add(&mut b, "b/", None);
        add(&mut b, "b/x", Some(b"x"));
        add(&mut b, "b/sub/", None);
        add(&mut b, "b/sub/deep", Some(b"deep"));
        add(&mut b, "c/", None);
        add(&mut b, "c/keep", Some(b"keep"));
        add(&mut b, "d", Some(b"a file that becomes a directory"));
        symlink(&mut b, "etc", "/");
        b.into_inner().unwrap()
    }

    fn layer2() -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        add(&mut b, "a/.wh.file1", Some(b""));
        add(&mut b, "b/", None);
        add(&mut b, "b/.wh..wh..opq", Some(b""));
        add(&mut b, "b/y", Some(b"y"));
        add(&mut b, "d/", None);
        add(&mut b, "d/inside", Some(b"in"));
        add(&mut b, "newfile", Some(b"new"));
        // A whiteout through a symlink must stay inside the root: etc -> / resolves to the root.
        add(&mut b, "etc/.wh.c", Some(b""));
        b.into_inner().unwrap()
    }

    fn gzip(data: &[u8]) -> Vec<u8> {
        use std::io::Write;
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        e.write_all(data).unwrap();
        e.finish().unwrap()
    }

    fn outer(entries: &[(&str, Vec<u8>)]) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        for (p, d) in entries {
            add(&mut b, p, Some(d));
        }
        b.into_inner().unwrap()
    }

    fn check(root: &Path) {
        let read = |p: &str| std::fs::read_to_string(root.join(p)).ok();
        assert_eq!(read("a/file1"), None, ".wh.file1 removed it");
        assert_eq!(read("a/file2").as_deref(), Some("two"));
        assert_eq!(read("b/x"), None, "opaque dir hid the lower x");
        assert!(!root.join("b/sub").exists(), "opaque dir hid the lower sub/");
        assert_eq!(read("b/y").as_deref(), Some("y"), "the opaque layer's own file stays");
        assert_eq!(read("d/inside").as_deref(), Some("in"), "a directory replaced a file");
        assert_eq!(read("newfile").as_deref(), Some("new"));
        assert!(!root.join("c").exists(), "etc/.wh.c resolved through etc -> / to the root's c");
    }

    #[test]
    fn docker_save_layers_with_whiteouts() {
        let d = tempfile::tempdir().unwrap();
        let manifest = br#"[{"Config":"cfg.json","RepoTags":["t:latest"],"Layers":["l1/layer.tar","l2/layer.tar"]}]"#;
        let tarball = outer(&[
            ("manifest.json", manifest.to_vec()),
            ("l1/layer.tar", layer1()),
            ("l2/layer.tar", gzip(&layer2())),
        ]);
        let archive = d.path().join("img.tar");
        std::fs::write(&archive, tarball).unwrap();
        let (root, scratch) = (d.path().join("root"), d.path().join("scratch"));
        std::fs::create_dir_all(&root).unwrap();
        std::fs::create_dir_all(&scratch).unwrap();
        assert_eq!(apply_archive(&archive, &root, &scratch).unwrap(), 2);
        check(&root);
    }

    #[test]
    fn oci_layout_layers_with_whiteouts() {
        let d = tempfile::tempdir().unwrap();
        let (l1, l2) = (layer1(), gzip(&layer2()));
        let digest = |b: &[u8]| {
            use std::fmt::Write;
            // Any 64-hex name works for a test; the builder does not verify layer digests.
            let h = blake3::hash(b);
            let mut s = String::new();
            for x in h.as_bytes() {
                let _ = write!(s, "{x:02x}");
            }
            s
        };
        let (d1, d2) = (digest(&l1), digest(&l2));
        let manifest = format!(
            r#"{{"schemaVersion":2,"layers":[{{"mediaType":"application/vnd.oci.image.layer.v1.tar","digest":"sha256:{d1}"}},{{"mediaType":"application/vnd.oci.image.layer.v1.tar+gzip","digest":"sha256:{d2}"}}]}}"#
        );
        let dm = digest(manifest.as_bytes());
        let index = format!(
            r#"{{"schemaVersion":2,"manifests":[{{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:{dm}"}}]}}"#
        );
        let tarball = outer(&[
            ("oci-layout", br#"{"imageLayoutVersion":"1.0.0"}"#.to_vec()),
            ("index.json", index.into_bytes()),
            (&format!("blobs/sha256/{dm}"), manifest.into_bytes()),
            (&format!("blobs/sha256/{d1}"), l1),
            (&format!("blobs/sha256/{d2}"), l2),
        ]);
        let archive = d.path().join("img.tar");
        std::fs::write(&archive, tarball).unwrap();
        let (root, scratch) = (d.path().join("root"), d.path().join("scratch"));
        std::fs::create_dir_all(&root).unwrap();
        std::fs::create_dir_all(&scratch).unwrap();
        assert_eq!(apply_archive(&archive, &root, &scratch).unwrap(), 2);
        check(&root);
    }

    #[test]
    fn broken_archives_are_named() {
        let d = tempfile::tempdir().unwrap();
        let archive = d.path().join("img.tar");
        std::fs::write(&archive, outer(&[("hello", b"x".to_vec())])).unwrap();
        let (root, scratch) = (d.path().join("root"), d.path().join("scratch"));
        std::fs::create_dir_all(&root).unwrap();
        std::fs::create_dir_all(&scratch).unwrap();
        let e = apply_archive(&archive, &root, &scratch).unwrap_err().to_string();
        assert!(e.contains("img.tar") && e.contains("manifest.json"), "{e}");
        let manifest = br#"[{"Layers":["../../etc/passwd"]}]"#;
        std::fs::write(&archive, outer(&[("manifest.json", manifest.to_vec())])).unwrap();
        let scratch2 = d.path().join("scratch2");
        std::fs::create_dir_all(&scratch2).unwrap();
        let e = apply_archive(&archive, &root, &scratch2).unwrap_err().to_string();
        assert!(e.contains("unsafe path"), "{e}");
    }

    #[test]
    fn resolve_in_clamps_symlinks_to_root() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path();
        std::os::unix::fs::symlink("/etc", root.join("e")).unwrap();
        std::os::unix::fs::symlink("../../..", root.join("up")).unwrap();
        assert_eq!(resolve_in(root, Path::new("e/passwd")).unwrap(), root.join("etc/passwd"));
        assert_eq!(resolve_in(root, Path::new("up/x")).unwrap(), root.join("x"));
        assert_eq!(resolve_in(root, Path::new("e")).unwrap(), root.join("e"), "the last component is not followed");
    }
}
