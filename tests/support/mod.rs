//! Shared helpers for the integration tests: a fake sysfs tree builder and the lspci oracle.
//!
//! Each integration test file includes this with `mod support;`, and every file uses a
//! different subset, so unused items are expected here.
#![allow(dead_code, unused_imports)]

pub use hostdevd::simhost as fakesys;
pub mod fakekernel;
pub mod faultfs;
pub mod libvirtd;
pub mod lspci;
pub mod server;

pub use fakesys::{FakeSys, PfLayout};

/// A child process (a daemon started by a test) that is killed and reaped when the
/// test ends, pass or fail.
pub struct Daemon(pub std::process::Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
