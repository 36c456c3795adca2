//! The root package's integration tests, through the public API only, gathered into one test
//! binary: each file below was a binary of its own, and every one of them linked candle again, which
//! was most of `cargo test`'s time on a fresh machine. A file is one area; its tests are named
//! `area::test` (`cargo test --test integration hooks::` runs one area).
//!
//! The data-parallel tests that need MPI or NCCL (`distributed_mpi.rs`, `distributed_nccl.rs`) stay
//! binaries of their own: they are behind features, and the MPI one runs itself under `mpiexec`.

#[path = "../support/mod.rs"]
mod support;

mod atomic_updates;
mod autocast;
mod backward_hook_api;
mod backward_hooks;
mod boundary_messages;
mod checkpoints;
mod concurrency;
mod containers;
mod cpu_capability;
mod crate_order;
mod dataflow;
mod derive_holes;
mod devices;
mod distributed;
mod functional;
mod fused_grad;
mod gapnet;
mod hook_identity;
mod hooks;
mod inference;
mod killed_saves;
mod layout;
mod lazy;
mod load_errors;
mod load_transforms;
mod module_api;
mod new_user;
mod one_dependency;
mod parametrize;
mod parity_layers;
mod parity_seq;
mod parity_training;
mod peft;
mod pipeline;
mod pipeline_errors;
mod pytorch_semantics;
mod recurrent;
mod repr;
mod state_dict;
mod traversal;
mod typed_paths;
