//! `#[derive(Module)]` and `#[derive(TensorStruct)]` for [`module-runtime`](https://docs.rs/module-runtime).
//!
//! Use it through `module_runtime` (which re-exports it), not directly. What each derive and
//! attribute does, with runnable examples, is on [`Module`](derive@Module) and
//! [`TensorStruct`](derive@TensorStruct) (from `docs/*.md`; rustdoc shows the same text at the
//! re-exports).
//!
//! The derive only emits a structural walk over the fields (`visit_children`); every semantic —
//! naming, dedup, state dicts, hooks — is runtime code built on that walk. Input goes through
//! three stages, never emitting code from half-validated input: `ast` reads the input into our own
//! types, `attr` parses the `#[module(...)]` attributes, `check` applies the cross-field rules,
//! and `expand` generates the impl. `#[derive(TensorStruct)]` goes through the same `attr` (its
//! `#[tensor(...)]` attributes) and `check` (structs only) before `tensor_struct` generates its
//! impl. Every mistake in one input is reported in one compile.
#![forbid(unsafe_code)]

mod ast;
mod attr;
mod bound;
mod check;
mod ctxt;
mod expand;
#[cfg(test)]
mod expansion_cost;
mod paths;
#[cfg(test)]
mod snapshot_tests;
mod tensor_struct;

use proc_macro::TokenStream;

// The docs users read: rustdoc shows them at `module_runtime::Module` (the re-export) too. Their
// examples are this crate's doctests (`cargo test -p module-derive --doc`), run against
// module-runtime, a dev-dependency.
#[doc = include_str!("../docs/module.md")]
#[proc_macro_derive(Module, attributes(module))]
pub fn derive_module(input: TokenStream) -> TokenStream {
    expand::derive(input.into()).into()
}

#[doc = include_str!("../docs/tensor_struct.md")]
#[proc_macro_derive(TensorStruct, attributes(tensor))]
pub fn derive_tensor_struct(input: TokenStream) -> TokenStream {
    tensor_struct::derive(input.into()).into()
}
