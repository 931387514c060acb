#!/usr/bin/env python3
# The checks tests/vm/run.sh runs inside the guest (chrooted into the host's / over 9p,
# with the guest's own /proc, /sys and /dev): hostdevd against a real kernel's sysfs,
# real SR-IOV VFs, real uevents and real vfio-pci binding.
# Usage: guest.py BIN_DIR OUT_DIR. Exit status 0 only when every check passed.
import json
import os
import re
import subprocess
import sys
import time
import uuid

BIN, OUT = sys.argv[1], sys.argv[2]
HOSTDEVD, CTL = os.path.join(BIN, "hostdevd"), os.path.join(BIN, "hostdevctl")
RUN = "/tmp/hostdevd"
SOCK = os.path.join(RUN, "hostdevd.sock")
failures = []


def check(name, ok, detail=""):
    print(("PASS " if ok else "FAIL ") + name + (f": {detail}" if detail and not ok else ""), flush=True)
    if not ok:
        failures.append(name)
    return ok


def sysfs(addr, attr):
    try:
        with open(f"/sys/bus/pci/devices/{addr}/{attr}") as f:
            return f.read().strip()
    except OSError:
        return None


def link_name(addr, attr):
    p = f"/sys/bus/pci/devices/{addr}/{attr}"
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


def compare_inventory(label):
    scan = {d["address"]: d for d in json.loads(subprocess.run(
        [HOSTDEVD, "scan", "--json", "--sysfs-root", "/sys", "--dev-root", "/dev"],
        capture_output=True, text=True, check=True).stdout)["devices"]}
    ls = lspci()
    problems = []
    if set(scan) != set(ls):
        problems.append(f"addresses differ: hostdevd-only {sorted(set(scan) - set(ls))}, lspci-only {sorted(set(ls) - set(scan))}")
    for a in sorted(set(scan) & set(ls)):
        d, l = scan[a], ls[a]
        want = {
            "vendor_id": hexid(l.get("Vendor")),
            "device_id": hexid(l.get("Device")),
            "class": (hexid(l.get("Class")) or "") + l.get("ProgIf", "00"),
            "revision": l.get("Rev", "00"),
            "driver": l.get("Driver"),
            "iommu_group": int(link_name(a, "iommu_group")) if link_name(a, "iommu_group") else None,
            "physfn": link_name(a, "physfn"),
        }
        numa = sysfs(a, "numa_node")
        want["numa_node"] = None if numa in (None, "-1") else int(numa)
        for k, v in want.items():
            if d.get(k) != v:
                problems.append(f"{a} {k}: hostdevd {d.get(k)!r}, kernel {v!r}")
        total = sysfs(a, "sriov_totalvfs")
        if total is not None:
            s = d.get("sriov") or {}
            vfs = sorted((n for n in os.listdir(f"/sys/bus/pci/devices/{a}") if n.startswith("virtfn")), key=lambda n: int(n[6:]))
            kernel = {"total_vfs": int(total), "num_vfs": int(sysfs(a, "sriov_numvfs")), "vfs": [link_name(a, n) for n in vfs]}
            got = {k: s.get(k) for k in kernel}
            if got != kernel:
                problems.append(f"{a} sriov: hostdevd {got}, kernel {kernel}")
    check(f"inventory equals lspci and sysfs for all {len(ls)} devices ({label})", not problems, "; ".join(problems[:10]))
    return scan


def ctl(*args, ok=True):
    r = subprocess.run([CTL, "--socket", SOCK, "--json", *args], capture_output=True, text=True, timeout=60)
    if ok and r.returncode != 0:
        raise RuntimeError(f"hostdevctl {' '.join(args)} failed ({r.returncode}): {r.stderr.strip()}")
    return r


def listing():
    return {d["address"]: d for d in json.loads(ctl("list").stdout)["devices"]}


def show(a):
    return json.loads(ctl("show", a).stdout)["device"]


def until(what, pred, timeout=30):
    deadline = time.time() + timeout
    while time.time() < deadline:
        got = listing()
        if pred(got):
            return got
        time.sleep(0.2)
    check(what, False, "timed out")
    return listing()


