//! The DRA driver `gpu.vramguard.io` (`--dra`): a quota on one GPU, placed by the scheduler
//! through Dynamic Resource Allocation with consumable capacity (resource.k8s.io/v1) and
//! enforced on the node by the same provisioned ledger as a `vramguard.io/gpu-memory` container.
//!
//! This room owns the driver's side of the protocol and its state:
//!
//! * the node's ResourceSlice pool: one device per GPU, `allowMultipleAllocations`, a `memory`
//!   capacity with a request policy ([`policy`]);
//! * the kubelet plugin: the registration service and the DRA v1 service on the kubelet's
//!   plugin sockets; prepare fetches the claim, checks it, writes its CDI spec and records it;
//! * the prepared claims ([`crate::prepared`], the contract with the NRI side, and its [`checkpoint`]): what the driver prepared, kept in the state
//!   directory so that a restarted agent unprepares what it prepared and the NRI side
//!   (`provision::nri`) provisions a container from its claim's share.
//!
//! The names below are the contract between those parts; the kubelet, the scheduler and the
//! runtime see only what the API (`resource.k8s.io/v1`) and CDI define.

pub mod health;
pub mod plugin;
pub mod policy;
pub mod prepare;
pub mod proto;
pub mod slices;

pub use crate::prepared::{cdi, checkpoint, device_index, device_name, Prepared, Share, DRIVER, MEMORY};
