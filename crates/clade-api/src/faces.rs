//! The local and remote faces cannot drift: the real router serves the in-memory [`Fake`] on a unix socket, the
//! real typed client ([`Remote`]) drives it, and every operation must answer through HTTP what the fake answers
//! in-process, and fail with the same error kind.

use std::sync::Arc;

use clade_core::backend::BackendKind;
use clade_core::ErrorKind;
use clade_host::api::*;
use clade_host::error::kind;

use crate::app::App;
use crate::client::Remote;
use crate::fake::Fake;

struct Served {
    _dir: tempfile::TempDir,
    _rt: tokio::runtime::Runtime,
    fake: Arc<Fake>,
    remote: Remote,
}

fn serve_fake() -> Served {
    let dir = tempfile::tempdir().unwrap();
    let home = clade_core::CladeHome::at(dir.path());
    let fake = Arc::new(Fake::default());
    let app = Arc::new(App {
        api: fake.clone(),
        store: None,
        home: dir.path().to_path_buf(),
        metrics: crate::metrics::Metrics::new(),
        idle: crate::idle::Idle::load(&home, 0),
        max_upload: 1 << 20,
        exec_limit: std::time::Duration::from_secs(60),
    });
    let sock = dir.path().join("api.sock");
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let lis = rt.block_on(async { tokio::net::UnixListener::bind(&sock) }).unwrap();
    let router = crate::routes::app_router(app, "k3y".into(), vec!["localhost".into()]);
    rt.spawn(clade_http::serve(lis, router, clade_http::Limits::default()));
    Served { remote: Remote::unix(&sock, "k3y"), fake, _rt: rt, _dir: dir }
}

fn same<T: serde::Serialize>(local: T, remote: T) {
    assert_eq!(serde_json::to_value(local).unwrap(), serde_json::to_value(remote).unwrap());
}

fn drain(events: ExecEvents) -> Vec<String> {
    events.map(|e| format!("{:?}", e.unwrap())).collect()
}

#[test]
fn every_operation_answers_through_http_what_the_library_answers() {
    let s = serve_fake();
    let api: &dyn SandboxApi = &s.remote;
    let forked = api.fork(&ForkRequest::new("tpl", Some(BackendKind::Ct), 2)).unwrap();
    assert_eq!(forked.sandboxes.len(), 2);
    assert_eq!(forked.shape.as_ref().map(|s| s.vcpus), Some(2), "the fork answer carries the sandbox's shape");
    same(s.fake.list().unwrap(), api.list().unwrap());
    let id = forked.sandboxes[0].sandbox.clone();
    same(s.fake.get(&id).unwrap(), api.get(&id).unwrap());
    same(s.fake.state(&id).unwrap(), api.state(&id).unwrap());

    let echo = ExecRequest { argv: vec!["echo".into(), "a".into(), "b".into()], ..Default::default() };
    let out = api.exec(&id, echo.clone()).unwrap();
    assert_eq!((out.code, out.stdout.as_slice()), (0, &b"a b\n"[..]));
    assert_eq!(drain(api.exec_stream(&id, echo.clone()).unwrap()), drain(s.fake.exec_stream(&id, echo).unwrap()));

    let how = WriteOptions {
        mode: Some(0o600),
        owner: Some(FileOwner { uid: 1000, gid: 1001 }),
        xattrs: [("user.e2b.k".to_string(), "v w".to_string())].into(),
    };
    assert_eq!(api.write_file_from(&id, "/d/f", &how, &mut &b"hello"[..]).unwrap(), 5);
    let st = api.stat(&id, "/d/f").unwrap();
    assert_eq!((st.mode, st.uid, st.gid, &st.xattrs), (0o600, 1000, 1001, &how.xattrs), "mode, owner, xattrs carried");
    let (size, mut r) = api.open_file(&id, "/d/f").unwrap();
    let mut got = Vec::new();
    std::io::Read::read_to_end(&mut r, &mut got).unwrap();
    assert_eq!((size, got.as_slice()), (5, &b"hello"[..]));
    same(s.fake.stat(&id, "/d/f").unwrap(), api.stat(&id, "/d/f").unwrap());
    same(s.fake.list_dir(&id, "/d", 1).unwrap(), api.list_dir(&id, "/d", 1).unwrap());
    assert!(api.make_dir(&id, "/d/e", Some(FileOwner { uid: 1000, gid: 1000 })).unwrap());
    api.rename(&id, "/d/f", "/d/g").unwrap();
    assert_eq!(api.stat(&id, "/d/g").unwrap().size, 5);
    api.remove(&id, "/d/g").unwrap();
    assert_eq!(kind(&api.stat(&id, "/d/g").unwrap_err()), ErrorKind::NotFound);

    let spec = ProcSpec { argv: vec!["echo".into(), "x".into()], ..Default::default() };
    let (pid, events) = api.proc_start(&id, spec).unwrap();
    assert_eq!(pid, 7);
    assert_eq!(drain(events), vec!["Stdout([120, 10])".to_string(), "Exit { code: 0, signal: None }".to_string()]);
    same(s.fake.proc_list(&id).unwrap(), api.proc_list(&id).unwrap());
    api.proc_input(&id, 7, b"in\0put").unwrap();
    api.proc_close_stdin(&id, 7).unwrap();
    api.proc_signal(&id, 7, 15).unwrap();
    api.proc_resize(&id, 7, 24, 80).unwrap();

    let m = api.mark(&id, &MarkRequest { label: Some("one".into()), ..Default::default() }).unwrap();
    assert_eq!(m.label.as_deref(), Some("one"));
    same(s.fake.marks(Some(&id)).unwrap(), api.marks(Some(&id)).unwrap());
    same(s.fake.marks(None).unwrap(), api.marks(None).unwrap());
    same(s.fake.mark_info(m.id.as_str(), None).unwrap(), api.mark_info(m.id.as_str(), None).unwrap());
    assert_eq!(api.retake(&id, m.id.as_str()).unwrap().mark, m.id);
    api.suspend(&id).unwrap();
    assert_eq!(api.state(&id).unwrap().state, "suspended");
    assert!(api.resume(&id).unwrap().ok);
    same(s.fake.audit(false).unwrap(), api.audit(false).unwrap());
    same(s.fake.roaming().unwrap(), api.roaming().unwrap());
    same(s.fake.branches().unwrap(), api.branches().unwrap());
    assert_eq!(api.kill(&id).unwrap().killed, id);
    assert_eq!(api.list().unwrap().len(), 1);
}

