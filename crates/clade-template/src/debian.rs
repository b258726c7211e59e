//! Debian root filesystems. A pristine `debootstrap --variant=minbase` of each (suite, variant, mirror) is
//! made once and kept (`$CLADE_HOME/templates/debootstrap-<hash>`, with its apt lists), because it is the
//! slow, network-bound step (~40 s). A *package stage* (`packages-<hash>`: a copy of it with a sorted
//! package set installed) is kept the same way, and a template's rootfs is a hard-linked copy of its stage
//! plus its own files, so changing files, services or the agent repeats neither debootstrap nor apt.
//! Packages go in through `chroot ... apt-get install --no-install-recommends` with a `policy-rc.d` that
//! keeps services from starting in the builder, and apt's caches are cleaned afterwards.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::chroot::{is_root, run, ChrootMounts, Scratch};
use crate::error::{IoCtx, Result, TemplateError};
use crate::identity::DEBIAN_VARIANT;

const POLICY_RC_D: &str = "usr/sbin/policy-rc.d";

/// The cache directory of the pristine debootstrap for (suite, variant, mirror).
pub fn debootstrap_dir(templates: &Path, suite: &str, mirror: &str) -> PathBuf {
    let key = format!("{suite}\0{DEBIAN_VARIANT}\0{mirror}\0amd64");
    let h = blake3::hash(key.as_bytes()).to_hex();
    templates.join(format!("debootstrap-{}", &h[..16]))
}

fn chroot_cmd(root: &Path, args: &[&str]) -> Command {
    let mut c = Command::new("chroot");
    c.arg(root).args(args);
    c.env_clear()
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .env("DEBIAN_FRONTEND", "noninteractive")
        .env("LC_ALL", "C")
        .env("HOME", "/root");
    c
}

/// Makes sure the pristine debootstrap exists; returns its path and whether it was already cached.
pub fn ensure_debootstrap(templates: &Path, tmp: &Path, suite: &str, mirror: &str) -> Result<(PathBuf, bool)> {
    let dir = debootstrap_dir(templates, suite, mirror);
    if dir.join("etc/debian_version").is_file() {
        return Ok((dir, true));
    }
    if !is_root() {
        return Err(TemplateError::Host("debootstrap needs root: run `clade template build` as root".into()));
    }
    if which("debootstrap").is_none() {
        return Err(TemplateError::Host("debootstrap is not installed: `apt-get install debootstrap`".into()));
    }
    let scratch = Scratch::new(tmp, "debootstrap-")?;
    let root = scratch.path().join("root");
    let mut c = Command::new("debootstrap");
    c.arg(format!("--variant={DEBIAN_VARIANT}")).arg("--arch=amd64").arg(suite).arg(&root).arg(mirror);
    run("debootstrap", &mut c).map_err(|e| match e {
        TemplateError::Command { step, command, status, output } => {
            let log = std::fs::read_to_string(root.join("debootstrap/debootstrap.log")).unwrap_or_default();
            TemplateError::Command {
                step,
                command,
                status,
                output: format!("{output}\n{}", crate::chroot::tail(&log, 10)),
            }
        }
        other => other,
    })?;
    {
        let _m = ChrootMounts::mount(&root)?;
        run("debootstrap: apt-get update", &mut chroot_cmd(&root, &["apt-get", "update", "-q"]))?;
    }
    std::fs::create_dir_all(templates).ctx("create", templates)?;
    match std::fs::rename(&root, &dir) {
        Ok(()) => {}
        // Another build finished first: theirs is as good as ours.
        Err(_) if dir.join("etc/debian_version").is_file() => {}
        Err(e) => return Err(e).ctx("rename into", &dir),
    }
    scratch.done();
    Ok((dir, false))
}

/// The cache directory of a package stage: the pristine debootstrap plus `packages` installed.
pub fn stage_dir(templates: &Path, debootstrap: &Path, packages: &[String]) -> PathBuf {
    let mut key = format!(
        "{}\0{}",
        crate::identity::BUILDER_VERSION,
        debootstrap.file_name().map(|n| n.to_string_lossy()).unwrap_or_default()
    );
    for p in packages {
        key.push('\0');
        key.push_str(p);
    }
    let h = blake3::hash(key.as_bytes()).to_hex();
    templates.join(format!("packages-{}", &h[..16]))
}

