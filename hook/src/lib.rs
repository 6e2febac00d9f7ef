//! `libvramguard.so`, preloaded into workloads to enforce GPU-memory quotas (DESIGN.md §2-4).
//!
//! Not implemented yet: interposition and enforcement are the subject of the issue "The hook".
//! Until then this library exports nothing and intercepts nothing; preloading it has no effect.
