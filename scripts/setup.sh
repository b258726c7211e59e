#!/usr/bin/env bash
# ./x setup: install what clade needs, idempotently. A second run on a complete machine touches no network.
#
#  - Debian packages through apt (the normal way on this distro): QEMU 7.2 (bookworm), busybox-static, cpio,
#    debootstrap, e2fsprogs, python3, libnbd-bin (nbdinfo/nbdcopy for tests), b3sum and qemu-utils (bench peers),
#    containerd and runc (the shim's tests start their own containerd; runc is the bench peer; a service the
#    package would start stays off: the tests never use the host's containerd), protobuf-compiler (protoc, for
#    the CRI client the shim's tests build).
#  - The guest kernel: Debian's linux-image-*-amd64 .deb, fetched with `apt-get download` and extracted under
#    $CLADE_HOME/kernel (never installed as the host's kernel), plus its uncompressed vmlinux (boots ~2x faster
#    under TCG: no xz decompression).
#  - CRIU 4.2 from Debian sid with all its libraries, fetched with a private apt configuration under
#    $CLADE_HOME/apt-sid (the host's sources are not changed), extracted under $CLADE_HOME/criu, run through
#    sid's own loader by the wrapper $CLADE_HOME/criu/bin/criu.
#  - Garage (a distributed S3 server, for the tests and benches of several hosts), built once with cargo into
#    $CLADE_HOME/garage.
# Downloaded .debs stay in $CLADE_HOME/debs, so a later setup needs no network. Every extraction goes to a
# temporary directory that is renamed into place only when complete.
set -euo pipefail
CLADE_HOME=${CLADE_HOME:-/var/lib/clade}
quiet=0
[ "${1:-}" = --quiet ] && quiet=1
say() { echo "setup: $*" >&2; }
info() { [ $quiet = 1 ] || say "$@"; }
die() { say "ERROR: $*"; exit 1; }
# private_apt (a private apt configuration for one suite) and extract_kernel (a linux-image .deb into
# $CLADE_HOME/kernel/<release>).
. "$(dirname "${BASH_SOURCE[0]}")/debian-lib.sh"

[ "$(id -u)" = 0 ] || die "run as root (clade needs namespaces, mounts and /dev/shm files)"
command -v apt-get >/dev/null || die "no apt-get: setup supports Debian/Ubuntu; install QEMU, busybox-static, cpio, debootstrap, e2fsprogs by hand"
mkdir -p "$CLADE_HOME"/{debs/kernel,debs/criu,kernel,tmp}
start=$(date +%s.%N)

