//! Shared helpers for the test workloads.
