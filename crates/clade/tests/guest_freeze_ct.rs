//! `clade freeze` / `clade thaw` on the `ct` backend (the cgroup freezer, what containerd's Pause uses): a
//! detached loop that ticks into a file stands still while the sandbox is frozen (control: the same wait thawed
//! sees it tick on), an exec meanwhile is refused with exit 4 (conflict) instead of hanging while `get` answers
//! at once, and a frozen sandbox suspends (and resumes) and is killed cleanly (its cgroup is thawed first).

mod common;
use common::clade;

/// Kills the sandbox when the test ends, passed or failed, before the home is removed: a failed run must not
/// leave a frozen sandbox behind (a kill thaws it first).
struct KillOnDrop<'a>(&'a std::path::Path, String);

impl Drop for KillOnDrop<'_> {
    fn drop(&mut self) {
        let _ = clade(self.0, &["kill", &self.1]);
    }
}

#[test]
fn guest_freeze_ct_stops_and_continues_a_sandbox() {
    let Some(t) = common::ct_home("clade-freeze-ct") else { return };
    let h = t.path();
    common::ct_template_record(h);
    let (code, out, err) = clade(h, &["fork", "ctbox", "--backend", "ct", "--json"]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let id = v["sandboxes"][0]["sandbox"].as_str().unwrap().to_string();
    let _guard = KillOnDrop(h, id.clone());
    let loop_ = "setsid sh -c 'while :; do echo >> /tmp/ticks; sleep 0.1; done' >/dev/null 2>&1 &";
    assert_eq!(clade(h, &["exec", &id, "--", "sh", "-c", loop_]).0, 0);
    let ticks = || {
        let (code, out, err) = clade(h, &["exec", &id, "--", "sh", "-c", "wc -l < /tmp/ticks"]);
        assert_eq!(code, 0, "{err}");
        out.trim().parse::<u32>().unwrap()
    };
    let wait = || std::thread::sleep(std::time::Duration::from_millis(1500));
    std::thread::sleep(std::time::Duration::from_millis(300));
    let t0 = ticks();
    wait();
    let running = ticks() - t0;
    assert!(running >= 5, "the loop ticks while thawed: {running} in 1.5 s");

    let before = ticks();
    let (code, out, err) = clade(h, &["freeze", &id, "--json"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("\"frozen\": true"), "{out}");
    let (code, _, err) = clade(h, &["exec", &id, "--", "true"]);
    assert_eq!(code, 4, "an exec into a frozen sandbox is a conflict: {err}");
    assert!(err.contains("frozen"), "{err}");
    // What needs no answer from inside still works, at once: the sandbox's facts.
    let t = std::time::Instant::now();
    let (code, out, err) = clade(h, &["info", &id, "--json"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("\"frozen\": true") && t.elapsed().as_secs() < 5, "{out}");
    wait();
    assert_eq!(clade(h, &["thaw", &id]).0, 0);
    let frozen = ticks() - before;
    assert!(frozen <= 2, "the loop stood still while frozen: {frozen} ticks (thawed: {running})");

    // A frozen sandbox suspends (thawed first: the dump stops it itself) and resumes running.
    assert_eq!(clade(h, &["freeze", &id]).0, 0);
    let (code, _, err) = clade(h, &["suspend", &id]);
    assert_eq!(code, 0, "a frozen sandbox suspends: {err}");
    let (code, _, err) = clade(h, &["resume", &id]);
    assert_eq!(code, 0, "{err}");
    let r0 = ticks();
    std::thread::sleep(std::time::Duration::from_millis(600));
    assert!(ticks() > r0, "the loop ticks again after the resume");

    assert_eq!(clade(h, &["freeze", &id]).0, 0);
    let (code, _, err) = clade(h, &["kill", &id]);
    assert_eq!(code, 0, "a frozen sandbox is killed: {err}");
}