#[test]
fn every_failure_keeps_its_kind_through_http() {
    let s = serve_fake();
    let id = s.fake.fork(&ForkRequest::new("tpl", None, 1)).unwrap().sandboxes[0].sandbox.clone();
    let suspended = s.fake.fork(&ForkRequest::new("tpl", None, 1)).unwrap().sandboxes[0].sandbox.clone();
    s.fake.suspend(&suspended).unwrap();
    type Call = Box<dyn Fn(&dyn SandboxApi) -> anyhow::Error>;
    fn e(r: anyhow::Result<()>) -> anyhow::Error {
        r.unwrap_err()
    }
    let id2 = id.clone();
    let sus = suspended.clone();
    let cases: Vec<(ErrorKind, &str, Call)> = vec![
        (ErrorKind::NotFound, "get unknown", Box::new(|a| e(a.get("nosuch").map(drop)))),
        (ErrorKind::Invalid, "get bad id", Box::new(|a| e(a.get("../etc").map(drop)))),
        (ErrorKind::Invalid, "fork 0", Box::new(|a| e(a.fork(&ForkRequest::new("tpl", None, 0)).map(drop)))),
        (ErrorKind::NotFound, "fork unknown", Box::new(|a| e(a.fork(&ForkRequest::new("nosuch", None, 1)).map(drop)))),
        (ErrorKind::NoCapacity, "fork too big", Box::new(|a| e(a.fork(&ForkRequest::new("huge", None, 1)).map(drop)))),
        (ErrorKind::Invalid, "gc", Box::new(|a| e(a.gc(true).map(drop)))),
        (ErrorKind::NoSpace, "push", Box::new(|a| e(a.push("x", &mut |_| {}).map(drop)))),
        (ErrorKind::NotFound, "pull", Box::new(|a| e(a.pull("x", &mut |_| {}).map(drop)))),
        (ErrorKind::NotFound, "delete branch", Box::new(|a| e(a.delete_branch("b").map(drop)))),
        (ErrorKind::Conflict, "audit siblings", Box::new(|a| e(a.audit_siblings("x", "y", Control::Skip).map(drop)))),
        (ErrorKind::Conflict, "resume running", Box::new(move |a| e(a.resume(&id2).map(drop)))),
        (
            ErrorKind::Conflict,
            "exec suspended",
            Box::new(move |a| {
                e(a.exec(&sus, ExecRequest { argv: vec!["true".into()], ..Default::default() }).map(drop))
            }),
        ),
        (ErrorKind::Invalid, "exec empty argv", Box::new(move |a| e(a.exec("x", ExecRequest::default()).map(drop)))),
    ];
    let id3 = id.clone();
    let more: Vec<(ErrorKind, &str, Call)> = vec![
        (ErrorKind::Invalid, "bad signal", Box::new(move |a| e(a.proc_signal(&id3, 7, 99)))),
        (ErrorKind::NotFound, "attach to nothing", Box::new(move |a| e(a.proc_connect(&id, 9).map(drop)))),
    ];
    for (want, what, call) in cases.into_iter().chain(more) {
        let local = call(s.fake.as_ref());
        let remote = call(&s.remote);
        assert_eq!(kind(&local), want, "{what}, in-process: {local:#}");
        assert_eq!(kind(&remote), want, "{what}, through HTTP: {remote:#}");
    }
}
