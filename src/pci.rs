//! Validated identifiers: PCI addresses, vendor/device ids, generations, owner and request ids.
//!
//! Every identifier that crosses a boundary (sysfs, the store, the API, the CLI) is parsed
//! here into a newtype once; nothing downstream re-validates or panics on a bad value.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Why an identifier was rejected. Messages are sentences naming the offending input.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdError {
    #[error("malformed PCI address {input:?}: {reason}")]
    Address { input: String, reason: &'static str },
    #[error("malformed {what} {input:?}: expected 4 hexadecimal digits")]
    HexId { what: &'static str, input: String },
    #[error("malformed consumer id {input:?}: expected a UUID")]
    Consumer { input: String },
    #[error("invalid {what}: {reason}")]
    Text { what: &'static str, reason: String },
}

/// Shortens untrusted input (a request field, a sysfs value, a config string) before it
/// is echoed in an error message.
pub(crate) fn shown(input: &str) -> String {
    const MAX: usize = 64;
    if input.len() <= MAX {
        return input.to_string();
    }
    let mut end = MAX;
    while !input.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &input[..end])
}

/// A PCI function address, `domain:bus:device.function`, displayed in the kernel's
/// canonical lowercase form `dddd:bb:dd.f`. Domains above 0xffff (Intel VMD) print with
/// more digits, as the kernel does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PciAddress {
    domain: u32,
    bus: u8,
    device: u8,
    function: u8,
}

impl PciAddress {
    /// Builds an address from parts; `None` when device > 31 or function > 7.
    pub fn new(domain: u32, bus: u8, device: u8, function: u8) -> Option<Self> {
        (device < 32 && function < 8).then_some(Self {
            domain,
            bus,
            device,
            function,
        })
    }
    pub fn domain(&self) -> u32 {
        self.domain
    }
    pub fn bus(&self) -> u8 {
        self.bus
    }
    pub fn device(&self) -> u8 {
        self.device
    }
    pub fn function(&self) -> u8 {
        self.function
    }
    /// The same slot with another function number (multi-function siblings).
    pub fn with_function(&self, function: u8) -> Option<Self> {
        Self::new(self.domain, self.bus, self.device, function)
    }
}

/// An address's text, on the stack: what [`PciAddress::text`] writes.
#[derive(Debug, Clone, Copy)]
pub struct AddressText {
    bytes: [u8; 16],
    len: usize,
}

impl AddressText {
    pub fn as_str(&self) -> &str {
        // Only ASCII hexadecimal digits and separators are ever written.
        std::str::from_utf8(&self.bytes[..self.len]).unwrap_or_default()
    }
}

impl PciAddress {
    /// The canonical text, `dddd:bb:dd.f` (more domain digits where needed), written
    /// without the formatting machinery or an allocation: the store writes one for every
    /// record it commits, and the API one for every device it answers with.
    pub fn text(&self) -> AddressText {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let hex = |nibble: u32| HEX[(nibble & 0xf) as usize];
        let mut t = AddressText {
            bytes: [0; 16],
            len: 0,
        };
        let domain_digits = (8 - self.domain.leading_zeros() as usize / 4).max(4);
        for i in (0..domain_digits).rev() {
            t.bytes[t.len] = hex(self.domain >> (4 * i));
            t.len += 1;
        }
        for (sep, byte) in [(b':', self.bus), (b':', self.device)] {
            t.bytes[t.len] = sep;
            t.bytes[t.len + 1] = hex(u32::from(byte) >> 4);
            t.bytes[t.len + 2] = hex(u32::from(byte));
            t.len += 3;
        }
        t.bytes[t.len] = b'.';
        t.bytes[t.len + 1] = hex(u32::from(self.function));
        t.len += 2;
        t
    }
}

impl fmt::Display for PciAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.text().as_str())
    }
}

impl FromStr for PciAddress {
    type Err = IdError;