# ---- 1. Debian packages -----------------------------------------------------------------------------------
# chromium: the benchmark report is checked to render in it (a test), as a reader would open it.
# libc6-dev: libc.a, which the static clade-agent links (scripts/static-agent.sh).
pkgs=(libc6-dev qemu-system-x86 qemu-utils busybox-static cpio debootstrap e2fsprogs python3 libnbd-bin b3sum xz-utils zstd iproute2 nftables kmod chromium containerd runc protobuf-compiler)
apt_updated=0
apt_update() {
  [ $apt_updated = 1 ] && return 0
  say "apt-get update"
  apt-get update -qq || die "apt-get update failed: check that the Debian mirror in /etc/apt/sources.list is reachable"
  apt_updated=1
}
find_missing() {
  missing=()
  for p in "${pkgs[@]}"; do
    dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null | grep -qx installed || missing+=("$p")
  done
}
# Twice: an install can remove a package that was there (a machine with backports' qemu-utils 10 loses it when
# bookworm's qemu-system-x86 7.2 comes in), so what is missing is looked at again after each round.
for round in 1 2; do
  find_missing
  [ ${#missing[@]} -eq 0 ] && break
  say "installing Debian packages: ${missing[*]}"
  if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null; then
    apt_update
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
      || die "could not install ${missing[*]}: see the apt-get output above; the Debian mirror must be reachable"
  fi
done
find_missing
[ ${#missing[@]} -eq 0 ] || die "still missing after installing: ${missing[*]} (apt removed them again; install them by hand with apt-get install)"
command -v cargo >/dev/null || die "no cargo on PATH: install the Rust toolchain (rustup) first"
# The musl target for the static agent (scripts/static-agent.sh); without it the agent links glibc statically.
if command -v rustup >/dev/null && ! rustup target list --installed 2>/dev/null | grep -qx x86_64-unknown-linux-musl; then
  say "adding the Rust target x86_64-unknown-linux-musl (the static clade-agent)"
  rustup target add x86_64-unknown-linux-musl >/dev/null 2>&1 \
    || say "could not add x86_64-unknown-linux-musl (no reach to static.rust-lang.org?): the agent links glibc statically"
fi

# ---- 2. Guest kernel --------------------------------------------------------------------------------------
kernel_ok() { [ -f "$CLADE_HOME/kernel/current/vmlinuz" ] && [ -f "$CLADE_HOME/kernel/current/vmlinux" ] && [ -f "$CLADE_HOME/kernel/current/modules/modules.dep" ]; }
if ! kernel_ok; then
  deb=$(ls "$CLADE_HOME"/debs/kernel/linux-image-*-amd64_*.deb 2>/dev/null | sort -V | tail -n1 || true)
  if [ -z "$deb" ]; then
    pkg=$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/{print $2; exit}')
    if [ -z "$pkg" ]; then apt_update; pkg=$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-[0-9]/{print $2; exit}'); fi
    [ -n "$pkg" ] || die "cannot resolve Debian's linux-image-amd64 to a kernel package: run apt-get update and retry"
    say "downloading guest kernel $pkg (apt-get download; not installed as the host's kernel)"
    (cd "$CLADE_HOME/debs/kernel" && apt-get download -qq -o APT::Sandbox::User=root "$pkg") \
      || die "could not download $pkg: the Debian mirror must be reachable (apt-get download $pkg)"
    deb=$(ls "$CLADE_HOME"/debs/kernel/linux-image-*-amd64_*.deb | sort -V | tail -n1)
  fi
  kver=$(extract_kernel "$deb")
  ln -sfn "$kver" "$CLADE_HOME/kernel/current.tmp" && mv -T "$CLADE_HOME/kernel/current.tmp" "$CLADE_HOME/kernel/current"
  say "guest kernel $kver ready in $CLADE_HOME/kernel/current"
fi

# ---- 3. CRIU 4.2 from sid, private --------------------------------------------------------------------------
criu_ok() { [ -x "$CLADE_HOME/criu/bin/criu" ] && "$CLADE_HOME/criu/bin/criu" --version >/dev/null 2>&1; }
if ! criu_ok; then
  if ! ls "$CLADE_HOME"/debs/criu/criu_*.deb >/dev/null 2>&1; then
    private_apt "$CLADE_HOME/apt-sid" sid "${CLADE_SID_MIRROR:-http://deb.debian.org/debian}"
    mapfile -t cpkgs < <(apt-cache depends --recurse --no-recommends --no-suggests --no-conflicts --no-breaks \
      --no-replaces --no-enhances criu 2>/dev/null | grep -v '^[ <]' | sort -u)
    [ ${#cpkgs[@]} -gt 0 ] || die "sid has no criu package in its lists"
    say "downloading CRIU and its libraries from sid: ${cpkgs[*]}"
    (cd "$CLADE_HOME/debs/criu" && apt-get download -qq "${cpkgs[@]}") || die "could not download ${cpkgs[*]} from sid"
    unset APT_CONFIG
  fi
  say "extracting CRIU privately into $CLADE_HOME/criu"
  tmp=$(mktemp -d "$CLADE_HOME/tmp/criu.XXXXXX")
  trap 'rm -rf "$tmp"' EXIT
  mkdir -p "$tmp/c/root" "$tmp/c/bin"
  for d in "$CLADE_HOME"/debs/criu/*.deb; do dpkg-deb -x "$d" "$tmp/c/root"; done
  loader=$(ls "$tmp"/c/root/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2 "$tmp"/c/root/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2 2>/dev/null | head -n1 || true)
  [ -n "$loader" ] || die "sid's libc6 has no ld-linux-x86-64.so.2"
  loader=${loader#"$tmp/c/root"}
  root="$CLADE_HOME/criu/root"
  cat > "$tmp/c/bin/criu" <<WRAP
#!/bin/sh
# CRIU from Debian sid, run through sid's own loader and libraries (the host's libc is too old for it).
R="$root"
exec "\$R$loader" --library-path "\$R/usr/lib/x86_64-linux-gnu:\$R/lib/x86_64-linux-gnu" "\$R/usr/sbin/criu" "\$@"
WRAP
  chmod +x "$tmp/c/bin/criu"
  rm -rf "$CLADE_HOME/criu"
  mv "$tmp/c" "$CLADE_HOME/criu"
  rm -rf "$tmp"; trap - EXIT
  criu_ok || die "the private CRIU does not run: $("$CLADE_HOME/criu/bin/criu" --version 2>&1 | head -n3)"
  say "CRIU ready: $("$CLADE_HOME/criu/bin/criu" --version | head -n1)"
fi

# ---- 4. Python tools for tests (moto's S3 mock for unit tests of the S3 code; the E2B SDKs) ------------------
py="$CLADE_HOME/py"
py_pkgs=("moto[server]")
py_ok() { [ -x "$py/bin/moto_server" ]; }
if ! py_ok; then
  say "installing Python test tools into $py: ${py_pkgs[*]}"
  rm -rf "$py.tmp"
  python3 -m venv "$py.tmp" 2>/dev/null || { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null; python3 -m venv "$py.tmp"; } \
    || die "python3 -m venv failed: install python3-venv"
  "$py.tmp/bin/pip" install -q "${py_pkgs[@]}" || die "pip could not install ${py_pkgs[*]}: PyPI must be reachable"
  rm -rf "$py"; mv "$py.tmp" "$py"
  # venv scripts carry their absolute path: rewrite the shebangs after the rename.
  grep -rl "^#!$py.tmp/bin/" "$py/bin" | xargs -r sed -i "1s|^#!$py.tmp/bin/|#!$py/bin/|"
  py_ok || die "moto_server missing after install"
fi

# ---- 4b. The official E2B SDKs for the E2B-compatibility tests: Python e2b in the venv above; Node 20
# (the machine's when it is >= 20.18, else the `node` package from the npm registry) and the JS e2b package
# under $CLADE_HOME/node. Versions pinned to the ones the tests ran with (both within e2b >=2.7,<3).
e2b_py="e2b==2.63.0"
if ! "$py/bin/python" -c 'import e2b' 2>/dev/null; then
  say "installing the E2B Python SDK ($e2b_py) into $py"
  "$py/bin/pip" install -q "$e2b_py" || die "pip could not install $e2b_py: PyPI must be reachable"
fi
# ---- 4c. Schemathesis for the API fuzz test (crates/clade/tests/guest_schemathesis_ct.rs), pinned to
# the version the test ran with, in the same venv.
st_py="schemathesis==4.32.5"
if ! "$py/bin/schemathesis" --version 2>/dev/null | grep -q "version ${st_py#*==}\$"; then
  say "installing $st_py into $py"
  "$py/bin/pip" install -q "$st_py" || die "pip could not install $st_py: PyPI must be reachable"
fi
node_dir="$CLADE_HOME/node"
node_ok() { local v; v=$("$1" --version 2>/dev/null | sed 's/^v//'); [ -n "$v" ] && printf '20.18.1\n%s\n' "$v" | sort -V -C; }
if ! command -v npm >/dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm >/dev/null || die "apt-get could not install nodejs/npm"
fi
mkdir -p "$node_dir"
if ! node_ok "$(command -v node)" && ! node_ok "$node_dir/node_modules/.bin/node"; then
  say "installing Node 20 from the npm registry into $node_dir"
  npm install --silent --no-audit --no-fund --prefix "$node_dir" node@20 || die "npm could not install node@20"
fi
if [ ! -f "$node_dir/node_modules/e2b/package.json" ]; then
  say "installing the E2B JS SDK (e2b@2.51.0) into $node_dir"
  npm install --silent --no-audit --no-fund --prefix "$node_dir" e2b@2.51.0 || die "npm could not install e2b@2.51.0"
fi

# ---- 5. Garage, a real distributed S3 server for the tests and benches of several hosts (docs/roam.md) -----
# Built once from crates.io with cargo (sqlite metadata, bundled C libraries) into $CLADE_HOME/garage; its
# build directory is removed afterwards, the binary stays, so later runs are offline.
garage_ver=2.5.0
garage_bin="$CLADE_HOME/garage/bin/garage"
garage_ok() { "$garage_bin" --version 2>/dev/null | grep -q "[:v]$garage_ver"; }
if ! garage_ok; then
  say "building Garage $garage_ver into $CLADE_HOME/garage (once; several minutes)"
  rm -rf "$CLADE_HOME/garage.tmp"
  cargo install -q garage --version "$garage_ver" --locked --no-default-features --features bundled-libs,sqlite \
    --root "$CLADE_HOME/garage.tmp" --target-dir "$CLADE_HOME/build/garage" \
    || die "cargo could not build garage $garage_ver: crates.io must be reachable"
  strip "$CLADE_HOME/garage.tmp/bin/garage" 2>/dev/null || true
  rm -rf "$CLADE_HOME/garage"; mv "$CLADE_HOME/garage.tmp" "$CLADE_HOME/garage"
  rm -rf "$CLADE_HOME/build/garage"
  garage_ok || die "garage does not run: $("$garage_bin" --version 2>&1 | head -n3)"
fi

end=$(date +%s.%N)
info "everything is installed under $CLADE_HOME ($(awk "BEGIN{printf \"%.1f\", $end-$start}") s)"
