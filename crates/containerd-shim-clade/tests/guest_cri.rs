//! The path a kubelet drives: containerd's CRI plugin with a runtime handler `clade`
//! (`io.containerd.clade.v2`), reached through the CRI protos over gRPC as a kubelet reaches it. A pod is one
//! clade sandbox (ContainerStats reports its CPU time and memory) and its containers are process groups in it:
//! two containers of one image share its files, a
//! container of another image runs on its own image's files in the same sandbox (its hostname, its processes)
//! and keeps the sandbox from being marked until it is removed; one container of a pod pauses and resumes
//! alone, and ends with what it started; a pod annotated with a mark starts with the mark's
//! state; a shim killed mid-pod leaves nothing once the pod is removed; an image clade cannot use fails
//! CreateContainer with a clear error.

mod common;

use std::time::Instant;

use common::{busybox_rootfs, containerd, cri_config, oci_archive, Containerd, Cri, Entry};
use k8s_cri::v1::*;

const PAUSE: &str = "clade.test/pause:latest";
const BUSYBOX: &str = "clade.test/busybox:latest";
const OTHER: &str = "clade.test/other:latest";

fn import_k8s(c: &Containerd, name: &str, entries: &[Entry], cmd: &[&str]) {
    let archive = c.dir.path().join(format!("{}.tar", name.replace(['/', ':'], "_")));
    oci_archive(&archive, name, entries, cmd);
    c.import_k8s(&archive);
}

fn setup() -> Option<(Containerd, Cri)> {
    let c = containerd(&cri_config(PAUSE))?;
    import_k8s(&c, PAUSE, &busybox_rootfs(), &["/bin/sleep", "2147483647"]);
    let mut with_marker = busybox_rootfs();
    with_marker.push(Entry::File("etc/flavour", b"busybox\n".to_vec(), 0o644));
    import_k8s(&c, BUSYBOX, &with_marker, &["/bin/sh"]);
    let mut other = busybox_rootfs();
    other.push(Entry::File("etc/flavour", b"other\n".to_vec(), 0o644));
    import_k8s(&c, OTHER, &other, &["/bin/sh"]);
    let cri = Cri::connect(&c);
    Some((c, cri))
}

/// `clade mark` of the one pod's sandbox (with `args`), through clade itself: whether it marked, what it said.
fn mark_pod(c: &Containerd, args: &[&str]) -> (bool, String) {
    let sandbox = c.sandboxes()[0]["id"].as_str().unwrap().to_string();
    let clade = std::path::Path::new(env!("CARGO_BIN_EXE_containerd-shim-clade-v2")).with_file_name("clade");
    let out = std::process::Command::new(clade)
        .args(["mark", &sandbox])
        .args(args)
        .env("CLADE_HOME", c.home.path())
        .output()
        .unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
}

const LOOP: &[&str] = &["sh", "-c", "echo $HOSTNAME > /tmp/first; while :; do sleep 0.1; done"];

/// A container `name` of the image OTHER in the pod whose container `first` runs the pod's image: created and
/// started, it runs on its own image's files with its own `/tmp`, the pod's hostname and the sandbox's `/proc`
/// (it writes `/tmp/<name>`, then sleeps). Returns its id.
fn member_of_another_image(
    c: &Containerd,
    cri: &mut Cri,
    (pod, config): (&str, &PodSandboxConfig),
    first: &str,
    name: &str,
) -> String {
    let t0 = Instant::now();
    let cmd = format!("echo mine > /tmp/{name}; exec sleep 1000");
    let id = cri
        .create(pod, config, name, OTHER, &["sh", "-c", &cmd])
        .unwrap_or_else(|e| panic!("CreateContainer of another image: {e}\n{}", c.log_tail()));
    cri.start(&id);
    let (code, out, err) = cri.exec_sync(&id, &["cat", "/etc/flavour"]);
    assert_eq!((code, out.as_str()), (0, "other\n"), "its own image's files: {err}\n{}", c.log_tail());
    eprintln!("CRI CreateContainer + StartContainer + first ExecSync, another image in the pod: {:?}", t0.elapsed());
    assert_eq!(cri.exec_sync(first, &["cat", "/etc/flavour"]).1, "busybox\n", "the first keeps its own");
    let look = format!(
        "i=0; while [ ! -s /tmp/{name} ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done; \
         ls /tmp; hostname; test -e /proc/self/status && echo proc"
    );
    let (_, out, _) = cri.exec_sync(&id, &["sh", "-c", &look]);
    let hostname = cri.exec_sync(first, &["hostname"]).1;
    assert_eq!(out, format!("{name}\n{hostname}proc\n"), "its own /tmp, the pod's hostname, the sandbox's /proc");
    let (code, _, _) = cri.exec_sync(first, &["sh", "-c", &format!("test -e /tmp/{name}")]);
    assert_ne!(code, 0, "what it writes to its root is not in the first's");
    id
}

