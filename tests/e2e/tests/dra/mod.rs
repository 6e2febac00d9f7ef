//! What the DRA tests share: the test kubelet.
#![allow(dead_code)]
pub mod kubelet;
