//! The demo: a simulated hypervisor (two SR-IOV NICs with VFs on two NUMA nodes, plus
//! plain devices) in a temporary directory, and the configuration to run the real agent
//! on it.

use std::path::{Path, PathBuf};

use crate::config::Config;
use crate::simhost::{FakeSys, FakeTree};

/// A simulated host and the agent configuration that points at it.
#[derive(Debug)]
pub struct Demo {
    pub tree: FakeTree,
    pub config: Config,
    pub socket: PathBuf,
}

/// The PFs of the simulated host: address, netdev, NUMA node, physical network.
pub const DEMO_PFS: [(&str, &str, i32, &str); 2] = [
    ("0000:3b:00.0", "ens1f0", 0, "physnet1"),
    ("0000:86:00.0", "ens2f0", 1, "physnet2"),
];

/// Builds the simulated host under `base` with `vfs` VFs per PF.
pub fn build(base: &Path, vfs: u32) -> Demo {
    let mut f = FakeSys::new();
    for (group, (pf, netdev, node, _)) in (10u32..).zip(DEMO_PFS) {
        f.pf(pf, 0x8086, 0x1572, 64, vfs)
            .driver(pf, "i40e")
            .netdev(pf, netdev)
            .numa(pf, node)
            .iommu_group(pf, group)
            .vf_driver(pf, "iavf")
            .vf_iommu_groups(pf, group * 10);
        for vf in f.vfs(pf) {
            f.numa(&vf.to_string(), node);
        }
    }
    f.device("0000:00:1f.0", 0x8086, 0xa1c8)
        .class("0000:00:1f.0", 0x060100);
    f.device("0000:5e:00.0", 0x144d, 0xa808)
        .class("0000:5e:00.0", 0x010802)
        .driver("0000:5e:00.0", "nvme")
        .iommu_group("0000:5e:00.0", 40)
        .numa("0000:5e:00.0", 0);
    let tree = f.build_in(base);
    let socket = base.join("hostdevd.sock");
    let mut config = Config {
        sysfs_root: tree.sysfs_root().to_path_buf(),
        dev_root: tree.dev_root().to_path_buf(),
        proc_root: tree.sysfs_root().join("no-proc"),
        state_dir: base.join("state"),
        ..Config::default()
    };
    config.api.socket = socket.clone();
    // The test driver runs in-process: an empty host (its one sample domain references
    // no PCI device), so the demo needs no libvirtd.
    config.libvirt.uri = "test:///default".into();
    config.api.socket_mode = "0600".into();
    config.api.writer_uids = vec![nix::unistd::getuid().as_raw()];
    config.devices = DEMO_PFS
        .iter()
        .map(|(_, netdev, _, physnet)| crate::config::DeviceSpec {
            pf_name: Some((*netdev).to_string()),
            vf: Some(true),
            physnets: vec![(*physnet).to_string()],
            ..Default::default()
        })
        .collect();
    Demo {
        tree,
        config,
        socket,
    }
}
