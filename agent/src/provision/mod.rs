//! Provisioning: quotas that belong to the operator (issue 10).
//!
//! A container whose quota comes from a trusted party (the pod spec's
//! `vramguard.io/gpu-memory` limit, or an operator's quota file) gets, before it starts, a
//! ledger the agent created with the agent's limits, a read-only copy of those limits, the
//! hook library and `/etc/ld.so.preload`, all injected by the container runtime through NRI.
//!
//! * [`nri`]: the NRI plugin: the runtime's socket, its wire protocol, the event loop.
//! * [`kube`]: the Kubernetes API side: pod lookup, the node's advertised capacity.
pub mod kube;
pub mod nri;
