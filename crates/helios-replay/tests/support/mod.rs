#![allow(unreachable_pub)]
pub mod device_fixture;
