//! Kernel uevents for the PCI subsystem (and for the network interfaces of PCI
//! functions): the netlink socket, message parsing, and the listener thread that turns events into "rescan these devices" or, after an overflow
//! or a lost socket, "rescan everything".
//!
//! The socket is opened before the first scan, so no change between that scan and the
//! listener's start can be missed: the kernel queues events for an open socket.

use std::os::fd::{AsRawFd, OwnedFd};
use std::time::Duration;

use nix::errno::Errno;
use nix::sys::socket::{
    bind, recv, setsockopt, socket, sockopt, AddressFamily, MsgFlags, NetlinkAddr, SockFlag,
    SockProtocol, SockType,
};
use tokio::sync::mpsc;

use crate::pci::PciAddress;

/// The kernel's uevent multicast group (udev's rebroadcast is group 2, which is ignored).
const KERNEL_GROUP: u32 = 1;

/// The largest uevent message the kernel sends (UEVENT_BUFFER_SIZE is 2048).
const MAX_MESSAGE: usize = 8192;

/// One PCI uevent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Uevent {
    /// "add", "remove", "bind", "unbind", "change", "move", ...
    pub action: String,
    pub devpath: String,
    /// The device the event names (`PCI_SLOT_NAME`, else the devpath's last component).
    pub address: PciAddress,
    /// The PCI function itself was removed (a `remove` of the pci subsystem; a network
    /// interface's `remove` is not one). Whatever is found at its address afterwards is
    /// another device, even with the same IDs: its claim must not carry over.
    pub removal: bool,
    /// The kernel's sequence number of the event (`SEQNUM`), if it sent one.
    pub seqnum: Option<u64>,
}

/// What the listener hands to the agent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Notice {
    /// A device changed: rescan it and its PF/VF relatives.
    Device(Uevent),
    /// Events were lost (ENOBUFS, or the socket failed and is open again): rescan
    /// everything.
    Resync(String),
    /// The socket failed: no event is received until it is reopened (tried with backoff;
    /// a [`Notice::Resync`] follows once it is).
    Down(String),
}

/// Parses one uevent message: `ACTION@DEVPATH\0KEY=VALUE\0...` from the kernel.
/// `None` for anything else (udev's "libudev" rebroadcasts, other subsystems, garbage).
pub fn parse(msg: &[u8]) -> Option<Uevent> {
    let mut fields = msg.split(|b| *b == 0);
    let header = std::str::from_utf8(fields.next()?).ok()?;
    let (_, header_path) = header.split_once('@')?;
    let mut action = None;
    let mut devpath = None;
    let mut subsystem = None;
    let mut slot = None;
    let mut seqnum = None;
    for f in fields {
        let Ok(f) = std::str::from_utf8(f) else {
            continue;
        };
        if let Some((k, v)) = f.split_once('=') {
            match k {
                "ACTION" => action = Some(v),
                "DEVPATH" => devpath = Some(v),
                "SUBSYSTEM" => subsystem = Some(v),
                "PCI_SLOT_NAME" => slot = Some(v),
                "SEQNUM" => seqnum = v.parse().ok(),
                _ => {}
            }
        }
    }
    let devpath = devpath.unwrap_or(header_path);
    let name = match subsystem {
        Some("pci") => slot.unwrap_or_else(|| devpath.rsplit('/').next().unwrap_or("")),
        // A PCI function's network interface added, removed or renamed ("move": udev
        // renaming eth0 to ens1f0 after the function's own events were read): its
        // netdev names, and its VFs' PF names that device specs match on, changed.
        // The function is the path component before `/net/`; a virtual interface has
        // none.
        Some("net") => devpath
            .rsplit_once("/net/")
            .and_then(|(parent, _)| parent.rsplit('/').next())
            .unwrap_or(""),
        _ => return None,
    };
    let address = name.parse::<PciAddress>().ok()?;
    let action = action?;
    Some(Uevent {
        removal: subsystem == Some("pci") && action == "remove",
        seqnum,
        action: action.to_string(),
        devpath: devpath.to_string(),
        address,
    })
}

/// An open uevent socket.
#[derive(Debug)]
pub struct UeventSocket {
    fd: OwnedFd,
}

impl UeventSocket {
    /// Opens and binds a socket on the kernel's uevent group, asking for a receive buffer
    /// of `rcvbuf` bytes (forced past the system limit where the agent may).
    pub fn open(rcvbuf: usize) -> std::io::Result<Self> {
        let fd = socket(
            AddressFamily::Netlink,
            SockType::Datagram,
            SockFlag::SOCK_CLOEXEC,
            SockProtocol::NetlinkKObjectUEvent,
        )?;
        if setsockopt(&fd, sockopt::RcvBufForce, &rcvbuf).is_err() {
            setsockopt(&fd, sockopt::RcvBuf, &rcvbuf)?;
        }
        bind(fd.as_raw_fd(), &NetlinkAddr::new(0, KERNEL_GROUP))?;
        // A receive timeout lets the thread notice that the agent has gone away.
        setsockopt(
            &fd,
            sockopt::ReceiveTimeout,
            &nix::sys::time::TimeVal::new(1, 0),
        )?;
        Ok(Self { fd })
    }
}

