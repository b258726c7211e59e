//! `docs/openapi.json` checked against the answer types: every typed answer (a sample of each, with its optional
//! parts filled so that every key appears) must fit the document's schema of its route's success response:
//! no key the document does not name (unless it allows extra ones), every key it requires, every value of the
//! type it says. A field added to a type without the document, or renamed in one of them, fails here.

use clade_core::backend::{BackendKind, Shape};
use clade_host::api::*;
use clade_ledger::{BranchId, MarkId};
use serde_json::{json, Value};

use crate::routes::OPENAPI;

fn resolve<'a>(doc: &'a Value, schema: &'a Value) -> &'a Value {
    match schema["$ref"].as_str().and_then(|r| r.strip_prefix("#/components/schemas/")) {
        Some(name) => resolve(doc, &doc["components"]["schemas"][name]),
        None => schema,
    }
}

/// What of `value` does not fit `schema`, each with where (`at`).
fn misfits(doc: &Value, schema: &Value, value: &Value, at: &str) -> Vec<String> {
    let schema = resolve(doc, schema);
    if let Some(alts) = schema["oneOf"].as_array() {
        let fits = alts.iter().any(|s| misfits(doc, s, value, at).is_empty());
        return if fits { vec![] } else { vec![format!("{at}: fits none of oneOf")] };
    }
    if value.is_null() {
        let ok = schema["nullable"] == true || schema.get("type").is_none();
        return if ok { vec![] } else { vec![format!("{at}: null where the document says {}", schema["type"])] };
    }
    let mut out = Vec::new();
    match schema["type"].as_str() {
        Some("object") => {
            let Some(map) = value.as_object() else { return vec![format!("{at}: not an object")] };
            let props = schema["properties"].as_object();
            let extra = &schema["additionalProperties"];
            for (k, v) in map {
                match props.and_then(|p| p.get(k)) {
                    Some(s) => out.extend(misfits(doc, s, v, &format!("{at}.{k}"))),
                    None if extra == true => {}
                    None if extra.is_object() => out.extend(misfits(doc, extra, v, &format!("{at}.{k}"))),
                    None => out.push(format!("{at}.{k}: a key the document does not name")),
                }
            }
            for r in schema["required"].as_array().into_iter().flatten().filter_map(Value::as_str) {
                if !map.contains_key(r) {
                    out.push(format!("{at}.{r}: required by the document, missing from the answer"));
                }
            }
        }
        Some("array") => match value.as_array() {
            Some(items) => {
                for (i, v) in items.iter().enumerate() {
                    out.extend(misfits(doc, &schema["items"], v, &format!("{at}[{i}]")));
                }
            }
            None => out.push(format!("{at}: not an array")),
        },
        Some("string") if !value.is_string() => out.push(format!("{at}: not a string")),
        Some("integer") if !(value.is_i64() || value.is_u64()) => out.push(format!("{at}: not an integer")),
        Some("number") if !value.is_number() => out.push(format!("{at}: not a number")),
        Some("boolean") if !value.is_boolean() => out.push(format!("{at}: not a boolean")),
        _ => {}
    }
    out
}

fn ready() -> Ready {
    serde_json::from_value(json!({
        "ok": true, "sandbox": "sb-1", "error": null, "pid": 7, "restore_ms": 1.5, "ready_ms": 2.5,
        "hygiene": {"clock": "stepped"}, "blob_bytes": 0,
    }))
    .unwrap()
}

fn row() -> SandboxRow {
    SandboxRow {
        id: "sb-1".into(),
        backend: BackendKind::Ct,
        state: "running".into(),
        origin: Some(MarkId::new("m-1")),
        branch: BranchId::new("b-1"),
        supervisor_pid: Some(9),
        error: None,
        created_ms: 1,
        last_active_ms: 2,
    }
}

fn watch_batch() -> WatchBatch {
    let event = |name: &str, kind| clade_agent::proto::WatchEvent { name: name.into(), kind };
    use clade_agent::proto::WatchKind;
    WatchBatch { events: vec![event("a", WatchKind::Create), event("d/b", WatchKind::Rename)], lost: false }
}