    /// Accepts `dddd:bb:dd.f` (domain of 1 to 8 hex digits) and the short `bb:dd.f`
    /// form (domain 0), in either case.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = |reason| IdError::Address {
            input: shown(s),
            reason,
        };
        if s.len() > 20 {
            return Err(err("too long"));
        }
        let (head, func) = s
            .rsplit_once('.')
            .ok_or_else(|| err("missing '.function'"))?;
        let mut parts = head.split(':');
        let (domain, bus, dev) = match (parts.next(), parts.next(), parts.next(), parts.next()) {
            (Some(d), Some(b), Some(v), None) => (d, b, v),
            (Some(b), Some(v), None, None) => ("0", b, v),
            _ => return Err(err("expected domain:bus:device.function")),
        };
        let hex = |t: &str, max_len: usize, what| -> Result<u32, IdError> {
            if t.is_empty() || t.len() > max_len || !t.bytes().all(|c| c.is_ascii_hexdigit()) {
                return Err(err(what));
            }
            u32::from_str_radix(t, 16).map_err(|_| err(what))
        };
        let domain = hex(domain, 8, "domain must be 1-8 hex digits")?;
        let bus = hex(bus, 2, "bus must be 1-2 hex digits")?;
        let device = hex(dev, 2, "device must be 1-2 hex digits")?;
        let function = hex(func, 1, "function must be one digit 0-7")?;
        if device > 31 {
            return Err(err("device must be at most 1f"));
        }
        if function > 7 {
            return Err(err("function must be at most 7"));
        }
        // Each value was bounded above, so the narrowing casts are exact.
        Ok(Self {
            domain,
            bus: bus as u8,
            device: device as u8,
            function: function as u8,
        })
    }
}

impl Serialize for PciAddress {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for PciAddress {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

macro_rules! hex16 {
    ($name:ident, $what:literal) => {
        #[doc = concat!("A 16-bit PCI ", $what, ", shown as 4 lowercase hex digits.")]
        #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub struct $name(pub u16);

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{:04x}", self.0)
            }
        }

        impl FromStr for $name {
            type Err = IdError;
            /// Accepts 1-4 hex digits with an optional `0x` prefix (sysfs writes `0x8086`).
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                let t = s.trim();
                let t = t
                    .strip_prefix("0x")
                    .or_else(|| t.strip_prefix("0X"))
                    .unwrap_or(t);
                if t.is_empty() || t.len() > 4 || !t.bytes().all(|c| c.is_ascii_hexdigit()) {
                    return Err(IdError::HexId {
                        what: $what,
                        input: shown(s),
                    });
                }
                u16::from_str_radix(t, 16)
                    .map($name)
                    .map_err(|_| IdError::HexId {
                        what: $what,
                        input: shown(s),
                    })
            }
        }

        impl Serialize for $name {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.collect_str(self)
            }
        }

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let s = String::deserialize(d)?;
                s.parse().map_err(serde::de::Error::custom)
            }
        }
    };
}

hex16!(VendorId, "vendor id");
hex16!(DeviceId, "device id");

/// A value of the host-wide generation counter. It only grows, across restarts too;
/// every change to a device record stamps it with the next value.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
)]
pub struct Generation(pub u64);

impl Generation {
    /// The generation after this one. Saturates instead of wrapping: 2^64 changes are
    /// out of reach, and wrapping would break "never goes backwards".
    pub fn next(self) -> Self {
        Generation(self.0.saturating_add(1))
    }

    /// The floor the host generation is raised to at start: the wall clock's time since
    /// the Unix epoch, in microseconds. A state directory restored from an older copy
    /// holds an older counter; starting from the clock instead, the agent hands out no
    /// generation again that it handed out before the restore, as long as the clock has
    /// not gone back and it handed out fewer than one a microsecond since its last start
    /// (a change costs tens of microseconds at least). Saturates past year 586,000.
    pub fn clock_floor(since_epoch: std::time::Duration) -> Self {
        Generation(u64::try_from(since_epoch.as_micros()).unwrap_or(u64::MAX))
    }
}

impl fmt::Display for Generation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// The consumer that owns a claim: an instance UUID, or a migration UUID during a move.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct ConsumerId(pub uuid::Uuid);