/// Makes sure the package stage of (`debootstrap`, `packages`) exists: a copy of the pristine
/// debootstrap with the packages installed and apt cleaned, never written afterwards. Templates that
/// differ only in files, services, provision script or agent share it (hard-linked), so changing those
/// repeats neither debootstrap nor apt. Returns its path and whether it was cached.
pub fn ensure_stage(
    templates: &Path,
    tmp: &Path,
    debootstrap: &Path,
    packages: &[String],
    suite: &str,
) -> Result<(PathBuf, bool)> {
    let dir = stage_dir(templates, debootstrap, packages);
    if dir.join("etc/debian_version").is_file() {
        return Ok((dir, true));
    }
    check_packages(debootstrap, packages, suite)?;
    let scratch = Scratch::new(tmp, "packages-")?;
    let root = scratch.path().join("root");
    crate::rootfs::copy_tree("packages: copy the debootstrap", debootstrap, &root)?;
    install_packages(&root, packages, suite)?;
    match std::fs::rename(&root, &dir) {
        Ok(()) => {}
        Err(_) if dir.join("etc/debian_version").is_file() => {}
        Err(e) => return Err(e).ctx("rename into", &dir),
    }
    scratch.done();
    Ok((dir, false))
}

/// Installs `packages` into `root` with apt. A package apt does not know fails before anything is
/// installed, with an error naming it.
pub fn install_packages(root: &Path, packages: &[String], suite: &str) -> Result<()> {
    if packages.is_empty() {
        return Ok(());
    }
    if !root.join("usr/bin/apt-get").exists() {
        return Err(TemplateError::Host(
            "`packages` needs apt-get in the root filesystem, and this source has none".into(),
        ));
    }
    let policy = root.join(POLICY_RC_D);
    std::fs::write(
        &policy,
        "#!/bin/sh\n# Written by clade's template builder: no service starts while building.\nexit 101\n",
    )
    .ctx("write", &policy)?;
    set_mode(&policy, 0o755)?;
    let result: Result<()> = (|| {
        let _m = ChrootMounts::mount(root)?;
        if !root
            .join("var/lib/apt/lists")
            .read_dir()
            .is_ok_and(|mut d| d.any(|e| e.is_ok_and(|e| e.file_name().to_string_lossy().ends_with("_Packages"))))
        {
            run("packages: apt-get update", &mut chroot_cmd(root, &["apt-get", "update", "-q"]))?;
        }
        check_packages(root, packages, suite)?;
        let mut args = vec!["apt-get", "install", "-y", "-q", "--no-install-recommends", "-o", "Dpkg::Use-Pty=0"];
        args.extend(packages.iter().map(String::as_str));
        run("packages: apt-get install", &mut chroot_cmd(root, &args))?;
        run("packages: apt-get clean", &mut chroot_cmd(root, &["apt-get", "clean"]))?;
        Ok(())
    })();
    let _ = std::fs::remove_file(&policy);
    result?;
    clean_apt(root)
}

/// Fails with [`TemplateError::PackageNotFound`] naming the first of `packages` that apt in `root` does
/// not know. Read-only (apt's binary caches are not written), and needs no mounts, so it also runs
/// against the pristine debootstrap before anything is copied.
pub fn check_packages(root: &Path, packages: &[String], suite: &str) -> Result<()> {
    for p in packages {
        let name = p.split(['=', '/']).next().unwrap_or(p);
        let out = chroot_cmd(
            root,
            &[
                "apt-cache",
                "-o",
                "Dir::Cache::pkgcache=",
                "-o",
                "Dir::Cache::srcpkgcache=",
                "show",
                "--no-all-versions",
                name,
            ],
        )
        .output();
        let known = out.as_ref().is_ok_and(|o| o.status.success() && !o.stdout.is_empty());
        if !known {
            return Err(TemplateError::PackageNotFound { package: p.clone(), suite: suite.into() });
        }
    }
    Ok(())
}

/// Removes apt's downloaded lists and archives (they are for building, not for sandboxes).
pub fn clean_apt(root: &Path) -> Result<()> {
    for d in ["var/lib/apt/lists", "var/cache/apt/archives"] {
        let dir = root.join(d);
        let Ok(rd) = std::fs::read_dir(&dir) else { continue };
        for e in rd.flatten() {
            let p = e.path();
            if e.file_type().is_ok_and(|t| t.is_file()) && p.file_name().is_some_and(|n| n != "lock") {
                std::fs::remove_file(&p).ctx("remove", &p)?;
            }
        }
    }
    for f in ["var/cache/apt/pkgcache.bin", "var/cache/apt/srcpkgcache.bin"] {
        let _ = std::fs::remove_file(root.join(f));
    }
    Ok(())
}

pub(crate) fn set_mode(p: &Path, mode: u32) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).ctx("chmod", p)
}

/// The first `name` on `$PATH` (and the sbin dirs, which root's PATH may lack).
pub fn which(name: &str) -> Option<PathBuf> {
    let path = std::env::var("PATH").unwrap_or_default();
    let found = path
        .split(':')
        .chain(["/usr/sbin", "/sbin", "/usr/bin", "/bin"])
        .map(|d| Path::new(d).join(name))
        .find(|p| p.is_file());
    found
}
