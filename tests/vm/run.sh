#!/usr/bin/env bash
# The real-kernel test of hostdevd: boots two kernels under QEMU (TCG) with an emulated
# SR-IOV NVMe controller and a virtual IOMMU, and runs the host-built hostdevd and
# hostdevctl inside each (tests/vm/guest.py) against the guest's real sysfs:
#   - Debian's 6.1 kernel, as packaged (VFIO group nodes only);
#   - a 6.12 kernel built here from Debian's linux-source-6.12 with tests/vm/guest.config,
#     which adds the iommufd interface's device nodes (/dev/vfio/devices/vfioN) that no
#     Debian kernel package enables.
#
# Needs root and Debian's qemu-system-x86, busybox-static, cpio, kmod, pciutils, python3,
# and a kernel build's tools (installed here through scripts/deps.sh --tests); a tool still
# missing after that is a failure, never a skip. The kernel package and the built kernel
# are kept in target/vm/ for the next run.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
work="$repo/target/vm"
mkdir -p "$work"

fail() { echo "tests/vm: FAIL: $*" >&2; exit 1; }
[ "$(id -u)" = 0 ] || fail "needs root (CI runs as root)"
"$repo/scripts/deps.sh" --tests || fail "scripts/deps.sh --tests could not install the tools"
for tool in qemu-system-x86_64 cpio depmod modprobe lspci xz objcopy dpkg-deb apt-get apt-cache timeout gzip make gcc flex bison bc; do
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

# 1a. The packaged kernel: the newest linux-image-6.1.0-N-amd64-unsigned the apt sources offer,
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

# 1b. The built kernel: Debian's linux-source-6.12 from the apt sources (on bookworm, from
# its backports suite, read through apt lists of our own in target/vm/apt so that the
# machine's sources stay as they are), configured from tinyconfig plus guest.config with
# everything built in, and kept as target/vm/built/bzImage until the source package or
# the fragment changes. The build takes about 6 minutes on 2 cores.
srcpkg=linux-source-6.12
apt_dir="$work/apt"
mkdir -p "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial"
# The machine's Debian archive, as its own apt sources name it (no mirror named here);
# apt knows a suite's codename only once its lists are fetched.
debian_archive() {
    apt-get indextargets --format '$(REPO_URI) $(RELEASE) $(CODENAME) $(ORIGIN)' |
        awk '!found && $4 == "Debian" && $2 == $3 && $2 !~ /-/ {print $1, $2; found = 1}'
}
archive_line=$(debian_archive)
[ -n "$archive_line" ] || { apt-get update -qq && archive_line=$(debian_archive); }
[ -n "$archive_line" ] || fail "no Debian archive in the apt sources (the built kernel's source comes from it)"
read -r archive codename <<< "$archive_line"
keyring=/usr/share/keyrings/debian-archive-keyring.gpg
[ -f "$keyring" ] || fail "$keyring is missing (Debian package debian-archive-keyring)"
printf 'deb [signed-by=%s] %s %s main\ndeb [signed-by=%s] %s %s-backports main\n' \
    "$keyring" "$archive" "$codename" "$keyring" "$archive" "$codename" > "$apt_dir/sources.list"
apt_own=(-o Dir::Etc::sourcelist="$apt_dir/sources.list" -o Dir::Etc::sourceparts=- \
    -o Dir::State::Lists="$apt_dir/lists" -o Dir::Cache="$apt_dir/cache" -o APT::Sandbox::User=root)
src_deb=$(ls "$work/${srcpkg}"_*.deb 2>/dev/null | sort -V | tail -1 || true)
if [ -z "$src_deb" ]; then
    apt-get "${apt_own[@]}" update -qq || fail "cannot read $codename and $codename-backports from $archive"
    (cd "$work" && apt-get "${apt_own[@]}" download -qq "$srcpkg") ||
        fail "cannot download $srcpkg from $codename or $codename-backports"
    src_deb=$(ls "$work/${srcpkg}"_*.deb | sort -V | tail -1)
