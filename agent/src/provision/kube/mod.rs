//! The Kubernetes API client (work in progress).
