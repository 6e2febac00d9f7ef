//! What the DRA tests share: the test kubelet, and the helpers of the tests on a real
//! containerd.
#![allow(dead_code)]
pub mod kubelet;
pub mod node;
