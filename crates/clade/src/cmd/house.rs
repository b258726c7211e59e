//! Housekeeping: `branches [rm]`, `gc`, `audit`, `completions`. Embedded, or through `clade serve` when
//! `CLADE_HOST` is set, like the sandbox operations.

use super::sandbox::{api, print};

#[derive(clap::Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct BranchesArgs {
    #[command(subcommand)]
    pub cmd: Option<BranchCmd>,
    #[arg(long)]
    pub json: bool,
}

#[derive(clap::Subcommand)]
pub enum BranchCmd {
    /// Delete a branch: its marks go at the next `clade gc`, except those needed elsewhere.
    Rm {
        branch: String,
        #[arg(long)]
        json: bool,
    },
}

#[derive(clap::Args)]
pub struct GcArgs {
    /// Report what a run would delete now; change nothing.
    #[arg(long)]
    pub dry_run: bool,
    #[arg(long)]
    pub json: bool,
}

#[derive(clap::Args)]
pub struct AuditArgs {
    /// Two running ct sandboxes: the sibling audit (distinct namespaces, disjoint PIDs, no shared pipe,
    /// socket, eventfd, writable file or lock; shared character devices judged against a control pair)
    /// instead of the ledger audit.
    /// With --security: the sandboxes to audit (default: every running one).
    #[arg(num_args = 0.., value_names = ["SBX_A", "SBX_B"])]
    pub sandboxes: Vec<String>,
    /// The security audit: each sandbox's jail as the host's kernel reports it (ct: capabilities, seccomp,
    /// no_new_privs, id map, cgroup namespace, masked and read-only paths, limits; vm: QEMU's uid,
    /// capabilities, seccomp, -sandbox flags, chroot, mount namespace). Exit 1 on any deviation from the policy.
    #[arg(long, conflicts_with_all = ["control", "no_control", "fix"])]
    pub security: bool,
    /// The sibling audit's control pair: two running ct sandboxes (default: two cold sandboxes of the
    /// siblings' template, started for the audit and ended after it).
    #[arg(long, num_args = 2, value_names = ["SBX_C", "SBX_D"], conflicts_with = "no_control")]
    pub control: Option<Vec<String>>,
    /// Sibling audit without a control pair: judged by the literal rule (nothing shared at all).
    #[arg(long)]
    pub no_control: bool,
    /// Take leftovers down (processes, mounts, cgroups, run dirs, RAM files of sandboxes that are gone).
    #[arg(long, conflicts_with_all = ["sandboxes", "control", "no_control"])]
    pub fix: bool,
    #[arg(long)]
    pub json: bool,
}

#[derive(clap::Args)]
pub struct CompletionsArgs {
    pub shell: clap_complete::Shell,
}

pub fn branches(a: BranchesArgs) -> anyhow::Result<i32> {
    if let Some(BranchCmd::Rm { branch, json }) = a.cmd {
        let body = api()?.delete_branch(&branch)?;
        return print(json, &body, |_| format!("branch {branch} deleted; `clade gc` collects its marks"));
    }
    let rows = api()?.branches()?;
    print(a.json, &rows, |rows| {
        let mut s = format!("{:<40} {:>5}  head", "BRANCH", "MARKS");
        for r in rows {
            let head = r.head_mark.as_ref().map_or("-", |m| m.as_str());
            s.push_str(&format!("\n{:<40} {:>5}  {head}", r.id.as_str(), r.marks));
        }
        s
    })
}

pub fn gc(a: GcArgs) -> anyhow::Result<i32> {
    let out = api()?.gc(a.dry_run)?;
    print(a.json, &out, |o| {
        let b = serde_json::to_value(o).unwrap_or_default();
        let dry = if o.dry_run { "dry run: " } else { "" };
        let l = &b["ledger"];
        let st = &b["store"];
        let n = |v: &serde_json::Value| v.as_array().map(|a| a.len()).unwrap_or(0);
        format!(
            "{dry}marks: kept {}, deleted {} ({} branches purged); manifests unpublished {}; RAM files {} ({} MiB); \
             cache dirs {} ({} MiB); pool members ended {}; store: {} packs deleted, {} repacked, {} kept ({} younger than the grace period); freed {} MiB in {:.0} ms",
            n(&l["kept"]),
            n(&l["deleted"]),
            n(&l["branches_purged"]),
            b["manifests_deleted"],
            b["ram_files_deleted"],
            b["ram_bytes_freed"].as_u64().unwrap_or(0) >> 20,
            b["cache_dirs_deleted"],
            b["cache_bytes_freed"].as_u64().unwrap_or(0) >> 20,
            b["pool_members_ended"],
            st["packs_deleted"],
            st["packs_repacked"],
            st["packs_kept"],
            st["packs_kept_young"],
            (st["bytes_freed"].as_u64().unwrap_or(0)
                + b["ram_bytes_freed"].as_u64().unwrap_or(0)
                + b["cache_bytes_freed"].as_u64().unwrap_or(0))
                >> 20,
            b["took_ms"].as_f64().unwrap_or(0.0)
        )
    })
}

