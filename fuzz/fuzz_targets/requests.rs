//! Fuzz target: every request message of `hostdev.v1` decoded from the same bytes with
//! prost (as tonic's codec does), then validated into domain types the way each handler
//! does (`hostdevd::api::convert`), and each refusal turned into its gRPC status.
//! Properties: no panic; a decoded message re-encodes to the same message; refusals
//! become short INVALID_ARGUMENT statuses; a selector that converts can be displayed and
//! matched against real device facts.
#![no_main]

use std::sync::OnceLock;

use hostdevd::api::convert;
use hostdevd::api::proto;
use hostdevd::api::status::ApiError;
use hostdevd::config::Config;
use hostdevd::ledger::DeviceFacts;
use hostdevd::simhost::FakeSys;
use hostdevd::sysfs::{self, PciNames};
use libfuzzer_sys::fuzz_target;
use prost::Message;

fn facts() -> &'static [DeviceFacts] {
    static FACTS: OnceLock<Vec<DeviceFacts>> = OnceLock::new();
    FACTS.get_or_init(|| {
        let mut f = FakeSys::new();
        f.pf("0000:3b:00.0", 0x8086, 0x1572, 8, 2)
            .driver("0000:3b:00.0", "i40e")
            .netdev("0000:3b:00.0", "ens1f0");
        f.vf_driver("0000:3b:00.0", "vfio-pci")
            .numa("0000:3b:00.0", 1);
        let tree = f.build();
        let inv =
            sysfs::scan(tree.sysfs_root(), tree.dev_root(), &PciNames::builtin()).expect("scan");
        Config::parse("[[devices]]\naddress = \"*:*:*.*\"\nphysnets = [\"physnet1\"]\n")
            .expect("config")
            .selection()
            .expect("selection")
            .facts(&inv.devices)
    })
}

/// A refusal becomes a short INVALID_ARGUMENT (or NOT_FOUND for ids) status.
fn refused(e: ApiError) {
    let s = tonic::Status::from(e);
    assert!(
        matches!(
            s.code(),
            tonic::Code::InvalidArgument | tonic::Code::NotFound
        ),
        "validation refused with {:?}: {}",
        s.code(),
        s.message()
    );
    assert!(
        s.message().len() < 1024,
        "status message of {} bytes",
        s.message().len()
    );
    assert!(
        s.details().len() < 8192,
        "status details of {} bytes",
        s.details().len()
    );
}

fn check<T>(r: Result<T, ApiError>) -> Option<T> {
    match r {
        Ok(v) => Some(v),
        Err(e) => {
            refused(e);
            None
        }
    }
}

/// Decodes `data` as `M`; a decoded message re-encodes to itself.
fn decode<M: Message + Default + PartialEq>(data: &[u8]) -> Option<M> {
    let m = M::decode(data).ok()?;
    let bytes = m.encode_to_vec();
    assert_eq!(bytes.len(), m.encoded_len());
    assert!(bytes.len() <= data.len(), "re-encoding grew the message");
    let again = M::decode(bytes.as_slice()).expect("a re-encoded message decodes");
    assert!(again == m, "decode(encode(m)) != m");
    Some(m)
}

fn selector(s: &proto::Selector) {
    if let Some(sel) = check(convert::selector(s)) {
        let _ = sel.to_string();
        for f in facts() {
            let _ = sel.matches(f);
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let _ = decode::<proto::ListDevicesRequest>(data);
    let _ = decode::<proto::GetStatusRequest>(data);
    let _ = decode::<proto::WatchRequest>(data);
    if let Some(r) = decode::<proto::GetDeviceRequest>(data) {
        check(convert::address("address", &r.address));
    }
    if let Some(r) = decode::<proto::ClaimRequest>(data) {
        check(convert::owner("owner", r.owner.as_ref()));
        check(convert::request_id(&r.request_id));
        match &r.target {
            Some(proto::claim_request::Target::Address(a)) => {
                check(convert::address("address.address", &a.address));
            }
            Some(proto::claim_request::Target::Selector(s)) => selector(s),
            None => {}
        }
    }
    if let Some(r) = decode::<proto::ReleaseRequest>(data) {
        check(convert::owner("owner", r.owner.as_ref()));
        check(convert::address("address", &r.address));
        check(convert::request_id(&r.request_id));
    }
    if let Some(r) = decode::<proto::TransferRequest>(data) {
        check(convert::address("address", &r.address));
        check(convert::consumer("from_consumer_id", &r.from_consumer_id));
        check(convert::owner("to", r.to.as_ref()));
        check(convert::request_id(&r.request_id));
    }
    if let Some(r) = decode::<proto::ReconcileRequest>(data) {
        for c in r.expected_consumer_ids.iter().take(1000) {
            check(convert::consumer("expected_consumer_ids", c));
        }
        check(convert::request_id(&r.request_id));
    }
    if let Some(r) = decode::<proto::GetRequestOutcomeRequest>(data) {
        check(convert::consumer("consumer_id", &r.consumer_id));
        check(convert::request_id(&r.request_id));
    }
    if let Some(r) = decode::<proto::PrepareVfioRequest>(data) {
        check(convert::owner("owner", r.owner.as_ref()));
        check(convert::address("address", &r.address));
        check(convert::request_id(&r.request_id));
    }
    if let Some(r) = decode::<proto::SetVfCountRequest>(data) {
        check(convert::address("address", &r.address));
        check(convert::consumer("consumer_id", &r.consumer_id));
        check(convert::request_id(&r.request_id));
    }
});
