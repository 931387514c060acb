//! Domain XML → the host PCI addresses a domain references: `<hostdev mode='subsystem'
//! type='pci'>` sources and `<interface type='hostdev'>` sources (also an interface's
//! `<actual type='hostdev'>`, which is how a network of hostdev pool forwards shows up);
//! and what names a PCI function only through sysfs: the host network interfaces of
//! `<interface type='direct'>` sources (macvtap, in passthrough mode on a VF's
//! interface; also as an `<actual type='direct'>`), the mediated devices of `<hostdev
//! type='mdev'>` sources (a vGPU or another slice of a PCI function, by UUID), and the
//! vhost-vdpa character devices of `<interface type='vdpa'>` and `<disk
//! type='vhostvdpa'>` sources (a vDPA device, usually on a VF). An NVMe disk (`<disk
//! type='nvme'>`, whose `<source type='pci'>` names the controller) is a PCI address
//! too: libvirt binds that controller to vfio-pci for the guest.
//!
//! Pure: text in, addresses out. The guest-side `<address type='pci'>` that is a direct
//! child of `<hostdev>` or `<interface>` is where the device appears *inside* the VM and
//! is deliberately ignored; only `<source><address>` names a host device.

use roxmltree::{Document, Node};

use crate::pci::PciAddress;

/// Why a domain's XML could not be read.
#[derive(Debug, thiserror::Error)]
pub enum XmlError {
    #[error("the domain XML is not well-formed: {0}")]
    Syntax(#[from] roxmltree::Error),
    #[error("the domain XML's root is <{0}>, not <domain>")]
    NotDomain(String),
    #[error("a host PCI source address has {attr}={value:?}: {reason}")]
    BadAddress {
        attr: &'static str,
        value: String,
        reason: &'static str,
    },
}

/// What a domain's XML references on the host.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct References {
    /// Host PCI addresses, sorted, without duplicates.
    pub addresses: Vec<PciAddress>,
    /// Host network interfaces of `direct` interfaces, by name, sorted, without
    /// duplicates.
    pub netdevs: Vec<String>,
    /// Mediated devices of `mdev` hostdevs, by UUID as written, sorted, without
    /// duplicates.
    pub mdevs: Vec<String>,
    /// vhost-vdpa character devices of `vdpa` interfaces and `vhostvdpa` disks, by path
    /// as written, sorted, without duplicates.
    pub vdpa: Vec<String>,
}

