//! Forward and backward hooks: observe and change what flows through any submodule, forward and
//! back.
//!
//! A [`Hooks`] registry holds hooks targeted by path pattern (or global ones that see every call),
//! and [`Hooks::run`] runs a closure with the registry attached to a model:
//!
//! ```
//! use module_runtime::prelude::*;
//! use module_runtime::{HookCtx, HookOptions, Hooks};
//!
//! #[derive(Module)]
//! struct Net {
//!     fc1: Linear,
//!     fc2: Linear,
//! }
//!
//! impl Forward<&Tensor> for Net {
//!     type Output = Tensor;
//!     fn forward(&self, x: &Tensor) -> Result<Tensor> {
//!         let h = self.fc1.call(x)?.relu()?;
//!         self.fc2.call(&h)
//!     }
//! }
//!
//! let dev = Device::Cpu;
//! let net = Net { fc1: Linear::new(4, 8, &dev)?, fc2: Linear::new(8, 2, &dev)? };
//! let x = Tensor::ones((3, 4), DType::F32, &dev)?;
//!
//! let hooks = Hooks::new();
//! // Zero the output of `fc1` (PyTorch's `register_forward_hook` returning a new output).
//! let zero = |_: &HookCtx<'_>, _input: &[Tensor], output: &[Tensor]| {
//!     Ok(Some(vec![output[0].zeros_like()?]))
//! };
//! let handle = hooks.register_forward_hook("fc1", zero, HookOptions::default())?;
//! let y = hooks.run(&net, |net| net.call(&x))?;
//! // With fc1 zeroed, the output is fc2's bias on every row.
//! let bias = net.fc2.bias.as_ref().unwrap().tensor()?;
//! assert_eq!(y.to_vec2::<f32>()?[1], bias.to_vec1::<f32>()?);
//!
//! handle.remove();
//! let y = hooks.run(&net, |net| net.call(&x))?;
//! assert_eq!(y.to_vec2::<f32>()?, net.call(&x)?.to_vec2::<f32>()?);
//! # Ok::<(), module_runtime::Error>(())
//! ```
//!
//! # How a call finds its path
//!
//! Modules carry no hidden field. [`Hooks::run`] walks the tree once and lists every module by
//! identity: the address and type it is called through (a `call` on a field, on a `Box` of it or
//! on a built `Lazy` of it names the module; a `call` on an `Arc` field names that field), at every
//! path it is reachable by. While the run is active, each thread keeps a stack of the *paths* of
//! the calls it is running; [`call`](crate::ModuleExt::call) looks the module up by identity, which
//! gives its path, and fires the hooks worked out for that module when the hooks were attached
//! (again after a hook is registered or removed: from the next call on). So:
//!
//! - run submodules with `call`, not `forward`: a `forward` is invisible to hooks;
//! - a module called three times fires its hooks three times;
//! - a module shared through `Arc` and reached by two paths reports the path of the `Arc` it was
//!   called through (`self.a.call(x)` vs `self.b.call(x)`); called through a plain reference to the
//!   module inside, it reports its first path under the running module, else its first path;
//!   the submodules of such a module report the path it was called through (`a.fc` or `b.fc`);
//! - a module that is not part of the tree (a temporary) runs without hooks;
//! - a [`Lazy`](../module_runtime/nn/struct.Lazy.html) cell built during the run joins the tree
//!   when it is built (or first reached through `get_or_build` on this thread), so the modules
//!   inside it fire their hooks from then on;
//! - calls made on other threads (spawned by a `forward`) see no hooks; two threads running one model
//!   at once each see their own calls and paths, and hooks may be shared by both;
//! - two zero-sized fields of one type can share an address: the runtime's own parameterless layers
//!   are not zero-sized, and a zero-sized module of your own reports the first of such fields.
//!
//! When no registry is active, `call` costs one thread-local read on top of `forward`; with one, a
//! hash lookup and a push of the path.
//!
//! # Backward hooks
//!
//! [`Hooks::register_full_backward_hook`] and [`Hooks::register_full_backward_pre_hook`] are
//! PyTorch's, built as PyTorch builds them (`torch/utils/hooks.py`, `BackwardHook`): a call of a
//! module they target, under [`Hooks::run`] with grad mode on, passes its inputs and outputs
//! through identity ops whose backward runs the hooks (`backward.rs`). They fire in
//! `loss.backward()`, as the backward reaches each call: the pre-hooks when the gradients with
//! respect to its outputs are known, the full hooks when those with respect to its inputs are;
//! so inner-most modules first. Calls of modules no backward hook targets record nothing more
//! than without hooks; a targeted call records one copy of each input and output tensor that
//! requires a gradient, and one scalar per side.
//!
//! # Files
//!
//! Bottom up, each using only those above it:
//!
//! - `hook.rs`: what a hook is and what it is given ([`HookCtx`]), how it is registered
//!   ([`HookOptions`], [`PreHookOptions`]) and removed ([`HookHandle`]), and a registry's lists;
//! - `grad_op.rs`: identity ops whose backward calls code, and tensor gradient hooks
//!   ([`register_hook`]);
//! - `backward.rs`: full backward hooks and pre-hooks at run time: the identities a hooked call
//!   puts around its inputs and outputs, whose backward runs the hooks;
//! - `call_table.rs`: the modules of a tree by identity, at each of their paths;
//! - `dispatch.rs`: the per-thread sessions and stack of call paths, and `call` with hooks around
//!   `forward` (no `unsafe`: a replaced borrowed input lives in a [`Scope`](crate::Scope), in
//!   `scope.rs`, which holds the hook machinery's `unsafe`);
//! - `registry.rs`: [`Hooks`], registering forward and backward hooks and attaching them to a
//!   model for a run;
//! - `typed.rs`: typed forward hooks, on a [`TypedPath`](module_core::TypedPath), given the module
//!   and its input and output as their own types;
//! - `observe.rs`: what is built on hooks: [`capture`](crate::ModuleExt::capture),
//!   [`call_order`](crate::ModuleExt::call_order) and the shapes of
//!   [`summary_with`](crate::ModuleExt::summary_with).

// The hook machinery's only `unsafe` is the crate's `scope.rs`; the compiler keeps it so.
#![forbid(unsafe_code)]

// Bottom up, each file using only those above it (blank lines keep rustfmt from sorting them).
mod hook;

mod grad_op;

mod backward;

mod call_table;

pub mod dispatch;

mod registry;

mod typed;

pub mod observe;

pub use grad_op::{register_hook, TensorHookFn};
pub use hook::{BackwardHookCtx, BackwardHookFn, BackwardHookOptions, BackwardPreHookFn};
pub use hook::{ForwardHookFn, HookCtx, HookHandle, HookOptions, PreHookFn, PreHookOptions};
pub use observe::Captures;
pub use registry::Hooks;
