//! `#[derive(Module)]` and `#[derive(TensorStruct)]` for [`module-runtime`](https://docs.rs/module-runtime).
//!
//! Use it through `module_runtime` (which re-exports it), not directly. The derive only emits a
//! structural walk over the fields (`visit_children`); every semantic — naming, dedup, state dicts,
//! hooks — is runtime code built on that walk. Input goes through three stages, never emitting code
//! from half-validated input: `ast` reads the input into our own types, `attr` parses the
//! `#[module(...)]` attributes, `check` applies the cross-field rules, and `expand` generates
//! the impl. Every mistake in one input is reported in one compile.
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

/// Implements `module_runtime::Module` by walking the fields; see `module_runtime` for the
/// attributes.
#[proc_macro_derive(Module, attributes(module))]
pub fn derive_module(input: TokenStream) -> TokenStream {
    expand::derive(input.into()).into()
}

/// Implements `module_runtime::TensorStruct` for a struct whose fields are tensors or tensor trees
/// (`Option<Tensor>`, `Vec<Tensor>`, tuples, other `TensorStruct`s, …), walked in field order;
/// fields marked `#[tensor(skip)]` are plain values carried over unchanged. See
/// `module_runtime::TensorStruct`.
#[proc_macro_derive(TensorStruct, attributes(tensor))]
pub fn derive_tensor_struct(input: TokenStream) -> TokenStream {
    tensor_struct::derive(input.into()).into()
}