fn mark_row() -> MarkRow {
    MarkRow {
        id: MarkId::new("m-1"),
        branch: BranchId::new("b-1"),
        label: Some("l".into()),
        parent: Some(MarkId::new("m-0")),
        backend: BackendKind::Vm,
        pause_ms: Some(3),
        logical_bytes: 10,
        stored_bytes: 5,
        created_ms: 1,
        pinned: false,
        clean: true,
        disk_only: false,
    }
}

fn mark_record() -> Mark {
    Mark {
        id: MarkId::new("m-1"),
        branch: BranchId::new("b-1"),
        label: None,
        parent: None,
        backend: clade_ledger::Backend::Ct,
        manifests: [("criu".to_string(), clade_ledger::ManifestId::new("x"))].into(),
        logical_bytes: 1,
        stored_bytes: 1,
        pause_ms: Some(1),
        timings: json!({"pause_us": 1000}),
        created_ms: 1,
        pinned: true,
        clean: true,
    }
}

fn pull() -> PullOutcome {
    PullOutcome {
        sandbox: "sb-1".into(),
        mark: MarkId::new("m-1"),
        blob: "s3://b".into(),
        host: "h2".into(),
        from: "h1".into(),
        full_bytes: 1,
        pull_ms: 1.0,
        blob_bytes: 1,
    }
}

fn stat() -> FileStat {
    FileStat {
        file_type: FileType::Symlink,
        size: 1,
        mode: 0o644,
        uid: 0,
        gid: 0,
        mtime_ns: 1,
        link_target: None,
        xattrs: [("user.k".to_string(), "v".to_string())].into(),
    }
}

/// One typed answer per route that answers one: (method, path, success status, the answer as JSON).
fn samples() -> Vec<(&'static str, &'static str, &'static str, Value)> {
    let v = |x: &dyn erased::Ser| x.value();
    let fork = ForkOutcome {
        mark: MarkId::new("m-1"),
        backend: BackendKind::Ct,
        shape: Some(Shape { memory_mib: 256, vcpus: 1, disk_gib: 2 }),
        total_ms: 1.0,
        sandboxes: vec![ready()],
        suspended_to_make_room: vec!["sb-0".into()],
    };
    let info = SandboxInfo {
        row: row(),
        live: Some(LiveFacts { pids: vec![1], pss: 1, rss: 2, generation: 1, ..Default::default() }),
    };
    let home = tempfile::tempdir().unwrap();
    let ops = clade_host::Ops::open(&clade_core::CladeHome::at(home.path())).unwrap();
    let gc = ops.gc(true).unwrap();
    let audit = ops.audit(false).unwrap();
    let kill = KillOutcome { killed: "sb-1".into(), reaped: Some(1), taken_down: Some(2) };
    let push = PushOutcome {
        sandbox: "sb-1".into(),
        mark: MarkId::new("m-1"),
        blob: "s3://b".into(),
        host: "h1".into(),
        full_bytes: 1,
        packs: 1,
        packs_uploaded: 1,
        bytes_uploaded: 1,
        push_ms: 1.0,
    };
    let resume = ResumeOutcome {
        sandbox: "sb-1".into(),
        mark: MarkId::new("m-1"),
        ok: true,
        error: None,
        resume_ms: 1.0,
        blob_bytes: 1,
        pulled: Some(pull()),
    };
    let roam =
        RoamRow { sandbox: "sb-1".into(), owner: Some(Owner { host: "h1".into(), state: "pushed".into(), at_ms: 1 }) };
    let branch = BranchRow {
        id: BranchId::new("b-1"),
        name: None,
        parent_mark: Some(MarkId::new("m-0")),
        head_mark: None,
        marks: 2,
        created_ms: 1,
    };
    let exec = ExecOutput { code: 0, signal: None, stdout: b"hi".to_vec(), stderr: vec![] };
    let entry = DirEntry { path: "/a".into(), depth: 1, stat: stat() };
    let procs: Vec<ProcListing> = serde_json::from_value(json!([{"pid": 3, "argv": ["sh"], "pty": false}])).unwrap();
    vec![
        ("get", "/v1/sandboxes", "200", v(&vec![row()])),
        ("post", "/v1/sandboxes", "201", v(&fork)),
        ("get", "/v1/sandboxes/{id}", "200", v(&info)),
        ("delete", "/v1/sandboxes/{id}", "200", v(&kill)),
        ("post", "/v1/sandboxes/{id}/exec", "200", v(&exec)),
        ("get", "/v1/sandboxes/{id}/marks", "200", v(&vec![mark_row()])),
        ("post", "/v1/sandboxes/{id}/marks", "201", v(&mark_record())),
        ("post", "/v1/sandboxes/{id}/retake", "200", v(&RetakeOutcome { mark: MarkId::new("m-1"), retake_ms: 1.0 })),
        ("post", "/v1/sandboxes/{id}/suspend", "200", v(&mark_record())),
        ("post", "/v1/sandboxes/{id}/resume", "200", v(&resume)),
        ("get", "/v1/marks", "200", v(&vec![mark_row()])),
        ("get", "/v1/marks/{id}", "200", v(&mark_row())),
        ("post", "/v1/marks/{id}/fork", "201", v(&fork)),
        ("get", "/v1/branches", "200", v(&vec![branch])),
        ("delete", "/v1/branches/{id}", "200", v(&Deleted { deleted: "b-1".into() })),
        ("post", "/v1/gc", "200", v(&gc)),
        ("post", "/v1/audit", "200", v(&audit)),
        ("post", "/v1/sandboxes/{id}/push", "200", v(&push)),
        ("post", "/v1/sandboxes/{id}/pull", "200", v(&pull())),
        ("get", "/v1/roam", "200", v(&vec![roam])),
        ("get", "/v1/sandboxes/{id}/fs/stat", "200", v(&stat())),
        ("get", "/v1/sandboxes/{id}/fs/list", "200", json!({ "entries": [v(&entry)] })),
        ("get", "/v1/sandboxes/{id}/processes", "200", json!({ "processes": v(&procs) })),
        ("post", "/v1/sandboxes/{id}/watches", "201", json!({"watch": 1})),
        ("get", "/v1/sandboxes/{id}/watches/{watch}", "200", v(&watch_batch())),
        ("delete", "/v1/sandboxes/{id}/watches/{watch}", "200", json!({"stopped": 1})),
    ]
}