def main():
    ls = lspci()
    pfs = [a for a, d in ls.items() if hexid(d.get("Vendor")) == "1b36" and hexid(d.get("Device")) == "0010" and sysfs(a, "sriov_totalvfs")]
    if not check("an SR-IOV NVMe PF is present", len(pfs) == 1, f"lspci: {ls}"):
        return
    pf = pfs[0]
    check("the PF is bound to nvme", link_name(pf, "driver") == "nvme", str(link_name(pf, "driver")))
    compare_inventory("before VFs")

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
    daemon = subprocess.Popen([HOSTDEVD, "serve", "--config", cfg], stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "RUST_LOG": "info"})
    try:
        for _ in range(300):
            if os.path.exists(SOCK):
                break
            time.sleep(0.1)
        check("the daemon serves", os.path.exists(SOCK) and daemon.poll() is None)
        st = json.loads(ctl("status").stdout)
        check("hotplug listener is up", st["hotplug"]["ok"], json.dumps(st["hotplug"]))

        # VFs through the daemon; their uevents bring them into the ledger.
        g = show(pf)["generation"]
        r = ctl("set-vfs", pf, "2", "--generation", str(g), "--autoprobe", "false", ok=False)
        check("set-vfs 2 accepted", r.returncode == 0, r.stderr)
        devs = until("2 VFs appear via uevents", lambda l: len([d for d in l.values() if d.get("physfn") == pf]) == 2)
        vfs = sorted(a for a, d in devs.items() if d.get("physfn") == pf)
        check("kernel shows 2 VFs", sysfs(pf, "sriov_numvfs") == "2" and len(vfs) == 2, str(vfs))
        check("VFs are free and managed", all(devs[a]["state"] == "free" for a in vfs), str({a: devs[a]["state"] for a in vfs}))
        compare_inventory("with 2 VFs")
        st = json.loads(ctl("status").stdout)
        check("uevents were handled", st["uevents"] >= 2, str(st["uevents"]))
        r = ctl("set-vfs", pf, "3", "--generation", str(g), ok=False)
        check("a stale PF generation is refused", r.returncode != 0 and "stale" in r.stderr.lower(), r.stderr)

        # Claim with vfio: the VF moves to vfio-pci and its group node appears.
        vf = vfs[0]
        before_driver = link_name(vf, "driver")
        owner = str(uuid.uuid4())
        d = show(vf)
        r = ctl("claim", vf, "--owner", owner, "--generation", str(d["generation"]), "--vfio", ok=False)
        check("claim --vfio accepted", r.returncode == 0, r.stderr)
        group = link_name(vf, "iommu_group")
        check("VF bound to vfio-pci", link_name(vf, "driver") == "vfio-pci", str(link_name(vf, "driver")))
        check(f"/dev/vfio/{group} exists", group is not None and os.path.exists(f"/dev/vfio/{group}"))
        d = show(vf)
        check("binding recorded with the original driver", [m["original_driver"] for m in d["vfio_binding"]] == [before_driver], json.dumps(d["vfio_binding"]))

        # A claimed VF blocks VF-count changes.
        g = show(pf)["generation"]
        r = ctl("set-vfs", pf, "0", "--generation", str(g), ok=False)
        check("set-vfs refused while a VF is claimed", r.returncode != 0 and "claimed" in r.stderr, r.stderr)
        check("VFs unchanged after the refusal", sysfs(pf, "sriov_numvfs") == "2")

        # A process holding the group open blocks the release.
        holder = subprocess.Popen(["python3", "-c", f"import os,time; fd=os.open('/dev/vfio/{group}', os.O_RDWR); print('open', flush=True); time.sleep(600)"], stdout=subprocess.PIPE, text=True)
        holder.stdout.readline()
        d = show(vf)
        r = ctl("release", vf, "--owner", owner, "--generation", str(d["generation"]), ok=False)
        check("release refused while /dev/vfio is held", r.returncode != 0 and ("VFIO" in r.stderr or "in use" in r.stderr), r.stderr)
        check("VF still on vfio-pci", link_name(vf, "driver") == "vfio-pci")
        holder.kill()
        holder.wait()
        d = show(vf)
        r = ctl("release", vf, "--owner", owner, "--generation", str(d["generation"]), ok=False)
        check("release succeeds once the holder is gone", r.returncode == 0, r.stderr)
        check("original driver restored", link_name(vf, "driver") == before_driver, f"{link_name(vf, 'driver')} vs {before_driver}")
        check("driver_override cleared", sysfs(vf, "driver_override") == "(null)", str(sysfs(vf, "driver_override")))

        # A claimed VF lost when an operator writes 0 behind the daemon's back.
        d = show(vfs[1])
        ctl("claim", vfs[1], "--owner", owner, "--generation", str(d["generation"]))
        with open(f"/sys/bus/pci/devices/{pf}/sriov_numvfs", "w") as f:
            f.write("0")
        devs = until("claimed VF turns lost after sriov_numvfs=0", lambda l: l.get(vfs[1], {}).get("state") == "lost")
        check("free VF removed from the ledger", vfs[0] not in devs or devs[vfs[0]]["state"] != "free", str(devs.get(vfs[0])))
        compare_inventory("after VFs removed")
    finally:
        daemon.terminate()
        try:
            daemon.wait(timeout=20)
        except subprocess.TimeoutExpired:
            daemon.kill()
        log.close()
        with open(os.path.join(OUT, "hostdevd.log")) as f:
            tail = f.read().splitlines()[-40:]
        print("---- hostdevd log (last 40 lines) ----")
        print("\n".join(tail))


try:
    main()
except Exception as e:  # a crash of the checks is a failure, with its reason
    check("guest checks ran to the end", False, repr(e))
print(f"{len(failures)} check(s) failed: {failures}" if failures else "all guest checks passed", flush=True)
sys.exit(1 if failures else 0)
