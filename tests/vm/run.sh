#!/usr/bin/env bash
# The real-kernel test of hostdevd: boots Debian's 6.1 kernel under QEMU (TCG) with an
# emulated SR-IOV NVMe controller and a virtual IOMMU, and runs the host-built hostdevd
# and hostdevctl inside it (tests/vm/guest.py) against the guest's real sysfs.
#
# Needs root and Debian's qemu-system-x86, busybox-static, cpio, kmod, pciutils, python3
# (installed here through scripts/deps.sh --tests); a tool still missing after that is a
# failure, never a skip. The kernel package is downloaded once into target/vm/.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
work="$repo/target/vm"
mkdir -p "$work"

fail() { echo "tests/vm: FAIL: $*" >&2; exit 1; }
[ "$(id -u)" = 0 ] || fail "needs root (CI runs as root)"
"$repo/scripts/deps.sh" --tests || fail "scripts/deps.sh --tests could not install the tools"
for tool in qemu-system-x86_64 cpio depmod modprobe lspci xz objcopy dpkg-deb apt-get timeout gzip; do
    command -v "$tool" >/dev/null || fail "$tool is missing (run scripts/deps.sh --tests)"
done
busybox=/bin/busybox
# grep reads all of its input (no -q): busybox writes its list a line at a time, and a
# grep that quit at the first match would kill it with SIGPIPE, failing the pipeline
# under pipefail (2% of runs).
[ -x "$busybox" ] && "$busybox" --list | grep -x insmod >/dev/null || fail "a static busybox is missing (Debian package busybox-static)"
file -L "$busybox" 2>/dev/null | grep "statically linked" >/dev/null || fail "$busybox is not static (install busybox-static)"
# The guest runs the host's own python3 and lspci through the chroot.
[ -x /usr/bin/python3 ] || fail "/usr/bin/python3 is missing (Debian package python3)"

# 1. The kernel: the newest linux-image-6.1.0-N-amd64-unsigned the apt sources offer,
# downloaded once (older ones in the cache are dropped).
newest() { apt-cache search --names-only '^linux-image-6\.1\.0-[0-9]+-amd64-unsigned$' | awk '{print $1}' | sort -V | tail -1; }
pkg=$(newest)
# A fresh machine may have no package lists yet.
[ -n "$pkg" ] || { apt-get update -qq && pkg=$(newest); }
[ -n "$pkg" ] || fail "no linux-image-6.1.0-*-amd64-unsigned package in the apt sources"
deb=$(ls "$work/${pkg}"_*.deb 2>/dev/null | sort -V | tail -1 || true)
if [ -z "$deb" ]; then
    # Stale package lists name a version the mirror no longer has: update once and retry.
    (cd "$work" && apt-get download -qq "$pkg") ||
        { apt-get update -qq && pkg=$(newest) && (cd "$work" && apt-get download -qq "$pkg"); } ||
        fail "cannot download $pkg"
    deb=$(ls "$work/${pkg}"_*.deb | sort -V | tail -1)
    for old in "$work"/linux-image-6.1.0-*-amd64-unsigned_*.deb; do
        [ "$old" = "$deb" ] || rm -f "$old"
    done
fi
kdir="$work/kernel"
if [ ! -f "$kdir/.from" ] || [ "$(cat "$kdir/.from")" != "$(basename "$deb")" ]; then
    rm -rf "$kdir"; mkdir -p "$kdir"
    dpkg-deb -x "$deb" "$kdir"
    basename "$deb" > "$kdir/.from"
fi
kver=$(ls "$kdir/lib/modules" | head -1)
vmlinuz="$kdir/boot/vmlinuz-$kver"
[ -f "$vmlinuz" ] || fail "no kernel image in $deb"
# The package ships no modules.dep.
depmod -b "$kdir" "$kver"

# 2. The host-built binaries, without debug info (the guest reads them over 9p).
(cd "$repo" && cargo build --quiet --bin hostdevd --bin hostdevctl)
mkdir -p "$work/bin"
for b in hostdevd hostdevctl; do
    objcopy --strip-debug "$repo/target/debug/$b" "$work/bin/$b"
done

