//! What the ct tests share: a backend over a fresh home under `$CLADE_HOME/tmp` (removed after, unless
//! `CT_KEEP` is set) with the cached test rootfs as its template; `None` (and a printed reason) where CRIU or the
//! agent cannot be found.

use std::path::PathBuf;

use clade_core::backend::TemplateImage;
use clade_core::CladeHome;
use clade_ct::{CtBackend, CtConfig};

pub struct Env {
    pub backend: CtBackend,
    pub image: TemplateImage,
    pub home: PathBuf,
}

impl Drop for Env {
    fn drop(&mut self) {
        if std::env::var_os("CT_KEEP").is_none() {
            let _ = std::fs::remove_dir_all(&self.home);
        }
    }
}

/// A backend named `name` whose configuration `tweak` may change, and the test rootfs as a template of
/// `memory_mib` with or without egress.
pub fn env_with(name: &str, memory_mib: u32, egress: bool, tweak: impl FnOnce(&mut CtConfig)) -> Option<Env> {
    let real = CladeHome::from_env();
    let mut cfg = match CtConfig::from_home(&real) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("skipping: {e}");
            return None;
        }
    };
    if !cfg.criu.exists() {
        eprintln!("skipping: no CRIU at {} (run ./x setup)", cfg.criu.display());
        return None;
    }
    tweak(&mut cfg);
    let rootfs = clade_ct::testroot::ensure(&real, &cfg.agent_bin).expect("test rootfs");
    let home = real.tmp_dir().join(format!("ct-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&home);
    std::fs::create_dir_all(&home).unwrap();
    let h = CladeHome::at(&home);
    let store = clade_store::Store::open(&h.store_dir(), Default::default()).expect("store");
    let backend = CtBackend::new(h, store, cfg).expect("backend");
    let image = clade_ct::testroot::image("ct-test", rootfs, memory_mib, egress);
    Some(Env { backend, image, home })
}
