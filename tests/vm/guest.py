#!/usr/bin/env python3
# The checks tests/vm/run.sh runs inside the guest (chrooted into the host's / over 9p,
# with the guest's own /proc, /sys and /dev): hostdevd against a real kernel's sysfs,
# real SR-IOV VFs, real uevents and real vfio-pci binding.
# Usage: guest.py BIN_DIR OUT_DIR NODES. NODES is "group" for a kernel with VFIO's group
# nodes only (Debian's 6.1), "device" for one that also has the iommufd interface's device
# nodes (/dev/vfio/devices/vfioN, Linux 6.6 and later with VFIO_DEVICE_CDEV). Exit status
# 0 only when every check passed.
import copy
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid

BIN, OUT, NODES = sys.argv[1], sys.argv[2], sys.argv[3]
assert NODES in ("group", "device"), NODES
HOSTDEVD, CTL = os.path.join(BIN, "hostdevd"), os.path.join(BIN, "hostdevctl")
RUN = "/tmp/hostdevd"
SOCK = os.path.join(RUN, "hostdevd.sock")
PCI = "/sys/bus/pci"
failures = []
T0 = time.time()


def check(name, ok, detail=""):
    print(f"[{time.time() - T0:6.1f}s] " + ("PASS " if ok else "FAIL ") + name + (f": {detail}" if detail and not ok else ""), flush=True)
    if not ok:
        failures.append(name)
    return ok


def info(text):
    print(f"[{time.time() - T0:6.1f}s] INFO " + text, flush=True)


def cost(*argv):
    """Seconds one run of argv takes (the guest is emulated: every process counts)."""
    t = time.time()
    subprocess.run(argv, capture_output=True)
    return f"{time.time() - t:.2f}s"


# ---- the kernel's view: lspci, plus raw sysfs for what lspci does not print ----

def sysfs(addr, attr):
    try:
        with open(f"{PCI}/devices/{addr}/{attr}") as f:
            return f.read().strip()
    except OSError:
        return None


def write(path, value):
    with open(path, "w") as f:
        f.write(value)


def link_name(addr, attr):
    p = f"{PCI}/devices/{addr}/{attr}"
    return os.path.basename(os.readlink(p)) if os.path.islink(p) else None


def lspci():
    out = subprocess.run(["lspci", "-D", "-nn", "-vmm", "-k"], capture_output=True, text=True, check=True).stdout
    devs = {}
    for block in out.strip().split("\n\n"):
        rec = {}
        for line in block.splitlines():
            k, _, v = line.partition(":\t")
            rec[k] = v.strip()
        devs[rec["Slot"]] = rec
    return devs


def hexid(s):
    m = re.search(r"\[([0-9a-f]{4})\]$", s or "")
    return m.group(1) if m else None


def virtfns(pf):
    names = [n for n in os.listdir(f"{PCI}/devices/{pf}") if re.fullmatch(r"virtfn\d+", n)]
    return [(int(n[6:]), link_name(pf, n)) for n in sorted(names, key=lambda n: int(n[6:]))]


def vfio_device_node(a):
    """The iommufd interface's node of a device on vfio-pci, where this kernel has one."""
    d = f"{PCI}/devices/{a}/vfio-dev"
    names = sorted(n for n in os.listdir(d) if n[4:].isdigit() and n.startswith("vfio")) if os.path.isdir(d) else []
    return next((f"/dev/vfio/devices/{n}" for n in names if os.path.exists(f"/dev/vfio/devices/{n}")), None)


