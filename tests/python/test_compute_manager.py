# Owns: the compute-manager test: Python's grpcio plays nova-compute against the real
# hostdevd daemon on a fake sysfs tree (list, claim, stale audit, release, watch,
# reconcile, health, reflection), through stubs generated from proto/ at test time.
#
# Run with tests/python/run.sh (it makes the venv, builds the binaries, runs pytest).
# HOSTDEVD_BIN overrides the daemon binary (default target/debug/hostdevd).

import importlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2
from google.rpc import error_details_pb2, status_pb2

REPO = Path(__file__).resolve().parents[2]
PF = "0000:3b:00.0"
VFS = [f"0000:3b:02.{i}" for i in range(4)]
OTHER = "0000:00:04.0"  # an NVMe controller without SR-IOV: never managed
INSTANCE = "5f0c2d4e-8a52-4c1b-9d6e-0a1b2c3d4e5f"
OTHER_INSTANCE = "0b9f7c1e-3d2a-4e5f-8a6b-7c8d9e0f1a2b"


# --- a fake sysfs tree with the kernel's layout (like src/simhost.rs, much smaller) ---


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text if isinstance(text, bytes) else text.encode())


def _rel_link(root, at, to):
    """Creates root/at as a relative link to root/to, as the kernel's links are."""
    at_path = root / at
    at_path.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(os.path.relpath(root / to, at_path.parent), at_path)


def _config_space(vendor, device, cls, rev, sub_vendor, sub_device):
    c = bytearray(256)
    c[0:2] = vendor.to_bytes(2, "little")
    c[2:4] = device.to_bytes(2, "little")
    c[8] = rev
    c[9:12] = cls.to_bytes(3, "little")
    c[0x2C:0x2E] = sub_vendor.to_bytes(2, "little")
    c[0x2E:0x30] = sub_device.to_bytes(2, "little")
    return bytes(c)


def build_fake_sysfs(base):
    """Writes <base>/sys (one i40e PF with 4 iavf VFs on NUMA node 0, and an NVMe
    controller) and an empty <base>/dev; returns (sysfs_root, dev_root)."""
    root = base / "sys"
    dev = base / "dev"
    dev.mkdir(parents=True)
    for d in ("bus/pci/devices", "bus/pci/drivers", "kernel/iommu_groups"):
        (root / d).mkdir(parents=True)

    def device(addr, vendor, dev_id, cls, driver, group, numa, physfn=None):
        rel = Path("devices/pci0000:" + addr[5:7]) / addr
        d = root / rel
        sub_vendor, sub_device = vendor, 0x0000
        attrs = {
            "vendor": f"0x{vendor:04x}\n",
            "device": f"0x{dev_id:04x}\n",
            "subsystem_vendor": f"0x{sub_vendor:04x}\n",
            "subsystem_device": f"0x{sub_device:04x}\n",
            "class": f"0x{cls:06x}\n",
            "revision": "0x02\n",
            "numa_node": f"{numa}\n",
            "driver_override": "(null)\n",
            "enable": "1\n",
            "irq": "0\n",
            "uevent": f"DRIVER={driver}\nPCI_SLOT_NAME={addr}\n",
        }
        for name, text in attrs.items():
            _write(d / name, text)
        _write(d / "config", _config_space(vendor, dev_id, cls, 2, sub_vendor, sub_device))
        _rel_link(root, Path("bus/pci/devices") / addr, rel)
        drel = Path("bus/pci/drivers") / driver
        if not (root / drel).exists():
            for f in ("bind", "unbind", "new_id", "remove_id", "uevent"):
                _write(root / drel / f, "")
        _rel_link(root, rel / "driver", drel)
        _rel_link(root, drel / addr, rel)
        grel = Path("kernel/iommu_groups") / str(group)
        if not (root / grel).exists():
            (root / grel / "devices").mkdir(parents=True)
            _write(root / grel / "type", "DMA\n")
        _rel_link(root, rel / "iommu_group", grel)
        _rel_link(root, grel / "devices" / addr, rel)
        if physfn is not None:
            _rel_link(root, rel / "physfn", Path("devices/pci0000:3b") / physfn)
        return rel

    pf_rel = device(PF, 0x8086, 0x1572, 0x020000, "i40e", 20, 0)
    _write(root / pf_rel / "sriov_totalvfs", "64\n")
    _write(root / pf_rel / "sriov_numvfs", f"{len(VFS)}\n")
    _write(root / pf_rel / "sriov_drivers_autoprobe", "1\n")
    _write(root / pf_rel / "sriov_offset", "16\n")
    _write(root / pf_rel / "sriov_stride", "1\n")
    _write(root / pf_rel / "sriov_vf_device", "154c\n")
    (root / pf_rel / "net" / "ens1f0").mkdir(parents=True)
    for i, vf in enumerate(VFS):
        vf_rel = device(vf, 0x8086, 0x154C, 0x020000, "iavf", 21 + i, 0, physfn=PF)
        _rel_link(root, pf_rel / f"virtfn{i}", vf_rel)
    device(OTHER, 0x8086, 0x0953, 0x010802, "nvme", 5, -1)
    return root, dev


