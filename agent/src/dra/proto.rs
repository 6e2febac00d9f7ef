//! The kubelet's plugin protocols, generated at build time from `agent/proto/*.proto` (written
//! from the published k8s.io/kubelet API): messages, servers, and the clients the tests'
//! kubelet uses.
#![allow(clippy::all, clippy::pedantic, missing_docs)]

/// Plugin registration (`pluginregistration`): `Registration`.
pub mod registration {
    tonic::include_proto!("pluginregistration");
}

/// DRA v1 (`k8s.io.kubelet.pkg.apis.dra.v1`): `DRAPlugin`.
pub mod v1 {
    tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1");
}

/// DRA device health v1alpha1 (`v1alpha1`): `DRAResourceHealth`.
pub mod health {
    tonic::include_proto!("v1alpha1");
}
