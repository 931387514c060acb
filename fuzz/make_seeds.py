#!/usr/bin/env python3
# Writes the hand-made seed inputs of every fuzz target into fuzz/corpus/<target>/
# (named seed-*; what the fuzzer adds by `run.sh --merge` is named by content hash).
import os
import struct

here = os.path.dirname(os.path.abspath(__file__))


def put(target, name, data):
    d = os.path.join(here, "corpus", target)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(d, "seed-" + name), "wb") as f:
        f.write(data)


UUID = "6f1c6ad2-6b1c-4e9f-9a1b-1a2b3c4d5e6f"

# ---- ids ----
for i, s in enumerate([
    "0000:3b:02.1", "3b:02.1", "10000:e1:00.0", "0000:3B:1f.7", "0000:3b:20.0",
    "0x8086", "8086", "10fb\n", UUID, "{" + UUID + "}", "urn:uuid:" + UUID,
    UUID.replace("-", ""), "physnet1", "instance-0000002a", "0000:3b:*.*",
    "*:*:02.1", "req-1", "a\x07b",
]):
    put("ids", f"{i:02}", s)

# ---- sysfs_attr ----
for i, s in enumerate([
    "0x8086\n", "0x020000\n", "0x01\n", "64\n", "-1\n", "(null)\n", "vfio-pci\n",
    "virtfn12", "  7 \t\n", "0X10FB", "4294967295", "+5",
]):
    put("sysfs_attr", f"{i:02}", s)


# ---- sysfs_scan: chunks of (slot byte, content) separated by 0x00 ----
# slot = device * 16 + attribute; devices PF, VF0, VF1, plain; the byte is 64 + slot.
FILES = ["vendor", "device", "subsystem_vendor", "subsystem_device", "class", "revision",
         "numa_node", "driver_override", "sriov_totalvfs", "sriov_numvfs",
         "sriov_vf_device"]
LINKS = ["iommu_group", "driver", "physfn", "virtfn0", "virtfn1"]


def slot(dev, name):
    i = FILES.index(name) if name in FILES else len(FILES) + LINKS.index(name)
    return bytes([64 + dev * 16 + i])


def scan(*chunks):
    return b"\x00".join(slot(d, n) + c for d, n, c in chunks)


put("sysfs_scan", "vendor", scan((0, "vendor", b"0x15b3\n")))
put("sysfs_scan", "bad-ids", scan((1, "vendor", b"0x18086\n"), (1, "device", b"\xff\xfe"),
                                  (2, "class", b"0x0200000\n")))
put("sysfs_scan", "removed", scan((0, "vendor", b"\xff"), (3, "numa_node", b"\xff")))
put("sysfs_scan", "numa", scan((0, "numa_node", b"1\n"), (1, "numa_node", b"-1\n"),
                               (3, "numa_node", b"-2\n")))
put("sysfs_scan", "sriov", scan((0, "sriov_numvfs", b"5\n"), (0, "sriov_totalvfs", b"1\n")))
put("sysfs_scan", "links", scan((1, "iommu_group", b"../../../kernel/iommu_groups/abc"),
                                (2, "physfn", b"nowhere"),
                                (0, "virtfn0", b"../0000:5e:00.0")))
put("sysfs_scan", "cycle", scan((0, "physfn", b"../0000:3b:10.0"),
                                (1, "virtfn0", b"../0000:3b:00.0")))
put("sysfs_scan", "override", scan((1, "driver_override", b"(null)\n"),
                                   (2, "driver", b"../../../bus/pci/drivers/\xff")))
put("sysfs_scan", "long", scan((3, "vendor", b"0" * 5000)))

# ---- config ----
with open(os.path.join(here, "..", "packaging", "config.toml"), "rb") as f:
    put("config", "packaged", f.read())
put("config", "readme", """sysfs_root = "/sys"
dev_root = "/dev"
state_dir = "/var/lib/hostdevd"

[api]
socket = "/run/hostdevd/hostdevd.sock"
socket_mode = "0660"
socket_group = "hostdevd"
writer_uids = [0]
writer_gids = []

[[devices]]
pf_name = "ens1f0"
vf = true
physnets = ["physnet1"]

[[devices]]
vendor_id = "15b3"
address = "0000:86:*.*"
physnets = ["physnet2"]
""")
put("config", "tcp", """[api.tcp]
listen = "0.0.0.0:7443"
cert = "/etc/hostdevd/tls/server.pem"
key = "/etc/hostdevd/tls/server.key"
client_ca = "/etc/hostdevd/tls/clients-ca.pem"
max_connections_per_peer = 512
handshake_timeout_ms = 10000

[metrics]
listen = "127.0.0.1:9464"

[log]
filter = "info"
""")
put("config", "libvirt", '[libvirt]\nuri = "test:///default"\nenabled = false\npoll_interval_ms = 50\ntimeout_ms = 1\n')
put("config", "bad", '[[devices]]\nvendor_id = "80866"\naddress = "0000:3b:*"\n[api]\nsocket_mode = "999"\n')
put("config", "empty", "")


# ---- requests: protobuf by hand ----
def varint(v):
    out = b""
    while v >= 0x80:
        out += bytes([(v & 0x7F) | 0x80])
        v >>= 7
    return out + bytes([v])


def ld(field, payload):
    if isinstance(payload, str):
        payload = payload.encode()
    return varint(field << 3 | 2) + varint(len(payload)) + payload


def vi(field, v):
    return varint(field << 3) + varint(v)


owner = ld(1, UUID) + ld(2, "instance-0000002a")
put("requests", "get-device", ld(1, "0000:3b:10.0"))
put("requests", "claim-address", ld(1, owner) + ld(2, "boot-1") +
    ld(3, ld(1, "0000:3b:10.1") + vi(2, 21)))
put("requests", "claim-selector", ld(1, owner) + ld(2, "boot-2") +
    ld(4, ld(1, "8086") + ld(3, "0000:3b:00.0") + ld(4, "physnet1") + vi(5, 1) +
       ld(6, "vfio-pci")) + vi(5, 1))
put("requests", "release", ld(1, "0000:3b:10.1") + ld(2, owner) + ld(3, "free-1") + vi(4, 22))
put("requests", "transfer", ld(1, "0000:3b:10.1") + ld(2, UUID) +
    ld(3, ld(1, "00000000-0000-0000-0000-0000000000aa")) + ld(4, "move-1") + vi(5, 23))
put("requests", "reconcile", ld(1, UUID) + ld(1, "not-a-uuid") + vi(2, 100) + vi(3, 1) +
    ld(4, "audit-1"))
put("requests", "watch", vi(1, 12345) + vi(2, 1))
put("requests", "outcome", ld(1, UUID) + ld(2, "boot-1"))
put("requests", "prepare-vfio", ld(1, "0000:3b:10.1") + ld(2, owner) + vi(3, 24))
put("requests", "set-vf-count", ld(1, "0000:3b:00.0") + vi(2, 8) + vi(3, 25) + vi(4, 0))
put("requests", "non-utf8", ld(1, b"\xff\xfe0000:3b:10.0"))
put("requests", "unknown-fields", vi(99, 2**64 - 1) + varint(100 << 3 | 5) +
    struct.pack("<I", 7) + ld(1, "0000:3b:10.0"))
