//! Crash safety: kill -9 a process in the middle of large puts, again and again; afterwards fsck is clean
//! and every published manifest reads back completely (its data was durable before it was published).

mod common;

use std::process::{Command, Stdio};
use std::time::Duration;

use rand::{Rng, SeedableRng};

#[test]
fn kill_9_during_puts_leaves_a_clean_store() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("s");
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    let mut published = 0;
    for round in 0..10u64 {
        let mut child = Command::new(env!("CARGO_BIN_EXE_store-stress"))
            .arg(&dir)
            .arg(round.to_string())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(rng.random_range(50..2500)));
        // SIGKILL: no destructor, no flush.
        child.kill().unwrap();
        let st = child.wait().unwrap();
        assert!(!st.success(), "store-stress exited by itself: {st}");

        let s = common::open(&dir);
        let f = s.fsck().unwrap();
        assert!(f.ok, "round {round}: fsck after kill -9: {:?}", f.errors);
        let ids = s.manifests().unwrap();
        for id in &ids {
            let m = s.manifest(id).unwrap();
            let r = s.image(id).unwrap();
            let mut buf = vec![0u8; m.size as usize];
            r.read_at(0, &mut buf).unwrap_or_else(|e| panic!("round {round}: manifest {id} lacks data: {e}"));
        }
        published = ids.len();
    }
    assert!(published > 0, "no put ever finished: the kills came too early to test anything");
    // Leftovers of the killed writers are collected, published data stays.
    let s = common::open(&dir);
    let r = s.gc(false).unwrap();
    assert!(s.fsck().unwrap().ok, "{r:?}");
    assert_eq!(s.manifests().unwrap().len(), published);
}
