//! Shared helpers for the integration tests: a fake sysfs tree builder and the lspci oracle.
//!
//! Each integration test file includes this with `mod support;`, and every file uses a
//! different subset, so unused items are expected here.
#![allow(dead_code, unused_imports)]

pub use hostdevd::simhost as fakesys;
pub mod lspci;

pub use fakesys::{FakeSys, PfLayout};