# --- stubs generated from proto/ at test time ---


@pytest.fixture(scope="session")
def pb():
    """The generated hostdev.v1 modules: (messages, grpc stubs)."""
    out = Path(tempfile.mkdtemp(prefix="hostdev-stubs-"))
    proto_dir = REPO / "proto"
    files = [str(p.relative_to(proto_dir)) for p in proto_dir.rglob("*.proto")]
    cmd = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"-I{proto_dir}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        *files,
    ]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, f"protoc failed: {' '.join(cmd)}\n{res.stderr}"
    sys.path.insert(0, str(out))
    try:
        msgs = importlib.import_module("hostdev.v1.hostdev_pb2")
        stubs = importlib.import_module("hostdev.v1.hostdev_pb2_grpc")
        yield msgs, stubs
    finally:
        sys.path.remove(str(out))
        shutil.rmtree(out, ignore_errors=True)


# --- the daemon ---


def _binary():
    b = Path(os.environ.get("HOSTDEVD_BIN", REPO / "target" / "debug" / "hostdevd"))
    if not b.is_file():
        pytest.fail(f"{b} is missing: build it with `cargo build --bins` (tests/python/run.sh does)")
    return b


def unix_channel(socket):
    """A channel to the agent's socket. grpcio (1.57 and later) sends the socket path as
    the HTTP/2 :authority, which the agent's HTTP/2 layer (h2) rejects as malformed with
    RST_STREAM(PROTOCOL_ERROR) on every call; "localhost" is the convention for Unix
    sockets (grpc-go, kubelet). Every grpcio client of hostdevd needs this option."""
    return grpc.insecure_channel(f"unix:{socket}", options=[("grpc.default_authority", "localhost")])


class Agent:
    def __init__(self, base):
        self.base = base
        self.sysfs, self.dev = build_fake_sysfs(base)
        self.state = base / "state"
        self.socket = base / "hostdevd.sock"
        self.log = base / "hostdevd.log"
        self.proc = None
        self.channel = None
        self.libvirt_uri = "test:///default"
        self.config = None  # a TOML file passed with --config, if set

    def start(self):
        self.log_file = open(self.log, "wb")
        self.proc = subprocess.Popen(
            [
                str(_binary()),
                "serve",
                "--sysfs-root", str(self.sysfs),
                "--dev-root", str(self.dev),
                "--state-dir", str(self.state),
                "--socket", str(self.socket),
                "--writer-uid", str(os.getuid()),
                # In-process test driver: no libvirtd; a test may name a host file.
                "--libvirt-uri", self.libvirt_uri,
                *(["--config", str(self.config)] if self.config else []),
            ],
            stdout=self.log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, "RUST_LOG": "info"},
        )
        deadline = time.monotonic() + 20
        while not self.socket.exists():
            if self.proc.poll() is not None:
                pytest.fail(f"hostdevd exited with {self.proc.returncode}:\n{self.log.read_text()}")
            if time.monotonic() > deadline:
                pytest.fail(f"hostdevd did not create {self.socket} in 20 s:\n{self.log.read_text()}")
            time.sleep(0.05)
        self.channel = unix_channel(self.socket)
        grpc.channel_ready_future(self.channel).result(timeout=10)

    def stop(self):
        if self.channel is not None:
            self.channel.close()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log_file.close()


