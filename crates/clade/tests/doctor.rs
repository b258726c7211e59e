//! `clade doctor` as a user runs it: the binary, its exit code and its JSON.

use std::process::Command;

fn clade() -> Command {
    Command::new(env!("CARGO_BIN_EXE_clade"))
}

/// An empty CLADE_HOME and no QEMU on PATH: the vm backend is reported not ready, each missing part names its
/// fix, and the exit code says so.
#[test]
fn doctor_reports_missing_parts_and_fails() {
    let home = tempfile::tempdir().unwrap();
    let out = clade()
        .args(["doctor", "--json"])
        .env("CLADE_HOME", home.path())
        .env("PATH", "/nonexistent")
        .env("CLADE_CRIU", "/nonexistent/criu")
        .env_remove("CLADE_QEMU")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let checks = v["checks"].as_array().unwrap();
    let find = |name: &str| checks.iter().find(|c| c["name"] == name).unwrap_or_else(|| panic!("no check {name}"));
    assert_eq!(find("qemu")["ok"], false);
    assert_eq!(find("guest-kernel")["fix"], "run ./x setup");
    assert_eq!(find("criu")["ok"], false);
    let backends = v["backends"].as_array().unwrap();
    assert!(backends.iter().all(|b| b["ready"] == false));
}

/// A CLADE_HOME too deep for QEMU's unix sockets is named as the vm backend's missing part, with the length
/// to use; a short one passes the same check.
#[test]
fn doctor_names_a_home_too_deep_for_qemus_sockets() {
    let t = tempfile::tempdir().unwrap();
    let run = |home: &std::path::Path| {
        let out = clade()
            .args(["doctor", "--json"])
            .env("CLADE_HOME", home)
            .env("PATH", "/nonexistent")
            .env("CLADE_CRIU", "/nonexistent/criu")
            .env_remove("CLADE_QEMU")
            .output()
            .unwrap();
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        v["checks"].as_array().unwrap().iter().find(|c| c["name"] == "home-path").cloned().expect("a home-path check")
    };
    let deep = run(&t.path().join("d".repeat(70)));
    assert_eq!(deep["ok"], false, "{deep}");
    assert!(deep["detail"].as_str().unwrap().contains("at most"), "{deep}");
    assert_eq!(deep["needed_by"], serde_json::json!(["vm"]), "{deep}");
    assert_eq!(run(t.path())["ok"], true);
}

/// On this host: a real probe boot under KVM and under TCG. The choice must follow the KVM boot's outcome, and
/// TCG must boot (QEMU and the guest kernel from ./x setup work).
#[test]
fn guest_doctor_probes_accelerator_by_booting() {
    let home = std::env::var("CLADE_TEST_HOME").unwrap_or_else(|_| "/var/lib/clade".into());
    if !std::path::Path::new(&home).join("kernel/current/vmlinux").exists() {
        eprintln!("skip: no guest kernel under {home} (run ./x setup)");
        return;
    }
    let out = clade().args(["doctor", "--json", "--refresh"]).env("CLADE_HOME", &home).output().unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let accel = &v["accel"];
    assert_eq!(accel["tcg"]["ok"], true, "TCG boot failed: {}", accel["tcg"]["detail"]);
    let expect = if accel["kvm"]["ok"] == true { "kvm" } else { "tcg" };
    assert_eq!(accel["chosen"], expect);
    // The second call is answered from the per-boot cache, without booting.
    let t = std::time::Instant::now();
    let again = clade().args(["doctor", "--json"]).env("CLADE_HOME", &home).output().unwrap();
    let v2: serde_json::Value = serde_json::from_slice(&again.stdout).unwrap();
    assert_eq!(v2["accel"]["chosen"], accel["chosen"]);
    assert_eq!(
        v2["accel"]["tcg"]["seconds"], accel["tcg"]["seconds"],
        "second doctor re-probed instead of using the cache"
    );
    assert!(t.elapsed().as_secs_f64() < accel["tcg"]["seconds"].as_f64().unwrap() + 5.0);
}
