//! The builder: spec -> cached root filesystem -> (vm) ext4 disk image in the store.
//!
//! Layout under `$CLADE_HOME/templates/`:
//! - `debootstrap-<key>/`: a pristine debootstrap per (suite, variant, mirror), reused by every template;
//! - `<hash>/rootfs/`: the template's root filesystem, never written after it is renamed into place (the
//!   `ct` backend mounts it as the overlay's lower layer);
//! - `<hash>/template.json`: the [`TemplateRecord`], written last, so a second build is a file read.
//!
//! Everything is built in a [`Scratch`] directory under `$CLADE_HOME/tmp` and renamed into place when
//! complete: a failed build leaves the cache exactly as it was.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use clade_core::time::now_ms;
use serde::{Deserialize, Serialize};

use crate::chroot::Scratch;
use crate::error::{IoCtx, Result, TemplateError};
use crate::identity::Identity;
use crate::spec::{Ready, Service, Source, TemplateSpec};
use crate::{debian, image, oci, rootfs, templates_dir};

/// What a build produced; stored as `<hash>/template.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TemplateRecord {
    pub name: String,
    pub hash: String,
    pub built_ms: u64,
    /// The spec file it was last built from.
    pub spec: PathBuf,
    pub rootfs: PathBuf,
    /// Bytes of regular files in the rootfs, and entries (files, dirs, links).
    pub rootfs_bytes: u64,
    pub rootfs_entries: u64,
    pub memory_mib: u32,
    pub vcpus: u32,
    pub disk_gib: u32,
    pub egress: bool,
    /// ct: the jail sets `no_new_privs` (`[jail]` in the spec; records of an older clade: yes).
    #[serde(default = "crate::spec::yes")]
    pub no_new_privs: bool,
    pub ready: Option<Ready>,
    pub services: Vec<Service>,
    /// `/etc/clade/provision.sh` exists in the rootfs.
    pub provision: bool,
    /// `/usr/lib/clade/clade-agent` exists in the rootfs.
    pub agent: bool,
    /// The vm backend's disk, once built.
    pub disk: Option<DiskRecord>,
    pub identity: Identity,
}

/// The ext4 image of the rootfs.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct DiskRecord {
    pub disk_gib: u32,
    /// The store manifest (64 hex digits).
    pub manifest: Option<String>,
    /// The image file, when kept (no store, or `keep_image`).
    pub image: Option<PathBuf>,
    pub apparent_bytes: u64,
    pub allocated_bytes: u64,
    /// Non-zero bytes of the image (zero blocks cost nothing in the store).
    pub nonzero_bytes: u64,
    /// Of those, bytes the store did not hold yet (duplicate blocks are stored once).
    pub new_bytes: u64,
    /// What the store appended to its packs for the new blocks (compressed).
    pub stored_bytes: u64,
}

/// Which backends to prepare for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backends {
    pub vm: bool,
    pub ct: bool,
}

impl Backends {
    pub const ALL: Backends = Backends { vm: true, ct: true };
    pub const VM: Backends = Backends { vm: true, ct: false };
    pub const CT: Backends = Backends { vm: false, ct: true };
}

/// One progress line: a step, the time since the build started, and what happened.
#[derive(Debug, Clone, Serialize)]
pub struct Progress {
    pub step: &'static str,
    pub elapsed: Duration,
    pub detail: String,
}

/// The outcome of [`Builder::build`].
#[derive(Debug, Clone, Serialize)]
pub struct BuildReport {
    pub record: TemplateRecord,
    /// The rootfs came from the cache.
    pub rootfs_cached: bool,
    /// The disk came from the cache (or was not asked for).
    pub disk_cached: bool,
    pub elapsed: Duration,
    pub steps: Vec<Progress>,
}

/// Scratch directories older than this belong to a build that died.
const STALE_SCRATCH: Duration = Duration::from_secs(6 * 3600);

type ProgressFn = Box<dyn Fn(&Progress) + Send + Sync>;

/// Builds templates into a `CladeHome`.
pub struct Builder {
    home: clade_core::CladeHome,
    debootstrap_root: PathBuf,
    agent: Option<PathBuf>,
    store: bool,
    ledger: bool,
    keep_image: bool,
    progress: Option<ProgressFn>,
}

struct Steps<'a> {
    t0: Instant,
    list: Vec<Progress>,
    sink: Option<&'a ProgressFn>,
}