pub fn audit(a: AuditArgs) -> anyhow::Result<i32> {
    if a.security {
        if clade_api::client::Remote::from_env()?.is_some() {
            return Err(clade_host::error::invalid(
                "the security audit reads the host's /proc: run it on the sandbox's host (unset CLADE_HOST)",
            ));
        }
        let ops = clade_host::Ops::open(&clade_core::CladeHome::from_env())?;
        let body = clade_host::security::audit(&ops, &a.sandboxes)?;
        let ok = body["ok"].as_bool().unwrap_or(false);
        print(a.json, &body, clade_host::security::render)?;
        return Ok(if ok { 0 } else { 1 });
    }
    match a.sandboxes.len() {
        0 if a.control.is_some() || a.no_control => {
            return Err(anyhow::anyhow!(clade_core::OpError::new(
                clade_core::ErrorKind::Invalid,
                "--control and --no-control belong to the sibling audit: name two sandboxes (clade audit SBX_A SBX_B)"
            )))
        }
        0 => {}
        2 => return audit_siblings(a),
        _ => {
            return Err(anyhow::anyhow!(clade_core::OpError::new(
                clade_core::ErrorKind::Invalid,
                "the sibling audit takes two sandboxes (clade audit SBX_A SBX_B); without any, the ledger is audited"
            )))
        }
    }
    let report = api()?.audit(a.fix)?;
    let ok = report.ok;
    print(a.json, &report, |b| {
        let findings = &b.findings;
        let mut s = format!(
            "{} sandboxes, {} marks, {} live supervisors: {}",
            b.sandboxes,
            b.marks,
            b.live,
            if findings.is_empty() { "nothing wrong".to_string() } else { format!("{} finding(s)", findings.len()) }
        );
        for f in findings {
            let fixed = if f.fixed { " [fixed]" } else { "" };
            s.push_str(&format!("\n  {:<18} {}  {}{fixed}", f.kind, f.id, f.detail));
        }
        if !ok && !a.fix {
            s.push_str("\n(`clade audit --fix` takes leftovers down; lost sandboxes end with `clade kill`)");
        }
        s
    })?;
    Ok(if ok { 0 } else { 1 })
}

/// `clade audit SBX_A SBX_B`: exit 0 when the pair passes (shared character devices judged against a control pair,
/// or nothing shared at all without one), 1 when not.
fn audit_siblings(a: AuditArgs) -> anyhow::Result<i32> {
    let (x, y) = (&a.sandboxes[0], &a.sandboxes[1]);
    let control = clade_host::siblings::Control::parse(a.control.clone(), a.no_control)?;
    if control == clade_host::siblings::Control::Cold && !a.json && x != y {
        eprintln!("starting two cold sandboxes of the siblings' template as the control pair ...");
    }
    let body = serde_json::to_value(api()?.audit_siblings(x, y, control)?)?;
    let pass = body["pass"].as_bool().unwrap_or(false);
    print(a.json, &body, |b| {
        let list = |k: &str| {
            b[k].as_array()
                .map(|v| v.iter().map(|x| x.as_str().map(str::to_string).unwrap_or_else(|| x.to_string())).collect())
                .unwrap_or_else(Vec::<String>::new)
        };
        let mut s = format!(
            "{x} and {y}: {} ({})\n  processes: {} and {}",
            if pass { "PASS" } else { "FAIL" },
            b["rule"].as_str().unwrap_or(""),
            b["processes"][0],
            b["processes"][1]
        );
        for (k, what) in [
            ("shared_namespaces", "namespaces"),
            ("shared_pids", "pids"),
            ("shared_pipes", "pipes"),
            ("shared_sockets", "sockets"),
            ("shared_eventfds", "eventfds"),
            ("shared_writable_files", "writable files"),
            ("shared_locks", "locks"),
            ("shared_char_devices", "character devices"),
        ] {
            let v = list(k);
            s.push_str(&format!("\n  shared {what}: {}", if v.is_empty() { "none".into() } else { v.join(", ") }));
        }
        let ctl = &b["control"];
        match ctl["kind"].as_str() {
            Some("none") => s.push_str("\n  control: none (--no-control)"),
            Some(kind) => s.push_str(&format!(
                "\n  control ({kind}{}): shares {}",
                ctl["template"].as_str().map(|t| format!(" of {t}")).unwrap_or_default(),
                {
                    let v = list("control_shared_char_devices");
                    if v.is_empty() {
                        "no character device".to_string()
                    } else {
                        v.join(", ")
                    }
                }
            )),
            None => {}
        }
        s
    })?;
    Ok(if pass { 0 } else { 1 })
}

pub fn completions<C: clap::CommandFactory>(a: CompletionsArgs) -> anyhow::Result<i32> {
    let mut cmd = C::command();
    clap_complete::generate(a.shell, &mut cmd, "clade", &mut std::io::stdout());
    Ok(0)
}
