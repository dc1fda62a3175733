#!/usr/bin/env bash
# Installs the host dependencies of space. Idempotent; needs root (apt-get).
#   runsc (gVisor) from Debian bookworm-backports: the 2024 build with the fast systrap platform
#   mmdebstrap (the debian template), busybox-static (the busybox template),
#   tmux (the interactive `space exec -t` test)
#   iptables (nft backend), iproute2, procps (sysctl): egress networking (space_runtime::net)
set -euo pipefail
# Retries for a mirror that does not answer for a moment (scripts/apt.conf).
export APT_CONFIG="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/apt.conf"

if [ "$(id -u)" -ne 0 ]; then
  echo "scripts/setup.sh must run as root (it installs packages with apt-get)" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive

updated=0
apt_update() {
  if [ "$updated" -eq 0 ]; then
    apt-get update -q >/dev/null
    updated=1
  fi
}

if ! grep -rqs 'bookworm-backports' /etc/apt/sources.list /etc/apt/sources.list.d/; then
  echo "setup: adding Debian bookworm-backports (for runsc)"
  cat > /etc/apt/sources.list.d/bookworm-backports.sources <<'SRC'
Types: deb
URIs: http://deb.debian.org/debian
Suites: bookworm-backports
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
  updated=0
fi

# runsc: the backports build (2024) has systrap; bookworm's own (2022) only ptrace.
if ! runsc --version 2>/dev/null | grep -qE 'version 0\.0~2024'; then
  echo "setup: installing runsc from bookworm-backports"
  apt_update
  apt-get install -y -q -t bookworm-backports runsc >/dev/null
fi

missing=()
for pkg in mmdebstrap busybox-static ca-certificates util-linux mount e2fsprogs tmux \
  iptables iproute2 procps python3 python3-venv; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed' || missing+=("$pkg")
done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  apt_update
  apt-get install -y -q "${missing[@]}" >/dev/null
fi

# The web console (console/) is bundled by `cargo build` (crates/space/build.rs) with
# node and npm. Debian's nodejs (18) is enough; a newer node already here is kept.
if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
  echo "setup: installing nodejs npm (the web console's build)"
  apt_update
  apt-get install -y -q nodejs npm >/dev/null
fi

# The microVM guest: kernel + initramfs (QEMU, busybox-static, cpio come with it).
scripts/build-guest.sh "${SPACE_GUEST_DIR:-$PWD/target/guest}"

echo "setup: $(runsc --version | head -n1), $(mmdebstrap --version), busybox $(busybox | head -n1 | awk '{print $2}')"