impl Steps<'_> {
    fn note(&mut self, step: &'static str, detail: impl Into<String>) {
        let p = Progress { step, elapsed: self.t0.elapsed(), detail: detail.into() };
        if let Some(f) = self.sink {
            f(&p);
        }
        self.list.push(p);
    }
}

impl Builder {
    /// A builder over `home` that puts disks into the store and records templates in the ledger.
    pub fn new(home: clade_core::CladeHome) -> Builder {
        let debootstrap_root = templates_dir(&home);
        Builder { home, debootstrap_root, agent: None, store: true, ledger: true, keep_image: false, progress: None }
    }

    /// Install this clade-agent binary at `/usr/lib/clade/clade-agent` (its hash joins the identity).
    pub fn agent(mut self, agent: Option<PathBuf>) -> Self {
        self.agent = agent;
        self
    }

    /// Keep pristine debootstraps in another directory (tests share the host's cache this way).
    pub fn debootstrap_cache(mut self, dir: PathBuf) -> Self {
        self.debootstrap_root = dir;
        self
    }

    /// Whether to put the disk image into the store (default yes); without, the image file is kept.
    pub fn use_store(mut self, yes: bool) -> Self {
        self.store = yes;
        self
    }

    /// Whether to record the template in the ledger (default yes).
    pub fn use_ledger(mut self, yes: bool) -> Self {
        self.ledger = yes;
        self
    }

    /// Keep the image file next to the rootfs even once it is in the store.
    pub fn keep_image(mut self, yes: bool) -> Self {
        self.keep_image = yes;
        self
    }

    pub fn on_progress(mut self, f: impl Fn(&Progress) + Send + Sync + 'static) -> Self {
        self.progress = Some(Box::new(f));
        self
    }

    pub fn home(&self) -> &clade_core::CladeHome {
        &self.home
    }

    /// Builds (or finds in the cache) the template of `spec` for `backends`.
    pub fn build(&self, spec: &TemplateSpec, backends: Backends) -> Result<BuildReport> {
        let mut steps = Steps { t0: Instant::now(), list: Vec::new(), sink: self.progress.as_ref() };
        let swept = crate::chroot::sweep_stale(&self.home.tmp_dir(), STALE_SCRATCH);
        if swept > 0 {
            steps.note("tmp", format!("removed {swept} scratch directories of builds that died"));
        }
        if let Some(a) = &self.agent {
            if !a.is_file() {
                return Err(TemplateError::Host(format!(
                    "agent binary {} does not exist; build clade-agent first",
                    a.display()
                )));
            }
        }
        let identity = Identity::of(spec, self.agent.as_deref())?;
        let hash = identity.hash();
        steps.note("identity", format!("{} {}", spec.name, &hash[..16]));
        let dir = templates_dir(&self.home).join(&hash);
        let rootfs = dir.join("rootfs");
        let record_path = dir.join("template.json");

        let mut rootfs_cached = true;
        // An unreadable record (an older builder's) is rebuilt from the rootfs, which is what counts.
        let mut record = match read_record(&record_path).ok().flatten() {
            Some(r) if rootfs.is_dir() => {
                steps.note("rootfs", format!("cached {}", rootfs.display()));
                r
            }
            _ => {
                if !rootfs.is_dir() {
                    rootfs_cached = false;
                    self.build_rootfs(spec, &identity, &hash, &rootfs, &mut steps)?;
                } else {
                    steps.note("rootfs", format!("found {} without a record", rootfs.display()));
                }
                let (rootfs_bytes, rootfs_entries) = rootfs::tree_size(&rootfs);
                TemplateRecord {
                    name: spec.name.clone(),
                    hash: hash.clone(),
                    built_ms: now_ms(),
                    spec: spec.path.clone(),
                    rootfs: rootfs.clone(),
                    rootfs_bytes,
                    rootfs_entries,
                    memory_mib: spec.memory_mib,
                    vcpus: spec.vcpus,
                    disk_gib: spec.disk_gib,
                    egress: spec.network.egress,
                    no_new_privs: spec.jail.no_new_privs,
                    ready: spec.ready.clone(),
                    services: spec.services.clone(),
                    provision: spec.provision.is_some(),
                    agent: self.agent.is_some(),
                    disk: None,
                    identity: identity.clone(),
                }
            }
        };
        // Shape settings do not change the rootfs: the record follows the latest spec.
        let before = record.clone();
        record.spec = spec.path.clone();
        record.memory_mib = spec.memory_mib;
        record.vcpus = spec.vcpus;
        record.disk_gib = spec.disk_gib;
        record.egress = spec.network.egress;
        record.no_new_privs = spec.jail.no_new_privs;
        record.ready = spec.ready.clone();

        let mut disk_cached = true;
        if backends.vm {
            let ok = record.disk.as_ref().is_some_and(|d| d.disk_gib == spec.disk_gib && self.disk_present(d));
            if ok {
                steps.note("image", "cached");
            } else {
                disk_cached = false;
                let old = record.disk.take();
                record.disk = Some(self.build_disk(&rootfs, &dir, spec.disk_gib, &mut steps)?);
                if let Some(old_manifest) = old.and_then(|d| d.manifest) {
                    if record.disk.as_ref().and_then(|d| d.manifest.as_ref()) != Some(&old_manifest) {
                        self.forget_manifest(&old_manifest);
                    }
                }
            }
        }
        if backends.ct {
            steps.note("ct", format!("overlay lower layer {}", rootfs.display()));
        }
        if record != before || !record_path.is_file() {
            write_record(&record_path, &record)?;
        }
        if self.ledger {
            let l = clade_ledger::Ledger::open(self.home.ledger_path())?;
            l.put_template(&clade_ledger::TemplateId::new(hash.clone()), &spec.name, &identity.to_json())?;
            steps.note("ledger", "recorded");
        }
        let elapsed = steps.t0.elapsed();
        steps.note("done", format!("{} {} in {:.2} s", spec.name, &hash[..16], elapsed.as_secs_f64()));
        Ok(BuildReport { record, rootfs_cached, disk_cached, elapsed, steps: steps.list })
    }

