//! The NRI plugin (work in progress).