@pytest.fixture
def agent():
    base = Path(tempfile.mkdtemp(prefix="hostdevd-py-"))
    a = Agent(base)
    try:
        a.start()
        yield a
    finally:
        a.stop()
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def stub(agent, pb):
    return pb[1].HostDevStub(agent.channel)


# --- helpers ---


def rpc_details(err):
    """The google.rpc.Status carried in the grpc-status-details-bin trailer."""
    for key, value in err.trailing_metadata() or ():
        if key == "grpc-status-details-bin":
            st = status_pb2.Status()
            st.ParseFromString(value)
            return st
    pytest.fail(f"no grpc-status-details-bin trailer on {err.code()}: {err.details()}")


def error_info(err):
    st = rpc_details(err)
    assert st.code == err.code().value[0], "trailer status code differs from the call's"
    for any_msg in st.details:
        info = error_details_pb2.ErrorInfo()
        if any_msg.Unpack(info):
            return info
    pytest.fail(f"no google.rpc.ErrorInfo in the details of {err.code()}: {err.details()}")


def detail_of(err, cls):
    for any_msg in rpc_details(err).details:
        m = cls()
        if any_msg.Unpack(m):
            return m
    return None


def devices_by_address(stub, msgs):
    r = stub.ListDevices(msgs.ListDevicesRequest(), timeout=10)
    return r, {d.address: d for d in r.devices}


def claim(stub, msgs, address, generation, owner=INSTANCE, label="instance-0000002a", request_id=None):
    return stub.Claim(
        msgs.ClaimRequest(
            owner=msgs.Owner(consumer_id=owner, label=label),
            request_id=request_id or str(uuid.uuid4()),
            address=msgs.ByAddress(address=address, expected_generation=generation),
        ),
        timeout=10,
    )


def release(stub, msgs, address, generation, owner=INSTANCE, request_id=None):
    return stub.Release(
        msgs.ReleaseRequest(
            address=address,
            owner=msgs.Owner(consumer_id=owner),
            request_id=request_id or str(uuid.uuid4()),
            generation=generation,
        ),
        timeout=10,
    )


# --- the tests ---


def test_list_shows_the_pf_tree(stub, pb):
    msgs, _ = pb
    r, devs = devices_by_address(stub, msgs)
    assert set(devs) == {PF, OTHER, *VFS}
    assert r.host_generation >= max(d.generation for d in r.devices)
    pf = devs[PF]
    assert list(pf.sriov.vfs) == VFS and pf.sriov.total_vfs == 64
    assert not pf.managed and pf.state == msgs.DEVICE_STATE_UNMANAGED
    for i, vf in enumerate(VFS):
        d = devs[vf]
        assert d.physfn == PF and d.vf_index == i
        assert d.managed and d.state == msgs.DEVICE_STATE_FREE
        assert (d.vendor_id, d.device_id, d.driver) == ("8086", "154c", "iavf")
        assert d.HasField("numa_node") and d.numa_node == 0
        assert d.iommu_group == 21 + i
    assert devs[OTHER].state == msgs.DEVICE_STATE_UNMANAGED