/// Every host PCI address and host network interface the domain XML references.
pub fn references(xml: &str) -> Result<References, XmlError> {
    let doc = Document::parse(xml)?;
    let root = doc.root_element();
    if root.tag_name().name() != "domain" {
        return Err(XmlError::NotDomain(root.tag_name().name().to_string()));
    }
    let mut out = Vec::new();
    let mut netdevs = Vec::new();
    let mut mdevs = Vec::new();
    let mut vdpa = Vec::new();
    for devices in root.children().filter(|n| is(n, "devices")) {
        for dev in devices.children().filter(Node::is_element) {
            let kind = attr(&dev, "type");
            match dev.tag_name().name() {
                "hostdev" if kind == Some("mdev") => {
                    for source in children(&dev, "source") {
                        for a in children(&source, "address") {
                            if let Some(uuid) = attr(&a, "uuid") {
                                mdevs.push(uuid.to_string());
                            }
                        }
                    }
                }
                "interface" | "disk" if kind == Some("vdpa") || kind == Some("vhostvdpa") => {
                    for source in children(&dev, "source") {
                        if let Some(path) = attr(&source, "dev") {
                            vdpa.push(path.to_string());
                        }
                    }
                }
                _ => {}
            }
            if dev.tag_name().name() == "interface" {
                let direct = std::iter::once(dev)
                    .chain(children(&dev, "actual"))
                    .filter(|i| attr(i, "type") == Some("direct"));
                for i in direct {
                    for source in children(&i, "source") {
                        if let Some(name) = attr(&source, "dev") {
                            netdevs.push(name.to_string());
                        }
                    }
                }
            }
            let sources: Vec<Node> = match dev.tag_name().name() {
                "hostdev" if attr(&dev, "mode") != Some("capabilities") => {
                    // mode defaults to subsystem; only type pci names a PCI function.
                    if attr(&dev, "type") == Some("pci") {
                        children(&dev, "source")
                    } else {
                        Vec::new()
                    }
                }
                "interface" => {
                    let mut s = Vec::new();
                    if attr(&dev, "type") == Some("hostdev") {
                        s.extend(children(&dev, "source"));
                    }
                    for actual in children(&dev, "actual") {
                        if attr(&actual, "type") == Some("hostdev") {
                            s.extend(children(&actual, "source"));
                        }
                    }
                    s
                }
                // An NVMe disk that libvirt detaches from the host and hands to the guest
                // through vfio-pci itself (`<source type='pci'>`, the controller's address).
                "disk" if kind == Some("nvme") => children(&dev, "source")
                    .into_iter()
                    .filter(|s| attr(s, "type").is_none_or(|t| t == "pci"))
                    .collect(),
                _ => Vec::new(),
            };
            for source in sources {
                for a in children(&source, "address") {
                    // An interface source's address says type='pci'; a hostdev's may
                    // omit it. Any other type (usb, ...) is not a PCI function.
                    if attr(&a, "type").is_some_and(|t| t != "pci") {
                        continue;
                    }
                    out.push(address(&a)?);
                }
            }
        }
    }
    out.sort();
    out.dedup();
    for names in [&mut netdevs, &mut mdevs, &mut vdpa] {
        names.sort();
        names.dedup();
    }
    Ok(References {
        addresses: out,
        netdevs,
        mdevs,
        vdpa,
    })
}

fn is(n: &Node, name: &str) -> bool {
    n.is_element() && n.tag_name().name() == name
}

fn attr<'a>(n: &Node<'a, '_>, name: &str) -> Option<&'a str> {
    n.attribute(name)
}

fn children<'a, 'i>(n: &Node<'a, 'i>, name: &str) -> Vec<Node<'a, 'i>> {
    n.children().filter(|c| is(c, name)).collect()
}

fn address(a: &Node) -> Result<PciAddress, XmlError> {
    let domain = match attr(a, "domain") {
        Some(v) => number("domain", v, u64::from(u32::MAX))?,
        None => 0,
    };
    let required = |name: &'static str, max: u64| -> Result<u64, XmlError> {
        let v = attr(a, name).ok_or(XmlError::BadAddress {
            attr: name,
            value: String::new(),
            reason: "the attribute is missing",
        })?;
        number(name, v, max)
    };
    let bus = required("bus", 0xff)?;
    let slot = required("slot", 0x1f)?;
    let function = required("function", 7)?;
    // Each value was bounded above, so the narrowing conversions are exact.
    PciAddress::new(domain as u32, bus as u8, slot as u8, function as u8).ok_or(
        XmlError::BadAddress {
            attr: "slot",
            value: slot.to_string(),
            reason: "out of range",
        },
    )
}

