#!/usr/bin/env bash
# Writes a small fake host under DIR: DIR/sys (the kernel's PCI sysfs layout) with one
# SR-IOV PF (0000:3b:00.0, 8086:1572) and two VFs (0000:3b:10.0, 0000:3b:10.1), each in
# its own IOMMU group, and an empty DIR/dev. Enough for the installed daemon to manage two
# VFs; the full fixture for the Rust tests is src/simhost.rs.
# Usage: fake-host.sh DIR
set -euo pipefail
root="$1/sys"
mkdir -p "$root/bus/pci/devices" "$root/kernel/iommu_groups" "$1/dev/vfio"
bus="$root/devices/pci0000:3b"

dev() { # bdf vendor device class group
  local d="$bus/$1"
  mkdir -p "$d"
  printf '0x%s\n' "$2" >"$d/vendor"
  printf '0x%s\n' "$3" >"$d/device"
  printf '0x8086\n' >"$d/subsystem_vendor"
  printf '0x0000\n' >"$d/subsystem_device"
  printf '0x%s\n' "$4" >"$d/class"
  printf '0x01\n' >"$d/revision"
  printf '0\n' >"$d/numa_node"
  printf '(null)\n' >"$d/driver_override"
  ln -s "../../../devices/pci0000:3b/$1" "$root/bus/pci/devices/$1"
  mkdir -p "$root/kernel/iommu_groups/$5/devices"
  printf 'DMA\n' >"$root/kernel/iommu_groups/$5/type"
  ln -s "../../../../devices/pci0000:3b/$1" "$root/kernel/iommu_groups/$5/devices/$1"
  ln -s "../../../kernel/iommu_groups/$5" "$d/iommu_group"
}

dev 0000:3b:00.0 8086 1572 020000 10
printf '4\n' >"$bus/0000:3b:00.0/sriov_totalvfs"
printf '2\n' >"$bus/0000:3b:00.0/sriov_numvfs"
printf '1\n' >"$bus/0000:3b:00.0/sriov_drivers_autoprobe"
printf '128\n' >"$bus/0000:3b:00.0/sriov_offset"
printf '1\n' >"$bus/0000:3b:00.0/sriov_stride"
printf '154c\n' >"$bus/0000:3b:00.0/sriov_vf_device"
for i in 0 1; do
  vf="0000:3b:10.$i"
  dev "$vf" 8086 154c 020000 "10$i"
  ln -s "../0000:3b:00.0" "$bus/$vf/physfn"
  ln -s "../$vf" "$bus/0000:3b:00.0/virtfn$i"
done
