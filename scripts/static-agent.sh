#!/usr/bin/env bash
# Build the static clade-agent that templates, ct sandboxes and vm guests get (docs/agent.md, "Build"): it runs
# in any rootfs, with or without glibc (busybox-only, Alpine, distroless). musl (`release-small`, panic=unwind:
# for PID 1 a bug must cost one request, not the sandbox) where the toolchain has the musl target (./x setup adds
# it); otherwise glibc linked in statically (crt-static, a static-pie; libc6-dev's libc.a). An explicit --target
# keeps RUSTFLAGS off build scripts and proc macros and this build's outputs apart from the workspace's (cargo
# would overwrite an agent copied beside clade). The result is copied to $target_dir/static/clade-agent, which
# clade_core::host::agent_binary prefers over the dynamic build beside clade.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
tdir=${CARGO_TARGET_DIR:-target}
musl=x86_64-unknown-linux-musl
if rustup target list --installed 2>/dev/null | grep -qx "$musl"; then
  CARGO_PROFILE_RELEASE_SMALL_PANIC=unwind cargo build -q -p clade-agent --profile release-small --target "$musl"
  built=$tdir/$musl/release-small/clade-agent
else
  echo "static-agent: no $musl target in this toolchain (./x setup adds it); linking glibc statically instead" >&2
  RUSTFLAGS="-C target-feature=+crt-static" cargo build -q -p clade-agent --release --target x86_64-unknown-linux-gnu
  built=$tdir/x86_64-unknown-linux-gnu/release/clade-agent
fi
mkdir -p "$tdir/static"
cp "$built" "$tdir/static/clade-agent.tmp"
mv -f "$tdir/static/clade-agent.tmp" "$tdir/static/clade-agent"
