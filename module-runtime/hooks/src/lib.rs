//! The calls and hooks of [`module-runtime`](https://docs.rs/module-runtime): what flows through a
//! module call and how to observe or change it. Users depend on `module-runtime`, which
//! re-exports all of it at the same paths; this crate exists so the direction between the
//! runtime's layers is the compiler's. It builds on `module-core` and `module-state`, and ends
//! with [`ModuleExt`], the methods every module has (PyTorch's `nn.Module` API), which need all
//! three.
//!
//! The files, bottom up (each uses only those above it):
//!
//! | file | what |
//! |---|---|
//! | `scope` | where a pre-hook's replacement of a borrowed input lives during the call (the crate's `unsafe`) |
//! | `tensor_tree` | [`TensorTree`]: the tensors of a call's inputs and outputs |
//! | `hooks/hook` | what a hook is, what it is told ([`HookCtx`], [`BackwardHookCtx`]), a registry's lists |
//! | `hooks/grad_op` | identity ops whose backward calls code; tensor gradient hooks ([`register_hook`]) |
//! | `hooks/backward` | full backward hooks and pre-hooks at run time: the identities around a call |
//! | `hooks/call_table` | the modules of a hooked tree by identity, at each of their paths |
//! | `hooks/dispatch` | the call path: the registries attached to a thread, hook dispatch |
//! | `hooks/registry`, `hooks/typed` | [`Hooks`]: forward, pre-forward and backward hooks by pattern or typed path |
//! | `hooks/observe` | [`Captures`]: outputs recorded by path, call order |
//! | `dataflow/` | [`Dataflow`]: a run's graph of modules and the tensors between them (`mod`); as DOT, rendered (`dot`) |
//! | `ext` | [`ModuleExt`]: traversal, `call`, train/eval, state dicts, moves, summaries |
#![warn(missing_docs)]

// The core's modules and items, under the names this crate's files use (`crate::module::Module`).
use module_core::{
    buffer, convert, error, forward, identity, module, names, param, path, pattern, report,
    summary, trace, typed_path, views,
};
// The state layer's modules, likewise.
use module_state::{checkpoint, state};

#[doc(hidden)]
pub mod dataflow;
#[doc(hidden)]
pub mod ext;
#[doc(hidden)]
pub mod hooks;
#[doc(hidden)]
pub mod scope;
#[doc(hidden)]
pub mod tensor_tree;

pub use dataflow::{Dataflow, DataflowEdge, DataflowNode, NodeKind};
pub use ext::ModuleExt;
pub use hooks::{
    register_hook, BackwardHookCtx, BackwardHookFn, BackwardHookOptions, BackwardPreHookFn,
    TensorHookFn,
};
pub use hooks::{
    Captures, ForwardHookFn, HookCtx, HookHandle, HookOptions, Hooks, PreHookFn, PreHookOptions,
};
#[doc(hidden)]
pub use tensor_tree::Scope;
pub use tensor_tree::{TensorStruct, TensorTree};