/// `&dyn Serialize` is not object safe; this is the one method the samples need.
mod erased {
    pub trait Ser {
        fn value(&self) -> serde_json::Value;
    }
    impl<T: serde::Serialize> Ser for T {
        fn value(&self) -> serde_json::Value {
            serde_json::to_value(self).expect("a sample serializes")
        }
    }
}

#[test]
fn every_typed_answer_fits_the_document() {
    let doc: Value = serde_json::from_str(OPENAPI).unwrap();
    let mut bad = Vec::new();
    for (method, path, status, value) in samples() {
        let op = &doc["paths"][path][method];
        assert!(op.is_object(), "{method} {path}: not in docs/openapi.json");
        let schema = &op["responses"][status]["content"]["application/json"]["schema"];
        assert!(schema.is_object(), "{method} {path}: no {status} JSON answer in the document");
        bad.extend(misfits(&doc, schema, &value, &format!("{method} {path}")));
    }
    assert!(bad.is_empty(), "docs/openapi.json and the answer types differ:\n{}", bad.join("\n"));
}

#[test]
fn the_check_catches_an_undocumented_or_missing_key() {
    let doc: Value = serde_json::from_str(OPENAPI).unwrap();
    let schema = json!({"$ref": "#/components/schemas/RetakeResult"});
    assert!(misfits(&doc, &schema, &json!({"mark": "m", "retake_ms": 1.0}), "x").is_empty());
    let extra = misfits(&doc, &schema, &json!({"mark": "m", "retake_ms": 1.0, "colour": 1}), "x");
    assert_eq!(extra, vec!["x.colour: a key the document does not name".to_string()]);
    let missing = misfits(&doc, &schema, &json!({"mark": "m"}), "x");
    assert_eq!(missing, vec!["x.retake_ms: required by the document, missing from the answer".to_string()]);
    assert_eq!(misfits(&doc, &schema, &json!({"mark": 3, "retake_ms": 1.0}), "x"), vec!["x.mark: not a string"]);
}
