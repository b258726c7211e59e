//! E2B's `base` template on first use. E2B's SDKs ask for `base` unless told otherwise; clade serves it as
//! `$CLADE_E2B_TEMPLATE`, by default `e2b-base` (`templates/e2b-base`: E2B's user `user` in /home/user, sudo,
//! python, curl, git, node; docs/e2b.md). When that template has no base for the backend yet, the first create
//! builds it: from the template already built on this host, else from the spec shipped with clade
//! ([`clade_host::base::shipped_template`]). One build at a time; later creates fork.

use clade_core::backend::BackendKind;
use clade_core::CladeHome;

/// The template `base` is served as when `$CLADE_E2B_TEMPLATE` is not set.
pub const DEFAULT_TEMPLATE: &str = "e2b-base";

/// Serializes first-use builds in this process: concurrent creates wait for the one build.
static BUILDING: parking_lot::Mutex<()> = parking_lot::Mutex::new(());

/// Build `name`'s base for `backend` (and the template itself when this host has not built it).
pub fn ensure_base(home: &CladeHome, name: &str, backend: BackendKind) -> anyhow::Result<()> {
    let _one = BUILDING.lock();
    let say = |l: String| eprintln!("clade serve: e2b base: {l}");
    match clade_host::base::build(home, name, backend, false, &say) {
        Ok(_) => Ok(()),
        Err(first) => {
            let Some(spec) = clade_host::base::shipped_template(name) else {
                return Err(first.context(format!(
                    "template {name} is not built here and its spec was not found beside clade (set \
                     CLADE_TEMPLATES_DIR, or run `clade template build templates/{name}`)"
                )));
            };
            eprintln!("clade serve: e2b base: building template {name} from {} on first use", spec.display());
            clade_host::base::build(home, &spec.to_string_lossy(), backend, false, &say)?;
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_shipped_e2b_base_spec_is_found_from_a_test_binary() {
        // A cargo test binary lives in target/debug/deps: the repository's templates/ is four levels up.
        let p = clade_host::base::shipped_template(super::DEFAULT_TEMPLATE).expect("templates/e2b-base/template.toml");
        assert!(p.ends_with("templates/e2b-base/template.toml"), "{}", p.display());
        assert!(clade_host::base::shipped_template("no-such-template").is_none());
    }
}
