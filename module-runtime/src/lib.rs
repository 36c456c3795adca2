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

// The layers, bottom up. The core (Module, Param/Buffer, the walk, names, paths, patterns,
// identity, the functional scope, errors with all their payloads) is the crate `module-core`;
// state dicts and files (StateDict, LoadOptions, .pth and safetensors, checkpoints) are
// `module-state`, on the core; calls and hooks (TensorTree, Hooks, Captures, Dataflow) and
// ModuleExt are `module-hooks`, on both. None of them can name anything here. The files still in this crate are the layers above it, moving
// into crates of their own (issue 27):
//   functional/, distributed/                         functional calls, data-parallel training
// The core's modules, under the names the files above it use (`crate::param::Param`).
use module_core::{
    buffer, error, forward, identity, module, names, param, report, scope, views, walk,
};
// The state layer's modules (`module-state`), likewise.
use module_state::{state, suggest};
// The hooks layer's modules (`module-hooks`), likewise.
use module_hooks::{ext, hooks, tensor_tree};
/// Layers, written with `#[derive(Module)]`, with PyTorch's names, parameters and defaults (the
/// crate `module-nn`).
pub use module_nn as nn;
pub mod distributed;
mod functional;

pub use functional::{FlatSpec, FunctionalExt, FunctionalOptions, TensorSpec};
pub use module_core::buffer::Buffer;
pub use module_core::device::{device_name, parse_device};
pub use module_core::error::{Error, Result};
pub use module_core::extra_state::{
    extra_state_from_bytes, extra_state_to_bytes, ExtraState, EXTRA_STATE_KEY,
};
pub use module_core::forward::Forward;
pub use module_core::grad_mode::{
    enable_grad, inference_mode, is_grad_enabled, no_grad, without_grad, GradModeGuard,
};
#[doc(hidden)]
pub use module_core::identity::CallTarget;
pub use module_core::identity::Shared;
pub use module_core::lazy_cell::{build_empty, empty_weights, EmptyWeightsGuard, Init, InitFn};
pub use module_core::lazy_shape::LazyShape;
pub use module_core::module::{Child, ChildMut, Mode, Module, Name};
pub use module_core::names::Names;
pub use module_core::param::Param;
pub use module_core::pattern::PathPattern;
pub use module_core::report::{LoadReport, Mismatch};
pub use module_core::summary::{Summary, SummaryRow};
pub use module_core::type_name::short_type_name;
pub use module_core::typed_path;
pub use module_core::typed_path::{HasPath, PathExt, TypedPath};
pub use module_core::{
    DistributedError, KeyFix, KeyRule, OutputDivergence, PthErrorKind, Tolerance,
};
pub use module_hooks::ModuleExt;
#[doc(hidden)]
pub use module_hooks::Scope;
pub use module_hooks::{
    Captures, ForwardHookFn, HookCtx, HookHandle, HookOptions, Hooks, PreHookFn, PreHookOptions,
};
pub use module_hooks::{Dataflow, DataflowEdge, DataflowNode, NodeKind};
pub use module_hooks::{TensorStruct, TensorTree};
pub use module_nn::Recurrent;
pub use module_nn::{Build, Lazy, LazyExt};
pub use module_state::Checkpoint;
pub use module_state::{IncompatibleKeys, LoadPostHookFn};
pub use module_state::{LoadOptions, StateDict};

/// `#[derive(Module)]`: implements [`Module`](trait@Module) by walking the fields.
///
/// The documentation below (`module_derive`'s, whose examples are its doctests) shows what the
/// derive lists and how it names it, then each attribute with a runnable example: on fields
/// `#[module(skip)]`, `#[module(rename = "…")]` and `#[module(flatten)]`; on the type
/// `#[module(extra_state)]` (with [`ExtraState`]), `#[module(paths)]` ([`typed_path`]),
/// `#[module(bound = "…")]` and `#[module(crate = path)]`; then tuple structs, enums and generics.
/// The examples read the names through [`ModuleExt`] (`named_parameters`, `named_modules`,
/// `state_dict`).
pub use module_derive::Module;