impl ConsumerId {
    /// The hyphenated lowercase text, written into `buf` (no allocation).
    pub fn as_text<'b>(&self, buf: &'b mut [u8; uuid::fmt::Hyphenated::LENGTH]) -> &'b str {
        self.0.hyphenated().encode_lower(buf)
    }
}

impl fmt::Display for ConsumerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_text(&mut [0; uuid::fmt::Hyphenated::LENGTH]))
    }
}

impl FromStr for ConsumerId {
    type Err = IdError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.len() > 45 {
            return Err(IdError::Consumer { input: shown(s) });
        }
        uuid::Uuid::parse_str(s.trim())
            .map(ConsumerId)
            .map_err(|_| IdError::Consumer { input: shown(s) })
    }
}

/// Checks a free-text identifier: non-empty (unless allowed), bounded, printable.
fn check_text(what: &'static str, s: &str, max: usize, allow_empty: bool) -> Result<(), IdError> {
    if s.is_empty() && !allow_empty {
        return Err(IdError::Text {
            what,
            reason: "must not be empty".into(),
        });
    }
    if s.len() > max {
        return Err(IdError::Text {
            what,
            reason: format!("{} bytes is longer than the limit of {max}", s.len()),
        });
    }
    if s.chars().any(|c| c.is_control()) {
        return Err(IdError::Text {
            what,
            reason: format!("{:?} contains control characters", shown(s)),
        });
    }
    Ok(())
}