    fn disk_present(&self, d: &DiskRecord) -> bool {
        match (&d.manifest, &d.image) {
            (Some(m), _) if self.store => match (m.parse::<clade_store::ManifestId>(), self.open_store()) {
                (Ok(id), Ok(s)) => s.has_manifest(&id),
                _ => false,
            },
            (_, Some(img)) => img.is_file(),
            _ => false,
        }
    }

    fn open_store(&self) -> Result<clade_store::Store> {
        Ok(clade_store::Store::open(&self.home.store_dir(), clade_store::StoreConfig::default())?)
    }

    fn forget_manifest(&self, id: &str) {
        if let (Ok(id), Ok(s)) = (id.parse::<clade_store::ManifestId>(), self.open_store()) {
            let _ = s.delete_manifest(&id);
        }
    }

    fn build_rootfs(
        &self,
        spec: &TemplateSpec,
        identity: &Identity,
        hash: &str,
        dest: &Path,
        steps: &mut Steps<'_>,
    ) -> Result<()> {
        let tmp = self.home.tmp_dir();
        let scratch = Scratch::new(&tmp, &format!("template-{}-", &hash[..12]))?;
        let root = scratch.path().join("rootfs");
        match &spec.source {
            Source::Debian { suite, mirror } => {
                let (cache, cached) = debian::ensure_debootstrap(&self.debootstrap_root, &tmp, suite, mirror)?;
                steps.note(
                    "debootstrap",
                    format!("{} {suite} {}", if cached { "cached" } else { "built" }, cache.display()),
                );
                let (stage, cached) = if spec.packages.is_empty() {
                    (cache, true)
                } else {
                    debian::ensure_stage(&self.debootstrap_root, &tmp, &cache, &spec.packages, suite)?
                };
                steps.note(
                    "packages",
                    format!(
                        "{} [{}] {}",
                        if cached { "cached" } else { "installed" },
                        spec.packages.join(" "),
                        stage.display()
                    ),
                );
                // A cached stage may be reached through a symlink (a test home borrowing the real cache):
                // link its contents, not the link.
                let stage = std::fs::canonicalize(&stage).unwrap_or(stage);
                rootfs::link_tree("rootfs: link the stage", &stage, &root)?;
                steps.note("copy", "stage hard-linked");
            }
            Source::Dir { path } => {
                rootfs::copy_tree("from dir", path, &root)?;
                steps.note("source", format!("copied {}", path.display()));
            }
            Source::OciArchive { path } => {
                std::fs::create_dir_all(&root).ctx("create", &root)?;
                let unpack = scratch.path().join("archive");
                std::fs::create_dir_all(&unpack).ctx("create", &unpack)?;
                let n = oci::apply_archive(path, &root, &unpack)?;
                std::fs::remove_dir_all(&unpack).ctx("remove", &unpack)?;
                steps.note("source", format!("{n} layers of {} applied", path.display()));
            }
        }
        if !spec.packages.is_empty() && !matches!(spec.source, Source::Debian { .. }) {
            debian::install_packages(&root, &spec.packages, "the source's apt sources")?;
            steps.note("packages", spec.packages.join(" "));
        } else {
            // Unlinks only: safe on a hard-linked stage.
            debian::clean_apt(&root)?;
        }
        rootfs::install_files(&root, &spec.files)?;
        if let Some(p) = &spec.provision {
            rootfs::install_provision(&root, p)?;
        }
        if let Some(a) = &self.agent {
            rootfs::install_agent(&root, a)?;
        }
        rootfs::install_services(&root, &spec.services)?;
        let meta = serde_json::json!({ "name": spec.name, "hash": hash, "ready": spec.ready, "identity": identity });
        rootfs::write_file(
            &root,
            "/etc/clade/template.json",
            &serde_json::to_string_pretty(&meta).unwrap_or_default(),
            0o644,
        )?;
        steps.note(
            "files",
            format!(
                "{} files, provision {}, agent {}, {} services",
                spec.files.len(),
                if spec.provision.is_some() { "yes" } else { "no" },
                if self.agent.is_some() { "yes" } else { "no" },
                spec.services.len()
            ),
        );
        let parent = dest.parent().unwrap_or(Path::new("/"));
        std::fs::create_dir_all(parent).ctx("create", parent)?;
        if let Err(e) = std::fs::rename(&root, dest) {
            if !dest.is_dir() {
                return Err(e).ctx("rename into", dest);
            }
        }
        scratch.done();
        steps.note("rootfs", format!("{}", dest.display()));
        Ok(())
    }