def kernel_view():
    """Every device as lspci and sysfs describe it, in hostdevd's field names. lspci
    quirks: no Rev line for 00, no SVendor/SDevice for 0000/ffff, no NUMANode for -1."""
    view = {}
    for a, l in lspci().items():
        group = l.get("IOMMUGroup")
        link = link_name(a, "iommu_group")
        if group != link:
            check(f"{a}: lspci's IOMMU group matches the iommu_group link", False, f"{group} vs {link}")
        numa = l.get("NUMANode", sysfs(a, "numa_node"))
        pf = link_name(a, "physfn")
        d = {
            "vendor_id": hexid(l.get("Vendor")),
            "device_id": hexid(l.get("Device")),
            "subsystem_vendor_id": hexid(l.get("SVendor")) or (sysfs(a, "subsystem_vendor") or "0x")[2:] or None,
            "subsystem_device_id": hexid(l.get("SDevice")) or (sysfs(a, "subsystem_device") or "0x")[2:] or None,
            "class": (hexid(l.get("Class")) or "") + l.get("ProgIf", "00"),
            "revision": l.get("Rev", "00"),
            "driver": l.get("Driver"),
            "iommu_group": int(group) if group is not None else None,
            "numa_node": None if numa in (None, "-1") else int(numa),
            "physfn": pf,
            "vf_index": next((i for i, v in virtfns(pf) if v == a), None) if pf else None,
            "sriov": None,
            "netdevs": sorted(os.listdir(f"{PCI}/devices/{a}/net")) if os.path.isdir(f"{PCI}/devices/{a}/net") else [],
            "vfio_group": f"/dev/vfio/{group}" if l.get("Driver") == "vfio-pci" and group is not None else None,
            "vfio_device": vfio_device_node(a) if l.get("Driver") == "vfio-pci" else None,
        }
        total = sysfs(a, "sriov_totalvfs")
        if total is not None:
            d["sriov"] = {"total_vfs": int(total), "num_vfs": int(sysfs(a, "sriov_numvfs")), "vfs": [v for _, v in virtfns(a)]}
        view[a] = d
    return view


FIELDS = ["vendor_id", "device_id", "subsystem_vendor_id", "subsystem_device_id", "class", "revision",
          "driver", "iommu_group", "numa_node", "physfn", "vf_index", "sriov", "netdevs", "vfio_group",
          "vfio_device"]
# The daemon's device records carry these (no subsystem ids, class or revision).
DAEMON_FIELDS = ["vendor_id", "device_id", "driver", "iommu_group", "numa_node", "physfn", "vf_index",
                 "sriov", "netdevs", "vfio_group", "vfio_device"]


def diff(got, want, fields):
    """Every difference between hostdevd's devices and the kernel's, one line each."""
    problems = []
    if set(got) != set(want):
        problems.append(f"addresses differ: hostdevd-only {sorted(set(got) - set(want))}, "
                        f"kernel-only {sorted(set(want) - set(got))}")
    for a in sorted(set(got) & set(want)):
        for k in fields:
            if got[a].get(k) != want[a][k]:
                problems.append(f"{a} {k}: hostdevd {got[a].get(k)!r}, kernel {want[a][k]!r}")
        if got[a].get("errors"):
            problems.append(f"{a}: hostdevd reports errors {got[a]['errors']}")
    return problems


def scan():
    r = subprocess.run([HOSTDEVD, "scan", "--json", "--sysfs-root", "/sys", "--dev-root", "/dev"],
                       capture_output=True, text=True, check=True)
    return {d["address"]: d for d in json.loads(r.stdout)["devices"]}


def self_test_diff(got, want):
    """The comparison can fail: one corrupted field (or a missing device) in an otherwise
    equal copy is reported, naming that device and field, and nothing else is."""
    missed = []
    for k in FIELDS:
        for a in sorted(got):
            bad = copy.deepcopy(got)
            bad[a][k] = "corrupted"
            p = diff(bad, want, FIELDS)
            if len(p) != 1 or not p[0].startswith(f"{a} {k}:"):
                missed.append(f"{a} {k} -> {p}")
            break
    bad = copy.deepcopy(got)
    bad.pop(sorted(bad)[-1])
    if not any("addresses differ" in p for p in diff(bad, want, FIELDS)):
        missed.append("a missing device")
    check(f"the comparison catches each of {len(FIELDS)} corrupted fields and a missing device", not missed, "; ".join(missed))


def compare_scan(label, self_test=False):
    got, want = scan(), kernel_view()
    problems = diff(got, want, FIELDS)
    check(f"hostdevd scan equals lspci and sysfs for all {len(want)} devices ({label})", not problems, "; ".join(problems[:10]))
    if self_test and not problems:
        self_test_diff(got, want)
    return want


# ---- the daemon ----

