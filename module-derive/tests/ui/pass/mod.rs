//! Derive inputs that must compile, and run: each file is one case, with its checks in a `#[test]`.
//! They are modules of this test binary rather than trybuild cases, so that trybuild only has to
//! `cargo check` its own copy of the dependencies, never build them.

// Skipped fields are configuration that the cases carry but never read.
#![allow(dead_code)]

mod crate_path;
mod enums;
mod flatten_and_skip_limits;
mod generic_explicit_bound;
mod generic_inferred_bounds;
mod hygiene;
mod lifetimes_and_const_generics;
mod tuple_and_unit_structs;
mod type_alias;
mod typed_paths;
