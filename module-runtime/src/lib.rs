//! PyTorch's `nn.Module`, for candle.
//!
//! Define models as plain structs with `#[derive(Module)]`, and get what PyTorch users expect:
//! a parameter registry with PyTorch's names (`encoder.layer.0.attention.self.query.weight`),
//! traversal (`named_parameters`, `named_modules`, `get_submodule`), freezing by path pattern,
//! train/eval modes, device and dtype moves, and `trainable_vars()` for candle's optimizers — with
//! mistakes such as an untracked `Tensor` field caught at compile time.
//!
//! ```
//! use module_runtime::prelude::*;
//!
//! #[derive(Module)]
//! struct Mlp {
//!     fc1: Linear,
//!     fc2: Linear,
//!     #[module(skip)]
//!     act: candle_nn::Activation, // configuration, not state
//! }
//!
//! impl Forward<&Tensor> for Mlp {
//!     type Output = Tensor;
//!     fn forward(&self, x: &Tensor) -> Result<Tensor> {
//!         let h = self.fc1.call(x)?.apply(&self.act)?;
//!         self.fc2.call(&h)
//!     }
//! }
//!
//! let dev = Device::Cpu;
//! let model = Mlp {
//!     fc1: Linear::new(4, 8, &dev)?,
//!     fc2: Linear::new(8, 2, &dev)?,
//!     act: candle_nn::Activation::Relu,
//! };
//! for (name, p) in model.named_parameters() {
//!     println!("{name} {:?}", p.shape()); // fc1.weight [8, 4], fc1.bias [8], ...
//! }
//! let y = model.call(&Tensor::zeros((3, 4), DType::F32, &dev)?)?;
//! assert_eq!(y.dims(), [3, 2]);
//! # Ok::<(), module_runtime::Error>(())
//! ```
//!
//! # Devices
//!
//! CPU needs nothing. The features `cuda`, `cudnn`, `metal`, `mkl` and `accelerate` forward to
//! candle's.
#![warn(missing_docs)]

// The runtime's own layers use the derive, whose expansion names `::module_runtime`.
extern crate self as module_runtime;

mod buffer;
mod device;
mod error;
mod forward;
mod hooks;
mod io;
mod lazy;
mod module;
pub mod nn;
mod param;
mod pattern;
mod state;
mod summary;
mod tree;
mod visit;

pub use buffer::Buffer;
pub use device::{device_name, parse_device};
pub use error::{Error, Result};
pub use forward::Forward;
pub use hooks::{Captures, ForwardHookFn, HookCtx, HookHandle, Hooks, PreHookFn, Prepend};
pub use lazy::{Build, Init, InitFn, Lazy, LazyExt, LazyShape};
#[doc(hidden)]
pub use module::CallTarget;
pub use module::{Child, ChildMut, Mode, Module, Name, Shared};
pub use param::Param;
pub use pattern::PathPattern;
pub use state::{KeyRule, LoadOptions, LoadReport, Mismatch, StateDict};
pub use summary::{Summary, SummaryRow};
#[doc(hidden)]
pub use tree::Scope;
pub use tree::{TensorStruct, TensorTree};
pub use visit::{short_type_name, ModuleExt};

/// `#[derive(Module)]`: implements [`Module`](trait@Module) by walking the fields.
///
/// See the crate's README for the attributes: `#[module(skip)]`, `#[module(rename = "…")]`,
/// `#[module(flatten)]`, and on the type `#[module(bound = "…")]` and `#[module(crate = path)]`.
pub use module_derive::Module;

pub use candle_core;
pub use candle_nn;

/// Everything a model definition needs: `use module_runtime::prelude::*;`.
pub mod prelude {
    pub use crate::nn::Linear;
    pub use crate::{
        Buffer, Build, Error, Forward, Hooks, Lazy, LazyExt, LoadOptions, Mode, Module, ModuleExt,
        Param, Result, StateDict,
    };
    pub use candle_core::{DType, Device, Module as _, Tensor, D};
}

/// Support for the derive's expansion. Not public API.
#[doc(hidden)]
pub mod __private {
    pub use ::core;
}