#[test]
fn guest_cri_a_pod_is_one_sandbox_and_its_containers_share_it() {
    let Some((c, mut cri)) = setup() else { return };
    let config = Cri::pod_config("web", &[]);
    let t0 = Instant::now();
    let pod = cri.run_pod(&config).unwrap_or_else(|e| panic!("RunPodSandbox: {e}\n{}", c.log_tail()));
    let first = cri
        .create(&pod, &config, "first", BUSYBOX, LOOP)
        .unwrap_or_else(|e| panic!("CreateContainer: {e}\n{}", c.log_tail()));
    cri.start(&first);
    let (code, out, _) = cri.exec_sync(&first, &["cat", "/etc/flavour"]);
    eprintln!("CRI RunPodSandbox + CreateContainer + StartContainer + first ExecSync (cold image): {:?}", t0.elapsed());
    assert_eq!((code, out.as_str()), (0, "busybox\n"), "the container runs on its image's files");
    let (code, _, err) = cri.exec_sync(&first, &["sh", "-c", "echo to-err >&2; exit 4"]);
    assert_eq!((code, err.as_str()), (4, "to-err\n"), "ExecSync carries exit codes and stderr");
    let busy = "i=0; while [ $i -lt 20000 ]; do i=$((i+1)); done";
    assert_eq!(cri.exec_sync(&first, &["sh", "-c", busy]).0, 0);
    let (cpu_ns, working_set) = cri.stats(&first);
    // A member's figures are its own processes' (below): what ExecSync ran and ended is not among them.
    assert!(working_set > 0, "ContainerStats: cpu {cpu_ns} ns, working set {working_set} B");
    let st = cri.status(&first);
    assert_eq!(st.state, ContainerState::ContainerRunning as i32, "{st:?}");
    assert_eq!(c.sandboxes().len(), 1, "one sandbox for the pod");

    // A second container of the same image joins the pod's sandbox: it sees the first one's files.
    let second = cri.create(&pod, &config, "second", BUSYBOX, &["sleep", "1000"]).expect("the second container");
    cri.start(&second);
    let (code, out, _) = cri.exec_sync(&second, &["sh", "-c", "test -s /tmp/first && echo shared"]);
    assert_eq!((code, out.as_str()), (0, "shared\n"), "the pod's containers share one sandbox");
    assert_eq!(c.sandboxes().len(), 1, "still one sandbox for two containers");

    // Each member reports its own processes' figures, not the pod's: one holding ~2 MB, one a bare sleep.
    let hog = "x=$(busybox seq 1 300000); echo ready > /tmp/hog; while :; do sleep 1; done";
    let hog = cri.create(&pod, &config, "hog", BUSYBOX, &["sh", "-c", hog]).expect("the hog container");
    cri.start(&hog);
    let t0 = Instant::now();
    while cri.exec_sync(&first, &["cat", "/tmp/hog"]).0 != 0 {
        assert!(t0.elapsed().as_secs() < 20, "the hog did not fill its memory");
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let ((hog_cpu, hog_ws), (_, small_ws)) = (cri.stats(&hog), cri.stats(&second));
    assert!(hog_ws > 1 << 20 && hog_ws > 4 * small_ws, "ContainerStats per member: {hog_ws} B vs {small_ws} B");
    assert!(hog_cpu > 0, "the hog's CPU time");
    let stop = StopContainerRequest { container_id: hog.clone(), timeout: 2 };
    cri.rt.block_on(cri.client.stop_container(stop)).expect("StopContainer of the hog");

    // A container of another image runs in the same sandbox on its own image's files.
    let third = member_of_another_image(&c, &mut cri, (&pod, &config), &first, "third");
    let (_, seen, _) = cri.exec_sync(&first, &["sh", "-c", "ps -o args | busybox grep -c '^sleep 1000$'"]);
    assert_eq!(seen.trim(), "2", "the pod's processes see each other (one sandbox): {seen}");
    assert_eq!(c.sandboxes().len(), 1, "still one sandbox for the pod");
    let (marked, said) = mark_pod(&c, &[]);
    assert!(!marked && said.contains("root file systems of other images"), "clade mark: {said}");
    let stop = StopContainerRequest { container_id: third.clone(), timeout: 2 };
    cri.rt.block_on(cri.client.stop_container(stop)).expect("StopContainer of the third");
    let remove = RemoveContainerRequest { container_id: third.clone() };
    cri.rt.block_on(cri.client.remove_container(remove)).expect("RemoveContainer of the third");
    let (_, roots, _) = cri.exec_sync(&first, &["sh", "-c", "busybox grep -c /run/clade/roots /proc/mounts || true"]);
    assert_eq!(roots.trim(), "0", "its root is gone from the sandbox once it is removed");

    // StopContainer of one member ends its process only; the pod's sandbox stays for the other.
    let stop = StopContainerRequest { container_id: second.clone(), timeout: 2 };
    cri.rt.block_on(cri.client.stop_container(stop)).expect("StopContainer");
    assert_eq!(cri.status(&second).state, ContainerState::ContainerExited as i32);
    let (code, _, _) = cri.exec_sync(&first, &["true"]);
    assert_eq!(code, 0, "the first container still runs");

    cri.stop_and_remove(&pod);
    assert!(c.sandboxes().is_empty(), "a removed pod leaves no sandbox: {:?}", c.sandboxes());
}

#[test]
fn guest_cri_a_pod_from_a_mark_and_failures() {
    let Some((c, mut cri)) = setup() else { return };
    // A pod whose sandbox gets state, marked with a label through clade itself.
    let config = Cri::pod_config("origin", &[]);
    let pod = cri.run_pod(&config).expect("RunPodSandbox");
    // Its process writes the state and ends: a mark wants no process holding an agent connection.
    let ctr = cri
        .create(&pod, &config, "app", BUSYBOX, &["sh", "-c", "echo warmed-up > /root/state"])
        .expect("CreateContainer");
    cri.start(&ctr);
    let t0 = Instant::now();
    while cri.status(&ctr).state != ContainerState::ContainerExited as i32 {
        assert!(t0.elapsed().as_secs() < 20, "the warm-up did not end");
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    assert_eq!(cri.status(&ctr).exit_code, 0);
    let (marked, said) = mark_pod(&c, &["--label", "warm-pod"]);
    assert!(marked, "clade mark: {said}");
    cri.stop_and_remove(&pod);

    // A pod annotated with the mark starts from it: its container sees the mark's state.
    let config = Cri::pod_config("restored", &[("clade.dev/mark", "warm-pod")]);
    let t0 = Instant::now();
    let pod = cri.run_pod(&config).unwrap_or_else(|e| panic!("RunPodSandbox from a mark: {e}\n{}", c.log_tail()));
    let ctr = cri.create(&pod, &config, "app", BUSYBOX, &["sleep", "1000"]).expect("CreateContainer");
    cri.start(&ctr);
    let (code, out, _) = cri.exec_sync(&ctr, &["cat", "/root/state"]);
    eprintln!("CRI pod from a mark to first ExecSync: {:?}", t0.elapsed());
    assert_eq!((code, out.as_str()), (0, "warmed-up\n"), "the pod shows the mark's state");

    // The shim killed mid-pod: containerd sees the containers die; removing the pod leaves nothing.
    assert!(c.kill_shim(&pod), "the pod's shim was found and killed");
    let t0 = Instant::now();
    while cri.status(&ctr).state != ContainerState::ContainerExited as i32 {
        assert!(t0.elapsed().as_secs() < 20, "containerd still reports the container running");
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    cri.stop_and_remove(&pod);
    let t0 = Instant::now();
    while !c.sandboxes().is_empty() {
        assert!(t0.elapsed().as_secs() < 20, "the dead shim's pod sandbox is still there: {:?}", c.sandboxes());
        std::thread::sleep(std::time::Duration::from_millis(200));
    }

    // An image clade cannot start: CreateContainer fails with the reason.
    import_k8s(&c, "clade.test/lonely:latest", &[Entry::File("app", b"#!/app\n".to_vec(), 0o755)], &["/app"]);
    let config = Cri::pod_config("lonely", &[]);
    let pod = cri.run_pod(&config).expect("RunPodSandbox");
    let lonely = cri.create(&pod, &config, "app", "clade.test/lonely:latest", &["/app"]).expect("CreateContainer");
    let err = cri.try_start(&lonely).expect_err("an image without /bin, /usr or /etc cannot start");
    assert!(err.message().contains("no /bin, /usr or /etc"), "{}", err.message());
    cri.stop_and_remove(&pod);
    assert!(c.sandboxes().is_empty());
}

/// A loop counting into `/tmp/tick`, with a child of its own counting into `/tmp/bg`.
const TICKER: &str = "(j=0; while :; do j=$((j+1)); echo $j > /tmp/bg; sleep 0.05; done) & \
                      i=0; while :; do i=$((i+1)); echo $i > /tmp/tick; sleep 0.05; done";

/// Both counters, read from another container of the pod, 0.4 s apart: whether each moved.
fn moved(cri: &mut Cri, from: &str) -> (bool, bool) {
    let read = |cri: &mut Cri| cri.exec_sync(from, &["cat", "/tmp/tick", "/tmp/bg"]).1;
    let before = read(cri);
    std::thread::sleep(std::time::Duration::from_millis(400));
    let after = read(cri);
    let pair = |s: &str| s.lines().map(str::to_string).collect::<Vec<_>>();
    let (b, a) = (pair(&before), pair(&after));
    assert_eq!((b.len(), a.len()), (2, 2), "both counters: {before:?} {after:?}");
    (b[0] != a[0], b[1] != a[1])
}

/// containerd's Pause of one container of a pod stops its processes (a child it started included) while the
/// pod's other container runs on; Resume continues them; when the container ends, what it started ends too.
#[test]
fn guest_cri_one_container_of_a_pod_pauses_and_ends_with_what_it_started() {
    let Some((c, mut cri)) = setup() else { return };
    let config = Cri::pod_config("pausing", &[]);
    let pod = cri.run_pod(&config).expect("RunPodSandbox");
    let other = cri.create(&pod, &config, "other", BUSYBOX, &["sleep", "1000"]).expect("CreateContainer");
    cri.start(&other);
    let ticker = cri.create(&pod, &config, "ticker", BUSYBOX, &["sh", "-c", TICKER]).expect("CreateContainer");
    cri.start(&ticker);
    let t0 = Instant::now();
    while cri.exec_sync(&other, &["cat", "/tmp/tick", "/tmp/bg"]).0 != 0 {
        assert!(t0.elapsed().as_secs() < 10, "the ticker did not start");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert_eq!(moved(&mut cri, &other), (true, true), "control: both count while running");

    let out = c.ctr_ns("k8s.io", &["task", "pause", &ticker]);
    assert!(out.status.success(), "ctr task pause: {}\n{}", String::from_utf8_lossy(&out.stderr), c.log_tail());
    assert_eq!(moved(&mut cri, &other), (false, false), "paused: neither the container nor its child counts");
    assert_eq!(cri.exec_sync(&other, &["true"]).0, 0, "the pod's other container still answers");
    let ls = c.ctr_ns("k8s.io", &["task", "ls"]);
    let line = String::from_utf8_lossy(&ls.stdout).lines().find(|l| l.starts_with(&ticker)).map(str::to_string);
    assert!(line.as_deref().is_some_and(|l| l.contains("PAUSED")), "containerd shows it paused: {line:?}");

    let out = c.ctr_ns("k8s.io", &["task", "resume", &ticker]);
    assert!(out.status.success(), "ctr task resume: {}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(moved(&mut cri, &other), (true, true), "resumed: both count again");

    // StopContainer: its process ends, and the child it left in the pod's sandbox with it.
    let stop = StopContainerRequest { container_id: ticker.clone(), timeout: 2 };
    cri.rt.block_on(cri.client.stop_container(stop)).expect("StopContainer");
    assert_eq!(cri.status(&ticker).state, ContainerState::ContainerExited as i32);
    std::thread::sleep(std::time::Duration::from_millis(200));
    assert_eq!(moved(&mut cri, &other), (false, false), "nothing of the stopped container counts on");
    let (_, left, _) = cri.exec_sync(&other, &["sh", "-c", "ps -o args | busybox grep -c '^sh -c (j=0' || true"]);
    assert_eq!(left.trim(), "0", "no process of the stopped container is left");
    assert_eq!(cri.exec_sync(&other, &["true"]).0, 0, "the pod goes on");
    cri.stop_and_remove(&pod);
    assert!(c.sandboxes().is_empty());
}

/// A kubelet's volumes: host directories and files mounted into a pod's containers (read-only where asked),
/// one directory shared by a container on the pod's image and a sidecar of another image (under its own root);
/// what they write is the host's, owned as on the host; a pod with volumes is not marked.
#[test]
fn guest_cri_volumes_mount_host_paths_into_a_pods_containers() {
    use std::os::unix::fs::MetadataExt;
    let Some((c, mut cri)) = setup() else { return };
    let vol = c.dir.path().join("vol");
    std::fs::create_dir(&vol).unwrap();
    std::fs::write(vol.join("from-host"), "host\n").unwrap();
    let conf = c.dir.path().join("app.conf");
    std::fs::write(&conf, "conf\n").unwrap();
    let config = Cri::pod_config("volumes", &[]);
    let pod = cri.run_pod(&config).expect("RunPodSandbox");
    let app = cri
        .create_mounted(
            &pod,
            &config,
            "app",
            BUSYBOX,
            &["sleep", "1000"],
            &[(&vol, "/data", false), (&conf, "/etc/app.conf", true)],
        )
        .expect("CreateContainer");
    cri.try_start(&app).unwrap_or_else(|e| panic!("StartContainer with volumes: {e}\n{}", c.log_tail()));
    let side = cri
        .create_mounted(&pod, &config, "side", OTHER, &["sleep", "1000"], &[(&vol, "/shared", false)])
        .expect("CreateContainer");
    cri.try_start(&side).unwrap_or_else(|e| panic!("StartContainer of the sidecar: {e}\n{}", c.log_tail()));

    let (code, out, err) = cri.exec_sync(&app, &["cat", "/data/from-host", "/etc/app.conf"]);
    assert_eq!((code, out.as_str()), (0, "host\nconf\n"), "the host's files inside: {err}");
    assert_eq!(cri.exec_sync(&app, &["sh", "-c", "echo app > /data/by-app"]).0, 0);
    assert_eq!(std::fs::read_to_string(vol.join("by-app")).unwrap(), "app\n", "written through to the host");
    assert_eq!(std::fs::metadata(vol.join("by-app")).unwrap().uid(), 0, "owned by root on the host, as on runc");
    let (code, out, _) = cri.exec_sync(&side, &["cat", "/shared/by-app", "/etc/flavour"]);
    assert_eq!((code, out.as_str()), (0, "app\nother\n"), "the sidecar, on its own image, shares the volume");
    let (code, _, err) = cri.exec_sync(&app, &["sh", "-c", "echo x > /etc/app.conf"]);
    assert!(code != 0 && err.contains("Read-only"), "a read-only volume: {code} {err}");
    assert_eq!(std::fs::read_to_string(&conf).unwrap(), "conf\n");
    assert_ne!(cri.exec_sync(&side, &["sh", "-c", "test -e /data"]).0, 0, "control: the sidecar has no /data");

    // A mount point the image made a symbolic link is refused, not followed (the host mounts it, and the link
    // is the image's; it points at the sandbox's /etc here).
    let mut linked = busybox_rootfs();
    linked.push(Entry::Link("vol", "/etc"));
    import_k8s(&c, "clade.test/linked:latest", &linked, &["/bin/sh"]);
    let bad = cri
        .create_mounted(
            &pod,
            &config,
            "linked",
            "clade.test/linked:latest",
            &["sleep", "1000"],
            &[(&vol, "/vol", false)],
        )
        .expect("CreateContainer records it");
    let err = cri.try_start(&bad).expect_err("a volume on a symbolic link");
    assert!(err.message().contains("symbolic link"), "{}", err.message());
    assert_ne!(
        cri.exec_sync(&app, &["sh", "-c", "test -e /etc/from-host"]).0,
        0,
        "nothing was mounted on the pod's /etc"
    );

    let (marked, said) = mark_pod(&c, &[]);
    assert!(!marked && said.contains("volumes at /data"), "clade mark: {said}");
    cri.stop_and_remove(&pod);
    assert!(c.sandboxes().is_empty());
    assert_eq!(std::fs::read_to_string(vol.join("by-app")).unwrap(), "app\n", "the volume outlives the pod");
}

/// A pod on the vm backend (annotation `clade.dev/backend: vm`) with a container of another image: the image's
/// root is copied into the guest (clade-vm's volumes.rs) and the member runs `chroot`ed there, sharing the
/// guest's hostname, `/proc` and processes; the sandbox marks with it (the copy is guest memory); RemoveContainer
/// takes it away.
#[test]
fn guest_cri_vm_pod_of_two_images() {
    if !common::real_home().join("kernel/current/vmlinux").exists() {
        eprintln!("skip: no guest kernel (run ./x setup)");
        return;
    }
    let Some((c, mut cri)) = setup() else { return };
    let config = Cri::pod_config("vmpod", &[("clade.dev/backend", "vm")]);
    let pod = cri.run_pod(&config).unwrap_or_else(|e| panic!("RunPodSandbox: {e}\n{}", c.log_tail()));
    let first = cri.create(&pod, &config, "first", BUSYBOX, LOOP).expect("CreateContainer");
    cri.start(&first);
    assert_eq!(cri.exec_sync(&first, &["cat", "/etc/flavour"]).1, "busybox\n");
    assert_eq!(c.sandboxes()[0]["backend"], "vm", "{:?}", c.sandboxes());
    // Control: nothing is under the roots before a member of another image comes.
    let roots =
        |cri: &mut Cri| cri.exec_sync(&first, &["sh", "-c", "busybox grep -c /run/clade/roots /proc/mounts || true"]).1;
    assert_eq!(roots(&mut cri).trim(), "0");

    let other = member_of_another_image(&c, &mut cri, (&pod, &config), &first, "other");
    let (_, seen, _) = cri.exec_sync(&first, &["sh", "-c", "ps -o args | busybox grep -c '^sleep 1000$'"]);
    assert_eq!(seen.trim(), "1", "the guest's processes include the member's: {seen}");
    let mounted: usize = roots(&mut cri).trim().parse().unwrap_or(0);
    assert!(mounted >= 4, "its root and the guest's /proc, /dev and /sys in it: {mounted} mounts");
    assert_eq!(c.sandboxes().len(), 1, "one sandbox for the pod");
    // Unlike ct (a CRIU image cannot hold a host mount), the guest marks with the copy: it is guest memory.
    let (marked, said) = mark_pod(&c, &[]);
    assert!(marked, "clade mark of a vm pod showing another image's root: {said}");
    assert_eq!(cri.exec_sync(&other, &["cat", "/etc/flavour"]).1, "other\n", "it runs on after the mark");

    let stop = StopContainerRequest { container_id: other.clone(), timeout: 2 };
    cri.rt.block_on(cri.client.stop_container(stop)).expect("StopContainer");
    let remove = RemoveContainerRequest { container_id: other.clone() };
    cri.rt.block_on(cri.client.remove_container(remove)).expect("RemoveContainer");
    assert_eq!(roots(&mut cri).trim(), "0", "its root is gone once it is removed");
    cri.stop_and_remove(&pod);
    assert!(c.sandboxes().is_empty(), "{:?}", c.sandboxes());
}

/// A container's security context as a kubelet passes it (`capabilities.drop: [ALL]` plus one added,
/// `allowPrivilegeEscalation: false`): its processes, ExecSync's too, hold only what it keeps and run with
/// `no_new_privs`, on top of the sandbox's jail. Control: a container without one holds the jail's set.
#[test]
fn guest_cri_security_context_drops_capabilities() {
    let Some((c, mut cri)) = setup() else { return };
    let config = Cri::pod_config("caps", &[]);
    let pod = cri.run_pod(&config).unwrap_or_else(|e| panic!("RunPodSandbox: {e}\n{}", c.log_tail()));
    let status = "grep -E '^(CapPrm|CapEff|CapBnd|NoNewPrivs)' /proc/self/status | tr -s '\\t ' ' '";
    let plain = cri.create(&pod, &config, "plain", BUSYBOX, &["sleep", "1000"]).expect("CreateContainer");
    cri.start(&plain);
    let (_, own, _) = cri.exec_sync(&plain, &["sh", "-c", status]);
    let bounding = own.lines().find_map(|l| l.strip_prefix("CapBnd: ")).map(|h| u64::from_str_radix(h, 16));
    assert!(matches!(bounding, Some(Ok(b)) if b & !(1 << 10) != 0), "control: the jail's set: {own}");

    let security = LinuxContainerSecurityContext {
        capabilities: Some(Capability {
            drop_capabilities: vec!["ALL".into()],
            add_capabilities: vec!["NET_BIND_SERVICE".into()],
            ..Default::default()
        }),
        no_new_privs: true,
        ..Default::default()
    };
    let linux = LinuxContainerConfig { security_context: Some(security), ..Default::default() };
    let container = ContainerConfig {
        linux: Some(linux),
        ..Cri::container("secured", BUSYBOX, &["sh", "-c", &format!("{status} > /tmp/init; exec sleep 1000")])
    };
    let secured = cri
        .create_config(&pod, &config, container)
        .unwrap_or_else(|e| panic!("CreateContainer with a security context: {e}\n{}", c.log_tail()));
    cri.start(&secured);
    let want = "CapPrm: 0000000000000400\nCapEff: 0000000000000400\nCapBnd: 0000000000000400\nNoNewPrivs: 1\n";
    assert_eq!(cri.exec_sync(&secured, &["sh", "-c", status]).1, want, "ExecSync: NET_BIND_SERVICE only");
    let wait = "i=0; while [ ! -s /tmp/init ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done; cat /tmp/init";
    assert_eq!(cri.exec_sync(&secured, &["sh", "-c", wait]).1, want, "its init too");
    let (code, _, _) = cri.exec_sync(&secured, &["sh", "-c", "chown 1:1 /tmp/init"]);
    assert_ne!(code, 0, "root without CAP_CHOWN cannot chown");
    assert_eq!(cri.exec_sync(&plain, &["sh", "-c", "touch /tmp/p && chown 1:1 /tmp/p"]).0, 0, "control: it can");
    cri.stop_and_remove(&pod);
}