def ctl(*args, ok=True):
    r = subprocess.run([CTL, "--socket", SOCK, "--json", *args], capture_output=True, text=True, timeout=60)
    if ok and r.returncode != 0:
        raise RuntimeError(f"hostdevctl {' '.join(args)} failed ({r.returncode}): {r.stderr.strip()}")
    return r


def listing():
    """The daemon's present devices by address (lost records under 'lost:ADDR')."""
    devs = {}
    for d in json.loads(ctl("list").stdout)["devices"]:
        devs[d["address"] if d["present"] else "lost:" + d["address"]] = d
    return devs


def show(a):
    return json.loads(ctl("show", a).stdout)["device"]


def gen(a):
    return str(show(a)["generation"])


def poll(what, fn, pred, timeout=20):
    """fn() until pred holds (a FAIL after timeout seconds); returns the last value."""
    deadline = time.time() + timeout
    while True:
        got = fn()
        if pred(got):
            return got
        if time.time() > deadline:
            check(what, False, f"timed out after {timeout}s")
            return got
        time.sleep(0.2)


def compare_daemon(label, timeout=20):
    """The daemon's records (kept current by uevents) equal the kernel's view; polled,
    since uevents arrive a moment after the change."""
    start, rounds = time.time(), 0
    while True:
        rounds += 1
        present = {a: d for a, d in listing().items() if not a.startswith("lost:")}
        problems = diff(present, kernel_view(), DAEMON_FIELDS)
        if not problems or time.time() - start > timeout:
            break
        time.sleep(0.2)
    check(f"daemon's records equal lspci and sysfs ({label})", not problems, f"after {timeout}s: " + "; ".join(problems[:10]))
    if not problems:
        info(f"daemon matched the kernel after {rounds} comparison(s) ({label})")


def vfs_of(pf, devs):
    return sorted(a for a, d in devs.items() if not a.startswith("lost:") and d.get("physfn") == pf)


def set_vfs(pf, n, *extra):
    return ctl("set-vfs", pf, str(n), "--generation", gen(pf), *extra, ok=False)


def start_daemon(cfg, log):
    if os.path.exists(SOCK):
        os.unlink(SOCK)
    daemon = subprocess.Popen([HOSTDEVD, "serve", "--config", cfg], stdout=log, stderr=subprocess.STDOUT,
                              env={**os.environ, "RUST_LOG": "info", "NO_COLOR": "1"})
    for _ in range(300):
        if os.path.exists(SOCK) or daemon.poll() is not None:
            break
        time.sleep(0.1)
    check("the daemon serves its socket", os.path.exists(SOCK) and daemon.poll() is None)
    return daemon


def stop_daemon(daemon):
    daemon.send_signal(signal.SIGTERM)
    try:
        return daemon.wait(timeout=20)
    except subprocess.TimeoutExpired:
        daemon.kill()
        daemon.wait()
        return "killed after 20s"


def holder(node):
    """A process holding a VFIO node open, as QEMU would: the group's /dev/vfio/N, or the
    device's /dev/vfio/devices/vfioN (QEMU with iommufd opens only that one)."""
    p = subprocess.Popen(["python3", "-c", f"import os,time; fd=os.open('{node}', os.O_RDWR); "
                          "print('open', flush=True); time.sleep(600)"], stdout=subprocess.PIPE, text=True)
    return p, p.stdout.readline().strip() == "open"


