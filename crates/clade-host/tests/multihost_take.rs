//! Several hosts take one pushed sandbox at the same moment, through a real 3-node Garage cluster (replication
//! factor 3): exactly one wins each round, every other is refused naming the winner, a host that comes later is
//! refused naming the owner, a dead host's leftover claim stops counting, and all of it holds with one Garage
//! node down (docs/roam.md, "Ownership").

use std::path::PathBuf;
use std::sync::{Arc, Barrier};
use std::time::Duration;

use clade_store::testkit::Garage;
use clade_store::{Store, StoreConfig};

fn garage() -> Option<Garage> {
    let home = PathBuf::from(std::env::var("CLADE_TEST_HOME").unwrap_or_else(|_| "/var/lib/clade".into()));
    let bin = home.join("garage/bin/garage");
    if !bin.exists() {
        eprintln!("skip: {} is not installed (run ./x setup)", bin.display());
        return None;
    }
    Some(Garage::start(&bin, "clade-take").expect("start a 3-node Garage cluster"))
}

fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64
}

fn pushed(store: &Store, sbx: &str) {
    let o = serde_json::json!({"host": "host-pusher", "state": "pushed", "at_ms": now_ms()});
    store.blob_put_meta(&format!("sandboxes/{sbx}/owner.json"), o.to_string().into_bytes()).unwrap();
}

fn owner_of(store: &Store, sbx: &str) -> serde_json::Value {
    let b = store.blob_get_meta(&format!("sandboxes/{sbx}/owner.json")).unwrap().expect("an owner record");
    serde_json::from_slice(&b).unwrap()
}

/// `hosts` take `sbx` at once; returns the winner's name after checking the refusals.
fn race(stores: &[Arc<Store>], sbx: &str, patience: Duration) -> String {
    let barrier = Arc::new(Barrier::new(stores.len()));
    let threads: Vec<_> = stores
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let (s, b, sbx) = (s.clone(), barrier.clone(), sbx.to_string());
            std::thread::spawn(move || {
                let me = format!("host-{i}");
                b.wait();
                let r = clade_host::roam::take(&s, &sbx, &me, patience);
                (me, r.map_err(|e| (clade_host::error::kind(&e), format!("{e:#}"))))
            })
        })
        .collect();
    let results: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    let winners: Vec<&String> = results.iter().filter(|(_, r)| r.is_ok()).map(|(h, _)| h).collect();
    assert_eq!(winners.len(), 1, "exactly one host takes {sbx}: {results:?}");
    let winner = winners[0].clone();
    for (h, r) in &results {
        if let Err((kind, msg)) = r {
            assert_eq!(*kind, clade_core::ErrorKind::Conflict, "{h}: {msg}");
            assert!(msg.contains(&winner), "{h}'s refusal names the winner {winner}: {msg}");
        }
    }
    let o = owner_of(&stores[0], sbx);
    assert_eq!((o["host"].as_str(), o["state"].as_str()), (Some(winner.as_str()), Some("taken")), "{o}");
    assert!(stores[0].blob_list_meta(&format!("sandboxes/{sbx}/claims")).unwrap().is_empty(), "claims left behind");
    winner
}

#[test]
fn multihost_take_exactly_one_host_wins() {
    let Some(mut g) = garage() else { return };
    let dirs: Vec<tempfile::TempDir> = (0..4).map(|_| tempfile::tempdir().unwrap()).collect();
    let stores: Vec<Arc<Store>> = dirs
        .iter()
        .map(|d| Arc::new(Store::open(d.path(), StoreConfig { blob: Some(g.config()), ..Default::default() }).unwrap()))
        .collect();
    let patience = Duration::from_secs(10);

    let mut winners = Vec::new();
    for round in 0..4 {
        let sbx = format!("race-{round}");
        pushed(&stores[0], &sbx);
        winners.push(race(&stores, &sbx, patience));
        // A host that comes later is refused, naming the owner; the owner record is unchanged.
        let e = clade_host::roam::take(&stores[3], &sbx, "host-late", patience).unwrap_err();
        assert!(format!("{e:#}").contains(&format!("taken by host {}", winners[round])), "{e:#}");
        assert_eq!(owner_of(&stores[0], &sbx)["host"], winners[round].as_str());
    }
    eprintln!("winners: {winners:?}");

    // A claim left by a host that died mid-take stops counting after the claim TTL.
    pushed(&stores[0], "orphan");
    let old = now_ms() - clade_host::roam::CLAIM_TTL.as_millis() as u64 - 1000;
    let dead = serde_json::json!({"host": "host-dead", "at_ms": old});
    stores[0].blob_put_meta("sandboxes/orphan/claims/host-dead", dead.to_string().into_bytes()).unwrap();
    clade_host::roam::take(&stores[1], "orphan", "host-1", patience).expect("a stale claim does not count");
    // A live claim does: a host stuck mid-take (its claim stays) keeps the others out until their patience ends,
    // and they are refused naming it.
    pushed(&stores[0], "slow");
    let early = serde_json::json!({"host": "host-early", "at_ms": now_ms() - 100});
    stores[0].blob_put_meta("sandboxes/slow/claims/host-early", early.to_string().into_bytes()).unwrap();
    let t = std::time::Instant::now();
    let e = clade_host::roam::take(&stores[2], "slow", "host-2", Duration::from_secs(1)).unwrap_err();
    assert!(t.elapsed() >= Duration::from_secs(1), "it kept trying for its patience: {:?}", t.elapsed());
    assert!(format!("{e:#}").contains("host-early"), "{e:#}");
    assert_eq!(owner_of(&stores[0], "slow")["state"], "pushed", "the loser took nothing");

    // One Garage node down: quorums of two still decide, and the same holds.
    g.stop_node(2);
    pushed(&stores[0], "node-down");
    race(&stores, "node-down", patience);
    g.start_node(2).unwrap();
}
