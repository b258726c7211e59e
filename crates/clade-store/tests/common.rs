//! Shared helpers for the store's integration tests.
#![allow(dead_code)]

use std::path::Path;

use clade_store::{Store, StoreConfig};
use rand::{Rng, SeedableRng};

pub fn cfg() -> StoreConfig {
    StoreConfig { gc_grace: std::time::Duration::ZERO, pack_bytes: 4 << 20, ..Default::default() }
}

pub fn open(dir: &Path) -> Store {
    Store::open(dir, cfg()).unwrap()
}

/// Page-structured test data: zero pages, random pages, repeated pages.
pub fn pages(seed: u64, n: usize) -> Vec<u8> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut out = vec![0u8; n * 4096];
    for p in out.chunks_mut(4096) {
        match rng.random_range(0..4) {
            0 => {}
            1 => p.fill(0xab),
            _ => rng.fill(p),
        }
    }
    out
}

pub fn read_all(store: &Store, id: &clade_store::ManifestId) -> Vec<u8> {
    let r = store.image(id).unwrap();
    let mut buf = vec![0u8; r.size() as usize];
    r.read_at(0, &mut buf).unwrap();
    buf
}
