//! store-stress: put images into a store forever (full puts of buffers and of sparse files, derived
//! marks), printing each published id. The crash-safety test runs it and kills it with SIGKILL at random points.
//!
//! `store-stress STORE_DIR SEED`

use clade_store::{ImageKind, Store, StoreConfig, BLOCK};
use rand::{Rng, SeedableRng};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 3 {
        eprintln!("usage: store-stress STORE_DIR SEED");
        std::process::exit(2);
    }
    let seed: u64 = args[2].parse().unwrap_or(0);
    let cfg = StoreConfig { pack_bytes: 1 << 20, ..Default::default() };
    let store = match Store::open(std::path::Path::new(&args[1]), cfg) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("store-stress: {e}");
            std::process::exit(1);
        }
    };
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut last = None;
    for round in 0u64.. {
        let n = 1024; // 4 MiB images, several packs each
        let mut data = vec![0u8; n * BLOCK];
        for p in data.chunks_mut(BLOCK) {
            if rng.random_bool(0.7) {
                rng.fill(p);
            }
        }
        let r = match (round % 3, last) {
            (2, _) => {
                // A sparse file (zero pages are holes), stored by the parallel file path.
                let path = std::path::PathBuf::from(format!("{}.input", args[1]));
                let f = std::fs::File::create(&path).and_then(|f| {
                    f.set_len(data.len() as u64)?;
                    for (i, p) in data.chunks(BLOCK).enumerate() {
                        if p.iter().any(|b| *b != 0) {
                            std::os::unix::fs::FileExt::write_all_at(&f, p, (i * BLOCK) as u64)?;
                        }
                    }
                    Ok(())
                });
                if let Err(e) = f {
                    eprintln!("store-stress: {}: {e}", path.display());
                    std::process::exit(1);
                }
                store.put_file_rehash(&path, ImageKind::Mem)
            }
            (1, Some(base)) => {
                let mut b = match store.derive(Some(&base), data.len() as u64) {
                    Ok(b) => b,
                    Err(e) => fail(e),
                };
                for p in 0..n {
                    if rng.random_bool(0.1) {
                        if let Err(e) = b.write((p * BLOCK) as u64, &data[p * BLOCK..(p + 1) * BLOCK]) {
                            fail(e)
                        }
                    }
                }
                b.finish()
            }
            _ => store.put_bytes(&data, ImageKind::Mem),
        };
        match r {
            Ok(r) => {
                last = r.id;
                println!("{}", r.id.map(|i| i.to_hex()).unwrap_or_default());
            }
            Err(e) => fail(e),
        }
    }
}

fn fail(e: clade_store::StoreError) -> ! {
    eprintln!("store-stress: {e}");
    std::process::exit(1)
}