def test_claim_stale_audit_then_release(stub, pb):
    """The seed race: an audit that read the devices before the claim cannot free it."""
    msgs, _ = pb
    audit_view, devs = devices_by_address(stub, msgs)  # the audit's snapshot
    vf = VFS[1]
    listed = devs[vf].generation

    # nova-compute claims the VF for the instance with the generation it listed.
    rid = str(uuid.uuid4())
    c = claim(stub, msgs, vf, listed, request_id=rid)
    assert c.generation > listed and not c.replayed
    assert c.device.state == msgs.DEVICE_STATE_CLAIMED
    assert c.device.owner.consumer_id == INSTANCE and c.device.owner.label == "instance-0000002a"

    # A retry of the same request (timed-out client) replays the first answer.
    again = claim(stub, msgs, vf, listed, request_id=rid)
    assert again.replayed and again.generation == c.generation

    # The audit, acting on its stale snapshot, tries to free it: refused, nothing changes.
    with pytest.raises(grpc.RpcError) as e:
        release(stub, msgs, vf, devs[vf].generation)
    assert e.value.code() == grpc.StatusCode.ABORTED
    info = error_info(e.value)
    assert info.domain == "hostdev.v1" and info.reason == "STALE_GENERATION"
    assert info.metadata["current_generation"] == str(c.generation)
    assert info.metadata["owner_consumer_id"] == INSTANCE
    assert info.metadata["address"] == vf
    assert detail_of(e.value, error_details_pb2.PreconditionFailure) is not None
    now = stub.GetDevice(msgs.GetDeviceRequest(address=vf), timeout=10).device
    assert now.state == msgs.DEVICE_STATE_CLAIMED and now.generation == c.generation

    # Another consumer with the fresh generation still may not release it.
    with pytest.raises(grpc.RpcError) as e:
        release(stub, msgs, vf, c.generation, owner=OTHER_INSTANCE)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error_info(e.value).reason == "WRONG_OWNER"

    # The outcome of the claim is recorded for a client that lost its connection.
    o = stub.GetRequestOutcome(msgs.GetRequestOutcomeRequest(consumer_id=INSTANCE, request_id=rid), timeout=10)
    assert (o.operation, o.address, o.generation) == ("claimed", vf, c.generation)

    # The owner, with the fresh generation, releases it.
    r = release(stub, msgs, vf, c.generation)
    assert r.address == vf and r.generation > c.generation and not r.replayed
    _, devs = devices_by_address(stub, msgs)
    assert devs[vf].state == msgs.DEVICE_STATE_FREE and devs[vf].generation == r.generation
    assert audit_view.host_generation < r.generation


def test_claim_refusals_carry_details(stub, pb):
    msgs, _ = pb
    with pytest.raises(grpc.RpcError) as e:
        claim(stub, msgs, "0000:3b:02", 1)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    bad = detail_of(e.value, error_details_pb2.BadRequest)
    assert bad is not None and bad.field_violations[0].field == "address.address"

    with pytest.raises(grpc.RpcError) as e:
        stub.GetDevice(msgs.GetDeviceRequest(address="0000:99:00.0"), timeout=10)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    assert error_info(e.value).reason == "UNKNOWN_DEVICE"

    _, devs = devices_by_address(stub, msgs)
    with pytest.raises(grpc.RpcError) as e:
        claim(stub, msgs, PF, devs[PF].generation)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error_info(e.value).reason == "UNMANAGED"


