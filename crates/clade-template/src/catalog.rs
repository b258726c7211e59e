//! Listing and removing built templates. The cache directory is the source of truth for what exists on
//! this host; the ledger is asked whether a base still needs a template before it goes.

use std::path::PathBuf;

use crate::build::{read_record, TemplateRecord};
use crate::chroot::mounts_under;
use crate::error::{Result, TemplateError};
use crate::templates_dir;

/// Every built template in `home`, oldest first. A directory whose record cannot be read is skipped
/// (the next `build` of its spec rewrites it).
pub fn list(home: &clade_core::CladeHome) -> Result<Vec<TemplateRecord>> {
    let dir = templates_dir(home);
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir(&dir) else { return Ok(out) };
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.len() != 64 || !name.bytes().all(|b| b.is_ascii_hexdigit()) {
            continue;
        }
        if let Ok(Some(r)) = read_record(&e.path().join("template.json")) {
            out.push(r);
        }
    }
    out.sort_by(|a, b| a.built_ms.cmp(&b.built_ms).then(a.hash.cmp(&b.hash)));
    Ok(out)
}

/// The template named `key` (the newest of that name), or whose hash starts with `key` (at least 8 digits).
pub fn find(home: &clade_core::CladeHome, key: &str) -> Result<TemplateRecord> {
    let all = list(home)?;
    if let Some(r) = all.iter().rev().find(|r| r.name == key) {
        return Ok(r.clone());
    }
    let by_hash: Vec<&TemplateRecord> =
        all.iter().filter(|r| key.len() >= 8 && r.hash.starts_with(&key.to_ascii_lowercase())).collect();
    match by_hash.as_slice() {
        [] => Err(TemplateError::NotFound(key.into())),
        [one] => Ok((*one).clone()),
        _ => Err(TemplateError::Ambiguous(key.into())),
    }
}

/// What `remove` deleted.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Removed {
    pub name: String,
    pub hash: String,
    pub dir: PathBuf,
    /// The disk manifest deleted from the store, if there was one.
    pub manifest: Option<String>,
}

/// Removes a template's cache directory and its disk manifest, refusing while the ledger has a base of it.
pub fn remove(home: &clade_core::CladeHome, key: &str) -> Result<Removed> {
    let r = find(home, key)?;
    let ledger_path = home.ledger_path();
    if ledger_path.is_file() {
        let l = clade_ledger::Ledger::open(&ledger_path)?;
        let id = clade_ledger::TemplateId::new(r.hash.clone());
        for backend in [clade_ledger::Backend::Vm, clade_ledger::Backend::Ct] {
            if let Some(b) = l.base_for(&id, backend)? {
                return Err(TemplateError::InUse(format!(
                    "template {} ({}) is the {backend} base's template (mark {}); remove that base first",
                    r.name,
                    &r.hash[..16],
                    b.mark
                )));
            }
        }
    }
    let dir = templates_dir(home).join(&r.hash);
    if !mounts_under(&dir).is_empty() {
        return Err(TemplateError::InUse(format!(
            "{} is mounted (a ct sandbox uses it as its lower layer); stop it first",
            dir.display()
        )));
    }
    let mut manifest = None;
    if let Some(m) = r.disk.as_ref().and_then(|d| d.manifest.clone()) {
        if home.store_dir().is_dir() {
            if let Ok(id) = m.parse::<clade_store::ManifestId>() {
                let store = clade_store::Store::open(&home.store_dir(), clade_store::StoreConfig::default())?;
                if store.delete_manifest(&id)? {
                    manifest = Some(m);
                }
            }
        }
    }
    // Rename first so a half-deleted directory never looks like a template.
    let trash = home.tmp_dir().join(format!("rm-{}", r.hash));
    std::fs::create_dir_all(home.tmp_dir()).map_err(|e| TemplateError::Io {
        what: "create",
        path: home.tmp_dir(),
        source: e,
    })?;
    let _ = std::fs::remove_dir_all(&trash);
    std::fs::rename(&dir, &trash).map_err(|e| TemplateError::Io { what: "rename", path: dir.clone(), source: e })?;
    std::fs::remove_dir_all(&trash).map_err(|e| TemplateError::Io {
        what: "remove",
        path: trash.clone(),
        source: e,
    })?;
    Ok(Removed { name: r.name, hash: r.hash, dir, manifest })
}