    fn build_disk(&self, rootfs: &Path, dir: &Path, disk_gib: u32, steps: &mut Steps<'_>) -> Result<DiskRecord> {
        let scratch = Scratch::new(&self.home.tmp_dir(), "image-")?;
        let img = scratch.path().join("disk.ext4");
        let size = image::make_ext4(rootfs, &img, disk_gib)?;
        steps.note("image", format!("ext4 {disk_gib} GiB, {} MiB allocated", size.allocated_bytes >> 20));
        let mut rec = DiskRecord {
            disk_gib,
            manifest: None,
            image: None,
            apparent_bytes: size.apparent_bytes,
            allocated_bytes: size.allocated_bytes,
            nonzero_bytes: 0,
            new_bytes: 0,
            stored_bytes: 0,
        };
        if self.store {
            let store = self.open_store()?;
            let put = image::put_sparse(&store, &img)?;
            rec.manifest = put.id.map(|m| m.to_hex());
            rec.nonzero_bytes = put.bytes_new + put.bytes_dedup;
            rec.new_bytes = put.bytes_new;
            rec.stored_bytes = put.bytes_stored;
            steps.note(
                "store",
                format!(
                    "manifest {} ({} MiB new, {} MiB deduplicated, {} MiB in packs)",
                    rec.manifest.as_deref().map(|m| &m[..16]).unwrap_or("-"),
                    put.bytes_new >> 20,
                    put.bytes_dedup >> 20,
                    put.bytes_stored >> 20
                ),
            );
        }
        if !self.store || self.keep_image {
            let keep = dir.join(format!("disk-{disk_gib}g.ext4"));
            std::fs::rename(&img, &keep).ctx("rename into", &keep)?;
            rec.image = Some(keep);
        }
        Ok(rec)
    }
}

/// Reads a record; `None` if there is none.
pub fn read_record(path: &Path) -> Result<Option<TemplateRecord>> {
    match std::fs::read(path) {
        Ok(b) => serde_json::from_slice(&b)
            .map(Some)
            .map_err(|e| TemplateError::Record { path: path.into(), message: e.to_string() }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).ctx("read", path),
    }
}

fn write_record(path: &Path, r: &TemplateRecord) -> Result<()> {
    let tmp = path.with_extension("json.tmp");
    let text = serde_json::to_vec_pretty(r).unwrap_or_default();
    std::fs::write(&tmp, text).ctx("write", &tmp)?;
    std::fs::rename(&tmp, path).ctx("rename into", path)
}
