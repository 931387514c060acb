//! Fuzz target: every identifier parser (PCI address, vendor/device id, consumer UUID,
//! request id, owner label, physical network tag) and the config's address patterns.
//! Properties: no panic, bounded error messages, and whatever parses prints in a
//! canonical form that parses back to the same value.
#![no_main]

use std::str::FromStr;

use hostdevd::config::AddressPattern;
use hostdevd::pci::{
    ConsumerId, DeviceId, IdError, OwnerLabel, PciAddress, PhysNet, RequestId, VendorId,
};
use libfuzzer_sys::fuzz_target;

/// Errors quote at most 64 bytes of the input, escaped ({:?}: up to 10 bytes a byte).
fn bounded(e: &IdError) {
    let m = e.to_string();
    assert!(
        m.len() < 1024,
        "error message of {} bytes: {m:.300}",
        m.len()
    );
}

fn text<T>(s: &str, max: usize)
where
    T: FromStr<Err = IdError> + std::fmt::Display,
{
    match T::from_str(s) {
        Ok(v) => {
            assert_eq!(v.to_string(), s, "a text id is kept as given");
            assert!(s.len() <= max, "{} bytes accepted, limit {max}", s.len());
            assert!(
                !s.chars().any(char::is_control),
                "control characters accepted"
            );
        }
        Err(e) => bounded(&e),
    }
}

fuzz_target!(|data: &[u8]| {
    let Ok(s) = std::str::from_utf8(data) else {
        return;
    };

    let address = PciAddress::from_str(s);
    match &address {
        Ok(a) => {
            assert!(a.device() < 32 && a.function() < 8);
            let shown = a.to_string();
            let back: PciAddress = shown.parse().expect("the canonical form parses");
            assert_eq!(*a, back);
            assert_eq!(back.to_string(), shown);
            assert_eq!(
                PciAddress::new(a.domain(), a.bus(), a.device(), a.function()),
                Some(*a)
            );
            if a.domain() == 0 {
                let short = format!("{:02x}:{:02x}.{}", a.bus(), a.device(), a.function());
                assert_eq!(short.parse::<PciAddress>().ok(), Some(*a), "short form");
            }
            // Every address is a pattern matching exactly itself.
            let p: AddressPattern = shown.parse().expect("an address is a pattern");
            assert!(p.matches(*a));
            for f in 0..8 {
                if let Some(sib) = a.with_function(f) {
                    assert_eq!(p.matches(sib), f == a.function());
                }
            }
        }
        Err(e) => bounded(e),
    }
    match AddressPattern::from_str(s) {
        Ok(p) => {
            if let Ok(a) = &address {
                assert!(
                    p.matches(*a),
                    "pattern {s:?} does not match its own address"
                );
            }
        }
        // The pattern error quotes the whole input (escaped), unlike the other parsers,
        // which cut it at 64 bytes: linear in the input, never more.
        Err(m) => assert!(
            m.len() < 128 + 10 * s.len(),
            "pattern error of {} bytes for {} bytes of input",
            m.len(),
            s.len()
        ),
    }

    match VendorId::from_str(s) {
        Ok(v) => assert_eq!(v.to_string().parse::<VendorId>().ok(), Some(v)),
        Err(e) => bounded(&e),
    }
    match DeviceId::from_str(s) {
        Ok(v) => assert_eq!(format!("0x{v}").parse::<DeviceId>().ok(), Some(v)),
        Err(e) => bounded(&e),
    }
    match ConsumerId::from_str(s) {
        Ok(c) => {
            let shown = c.to_string();
            assert_eq!(shown.len(), 36, "hyphenated form");
            assert_eq!(shown.parse::<ConsumerId>().ok(), Some(c));
        }
        Err(e) => bounded(&e),
    }
    text::<RequestId>(s, RequestId::MAX_LEN);
    text::<OwnerLabel>(s, OwnerLabel::MAX_LEN);
    text::<PhysNet>(s, PhysNet::MAX_LEN);
});