fi
built="$work/built"
stamp="$(basename "$src_deb") $(sha256sum "$here/guest.config" | cut -c1-16)"
if [ ! -f "$built/bzImage" ] || [ "$(cat "$built/.from" 2>/dev/null)" != "$stamp" ]; then
    rm -rf "$built" "$work/linux-src" "$work/linux-build"
    mkdir -p "$work/linux-src" "$work/linux-build" "$built"
    echo "tests/vm: building a kernel from $(basename "$src_deb") (about 6 minutes on 2 cores)"
    dpkg-deb --fsys-tarfile "$src_deb" | tar -xO --wildcards './usr/src/linux-source-*.tar.xz' |
        xz -dc | tar -x -C "$work/linux-src" --strip-components=1 || fail "cannot unpack $src_deb"
    kmake() { make -s -C "$work/linux-src" O="$work/linux-build" ARCH=x86_64 "$@"; }
    kmake tinyconfig >/dev/null
    "$work/linux-src/scripts/kconfig/merge_config.sh" -m -O "$work/linux-build" \
        "$work/linux-build/.config" "$here/guest.config" >/dev/null
    kmake olddefconfig
    # Kconfig drops an option whose dependencies are unmet without a word: check each one.
    while IFS= read -r line; do
        case "$line" in
            CONFIG_*=*) grep -qx "$line" "$work/linux-build/.config" || fail "the built kernel's config lost $line" ;;
            "# CONFIG_"*" is not set") opt=${line#\# }; opt=${opt%% *}
                ! grep -q "^$opt=" "$work/linux-build/.config" || fail "the built kernel's config set $opt" ;;
        esac
    done < "$here/guest.config"
    kmake -j"$(nproc)" bzImage > "$work/linux-build.log" 2>&1 ||
        { tail -40 "$work/linux-build.log" >&2; fail "the kernel build failed (target/vm/linux-build.log)"; }
    cp "$work/linux-build/arch/x86/boot/bzImage" "$built/bzImage"
    make -s -C "$work/linux-src" O="$work/linux-build" kernelrelease > "$built/release"
    echo "$stamp" > "$built/.from"
    # 2.5 GB of source and objects: the image is all the next run needs.
    rm -rf "$work/linux-src" "$work/linux-build"
fi

# 2. The host-built binaries, without debug info (the guest reads them over 9p).
(cd "$repo" && cargo build --quiet --bin hostdevd --bin hostdevctl)
mkdir -p "$work/bin"
for b in hostdevd hostdevctl; do
    objcopy --strip-debug "$repo/target/debug/$b" "$work/bin/$b"
done

# 3. A busybox initramfs per kernel: NAME NODES [MODULE...], the modules (with their
# dependencies, in load order) from the packaged kernel; the built one has them built in.
initramfs() {
    local name=$1 nodes=$2; shift 2
    local initrd="$work/initramfs-$name"
    rm -rf "$initrd"; mkdir -p "$initrd"/{bin,proc,sys,dev,mnt/host,mnt/out,lib/modules}
    cp "$busybox" "$initrd/bin/busybox"
    : > "$initrd/modules.list"
    local mod
    for mod in "$@"; do
        modprobe -d "$kdir" -S "$kver" --show-depends "$mod" | while read -r kind path rest; do
            [ "$kind" = insmod ] || continue
            ko=$(basename "$path"); ko=${ko%.xz}
            [ -f "$initrd/lib/modules/$ko" ] && continue
            case "$path" in
                *.xz) xz -dc "$path" > "$initrd/lib/modules/$ko" ;;
                *) cp "$path" "$initrd/lib/modules/$ko" ;;
            esac
            args=""
            [ "$ko" = vfio-pci.ko ] && args="enable_sriov=1"
            echo "$ko $args" >> "$initrd/modules.list"
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
chroot /mnt/host /usr/bin/python3 "$repo/tests/vm/guest.py" "$work/bin" /mnt $nodes > /mnt/out/guest.log 2>&1
echo \$? > /mnt/out/rc
sync
poweroff -f
INIT
    chmod +x "$initrd/init"
    (cd "$initrd" && find . | cpio -o -H newc --quiet | gzip -1) > "$initrd.gz"
}

# 4. Boot NAME KERNEL RELEASE CMDLINE-EXTRA: the guest's console, checks and daemon log
# are kept as target/vm/NAME-console.log, NAME-guest.log and NAME-hostdevd.log.
boot() {
    local name=$1 kernel=$2 release=$3 extra=$4
    local out; out=$(mktemp -d)
    local started; started=$(date +%s)
    set +e
    timeout 400 qemu-system-x86_64 -accel tcg -machine q35,kernel-irqchip=split -m 1024 -smp 2 \
        -nographic -no-reboot \
        -device intel-iommu,intremap=on,caching-mode=on \
        -kernel "$kernel" -initrd "$work/initramfs-$name.gz" \
        -append "console=ttyS0 intel_iommu=on iommu=pt panic=-1 loglevel=4 $extra" \
        -device nvme-subsys,id=s0,nqn=s0 \
        -device nvme,serial=hostdevd0,subsys=s0,sriov_max_vfs=4,sriov_vq_flexible=10,sriov_vi_flexible=5,max_ioqpairs=12,msix_qsize=8 \
        -virtfs local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap \
        -virtfs local,path="$out",mount_tag=out,security_model=none,multidevs=remap \
        > "$work/$name-console.log" 2>&1
    local qemu_rc=$?
    set -e
    local took=$(( $(date +%s) - started ))
    local rc; rc=$(cat "$out/rc" 2>/dev/null || echo none)
    rm -f "$work/$name-guest.log" "$work/$name-hostdevd.log"
    [ -f "$out/guest.log" ] && cp "$out/guest.log" "$work/$name-guest.log"
    [ -f "$out/hostdevd.log" ] && cp "$out/hostdevd.log" "$work/$name-hostdevd.log"
    rm -rf "$out"
    [ "$qemu_rc" = 124 ] && echo "tests/vm: the $name guest did not power off within 400s" >&2
    if [ "$rc" != 0 ]; then
        echo "---- $name guest console (target/vm/$name-console.log) ----" >&2
        cat "$work/$name-console.log" >&2
        echo "---- $name guest checks (target/vm/$name-guest.log) ----" >&2
        cat "$work/$name-guest.log" >&2 2>/dev/null || echo "(no guest log)" >&2
        fail "$name guest checks exit status $rc (qemu exit $qemu_rc) after ${took}s"
    fi
    sed "s/^/[$name] /" "$work/$name-guest.log"
    echo "tests/vm: all guest checks passed on kernel $release in ${took}s"
}

initramfs packaged group virtio_pci 9pnet_virtio 9p nvme vfio_iommu_type1 vfio-pci pci-stub
boot packaged "$vmlinuz" "$kver" ""
initramfs built device
boot built "$built/bzImage" "$(cat "$built/release")" "vfio_pci.enable_sriov=1"