/// `#[derive(TensorStruct)]`: implements [`TensorStruct`](trait@TensorStruct) for a struct whose
/// fields are tensors or [`TensorTree`]s, so it can be a module's input or output with [`Hooks`]
/// seeing its tensors. The documentation below (`module_derive`'s) has runnable examples: the
/// field order, `#[tensor(skip)]`, and hooks replacing a derived input's tensors.
pub use module_derive::TensorStruct;

pub use candle_core;
pub use candle_nn;

/// Everything a model definition needs: `use module_runtime::prelude::*;`.
///
/// It brings this crate's [`Forward`] into scope and not candle's `Module` trait, so
/// `layer.forward(&x)` on a runtime layer is this crate's forward, never ambiguous (E0034). The
/// runtime's layers and derived models that implement candle's `Module` stay usable from candle
/// code, which needs no import: `x.apply(&layer)`.
///
/// ```
/// use module_runtime::prelude::*;
/// let layer = Linear::new(3, 2, &Device::Cpu)?;
/// let x = Tensor::ones((4, 3), DType::F32, &Device::Cpu)?;
/// let a = layer.forward(&x)?; // `Forward::forward`
/// let b = x.apply(&layer)?; // candle's `Module`, as candle code calls it
/// assert_eq!(a.to_vec2::<f32>()?, b.to_vec2::<f32>()?);
/// # Ok::<(), module_runtime::Error>(())
/// ```
///
/// It also brings the inference and loading helpers the README writes bare: [`no_grad`],
/// [`enable_grad`], [`without_grad`], [`build_empty`], and [`Tolerance`] for
/// [`expect_outputs`](crate::FunctionalExt::expect_outputs).
pub mod prelude {
    pub use crate::nn::Linear;
    pub use crate::Recurrent;
    pub use crate::{build_empty, enable_grad, no_grad, without_grad};
    pub use crate::{
        Buffer, Build, Error, Forward, FunctionalExt, HookOptions, Hooks, Lazy, LazyExt,
        LoadOptions, Mode, Module, ModuleExt, Param, PreHookOptions, Result, StateDict,
        TensorStruct, Tolerance,
    };
    pub use candle_core::{DType, Device, Tensor, D};
}

/// Support for the derive's expansion. Not public API.
#[doc(hidden)]
pub mod __private {
    pub use ::core;

    /// `#[derive(TensorStruct)]`'s `map_tensors` on one field.
    pub fn map_tree<T: crate::TensorTree>(
        tree: T,
        f: &mut dyn FnMut(crate::candle_core::Tensor) -> crate::candle_core::Tensor,
    ) -> T {
        crate::hooks::dispatch::map_tree(tree, f)
    }

    /// `#[derive(TensorStruct)]`'s `clone_tree`: `Some(clone)` when the struct is `Clone`, `None`
    /// otherwise, chosen by method resolution on `(&CloneProbe(value)).clone_tree()` (the
    /// by-value candidate, [`ViaClone`], needs `Clone`; the auto-referenced one, [`ViaNone`], is
    /// the fallback).
    pub struct CloneProbe<'a, T>(pub &'a T);

    /// The `Clone` case of [`CloneProbe`].
    pub trait ViaClone<T> {
        /// A clone.
        fn clone_tree(&self) -> Option<T>;
    }

    impl<T: Clone> ViaClone<T> for CloneProbe<'_, T> {
        fn clone_tree(&self) -> Option<T> {
            Some(self.0.clone())
        }
    }

    /// The fallback of [`CloneProbe`].
    pub trait ViaNone<T> {
        /// No copy.
        fn clone_tree(&self) -> Option<T>;
    }

    impl<T> ViaNone<T> for &CloneProbe<'_, T> {
        fn clone_tree(&self) -> Option<T> {
            None
        }
    }
}