macro_rules! text_id {
    ($name:ident, $what:literal, $max:expr, $allow_empty:expr) => {
        #[doc = concat!("A validated ", $what, " (at most ", stringify!($max), " bytes, no control characters).")]
        ///
        /// Shared, not copied: records are cloned into every change set, view and event,
        /// and a copy of each text cost an allocation every time.
        #[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Deserialize)]
        #[serde(try_from = "String")]
        pub struct $name(std::sync::Arc<str>);

        impl Serialize for $name {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(&self.0)
            }
        }

        impl $name {
            pub const MAX_LEN: usize = $max;
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl TryFrom<String> for $name {
            type Error = IdError;
            fn try_from(s: String) -> Result<Self, IdError> {
                s.parse()
            }
        }

        impl FromStr for $name {
            type Err = IdError;
            /// Checked as it is, then copied once into the shared text.
            fn from_str(s: &str) -> Result<Self, IdError> {
                check_text($what, s, $max, $allow_empty)?;
                Ok($name(s.into()))
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }
    };
}

text_id!(RequestId, "request id", 128, false);

impl RequestId {
    /// How many bytes [`Self::per_device`] adds at most: "@" and the longest address,
    /// "ffffffff:ff:1f.7" (a 32-bit domain; most are "dddd:bb:dd.f", 12).
    pub const PER_DEVICE_SUFFIX: usize = 17;

    /// The id of this request's part that acts on one device, `<id>@<address>`: an
    /// acting Reconcile logs each orphan's free under one, so that two orphans of one
    /// owner are two requests, and a retry of the audit finds the same ids again. Fails
    /// only if `self` is longer than [`Self::MAX_LEN`] less [`Self::PER_DEVICE_SUFFIX`].
    pub fn per_device(&self, address: PciAddress) -> Result<RequestId, IdError> {
        RequestId::try_from(format!("{}@{address}", self.0))
    }

    /// The audit id and the address of a [`Self::per_device`] id: `Some` when the text
    /// after the last "@" is an address in its canonical form. A client's own id may
    /// have that form too, so a match says only that the id could be one.
    pub fn split_per_device(id: &str) -> Option<(&str, PciAddress)> {
        let (audit, address) = id.rsplit_once('@')?;
        let parsed: PciAddress = address.parse().ok()?;
        (!audit.is_empty() && parsed.to_string() == address).then_some((audit, parsed))
    }
}
text_id!(OwnerLabel, "owner label", 256, true);
text_id!(PhysNet, "physical network tag", 64, false);

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_per_device_id_splits_back_into_its_parts() {
        let audit: RequestId = "audit-7@x".parse().expect("valid");
        let a: PciAddress = "0000:3b:10.1".parse().expect("valid");
        let part = audit.per_device(a).expect("short enough");
        assert_eq!(part.as_str(), "audit-7@x@0000:3b:10.1");
        assert_eq!(
            RequestId::split_per_device(part.as_str()),
            Some(("audit-7@x", a))
        );
        for not in [
            "audit",
            "audit@",
            "@0000:3b:10.1",
            "a@3b:10.1",
            "a@0000:3B:10.1",
        ] {
            assert_eq!(RequestId::split_per_device(not), None, "{not}");
        }
    }

    #[test]
    fn address_canonical_forms() {
        let a: PciAddress = "0000:3B:02.1".parse().expect("valid");
        assert_eq!(a.to_string(), "0000:3b:02.1");
        let b: PciAddress = "3b:02.1".parse().expect("short form");
        assert_eq!(a, b);
        let vmd: PciAddress = "10000:e1:00.0".parse().expect("vmd domain");
        assert_eq!(vmd.to_string(), "10000:e1:00.0");
    }

    #[test]
    fn address_rejections_name_the_input() {
        for bad in [
            "",
            "0000:3b:02",
            "0000:3b:20.0",
            "0000:3b:02.8",
            "0000:3g:02.1",
            "0000:03b:02.1",
            "1:2:3:4.0",
            "0000:3b:02.1 ",
            "+000:3b:02.1",
            "٣:3b:02.1",
        ] {
            let err = bad.parse::<PciAddress>().expect_err(bad);
            assert!(err.to_string().contains("malformed PCI address"), "{err}");
        }
        let huge = "a".repeat(1 << 20);
        let err = huge.parse::<PciAddress>().expect_err("huge");
        assert!(err.to_string().len() < 200, "error echoes bounded input");
    }

    #[test]
    fn hex_ids() {
        assert_eq!(
            "0x8086".parse::<VendorId>().expect("ok").to_string(),
            "8086"
        );
        assert_eq!("10fb\n".parse::<DeviceId>().expect("ok").0, 0x10fb);
        assert!("0x18086".parse::<VendorId>().is_err());
        assert!("".parse::<VendorId>().is_err());
    }

    #[test]
    fn text_ids() {
        assert!("req-1".parse::<RequestId>().is_ok());
        assert!("".parse::<RequestId>().is_err());
        assert!("a\u{0}b".parse::<RequestId>().is_err());
        assert!("x".repeat(129).parse::<RequestId>().is_err());
        assert!("".parse::<OwnerLabel>().is_ok());
        assert!("not-a-uuid".parse::<ConsumerId>().is_err());
    }

    #[test]
    fn generation_saturates() {
        assert_eq!(Generation(u64::MAX).next(), Generation(u64::MAX));
    }

    #[test]
    fn the_clock_floor_counts_microseconds_and_saturates() {
        use std::time::Duration;
        assert_eq!(
            Generation::clock_floor(Duration::from_secs(1_796_400_000)),
            Generation(1_796_400_000_000_000)
        );
        assert_eq!(
            Generation::clock_floor(Duration::from_micros(7)),
            Generation(7)
        );
        assert_eq!(Generation::clock_floor(Duration::MAX), Generation(u64::MAX));
    }

    proptest! {
        #[test]
        fn address_round_trips(d in 0u32..=0xffff_ffff, b: u8, dev in 0u8..32, f in 0u8..8) {
            let a = PciAddress::new(d, b, dev, f).expect("in range");
            let back: PciAddress = a.to_string().parse().expect("round trip");
            prop_assert_eq!(a, back);
            // The hand-written text is what the formatting machinery would print.
            prop_assert_eq!(a.to_string(), format!("{d:04x}:{b:02x}:{dev:02x}.{f:x}"));
        }

        #[test]
        fn a_consumer_reads_as_its_uuid(bits: u128) {
            let c = ConsumerId(uuid::Uuid::from_u128(bits));
            prop_assert_eq!(c.to_string(), c.0.hyphenated().to_string());
        }

        #[test]
        fn address_parse_never_panics(s in "\\PC{0,40}") {
            let _ = s.parse::<PciAddress>();
        }
    }
}
