#!/usr/bin/env bash
# Installs what hostdevd's demo and tests need on Debian/Ubuntu: Debian packages via
# apt-get when missing (as root), or prints the exact command to run otherwise.
#
#   scripts/deps.sh            the demo's needs
#   scripts/deps.sh --dev      plus what building the tests and benchmarks needs
#   scripts/deps.sh --tests    plus the test suites' (Python venv, packaging tools)
#   scripts/deps.sh --profile  plus perf, for `make profile`
#   scripts/deps.sh --fuzz     plus a C++ compiler (libFuzzer) and cargo-fuzz
#   scripts/deps.sh --deny     plus git (the advisory database fetch) and cargo-deny
#
# cargo-fuzz and cargo-deny are pinned and installed from crates.io with
# `cargo install --locked` into target/tools/ (as scripts/package.sh does for its tools).
set -euo pipefail

tests=0
dev=0
fuzz=0
deny=0
profile=0
for arg in "$@"; do
  case "$arg" in
    --tests) tests=1; dev=1 ;;
    --dev) dev=1 ;;
    --fuzz) fuzz=1 ;;
    --profile) profile=1 ;;
    --deny) deny=1 ;;
    *) echo "deps.sh: unknown argument $arg" >&2; exit 2 ;;
  esac
done

CARGO_FUZZ_VERSION=0.13.2
CARGO_DENY_VERSION=0.20.2
tools="$(cd "$(dirname "$0")/.." && pwd)/target/tools"
cargo_tool() { # crate version
  local bin="$tools/bin/$1"
  if [ -x "$bin" ] && "$bin" --version 2>/dev/null | grep "$2" >/dev/null; then
    return
  fi
  echo "deps: installing $1 $2 into $tools" >&2
  cargo install --quiet --locked --root "$tools" "$1" --version "$2"
}

need=()
command -v lspci >/dev/null 2>&1 || need+=(pciutils)
[ -e /usr/share/misc/pci.ids ] || [ -e /usr/share/hwdata/pci.ids ] || need+=(pci.ids)
if [ "$fuzz" = 1 ]; then
  command -v c++ >/dev/null 2>&1 || need+=(g++)
fi
if [ "$deny" = 1 ]; then
  command -v git >/dev/null 2>&1 || need+=(git)
fi
if [ "$profile" = 1 ] && ! perf --version >/dev/null 2>&1; then
  # Debian packages perf as linux-perf; Ubuntu as a tool package per kernel.
  if grep -qx 'ID=ubuntu' /etc/os-release 2>/dev/null; then
    need+=(linux-tools-common "linux-tools-$(uname -r)")
  else
    need+=(linux-perf)
  fi
fi
if [ "$tests" = 1 ]; then
  python3 -c 'import ensurepip, venv' >/dev/null 2>&1 || need+=(python3-venv)
  # The packaging suite (tests/packaging/run.sh): build, inspect, lint and install the
  # .deb (libvirt0 is its runtime dependency), query the .rpm.
  command -v rpm >/dev/null 2>&1 || need+=(rpm)
  command -v lintian >/dev/null 2>&1 || need+=(lintian)
  command -v strip >/dev/null 2>&1 || need+=(binutils)
  command -v dpkg-shlibdeps >/dev/null 2>&1 || need+=(dpkg-dev)
  command -v systemd-analyze >/dev/null 2>&1 || need+=(systemd)
  dpkg -s libvirt0 >/dev/null 2>&1 || need+=(libvirt0)
  # A real libvirtd (session mode, as nobody) killed and restarted under the agent
  # (tests/libvirt.rs).
  [ -x /usr/sbin/libvirtd ] || need+=(libvirt-daemon)
  # The real-kernel suite (tests/vm/run.sh): QEMU (TCG), a static busybox for the
  # initramfs, cpio and kmod to build it, xz for the kernel's compressed modules, file
  # to tell a static busybox. The kernel package itself is downloaded by the suite.
  command -v qemu-system-x86_64 >/dev/null 2>&1 || need+=(qemu-system-x86)
  dpkg -s busybox-static >/dev/null 2>&1 || need+=(busybox-static)
  command -v cpio >/dev/null 2>&1 || need+=(cpio)
  command -v depmod >/dev/null 2>&1 || need+=(kmod)
  command -v xz >/dev/null 2>&1 || need+=(xz-utils)
  command -v file >/dev/null 2>&1 || need+=(file)
  # Its second kernel is built from Debian's linux-source package (downloaded by the suite).
  command -v make >/dev/null 2>&1 || need+=(make)
  command -v flex >/dev/null 2>&1 || need+=(flex)
  command -v bison >/dev/null 2>&1 || need+=(bison)
  command -v bc >/dev/null 2>&1 || need+=(bc)
  dpkg -s libelf-dev >/dev/null 2>&1 || need+=(libelf-dev)
  dpkg -s libssl-dev >/dev/null 2>&1 || need+=(libssl-dev)
  [ -f /usr/share/keyrings/debian-archive-keyring.gpg ] || need+=(debian-archive-keyring)
fi
command -v cc >/dev/null 2>&1 || need+=(gcc)
# libvirt0: the client library the agent loads at run time; its in-process test:/// driver
# is what the demo and the tests talk to.
ls /usr/lib/*/libvirt.so.0 >/dev/null 2>&1 || need+=(libvirt0)
if [ "$dev" = 1 ]; then
  # The tests and benchmarks drive libvirt through the virt crate (a dev-dependency), which links it:
  # headers and pkg-config file to build it.
  command -v pkg-config >/dev/null 2>&1 || need+=(pkg-config)
  pkg-config --exists libvirt 2>/dev/null || need+=(libvirt-dev)
  # FUSE mounts: the sysfs write-fault tests (tests/hardware.rs: a file that fails writes
  # with a chosen errno) and the benchmark's slow-sync disk (benches/support/slowsync.rs);
  # fusermount3 mounts them for a user who is not root.
  command -v fusermount3 >/dev/null 2>&1 || need+=(fuse3)
fi

if [ "${#need[@]}" -gt 0 ]; then
  if [ "$(id -u)" -eq 0 ]; then
    echo "deps: installing ${need[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  else
    echo "deps: missing Debian packages; run: sudo apt-get install ${need[*]}" >&2
    exit 1
  fi
fi
if [ "$fuzz" = 1 ]; then
  cargo_tool cargo-fuzz "$CARGO_FUZZ_VERSION"
fi
if [ "$deny" = 1 ]; then
  cargo_tool cargo-deny "$CARGO_DENY_VERSION"
fi
