//! A template's network is not in its hash (it does not change the rootfs), so a base is rebuilt when its
//! template's record asks for another network than the base was marked with (docs/templates.md): a base of a
//! template without egress is cached; once the record says `egress = true` the next `clade base build` makes a
//! new base whose sandboxes have a network; then that one is cached.

mod common;
use common::clade;

/// A `--json` command that must succeed (common::ok_env without extra environment).
fn ok(h: &std::path::Path, args: &[&str]) -> serde_json::Value {
    common::ok_env(h, &Vec::new(), args)
}

#[test]
fn guest_base_rebuilt_when_its_template_network_changes_ct() {
    let Some(t) = common::ct_home("clade-basenet-ct") else { return };
    let h = t.path();
    common::ct_template_record(h);
    let build = || ok(h, &["base", "build", "ctbox", "--backend", "ct", "--json"]);
    let first = build();
    let again = build();
    assert_eq!((again["cached"].as_bool(), &again["mark"]), (Some(true), &first["mark"]), "{again}");

    // The record now asks for egress (as a rebuilt spec with `[network] egress = true` leaves it).
    let hash = first["hash"].as_str().expect("the template's hash").to_string();
    let path = h.join("templates").join(&hash).join("template.json");
    let mut rec: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    rec["egress"] = serde_json::Value::Bool(true);
    std::fs::write(&path, serde_json::to_vec_pretty(&rec).unwrap()).unwrap();
    let third = build();
    assert_eq!(third["cached"].as_bool(), Some(false), "a base without the template's network is built again: {third}");
    assert_ne!(third["mark"], first["mark"]);
    let fourth = build();
    assert_eq!((fourth["cached"].as_bool(), &fourth["mark"]), (Some(true), &third["mark"]), "{fourth}");

    // Its sandboxes have the network.
    let v = ok(h, &["fork", third["mark"].as_str().unwrap(), "--json"]);
    let id = v["sandboxes"][0]["sandbox"].as_str().unwrap().to_string();
    let (code, out, err) = clade(h, &["exec", &id, "--", "sh", "-c", "grep -c eth0 /proc/net/dev"]);
    let _ = clade(h, &["kill", &id]);
    assert_eq!((code, out.trim()), (0, "1"), "a sandbox of the new base has eth0: {err}");
}