def test_hardware_request_ids_are_checked_before_anything(stub, pb):
    """PrepareVfio's and SetVfCount's request ids, as grpcio sends them: a request id
    over 128 bytes, and SetVfCount's request id without the caller's consumer id, are
    refused INVALID_ARGUMENT naming the field, and nothing changes."""
    msgs, _ = pb
    before, devs = devices_by_address(stub, msgs)
    vf = next(a for a, d in devs.items() if d.physfn == PF)
    owner = msgs.Owner(consumer_id=str(uuid.uuid4()))
    with pytest.raises(grpc.RpcError) as e:
        stub.PrepareVfio(msgs.PrepareVfioRequest(address=vf, owner=owner, generation=devs[vf].generation,
                                                 request_id="r" * 129), timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    bad = detail_of(e.value, error_details_pb2.BadRequest)
    assert bad is not None and bad.field_violations[0].field == "request_id", e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        stub.SetVfCount(msgs.SetVfCountRequest(address=PF, vf_count=0, generation=devs[PF].generation,
                                               request_id="vfs-1"), timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    bad = detail_of(e.value, error_details_pb2.BadRequest)
    assert bad is not None and bad.field_violations[0].field == "consumer_id", e.value.details()
    after, devs_after = devices_by_address(stub, msgs)
    assert after.host_generation == before.host_generation
    assert {a: d.generation for a, d in devs_after.items()} == {a: d.generation for a, d in devs.items()}


def _collect(stream, n, timeout=10):
    """The first n events of a Watch stream (fails after timeout seconds)."""
    got, errors = [], []

    def run():
        try:
            for ev in stream:
                got.append(ev)
                if len(got) >= n:
                    return
        except grpc.RpcError as err:
            errors.append(err)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    stream.cancel()
    if errors and errors[0].code() != grpc.StatusCode.CANCELLED:
        raise errors[0]
    assert len(got) >= n, f"only {len(got)} of {n} watch events in {timeout} s: {got}"
    return got


def test_watch_sees_claim_and_release_and_resumes(stub, pb):
    msgs, _ = pb
    listed, devs = devices_by_address(stub, msgs)
    vf = VFS[2]
    stream = stub.Watch(msgs.WatchRequest(from_generation=listed.host_generation), timeout=30)
    c = claim(stub, msgs, vf, devs[vf].generation)
    r = release(stub, msgs, vf, c.generation)
    # Each change also re-reports the PF, whose derived state follows its VFs' claims
    # (unavailable while a VF is claimed); every event has a generation of its own, the
    # PF's right after the change that caused it (its record's generation is unchanged).
    evs = _collect(stream, 4)
    assert all(e.kind == msgs.WATCH_EVENT_KIND_CHANGED for e in evs)
    assert [(e.address, e.generation) for e in evs] == [
        (vf, c.generation),
        (PF, c.generation + 1),
        (vf, r.generation),
        (PF, r.generation + 1),
    ]
    claimed, blocked_pf, freed, unblocked_pf = (e.device for e in evs)
    assert claimed.state == msgs.DEVICE_STATE_CLAIMED and claimed.generation == c.generation
    assert claimed.owner.consumer_id == INSTANCE
    assert blocked_pf.state == msgs.DEVICE_STATE_UNAVAILABLE
    assert (blocked_pf.blocker.address, blocked_pf.blocker.relation) == (vf, "virtual_function")
    assert blocked_pf.generation == unblocked_pf.generation == devs[PF].generation
    assert freed.state == msgs.DEVICE_STATE_FREE and freed.generation == r.generation
    assert not freed.HasField("owner")
    assert unblocked_pf.state == msgs.DEVICE_STATE_UNMANAGED

    # Resuming from any event replays exactly the ones after it.
    for k, e in enumerate(evs[:-1]):
        rest = _collect(stub.Watch(msgs.WatchRequest(from_generation=e.generation), timeout=30), 3 - k)
        assert [(x.address, x.generation) for x in rest] == [
            (x.address, x.generation) for x in evs[k + 1 :]
        ]

    # A snapshot: one event per device at the snapshot's generation (each device's own
    # in the device), then the end marker at the host generation.
    snap = _collect(stub.Watch(msgs.WatchRequest(snapshot=True), timeout=30), len(devs) + 1)
    assert all(e.kind == msgs.WATCH_EVENT_KIND_SNAPSHOT for e in snap[:-1])
    assert {e.address for e in snap[:-1]} == set(devs)
    assert all(e.generation == r.generation + 1 for e in snap)
    assert snap[-1].kind == msgs.WATCH_EVENT_KIND_SNAPSHOT_END

    # A generation from the future cannot be resumed: re-list.
    with pytest.raises(grpc.RpcError) as e:
        next(iter(stub.Watch(msgs.WatchRequest(from_generation=r.generation + 1000), timeout=10)))
    assert e.value.code() == grpc.StatusCode.OUT_OF_RANGE
    assert error_info(e.value).reason == "WATCH_TOO_OLD"


def test_reconcile_dry_run_reports_orphan(stub, pb):
    msgs, _ = pb
    _, devs = devices_by_address(stub, msgs)
    mine = claim(stub, msgs, VFS[0], devs[VFS[0]].generation)
    leaked = claim(stub, msgs, VFS[3], devs[VFS[3]].generation, owner=OTHER_INSTANCE, label="instance-0000002b")
    snapshot, _ = devices_by_address(stub, msgs)

    rep = stub.Reconcile(
        msgs.ReconcileRequest(
            expected_consumer_ids=[INSTANCE],
            snapshot_generation=snapshot.host_generation,
            request_id=str(uuid.uuid4()),
        ),
        timeout=10,
    )
    assert not rep.acted
    assert [o.device.address for o in rep.orphans] == [VFS[3]]
    orphan = rep.orphans[0]
    assert orphan.device.owner.consumer_id == OTHER_INSTANCE
    assert orphan.freed_generation == 0 and orphan.kept_because == ""
    assert not rep.changed and not rep.lost and not rep.strays

    # An audit whose snapshot predates the leaked claim must not treat it as an orphan.
    old = stub.Reconcile(
        msgs.ReconcileRequest(expected_consumer_ids=[INSTANCE], snapshot_generation=mine.generation),
        timeout=10,
    )
    assert not old.orphans
    assert [d.address for d in old.changed] == [VFS[3]]

    # A dry run changes nothing.
    now = stub.GetDevice(msgs.GetDeviceRequest(address=VFS[3]), timeout=10).device
    assert now.state == msgs.DEVICE_STATE_CLAIMED and now.generation == leaked.generation


def test_health_and_reflection(agent, pb):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2

    health = health_pb2_grpc.HealthStub(agent.channel)
    for service in ("", "hostdev.v1.HostDev"):
        r = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        assert r.status == health_pb2.HealthCheckResponse.SERVING, f"health of {service!r}: {r}"

    # Both reflection versions (grpcurl 1.8 speaks only v1alpha); the messages of v1 are
    # wire-identical to v1alpha's, so the v1alpha classes serve for both.
    for version in ("v1alpha", "v1"):
        call = agent.channel.stream_stream(
            f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )
        requests = [
            reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol="hostdev.v1.HostDev"),
        ]
        listed, described = list(call(iter(requests), timeout=10))
        names = {s.name for s in listed.list_services_response.service}
        assert {"hostdev.v1.HostDev", "grpc.health.v1.Health"} <= names, f"{version}: {names}"
        files = [descriptor_pb2.FileDescriptorProto.FromString(b) for b in described.file_descriptor_response.file_descriptor_proto]
        hostdev = [f for f in files if f.package == "hostdev.v1"]
        assert hostdev and "HostDev" in {svc.name for svc in hostdev[0].service}, f"{version}: {files}"


def test_evacuated_instance_running_here_is_never_freed(pb):
    """The seed race end to end: the evacuated instance's domain already runs on this
    host (a libvirt test-driver host file) while the audit, with a fresh snapshot but an
    owner list assembled from stale reads, reconciles with act=true. Nothing is freed,
    and the report names the domain."""
    msgs, stubs = pb
    base = Path(tempfile.mkdtemp(prefix="hostdevd-py-"))
    vf = VFS[1]
    bus, slot_fn = vf[5:7], vf[8:]
    slot, fn = slot_fn.split(".")
    host_xml = base / "host.xml"
    host_xml.write_text(
        "<node xmlns:test='http://libvirt.org/schemas/domain/test/1.0'>"
        "<domain type='test'><name>instance-0000002a</name>"
        f"<uuid>{INSTANCE}</uuid><memory>1048576</memory><os><type>hvm</type></os><devices>"
        "<interface type='hostdev' managed='yes'><source>"
        f"<address type='pci' domain='0x0000' bus='0x{bus}' slot='0x{slot}' function='0x{fn}'/>"
        "</source></interface></devices></domain></node>"
    )
    a = Agent(base)
    a.libvirt_uri = f"test://{host_xml}"
    try:
        a.start()
        stub = stubs.HostDevStub(a.channel)
        # The evacuation claimed the VF for the instance on this (destination) host.
        _, devs = devices_by_address(stub, msgs)
        c = claim(stub, msgs, vf, devs[vf].generation)
        assert c.device.state == msgs.DEVICE_STATE_ATTACHED
        assert c.device.attached_domain.name == "instance-0000002a"
        assert c.device.attached_domain.running

        # The audit: a fresh snapshot, but the instance is in neither list it read.
        snapshot, _ = devices_by_address(stub, msgs)
        rep = stub.Reconcile(
            msgs.ReconcileRequest(
                expected_consumer_ids=[OTHER_INSTANCE],
                snapshot_generation=snapshot.host_generation,
                act=True,
                request_id=str(uuid.uuid4()),
            ),
            timeout=10,
        )
        assert rep.acted
        assert not rep.orphans, rep
        assert [d.address for d in rep.protected] == [vf]
        assert rep.protections[0].domain.name == "instance-0000002a"
        assert "instance-0000002a" in rep.protections[0].reason
        now = stub.GetDevice(msgs.GetDeviceRequest(address=vf), timeout=10).device
        assert now.state == msgs.DEVICE_STATE_ATTACHED and now.generation == c.generation

        # Even a Release with the current generation is refused, naming the domain.
        with pytest.raises(grpc.RpcError) as e:
            release(stub, msgs, vf, c.generation)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        info = error_info(e.value)
        assert info.reason == "ATTACHED" and info.metadata["domain_name"] == "instance-0000002a"
    finally:
        a.stop()
        shutil.rmtree(base, ignore_errors=True)


def test_a_connection_over_the_uid_cap_is_told_why(pb):
    """A compute manager that leaks channels reaches [api] max_connections_per_uid: a
    call on one more channel fails RESOURCE_EXHAUSTED with ErrorInfo
    TOO_MANY_CONNECTIONS naming the setting, not with a bare connection error, and the
    channel it holds goes on working."""
    msgs, stubs = pb
    base = Path(tempfile.mkdtemp(prefix="hostdevd-py-"))
    a = Agent(base)
    a.config = base / "hostdevd.toml"
    a.config.write_text("[api]\nmax_connections_per_uid = 1\n")
    try:
        a.start()
        held = stubs.HostDevStub(a.channel)
        held.GetStatus(msgs.GetStatusRequest(), timeout=10)
        # grpcio shares one connection among a process's channels to the same target
        # unless a channel keeps a pool of its own: this one makes a connection of its own.
        extra = grpc.insecure_channel(
            f"unix:{a.socket}",
            options=[("grpc.default_authority", "localhost"), ("grpc.use_local_subchannel_pool", 1)],
        )
        try:
            with pytest.raises(grpc.RpcError) as refused:
                stubs.HostDevStub(extra).GetStatus(msgs.GetStatusRequest(), timeout=10)
        finally:
            extra.close()
        err = refused.value
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, f"{err.code()}: {err.details()}"
        assert "max_connections_per_uid" in err.details(), err.details()
        info = error_info(err)
        assert info.reason == "TOO_MANY_CONNECTIONS", info
        assert info.metadata["max_connections_per_uid"] == "1", info
        assert info.metadata["uid"] == str(os.getuid()), info
        held.GetStatus(msgs.GetStatusRequest(), timeout=10)
    finally:
        a.stop()
        shutil.rmtree(base, ignore_errors=True)