def main():
    view = kernel_view()
    pfs = [a for a, d in view.items() if (d["vendor_id"], d["device_id"]) == ("1b36", "0010") and d["sriov"]]
    if not check("an SR-IOV NVMe PF is present", len(pfs) == 1, f"lspci: {view}"):
        return
    pf = pfs[0]
    check("the PF is bound to nvme with 4 VFs possible and none enabled",
          view[pf]["driver"] == "nvme" and view[pf]["sriov"] == {"total_vfs": 4, "num_vfs": 0, "vfs": []}, str(view[pf]))
    info(f"PF {pf}, IOMMU group {view[pf]['iommu_group']}; groups: {sorted({d['iommu_group'] for d in view.values()} - {None})}")
    compare_scan("before VFs", self_test=True)
    info(f"costs under TCG: hostdevctl --version {cost(CTL, '--version')}, again {cost(CTL, '--version')}, "
         f"hostdevd scan {cost(HOSTDEVD, 'scan', '--json')}, lspci {cost('lspci', '-D', '-nn', '-vmm', '-k')}, "
         f"python3 -c pass {cost('python3', '-c', 'pass')}")

    os.makedirs(RUN, exist_ok=True)
    cfg = os.path.join(RUN, "config.toml")
    with open(cfg, "w") as f:
        f.write(f'''sysfs_root = "/sys"
dev_root = "/dev"
proc_root = "/proc"
state_dir = "{RUN}/state"
[api]
socket = "{SOCK}"
[libvirt]
enabled = false
[hardware]
step_timeout_ms = 20000
[[devices]]
vendor_id = "1b36"
vf = true
''')
    log = open(os.path.join(OUT, "hostdevd.log"), "w")
    daemon = start_daemon(cfg, log)
    try:
        st = json.loads(ctl("status").stdout)
        check("status: store and hotplug listener healthy", st["store"]["ok"] and st["hotplug"]["ok"], json.dumps(st))
        compare_daemon("at start")
        check("the PF is not managed (only VFs are)", show(pf)["state"] == "unmanaged", show(pf)["state"])

        # 1. VFs through the daemon; their uevents bring them into the ledger.
        stale = gen(pf)
        tool, rid = str(uuid.uuid4()), str(uuid.uuid4())
        r = ctl("set-vfs", pf, "2", "--generation", stale, "--autoprobe", "false", "--owner", tool, "--request-id", rid, ok=False)
        first = json.loads(r.stdout) if r.returncode == 0 else {}
        check("set-vfs 2 --autoprobe false (with a request id) accepted", r.returncode == 0 and first.get("replayed") is False, r.stdout + r.stderr)
        devs = poll("2 VFs appear in the daemon via uevents", listing, lambda l: len(vfs_of(pf, l)) == 2)
        vfs = vfs_of(pf, devs)
        # The same command again (its answer lost): the first answer, and the kernel's VFs
        # untouched (writing the count again would destroy and remake them).
        r = ctl("set-vfs", pf, "2", "--generation", stale, "--autoprobe", "false", "--owner", tool, "--request-id", rid, ok=False)
        again = json.loads(r.stdout) if r.returncode == 0 else {}
        check("the same set-vfs again is replayed with the first answer's count before",
              r.returncode == 0 and again.get("replayed") is True and again.get("previous_vf_count") == first.get("previous_vf_count") == 0, r.stdout + r.stderr)
        check("the replay left the kernel's VFs as they were", sysfs(pf, "sriov_numvfs") == "2" and [v for _, v in virtfns(pf)] == vfs
              and vfs_of(pf, listing()) == vfs, str(virtfns(pf)))
        o = json.loads(ctl("outcome", "--owner", tool, "--request-id", rid).stdout)
        check("the change's outcome is 'vf_count_set'", o.get("operation") == "vf_count_set" and o.get("address") == pf, json.dumps(o))
        check("the kernel shows the same 2 VFs", sysfs(pf, "sriov_numvfs") == "2" and [v for _, v in virtfns(pf)] == vfs, f"{virtfns(pf)} vs {vfs}")
        check("the new VFs are free, managed and unbound", all(devs[a]["state"] == "free" and devs[a]["managed"] and devs[a]["driver"] is None for a in vfs),
              str({a: (devs[a]["state"], devs[a]["driver"]) for a in vfs}))
        groups = {a: link_name(a, "iommu_group") for a in vfs}
        info(f"VFs {vfs}, IOMMU groups {groups}")
        check("each VF has an IOMMU group of its own", len(set(groups.values())) == 2 and link_name(pf, "iommu_group") not in groups.values(), str(groups))
        compare_scan("with 2 VFs")
        compare_daemon("with 2 VFs")
        st = json.loads(ctl("status").stdout)
        check("uevents were counted", st["uevents"] >= 2, str(st["uevents"]))
        info(f"uevents handled so far: {st['uevents']}, resyncs: {st['uevent_resyncs']}")
        r = ctl("set-vfs", pf, "3", "--generation", stale, ok=False)
        check("set-vfs with a stale PF generation is refused", r.returncode == 1 and "stale" in r.stderr.lower(), r.stderr)
        check("VFs unchanged after the stale refusal", sysfs(pf, "sriov_numvfs") == "2")

        # 2. Claim with vfio: the VF moves to vfio-pci and its group node appears.
        vf = vfs[0]
        owner = str(uuid.uuid4())
        r = ctl("claim", vf, "--owner", owner, "--generation", gen(vf), "--vfio", ok=False)
        check("claim --vfio of an unbound VF accepted", r.returncode == 0, r.stderr)
        group = groups[vf]
        check("the VF is bound to vfio-pci", link_name(vf, "driver") == "vfio-pci", str(link_name(vf, "driver")))
        check(f"/dev/vfio/{group} exists", os.path.exists(f"/dev/vfio/{group}"))
        # The layout the holder check reads for the iommufd interface's device node.
        vfio_dev = os.listdir(f"/sys/bus/pci/devices/{vf}/vfio-dev") if os.path.isdir(f"/sys/bus/pci/devices/{vf}/vfio-dev") else []
        check("sysfs lists the VF's vfio-dev/vfioN", len(vfio_dev) == 1 and vfio_dev[0].startswith("vfio") and vfio_dev[0][4:].isdigit(), str(vfio_dev))
        node = f"/dev/vfio/devices/{vfio_dev[0]}" if vfio_dev else None
        if NODES == "device":
            check(f"{node} exists (this kernel has the iommufd interface)", node is not None and os.path.exists(node), str(node))
        else:
            check(f"{node} is absent (this kernel has no iommufd interface)", node is None or not os.path.exists(node), str(node))
        d = show(vf)
        check("hostdevctl shows the device node where the kernel has one",
              d.get("vfio_device") == (node if NODES == "device" else None), str(d.get("vfio_device")))
        check("binding recorded with the original driver (none)", [(m["address"], m["original_driver"]) for m in d["vfio_binding"]] == [(vf, None)], json.dumps(d["vfio_binding"]))
        check("the claimed VF shows vfio-pci and its group node", d["driver"] == "vfio-pci" and d["vfio_group"] == f"/dev/vfio/{group}", f"{d['driver']} {d['vfio_group']}")
        compare_daemon("VF on vfio-pci")

        # 3. A claimed VF blocks VF-count changes.
        r = set_vfs(pf, 0)
        check("set-vfs 0 refused while a VF is claimed", r.returncode == 1 and "claimed" in r.stderr, r.stderr)
        check("VFs unchanged after the refusal", sysfs(pf, "sriov_numvfs") == "2" and [v for _, v in virtfns(pf)] == vfs)

        # 4. A process holding the group open blocks the release.
        h, opened = holder(f"/dev/vfio/{group}")
        check(f"a holder opened /dev/vfio/{group}", opened)
        r = ctl("release", vf, "--owner", owner, "--generation", gen(vf), ok=False)
        check("release refused while /dev/vfio is held", r.returncode == 1 and ("vfio" in r.stderr.lower() or "in use" in r.stderr), r.stderr)
        check("the refusal names the holder's pid", str(h.pid) in r.stderr, r.stderr)
        check("still claimed and on vfio-pci after the refusal", show(vf)["state"] == "claimed" and link_name(vf, "driver") == "vfio-pci")
        h.kill()
        h.wait()
        if NODES == "device":
            # 4b. A process holding only the device node (QEMU's iommufd way) blocks it too.
            h, opened = holder(node)
            check(f"a holder opened {node}, and nobody the group node", opened)
            r = ctl("release", vf, "--owner", owner, "--generation", gen(vf), ok=False)
            check("release refused while the device node is held", r.returncode == 1 and node in r.stderr, r.stderr)
            check("that refusal names the holder's pid", str(h.pid) in r.stderr, r.stderr)
            info(f"the refusal as hostdevctl prints it: {r.stderr.strip()}")
            check("still claimed and on vfio-pci after that refusal", show(vf)["state"] == "claimed" and link_name(vf, "driver") == "vfio-pci")
            # The seed bug's audit: it believes nobody lives here and acts. The VF a
            # running VM holds through its device node is protected, not freed.
            hg = json.loads(ctl("status").stdout)["host_generation"]
            r = ctl("reconcile", "--expect-none", "--snapshot-generation", str(hg), "--act", ok=False)
            rep = json.loads(r.stdout) if r.returncode == 0 else {}
            freed = [o["device"]["address"] for o in rep.get("orphans", []) if o.get("freed_generation")]
            check("an acting audit expecting nobody keeps the VF whose device node is held",
                  r.returncode == 0 and rep.get("acted") is True and vf in [d["address"] for d in rep.get("protected", [])]
                  and vf not in freed, r.stdout + r.stderr)
            check("still claimed and on vfio-pci after the audit", show(vf)["state"] == "claimed" and link_name(vf, "driver") == "vfio-pci")
            h.kill()
            h.wait()
        r = ctl("release", vf, "--owner", owner, "--generation", gen(vf), ok=False)
        check("release succeeds once the holder is gone", r.returncode == 0, r.stderr)
        check("the VF is unbound again, as before the claim", link_name(vf, "driver") is None, str(link_name(vf, "driver")))
        check("driver_override cleared", sysfs(vf, "driver_override") == "(null)", str(sysfs(vf, "driver_override")))
        check("the VF is free", show(vf)["state"] == "free", show(vf)["state"])
        info(f"/dev/vfio/{group} after the release: {'still there' if os.path.exists(f'/dev/vfio/{group}') else 'gone'}")
        compare_daemon("after the release")

        # 4c. An unclaimed VF whose group a process holds open (a VM the agent knows
        # nothing of) blocks a VF-count change: writing the count would destroy the VF.
        write(f"{PCI}/devices/{vf}/driver_override", "vfio-pci")
        write(f"{PCI}/drivers_probe", vf)
        check("the unclaimed VF is bound to vfio-pci by hand", link_name(vf, "driver") == "vfio-pci", str(link_name(vf, "driver")))
        h, opened = holder(f"/dev/vfio/{group}")
        check(f"a holder opened /dev/vfio/{group} of the unclaimed VF", opened)
        r = set_vfs(pf, 0)
        check("set-vfs 0 refused while an unclaimed VF's group is held open",
              r.returncode == 1 and str(h.pid) in r.stderr, r.stderr)
        check("VFs unchanged after that refusal", sysfs(pf, "sriov_numvfs") == "2" and [v for _, v in virtfns(pf)] == vfs)
        h.kill()
        h.wait()
        write(f"{PCI}/devices/{vf}/driver/unbind", vf)
        write(f"{PCI}/devices/{vf}/driver_override", "\n")
        check("the VF is unbound again by hand", link_name(vf, "driver") is None and sysfs(vf, "driver_override") == "(null)",
              f"{link_name(vf, 'driver')} {sysfs(vf, 'driver_override')}")

        # 5. With no claim left, set-vfs 0 works and the VFs leave the ledger.
        r = set_vfs(pf, 0)
        check("set-vfs 0 accepted once nothing is claimed", r.returncode == 0, r.stderr)
        devs = poll("the VFs disappear from the daemon", listing, lambda l: not vfs_of(pf, l) and not any(a.startswith("lost:") for a in l))
        check("the kernel has no VFs", sysfs(pf, "sriov_numvfs") == "0" and virtfns(pf) == [], str(virtfns(pf)))
        compare_daemon("after set-vfs 0")

        # 6. A VF with a driver of its own: restored to that driver. VFs are created with
        # autoprobe off; the operator then turns it on and gives pci-stub their id, so
        # pci-stub takes them through its id table (no driver_override).
        r = set_vfs(pf, 3, "--autoprobe", "false")
        check("set-vfs 3 accepted", r.returncode == 0, r.stderr)
        devs = poll("3 VFs appear", listing, lambda l: len(vfs_of(pf, l)) == 3)
        vfs = vfs_of(pf, devs)
        r = set_vfs(pf, 2)
        check("set-vfs 3 -> 2 accepted (the daemon writes 0 first)", r.returncode == 0, r.stderr)
        devs = poll("2 VFs left", listing, lambda l: len(vfs_of(pf, l)) == 2)
        vfs = vfs_of(pf, devs)
        check("the kernel shows 2 VFs", sysfs(pf, "sriov_numvfs") == "2" and [v for _, v in virtfns(pf)] == vfs, str(virtfns(pf)))
        write(f"{PCI}/devices/{pf}/sriov_drivers_autoprobe", "1")
        write(f"{PCI}/drivers/pci-stub/new_id", "1b36 0010")
        bound = all(link_name(a, "driver") == "pci-stub" for a in vfs)
        check("pci-stub took both VFs through its id table", bound, str({a: link_name(a, "driver") for a in vfs}))
        compare_daemon("VFs on pci-stub")
        vf = vfs[0]
        r = ctl("claim", vf, "--owner", owner, "--generation", gen(vf), "--vfio", ok=False)
        check("claim --vfio of a VF on pci-stub accepted", r.returncode == 0, r.stderr)
        check("moved from pci-stub to vfio-pci", link_name(vf, "driver") == "vfio-pci", str(link_name(vf, "driver")))
        d = show(vf)
        check("binding recorded with the original driver pci-stub", [m["original_driver"] for m in d["vfio_binding"]] == ["pci-stub"], json.dumps(d["vfio_binding"]))
        r = ctl("release", vf, "--owner", owner, "--generation", gen(vf), ok=False)
        check("release of the pci-stub VF succeeds", r.returncode == 0, r.stderr)
        check("pci-stub restored", link_name(vf, "driver") == "pci-stub", str(link_name(vf, "driver")))
        check("driver_override cleared after the pci-stub restore", sysfs(vf, "driver_override") == "(null)", str(sysfs(vf, "driver_override")))
        compare_daemon("pci-stub restored")

        # 7. With autoprobe off, a VF can only have been bound through driver_override
        # (the kernel refuses every other probe of such a VF); the release must bring
        # that driver back too.
        vf = vfs[1]
        write(f"{PCI}/devices/{pf}/sriov_drivers_autoprobe", "0")
        write(f"{PCI}/devices/{vf}/driver/unbind", vf)
        write(f"{PCI}/devices/{vf}/driver_override", "pci-stub")
        write(f"{PCI}/drivers_probe", vf)
        check("a VF bound to pci-stub through driver_override (autoprobe off)", link_name(vf, "driver") == "pci-stub", str(link_name(vf, "driver")))
        poll("the daemon sees the VF on pci-stub", lambda: show(vf), lambda d: d["driver"] == "pci-stub")
        # Claimed first, then bound by prepare-vfio with a request id: the same request
        # sent again (an answer lost) is the first answer, replayed, with nothing redone.
        r = ctl("claim", vf, "--owner", owner, "--generation", gen(vf), ok=False)
        check("claim of the overridden VF accepted", r.returncode == 0, r.stderr)
        g, rid = gen(vf), str(uuid.uuid4())
        r = ctl("prepare-vfio", vf, "--owner", owner, "--generation", g, "--request-id", rid, ok=False)
        first = json.loads(r.stdout) if r.returncode == 0 else {}
        check("prepare-vfio of the overridden VF binds it to vfio-pci",
              r.returncode == 0 and first.get("replayed") is False and link_name(vf, "driver") == "vfio-pci", r.stdout + r.stderr)
        r = ctl("prepare-vfio", vf, "--owner", owner, "--generation", g, "--request-id", rid, ok=False)
        again = json.loads(r.stdout) if r.returncode == 0 else {}
        check("the same prepare-vfio again is replayed: its members, the claim's generation, still on vfio-pci",
              r.returncode == 0 and again.get("replayed") is True and again.get("members") == first.get("members")
              and again.get("generation", 0) >= first.get("generation", 1) and link_name(vf, "driver") == "vfio-pci", r.stdout + r.stderr)
        o = json.loads(ctl("outcome", "--owner", owner, "--request-id", rid).stdout)
        check("the binding's outcome is 'bound'", o.get("operation") == "bound" and o.get("address") == vf, json.dumps(o))
        r = ctl("release", vf, "--owner", owner, "--generation", gen(vf), ok=False)
        restored = link_name(vf, "driver") == "pci-stub"
        check("release of a VF bound through driver_override (autoprobe off) restores pci-stub", r.returncode == 0 and restored,
              f"rc {r.returncode}, driver {link_name(vf, 'driver')}, override {sysfs(vf, 'driver_override')}, state {show(vf)['state']}: {r.stderr.strip()}")
        info(f"after that release: driver {link_name(vf, 'driver')}, driver_override {sysfs(vf, 'driver_override')}, state {show(vf)['state']}")

        # 8. A claimed VF lost when an operator writes 0 behind the daemon's back.
        vf = vfs[0]
        r = ctl("claim", vf, "--owner", owner, "--generation", gen(vf), "--vfio", ok=False)
        check("claim --vfio before the VFs are removed", r.returncode == 0, r.stderr)
        write(f"{PCI}/devices/{pf}/sriov_numvfs", "0")
        devs = poll("the claimed VF turns lost after sriov_numvfs=0 in sysfs", listing, lambda l: l.get("lost:" + vf, {}).get("state") == "lost")
        lost = devs.get("lost:" + vf, {})
        check("the lost VF keeps its owner and binding record", lost.get("owner") is not None and [m["address"] for m in lost.get("vfio_binding", [])] == [vf], json.dumps(lost))
        check("no present VF left in the daemon", not vfs_of(pf, devs), str(vfs_of(pf, devs)))
        compare_scan("after VFs removed behind the daemon")
        compare_daemon("after VFs removed behind the daemon")
        r = set_vfs(pf, 2)
        check("set-vfs refused while a lost VF is claimed", r.returncode == 1 and "claimed" in r.stderr, r.stderr)

        # 9. A restart keeps the lost claim and finds the same world.
        rc = stop_daemon(daemon)
        check("SIGTERM stops the daemon with status 0", rc == 0, str(rc))
        daemon = start_daemon(cfg, log)
        devs = listing()
        check("after a restart the claim is still lost", devs.get("lost:" + vf, {}).get("state") == "lost", json.dumps(devs.get("lost:" + vf)))
        compare_daemon("after a restart")

        # 10. VFs made again while the daemon is stopped: the kernel gives each a new sysfs
        # directory, so at the next start the claim on one goes lost and the VF made again
        # comes free (I6), where no uevent reached the daemon.
        write(f"{PCI}/devices/{pf}/sriov_numvfs", "2")
        devs = poll("the VFs written behind the daemon's back appear", listing, lambda l: len(vfs_of(pf, l)) == 2)
        vf = vfs_of(pf, devs)[1]
        r = ctl("claim", vf, "--owner", owner, "--generation", gen(vf), ok=False)
        check("claim of a VF before it is made again", r.returncode == 0, r.stderr)
        ino = os.stat(f"{PCI}/devices/{vf}").st_ino
        rc = stop_daemon(daemon)
        check("SIGTERM stops the daemon with status 0", rc == 0, str(rc))
        write(f"{PCI}/devices/{pf}/sriov_numvfs", "0")
        write(f"{PCI}/devices/{pf}/sriov_numvfs", "2")
        again = os.stat(f"{PCI}/devices/{vf}").st_ino
        check("the kernel gives the VF made again another sysfs directory", again != ino, f"inode {ino}, then {again}")
        daemon = start_daemon(cfg, log)
        devs = listing()
        lost = devs.get("lost:" + vf, {})
        check("after the start the claim on the VF made again is lost", lost.get("state") == "lost" and lost.get("owner") is not None, json.dumps(lost))
        check("and the VF made again is free", devs.get(vf, {}).get("state") == "free", json.dumps(devs.get(vf)))
        compare_daemon("after VFs made again while the daemon was stopped")
    finally:
        rc = stop_daemon(daemon)
        check("the daemon stops cleanly at the end", rc == 0, str(rc))
        log.close()
        with open(os.path.join(OUT, "hostdevd.log")) as f:
            tail = f.read().splitlines()[-60:]
        print("---- hostdevd log (last 60 lines) ----")
        print("\n".join(tail))


try:
    main()
except Exception as e:  # a crash of the checks is a failure, with its reason
    import traceback
    traceback.print_exc()
    check("guest checks ran to the end", False, repr(e))
print(f"{len(failures)} check(s) failed: {failures}" if failures else "all guest checks passed", flush=True)
sys.exit(1 if failures else 0)