/// libvirt reads these attributes like strtoul with base 0: "0x" hex, a leading "0"
/// octal, otherwise decimal.
fn number(attr: &'static str, v: &str, max: u64) -> Result<u64, XmlError> {
    let bad = |reason| XmlError::BadAddress {
        attr,
        value: v.to_string(),
        reason,
    };
    let t = v.trim();
    let parsed = if let Some(h) = t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")) {
        u64::from_str_radix(h, 16)
    } else if t.len() > 1 && t.starts_with('0') {
        u64::from_str_radix(&t[1..], 8)
    } else {
        t.parse::<u64>()
    };
    let n = parsed.map_err(|_| bad("not a number"))?;
    if n > max {
        return Err(bad("out of range"));
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The host PCI addresses the XML names itself (not through sysfs).
    fn pci_addresses(xml: &str) -> Result<Vec<PciAddress>, XmlError> {
        references(xml).map(|r| r.addresses)
    }

    fn a(s: &str) -> PciAddress {
        s.parse().expect("address")
    }

    #[test]
    fn hostdevs_and_hostdev_interfaces() {
        let xml = r#"<domain type='kvm'>
  <name>instance-0000002a</name>
  <devices>
    <hostdev mode='subsystem' type='pci' managed='yes'>
      <driver name='vfio'/>
      <source><address domain='0x0000' bus='0x3b' slot='0x02' function='0x1'/></source>
      <address type='pci' domain='0x0000' bus='0x00' slot='0x05' function='0x0'/>
    </hostdev>
    <interface type='hostdev' managed='yes'>
      <mac address='52:54:00:6d:90:02'/>
      <source><address type='pci' domain='0x0000' bus='0x86' slot='0x10' function='0x2'/></source>
      <address type='pci' domain='0x0000' bus='0x00' slot='0x06' function='0x0'/>
    </interface>
    <interface type='network'>
      <source network='hostdev-pool'/>
      <actual type='hostdev'>
        <source><address type='pci' domain='0x0000' bus='0x86' slot='0x10' function='0x3'/></source>
      </actual>
    </interface>
    <interface type='bridge'><source bridge='br0'/></interface>
    <hostdev mode='subsystem' type='usb'>
      <source><vendor id='0x1234'/><product id='0xbeef'/><address bus='1' device='2'/></source>
    </hostdev>
    <hostdev mode='subsystem' type='mdev' model='vfio-pci'>
      <source><address uuid='c2177883-f1bb-47f0-914d-32a22e3a8804'/></source>
    </hostdev>
    <hostdev type='pci'>
      <source><address bus='59' slot='2' function='1'/></source>
    </hostdev>
    <disk type='file'><source file='/x'/><address type='pci' bus='0x3b' slot='0x02' function='0x7'/></disk>
  </devices>
</domain>"#;
        assert_eq!(
            pci_addresses(xml).expect("parse"),
            vec![a("0000:3b:02.1"), a("0000:86:10.2"), a("0000:86:10.3")]
        );
    }

    /// macvtap on a host interface, directly or as a network's actual interface: the
    /// interface's name, which sysfs turns into the PCI function it is on. A bridge, a
    /// network without a direct actual interface and a guest-side address name none.
    #[test]
    fn direct_interfaces_name_host_interfaces() {
        let xml = r#"<domain type='kvm'><devices>
    <interface type='direct'>
      <mac address='52:54:00:6d:90:04'/>
      <source dev='ens1f0v3' mode='passthrough'/>
      <address type='pci' domain='0x0000' bus='0x00' slot='0x07' function='0x0'/>
    </interface>
    <interface type='network'>
      <source network='macvtap-pool'/>
      <actual type='direct'><source dev='ens1f0v5' mode='passthrough'/></actual>
    </interface>
    <interface type='direct'><source dev='ens1f0v3' mode='vepa'/></interface>
    <interface type='network'><source network='default'/></interface>
    <interface type='bridge'><source bridge='br0'/></interface>
  </devices></domain>"#;
        let r = references(xml).expect("parse");
        assert_eq!(r.netdevs, vec!["ens1f0v3", "ens1f0v5"]);
        assert!(r.addresses.is_empty(), "{r:?}");
    }

    /// A mediated device (a vGPU) by its UUID, and vDPA devices by their vhost-vdpa
    /// character device, as an interface and as a disk: each names a PCI function only
    /// through sysfs. An s390 mdev is read the same (sysfs finds no PCI function for it).
    #[test]
    fn mdev_and_vdpa_sources_are_named() {
        let xml = r#"<domain type='kvm'><devices>
    <hostdev mode='subsystem' type='mdev' model='vfio-pci' display='on'>
      <source><address uuid='c2177883-f1bb-47f0-914d-32a22e3a8804'/></source>
      <address type='pci' domain='0x0000' bus='0x00' slot='0x05' function='0x0'/>
    </hostdev>
    <hostdev mode='subsystem' type='mdev' model='vfio-ccw'>
      <source><address uuid='90c6c135-ad44-41d0-b1b7-bae47de48627'/></source>
    </hostdev>
    <interface type='vdpa'>
      <mac address='52:54:00:11:22:33'/>
      <source dev='/dev/vhost-vdpa-0'/>
    </interface>
    <disk type='vhostvdpa' device='disk'>
      <driver name='qemu' type='raw' cache='none' io='threads'/>
      <source dev='/dev/vhost-vdpa-1'/>
      <target dev='vdb' bus='virtio'/>
    </disk>
    <disk type='block' device='disk'><source dev='/dev/sdb'/><target dev='vdc'/></disk>
  </devices></domain>"#;
        let r = references(xml).expect("parse");
        assert_eq!(
            r.mdevs,
            vec![
                "90c6c135-ad44-41d0-b1b7-bae47de48627",
                "c2177883-f1bb-47f0-914d-32a22e3a8804"
            ]
        );
        assert_eq!(r.vdpa, vec!["/dev/vhost-vdpa-0", "/dev/vhost-vdpa-1"]);
        assert!(r.addresses.is_empty() && r.netdevs.is_empty(), "{r:?}");
    }

    /// An NVMe disk names its controller by host PCI address (libvirt binds it to
    /// vfio-pci for the guest); the disk's guest-side address and other disks do not.
    #[test]
    fn nvme_disks_name_their_controller() {
        let xml = r#"<domain type='kvm'><devices>
    <disk type='nvme' device='disk'>
      <driver name='qemu' type='raw'/>
      <source type='pci' managed='yes' namespace='1'>
        <address domain='0x0000' bus='0x01' slot='0x00' function='0x0'/>
      </source>
      <target dev='vde' bus='virtio'/>
      <address type='pci' domain='0x0000' bus='0x00' slot='0x09' function='0x0'/>
    </disk>
    <disk type='nvme' device='disk'>
      <source type='pci' managed='no' namespace='2'>
        <address domain='0x0001' bus='0x5e' slot='0x00' function='0x0'/>
      </source>
    </disk>
    <disk type='file'><source file='/x'/><address type='pci' bus='0x3b' slot='0x02' function='0x7'/></disk>
  </devices></domain>"#;
        assert_eq!(
            pci_addresses(xml).expect("parse"),
            vec![a("0000:01:00.0"), a("0001:5e:00.0")]
        );
    }

    #[test]
    fn numbers_like_libvirt() {
        assert_eq!(number("bus", "0x3b", 0xff).expect("hex"), 0x3b);
        assert_eq!(number("bus", "59", 0xff).expect("dec"), 59);
        assert_eq!(number("bus", "073", 0xff).expect("oct"), 0o73);
        assert_eq!(number("bus", "0", 0xff).expect("zero"), 0);
        assert!(number("bus", "0x100", 0xff).is_err());
        assert!(number("bus", "zz", 0xff).is_err());
        let xml = "<domain><devices><hostdev mode='subsystem' type='pci'><source><address domain='0x10000' bus='0xe1' slot='0x00' function='0x0'/></source></hostdev></devices></domain>";
        assert_eq!(pci_addresses(xml).expect("vmd"), vec![a("10000:e1:00.0")]);
    }

    #[test]
    fn refusals_name_the_problem() {
        assert!(matches!(
            pci_addresses("<domain>"),
            Err(XmlError::Syntax(_))
        ));
        assert!(matches!(
            pci_addresses("<network/>"),
            Err(XmlError::NotDomain(n)) if n == "network"
        ));
        let xml = "<domain><devices><hostdev mode='subsystem' type='pci'><source><address bus='0x3b' slot='0x20' function='0x0'/></source></hostdev></devices></domain>";
        let e = pci_addresses(xml).expect_err("slot too big");
        assert!(e.to_string().contains("slot"), "{e}");
        let xml = "<domain><devices><interface type='hostdev'><source><address type='pci' slot='0x02' function='0x0'/></source></interface></devices></domain>";
        let e = pci_addresses(xml).expect_err("no bus");
        assert!(e.to_string().contains("bus"), "{e}");
        assert!(pci_addresses("<domain><name>x</name></domain>")
            .expect("no devices")
            .is_empty());
    }
}
