//! Forward hooks: observe and change what flows through any submodule.
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
//! Modules carry no hidden field. While [`Hooks::run`] is active, each thread keeps a stack of the
//! modules it is running; [`call`](crate::ModuleExt::call) on a module looks for it (by address and
//! type) among the descendants of the module running it, which gives its path. So:
//!
//! - run submodules with `call`, not `forward`: a `forward` is invisible to hooks;
//! - a module called three times fires its hooks three times;
//! - a module shared through `Arc` and reached by two paths reports the path of the `Arc` it was
//!   called through (`self.a.call(x)` vs `self.b.call(x)`); called through a plain reference to the
//!   module inside, it reports its first path;
//! - a module that is not part of the tree (a temporary) runs without hooks;
//! - calls made on other threads (spawned by a `forward`) see no hooks; two threads running one model
//!   at once each see their own calls and paths, and hooks may be shared by both;
//! - two zero-sized fields of one type can share an address: the runtime's own parameterless layers
//!   are not zero-sized, and a zero-sized module of your own reports the first of such fields.
//!
//! When no registry is active, `call` costs one thread-local read on top of `forward`.
//!
//! # Files
//!
//! - `registry.rs`: [`Hooks`], how a hook is registered ([`HookOptions`], [`PreHookOptions`]),
//!   what it is given ([`HookCtx`]) and how it is removed ([`HookHandle`]);
//! - `typed.rs`: typed forward hooks, on a [`TypedPath`](module_core::TypedPath), given the module and its
//!   input and output as their own types;
//! - `dispatch.rs`: the per-thread call stack that finds a called module's path and fires its hooks
//!   (all of the hook machinery's `unsafe`, each block with its reasoning);
//! - `observe.rs`: what is built on hooks: [`capture`](crate::ModuleExt::capture),
//!   [`call_order`](crate::ModuleExt::call_order) and the shapes of
//!   [`summary_with`](crate::ModuleExt::summary_with).

pub mod dispatch;
pub mod observe;
pub mod registry;
pub mod typed;

pub use observe::Captures;
pub use registry::{
    ForwardHookFn, HookCtx, HookHandle, HookOptions, Hooks, PreHookFn, PreHookOptions,
};
