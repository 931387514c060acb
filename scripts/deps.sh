#!/usr/bin/env bash
# Installs what hostdevd's demo and tests need on Debian/Ubuntu: Debian packages via
# apt-get when missing (as root), or prints the exact command to run otherwise.
set -euo pipefail

need=()
command -v lspci >/dev/null 2>&1 || need+=(pciutils)
[ -e /usr/share/misc/pci.ids ] || [ -e /usr/share/hwdata/pci.ids ] || need+=(pci.ids)
if [ "${1:-}" = "--tests" ]; then
  python3 -c 'import ensurepip, venv' >/dev/null 2>&1 || need+=(python3-venv)
  # The packaging suite (tests/packaging/run.sh): build, inspect, lint and install the
  # .deb (libvirt0 is its runtime dependency), query the .rpm.
  command -v rpm >/dev/null 2>&1 || need+=(rpm)
  command -v lintian >/dev/null 2>&1 || need+=(lintian)
  command -v strip >/dev/null 2>&1 || need+=(binutils)
  command -v dpkg-shlibdeps >/dev/null 2>&1 || need+=(dpkg-dev)
  command -v systemd-analyze >/dev/null 2>&1 || need+=(systemd)
  dpkg -s libvirt0 >/dev/null 2>&1 || need+=(libvirt0)
  # The real-kernel suite (tests/vm/run.sh): QEMU (TCG), a static busybox for the
  # initramfs, cpio and kmod to build it, xz for the kernel's compressed modules, file
  # to tell a static busybox. The kernel package itself is downloaded by the suite.
  command -v qemu-system-x86_64 >/dev/null 2>&1 || need+=(qemu-system-x86)
  dpkg -s busybox-static >/dev/null 2>&1 || need+=(busybox-static)
  command -v cpio >/dev/null 2>&1 || need+=(cpio)
  command -v depmod >/dev/null 2>&1 || need+=(kmod)
  command -v xz >/dev/null 2>&1 || need+=(xz-utils)
  command -v file >/dev/null 2>&1 || need+=(file)
fi
command -v cc >/dev/null 2>&1 || need+=(gcc)
# libvirt: headers and pkg-config file to build the virt crate (libvirt-dev pulls in
# libvirt0, the runtime library, whose in-process test:/// driver the demo and tests use).
command -v pkg-config >/dev/null 2>&1 || need+=(pkg-config)
pkg-config --exists libvirt 2>/dev/null || need+=(libvirt-dev)
ls /usr/lib/*/libvirt.so.0 >/dev/null 2>&1 || need+=(libvirt0)

if [ "${#need[@]}" -eq 0 ]; then
  exit 0
fi
if [ "$(id -u)" -eq 0 ]; then
  echo "deps: installing ${need[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
else
  echo "deps: missing Debian packages; run: sudo apt-get install ${need[*]}" >&2
  exit 1
fi
