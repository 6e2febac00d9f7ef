//! The shared quota ledger: one memory-mapped file per container that every hooked process
//! and the node agent map at once (DESIGN.md §4).
//!
//! Not implemented yet: the file format, buddy allocator, slots, robust lock and invariant
//! checker are the subject of the issue "The ledger". This crate holds nothing until then.