/// Where the listener receives uevent messages from: the netlink socket, or in tests a
/// script of messages and failures.
trait Receive {
    /// Receives one message: `Ok(None)` on timeout, `Err(ENOBUFS)` after an overflow.
    fn recv(&self, buf: &mut [u8]) -> Result<Option<usize>, Errno>;
}

impl Receive for UeventSocket {
    fn recv(&self, buf: &mut [u8]) -> Result<Option<usize>, Errno> {
        match recv(self.fd.as_raw_fd(), buf, MsgFlags::empty()) {
            Ok(n) => Ok(Some(n)),
            Err(Errno::EAGAIN) | Err(Errno::EINTR) => Ok(None),
            Err(e) => Err(e),
        }
    }
}

/// Runs the listener on its own thread: PCI events and resync notices go to `tx`. On a
/// socket error other than an overflow it reopens the socket (with backoff) and asks for
/// a resync. Ends when the receiver is dropped.
pub fn spawn(
    socket: UeventSocket,
    rcvbuf: usize,
    tx: mpsc::UnboundedSender<Notice>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name("hostdevd-uevents".into())
        .spawn(move || listen(socket, || UeventSocket::open(rcvbuf), tx))
}

/// The listener's loop: receives from `socket`, and after a failure other than an
/// overflow says so ([`Notice::Down`]) and opens another with `reopen`.
fn listen<S: Receive>(
    mut socket: S,
    mut reopen: impl FnMut() -> std::io::Result<S>,
    tx: mpsc::UnboundedSender<Notice>,
) {
    let mut buf = vec![0u8; MAX_MESSAGE];
    loop {
        if tx.is_closed() {
            return;
        }
        match socket.recv(&mut buf) {
            Ok(None) => {}
            Ok(Some(n)) => {
                if let Some(ev) = buf.get(..n).and_then(parse) {
                    if tx.send(Notice::Device(ev)).is_err() {
                        return;
                    }
                }
            }
            Err(Errno::ENOBUFS) => {
                let _ = tx.send(Notice::Resync(
                    "the uevent socket overflowed (ENOBUFS): events were lost".into(),
                ));
            }
            Err(e) => {
                let _ = tx.send(Notice::Down(format!("the uevent socket failed: {e}")));
                let mut delay = Duration::from_millis(100);
                socket = loop {
                    std::thread::sleep(delay);
                    if tx.is_closed() {
                        return;
                    }
                    match reopen() {
                        Ok(s) => break s,
                        Err(e) => {
                            tracing::error!(error = %e, "cannot reopen the uevent socket");
                            delay = (delay * 2).min(Duration::from_secs(30));
                        }
                    }
                };
                let _ = tx.send(Notice::Resync(
                    "the uevent socket failed and was reopened: events were lost".into(),
                ));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A receiver that plays a script of results, then times out (`Ok(None)`).
    struct Script(std::sync::Mutex<std::collections::VecDeque<Result<Vec<u8>, Errno>>>);

    impl Script {
        fn new(steps: Vec<Result<Vec<u8>, Errno>>) -> Self {
            Script(std::sync::Mutex::new(steps.into()))
        }
    }

    impl Receive for Script {
        fn recv(&self, buf: &mut [u8]) -> Result<Option<usize>, Errno> {
            let step = self.0.lock().expect("script").pop_front();
            match step {
                Some(Ok(m)) => {
                    buf[..m.len()].copy_from_slice(&m);
                    Ok(Some(m.len()))
                }
                Some(Err(e)) => Err(e),
                None => {
                    std::thread::sleep(Duration::from_millis(5));
                    Ok(None)
                }
            }
        }
    }

    /// A failed socket is reported as down (the agent's health says so) until another
    /// is open, which asks for a full rescan; an overflow asks for one at once; events
    /// on the new socket come through.
    #[test]
    fn a_failed_socket_is_down_until_reopened_then_everything_is_rescanned() {
        let add = msg(&[
            "add@/devices/pci0000:00/0000:01:00.2",
            "ACTION=add",
            "SUBSYSTEM=pci",
        ]);
        let first = Script::new(vec![Err(Errno::ENOBUFS), Err(Errno::EIO)]);
        let mut opens = 0;
        let reopen = move || {
            opens += 1;
            if opens < 3 {
                Err(std::io::Error::from(std::io::ErrorKind::PermissionDenied))
            } else {
                Ok(Script::new(vec![Ok(add.clone())]))
            }
        };
        let (tx, mut rx) = mpsc::unbounded_channel();
        let listener = std::thread::spawn(move || listen(first, reopen, tx));
        let mut got = Vec::new();
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while got.len() < 4 {
            match rx.try_recv() {
                Ok(n) => got.push(n),
                Err(_) => {
                    assert!(std::time::Instant::now() < deadline, "only {got:?}");
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
        }
        assert!(
            matches!(&got[0], Notice::Resync(w) if w.contains("ENOBUFS")),
            "{got:?}"
        );
        assert!(
            matches!(&got[1], Notice::Down(w) if w.contains("EIO")),
            "{got:?}"
        );
        assert!(
            matches!(&got[2], Notice::Resync(w) if w.contains("reopened")),
            "{got:?}"
        );
        assert!(
            matches!(&got[3], Notice::Device(ev) if ev.address.to_string() == "0000:01:00.2"),
            "{got:?}"
        );
        drop(rx);
        listener
            .join()
            .expect("the listener ends once the agent is gone");
    }

    fn msg(parts: &[&str]) -> Vec<u8> {
        parts.join("\0").into_bytes()
    }

    #[test]
    fn kernel_pci_event() {
        let m = msg(&[
            "add@/devices/pci0000:00/0000:00:03.0/0000:01:00.2",
            "ACTION=add",
            "DEVPATH=/devices/pci0000:00/0000:00:03.0/0000:01:00.2",
            "SUBSYSTEM=pci",
            "PCI_SLOT_NAME=0000:01:00.2",
            "SEQNUM=1234",
        ]);
        let ev = parse(&m).expect("parsed");
        assert_eq!(ev.action, "add");
        assert_eq!(ev.address.to_string(), "0000:01:00.2");
        assert!(!ev.removal);
        assert_eq!(ev.seqnum, Some(1234));
    }

    #[test]
    fn slot_from_devpath_when_absent() {
        let m = msg(&[
            "remove@/devices/pci0000:00/0000:00:1f.3",
            "ACTION=remove",
            "SUBSYSTEM=pci",
        ]);
        let ev = parse(&m).expect("parsed");
        assert_eq!(ev.address.to_string(), "0000:00:1f.3");
        assert!(ev.removal, "a PCI function's remove");
    }

    /// A PCI function's interface renamed (udev, after the function's own events) or
    /// added: the function is rescanned, so its netdev names are not left stale.
    #[test]
    fn a_pci_functions_interface_names_its_function() {
        let m = msg(&[
            "move@/devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0/net/ens1f0",
            "ACTION=move",
            "DEVPATH=/devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0/net/ens1f0",
            "DEVPATH_OLD=/devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0/net/eth0",
            "SUBSYSTEM=net",
            "INTERFACE=ens1f0",
        ]);
        let ev = parse(&m).expect("parsed");
        assert_eq!(
            (ev.action.as_str(), ev.address.to_string()),
            ("move", "0000:3b:00.0".to_string())
        );
        let m = msg(&[
            "add@/devices/pci0000:3a/0000:3a:00.0/0000:3b:02.1/net/eth7",
            "ACTION=add",
            "SUBSYSTEM=net",
        ]);
        assert_eq!(
            parse(&m).expect("parsed").address.to_string(),
            "0000:3b:02.1"
        );
        // An interface going away (its driver unbound) is no removal of the function.
        let m = msg(&[
            "remove@/devices/pci0000:3a/0000:3a:00.0/0000:3b:02.1/net/eth7",
            "ACTION=remove",
            "SUBSYSTEM=net",
        ]);
        assert!(!parse(&m).expect("parsed").removal);
    }

    #[test]
    fn ignores_other_messages() {
        assert_eq!(parse(b""), None);
        assert_eq!(parse(b"libudev\0\xfe\xed"), None);
        assert_eq!(
            parse(&msg(&[
                "add@/devices/virtual/net/lo",
                "ACTION=add",
                "SUBSYSTEM=net"
            ])),
            None
        );
        assert_eq!(
            parse(&msg(&[
                "add@/x",
                "ACTION=add",
                "SUBSYSTEM=pci",
                "PCI_SLOT_NAME=zz"
            ])),
            None
        );
        assert_eq!(parse(&msg(&["bogus", "SUBSYSTEM=pci"])), None);
        // An interface not under a PCI function, another subsystem.
        assert_eq!(
            parse(&msg(&[
                "move@/devices/platform/foo/net/wlan0",
                "ACTION=move",
                "SUBSYSTEM=net"
            ])),
            None
        );
        assert_eq!(
            parse(&msg(&[
                "add@/devices/pci0000:00/0000:00:14.0/usb1",
                "ACTION=add",
                "SUBSYSTEM=usb"
            ])),
            None
        );
        assert_eq!(parse(&[0xff, b'@', 0]), None);
    }

    proptest::proptest! {
        #[test]
        fn parse_never_panics(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..512)) {
            let _ = parse(&bytes);
        }
    }
}
