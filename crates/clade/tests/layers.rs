//! The product crates keep their layers: inside each of `clade-host`, `clade-api` and `clade`, no module reaches
//! another that reaches back to it (directly or around a longer circle), so each module can be read knowing only
//! the ones below it. A module using its own parent (a child of `supervisor/` using `supervisor/mod.rs`) is not
//! a circle: the parent declares the child.
//!
//! Read from the sources: a module's references are its `crate::a::b` and `super::x` paths, resolved to the
//! longest module the crate has.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Module path (`["supervisor", "pool"]`) of every `.rs` file under `src`, with its text.
fn modules(src: &Path) -> BTreeMap<Vec<String>, String> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                walk(&p, out);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    let mut files = Vec::new();
    walk(src, &mut files);
    let mut out = BTreeMap::new();
    for f in files {
        let rel = f.strip_prefix(src).unwrap().with_extension("");
        let mut path: Vec<String> = rel.iter().map(|c| c.to_string_lossy().into_owned()).collect();
        if matches!(path.last().map(String::as_str), Some("mod" | "lib" | "main")) {
            path.pop();
        }
        // A binary's own modules (`src/bin/...`) are other crates.
        if path.first().is_some_and(|p| p == "bin") {
            continue;
        }
        out.insert(path, std::fs::read_to_string(&f).unwrap());
    }
    out
}

/// The identifiers of `text` that follow `prefix` as a path: `crate::a::b` gives `[a, b]`.
fn paths_after(text: &str, prefix: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    for (i, _) in text.match_indices(prefix) {
        if text[..i].chars().next_back().is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue; // `my_crate::`, not `crate::`
        }
        let rest = &text[i + prefix.len()..];
        if let Some(group) = rest.strip_prefix('{') {
            // `crate::{a, b::c}`
            let inner = &group[..group.find('}').unwrap_or(group.len())];
            for item in inner.split(',') {
                out.push(item.trim().split("::").map(|s| s.trim().to_string()).filter(|s| !s.is_empty()).collect());
            }
            continue;
        }
        let ident: String = rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':').collect();
        out.push(ident.split("::").filter(|s| !s.is_empty()).map(str::to_string).collect());
    }
    out
}

/// The module a path names: its longest prefix that is a module of the crate.
fn resolve(mods: &BTreeMap<Vec<String>, String>, path: &[String]) -> Option<Vec<String>> {
    (1..=path.len()).rev().map(|n| path[..n].to_vec()).find(|p| mods.contains_key(p))
}

/// Edges between modules, a module's references to its own ancestors left out.
fn edges(mods: &BTreeMap<Vec<String>, String>) -> BTreeMap<Vec<String>, BTreeSet<Vec<String>>> {
    let mut out: BTreeMap<_, BTreeSet<_>> = BTreeMap::new();
    for (m, text) in mods {
        let mut targets = Vec::new();
        for p in paths_after(text, "crate::") {
            targets.extend(resolve(mods, &p));
        }
        if !m.is_empty() {
            for p in paths_after(text, "super::") {
                let mut full = m[..m.len() - 1].to_vec();
                full.extend(p);
                targets.extend(resolve(mods, &full));
            }
        }
        for t in targets {
            if &t != m && !m.starts_with(&t) {
                out.entry(m.clone()).or_default().insert(t);
            }
        }
    }
    out
}

/// Every module on a circle, as the circle found from it (empty: none).
fn circles(edges: &BTreeMap<Vec<String>, BTreeSet<Vec<String>>>) -> Vec<String> {
    let mut found = Vec::new();
    for start in edges.keys() {
        // Depth-first from `start`, looking for a way back to it.
        let mut stack = vec![(start.clone(), vec![start.clone()])];
        let mut seen = BTreeSet::new();
        while let Some((at, trail)) = stack.pop() {
            for next in edges.get(&at).into_iter().flatten() {
                if next == start {
                    let names: Vec<String> = trail.iter().chain([start]).map(|m| m.join("::")).collect();
                    found.push(names.join(" -> "));
                } else if seen.insert(next.clone()) {
                    let mut t = trail.clone();
                    t.push(next.clone());
                    stack.push((next.clone(), t));
                }
            }
        }
    }
    found
}

fn crate_src(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(name).join("src")
}

#[test]
fn no_module_circles_in_the_product_crates() {
    let mut bad = Vec::new();
    for name in ["clade-host", "clade-api", "clade"] {
        let mods = modules(&crate_src(name));
        assert!(mods.len() > 3, "{name}: no modules read");
        for c in circles(&edges(&mods)) {
            bad.push(format!("{name}: {c}"));
        }
    }
    assert!(bad.is_empty(), "module circles:\n{}", bad.join("\n"));
}

#[test]
fn the_check_sees_a_circle() {
    let mut mods = BTreeMap::new();
    mods.insert(vec!["a".to_string()], "use crate::b::x;".to_string());
    mods.insert(vec!["b".to_string()], "use crate::{c, d};".to_string());
    mods.insert(vec!["c".to_string()], "fn f() { crate::a::g() }".to_string());
    mods.insert(vec!["d".to_string()], "use super::a;".to_string());
    mods.insert(vec!["e".to_string(), "f".to_string()], "use super::g;".to_string());
    mods.insert(vec!["e".to_string()], "use my_crate::a;".to_string());
    let found = circles(&edges(&mods));
    assert!(found.iter().any(|c| c == "a -> b -> c -> a"), "{found:?}");
    assert!(found.iter().any(|c| c == "a -> b -> d -> a"), "{found:?}");
    assert!(!found.iter().any(|c| c.contains('e')), "a child using its parent is no circle: {found:?}");
}