# 3. A busybox initramfs with the modules, in load order.
initrd="$work/initramfs"
rm -rf "$initrd"; mkdir -p "$initrd"/{bin,proc,sys,dev,mnt/host,mnt/out,lib/modules}
cp "$busybox" "$initrd/bin/busybox"
: > "$initrd/modules.list"
for mod in virtio_pci 9pnet_virtio 9p nvme vfio_iommu_type1 vfio-pci pci-stub; do
    modprobe -d "$kdir" -S "$kver" --show-depends "$mod" | while read -r kind path rest; do
        [ "$kind" = insmod ] || continue
        name=$(basename "$path"); name=${name%.xz}
        [ -f "$initrd/lib/modules/$name" ] && continue
        case "$path" in
            *.xz) xz -dc "$path" > "$initrd/lib/modules/$name" ;;
            *) cp "$path" "$initrd/lib/modules/$name" ;;
        esac
        args=""
        [ "$name" = vfio-pci.ko ] && args="enable_sriov=1"
        echo "$name $args" >> "$initrd/modules.list"
    done
done
cat > "$initrd/init" <<INIT
#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
while read -r m args; do insmod /lib/modules/\$m \$args || echo "insmod \$m failed"; done < /modules.list
mount -t 9p -o trans=virtio,version=9p2000.L,ro,cache=loose,msize=512000 hostroot /mnt/host || echo "mount hostroot failed"
mount -t 9p -o trans=virtio,version=9p2000.L out /mnt/out || echo "mount out failed"
for d in proc sys dev; do mount --bind /\$d /mnt/host/\$d; done
mkdir -p /mnt/orig
mount --bind /mnt/host /mnt/orig
mount -t tmpfs tmpfs /mnt/host/tmp
mount -t tmpfs tmpfs /mnt/host/run
# A checkout under /tmp or /run would be hidden by those tmpfs: bring it back.
case "$repo" in /tmp/*|/run/*) mkdir -p "/mnt/host$repo" && mount --bind "/mnt/orig$repo" "/mnt/host$repo" ;; esac
mount --bind /mnt/out /mnt/host/mnt
chroot /mnt/host /usr/bin/python3 "$repo/tests/vm/guest.py" "$work/bin" /mnt > /mnt/out/guest.log 2>&1
echo \$? > /mnt/out/rc
sync
poweroff -f
INIT
chmod +x "$initrd/init"
(cd "$initrd" && find . | cpio -o -H newc --quiet | gzip -1) > "$work/initramfs.gz"

# 4. Boot.
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
started=$(date +%s)
set +e
timeout 400 qemu-system-x86_64 -accel tcg -machine q35,kernel-irqchip=split -m 1024 -smp 2 \
    -nographic -no-reboot \
    -device intel-iommu,intremap=on,caching-mode=on \
    -kernel "$vmlinuz" -initrd "$work/initramfs.gz" \
    -append "console=ttyS0 intel_iommu=on iommu=pt panic=-1 loglevel=4" \
    -device nvme-subsys,id=s0,nqn=s0 \
    -device nvme,serial=hostdevd0,subsys=s0,sriov_max_vfs=4,sriov_vq_flexible=10,sriov_vi_flexible=5,max_ioqpairs=12,msix_qsize=8 \
    -virtfs local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap \
    -virtfs local,path="$out",mount_tag=out,security_model=none,multidevs=remap \
    > "$work/console.log" 2>&1
qemu_rc=$?
set -e
took=$(( $(date +%s) - started ))
rc=$(cat "$out/rc" 2>/dev/null || echo none)
rm -f "$work/guest.log" "$work/hostdevd.log"
cp "$out/guest.log" "$out/hostdevd.log" "$work/" 2>/dev/null || true
[ "$qemu_rc" = 124 ] && echo "tests/vm: the guest did not power off within 400s" >&2
if [ "$rc" != 0 ]; then
    echo "---- guest console ($work/console.log) ----" >&2
    cat "$work/console.log" >&2
    echo "---- guest checks ($work/guest.log) ----" >&2
    cat "$out/guest.log" >&2 2>/dev/null || echo "(no guest log)" >&2
    fail "guest checks exit status $rc (qemu exit $qemu_rc) after ${took}s"
fi
cat "$out/guest.log"
echo "tests/vm: all guest checks passed on kernel $kver in ${took}s"
