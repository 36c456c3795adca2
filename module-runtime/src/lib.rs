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

// This crate is the façade: the runtime is seven crates, one per layer, and the compiler holds
// their direction (a crate cannot name one above it). Bottom up:
//
//   module-core        Module, Param/Buffer/Mode, identity, lazy cells, the walk, names, paths,
//                      patterns, typed paths, the functional scope, grad mode, Forward, summaries,
//                      and Error with every payload it carries (load reports, key rules, ...)
//   module-state       StateDict, LoadOptions, the all-or-nothing load, .pth and safetensors
//                      files, Checkpoint                                         (on core)
//   module-hooks       TensorTree, Hooks, Captures, Dataflow, and ModuleExt, the methods every
//                      module has                                         (on core, state)
//   module-nn          the layers, Lazy, Recurrent                   (on core, state, hooks)
//   module-functional  FunctionalExt: functional_call, call_and_update, deep_clone, flatten,
//                      expect_outputs, checkpoint           (on core, state, hooks, kernels)
//   module-distributed DistributedDataParallel, collectives, DistributedSampler
//                                                                           (on core, hooks)
//   module-optim       optimizers, parameter groups, clipping, schedules, optimizer state
//                                                                    (on core, state, hooks)
//
// Every public item keeps the path it had before the split (`module_runtime::Param`,
// `module_runtime::nn::Linear`, `module_runtime::distributed::Mpi`); the optimizers are
// `module_runtime::optim`, the common ones also in the prelude.
#[doc(inline)]
pub use module_core::typed_path;
/// Data-parallel training (the crate `module-distributed`).
#[doc(inline)]
pub use module_distributed as distributed;
/// Layers, written with `#[derive(Module)]`, with PyTorch's names, parameters and defaults (the
/// crate `module-nn`).
#[doc(inline)]
pub use module_nn as nn;
/// PyTorch's `torch.optim` (the crate `module-optim`): `SGD`, `Adam`, `AdamW`, parameter groups
/// by path pattern, gradient clipping and accumulation, learning-rate schedules, and the
/// optimizer's state keyed by parameter path.
#[doc(inline)]
pub use module_optim as optim;

pub use module_core::atomic_update;
/// The runtime's random generator, PyTorch's default generator: what it covers, what it does not.
#[doc(inline)]
pub use module_core::random;
pub use module_core::BackwardHookError;
#[doc(hidden)]
pub use module_core::CallTarget;
pub use module_core::CheckpointError;
pub use module_core::{
    build_empty, device_name, empty_weights, enable_grad, extra_state_from_bytes,
    extra_state_to_bytes, generic_class_name, inference_mode, is_grad_enabled, module_repr,
    no_grad, parse_device, py_bool, py_float, py_tuple, short_type_name, without_grad, Buffer,
    Child, ChildMut, ChildRepr, EmptyWeightsGuard, Error, ExtraRepr, ExtraState, Forward,
    GgufErrorKind, GradModeGuard, HasPath, Init, InitFn, KeyFix, KeyRule, LazyShape, LoadReport,
    Mismatch, Mode, Module, Name, Names, OutputDivergence, Param, ParametrizeError, PathExt,
    PathPattern, PeftError, PthErrorKind, QuantizeError, QuantizedLayout, Result, Shared, Summary,
    SummaryRow, Tolerance, TypedPath, EXTRA_STATE_KEY,
};
pub use module_core::{get_rng_state, initial_seed, manual_seed, rand, randn, set_rng_state};
/// Device maps and offload: the error and what an offloaded parameter reads from (the map itself
/// is [`nn::big_modeling`]).
pub use module_core::{DeviceMapError, OffloadSource};
pub use module_functional::{
    apply_activation_checkpointing, checkpoint, remove_activation_checkpointing, CheckpointWrapper,
    FlatSpec, FunctionalExt, FunctionalOptions, TensorSpec,
};
#[doc(hidden)]
pub use module_hooks::Scope;
pub use module_hooks::{
    register_hook, BackwardHookCtx, BackwardHookFn, BackwardHookOptions, BackwardPreHookFn,
    TensorHookFn,
};
pub use module_hooks::{
    Captures, Dataflow, DataflowEdge, DataflowNode, ForwardHookFn, HookCtx, HookHandle,
    HookOptions, Hooks, ModuleExt, NodeKind, PreHookFn, PreHookOptions, TensorStruct, TensorTree,
};
pub use module_kernels::{return_freed_memory, reuse_freed_memory};

/// PyTorch's `torch.amp`: mixed precision. [`autocast`](amp::autocast) runs a closure with each
/// of the runtime's ops in the precision PyTorch's per-op lists give it (products and
/// convolutions in bfloat16 or float16, losses in float32, on CUDA softmax and norms in float32
/// too), the parameters staying float32; [`GradScaler`](amp::GradScaler) scales a float16 loss.
/// [`autocast_cast`](amp::autocast_cast) and [`promote`](amp::promote) give code that calls
/// candle's ops directly the same policy.
pub mod amp {
    pub use module_core::autocast::{
        active_dtype, autocast, autocast_cache_len, autocast_cached, clear_autocast_cache,
        get_autocast_dtype, is_autocast_enabled, Autocast, AutocastState, DeviceType,
    };
    pub use module_core::autocast_policy::{
        autocast_cast, autocast_cast_opt, autocast_target, promote, promote_types, AutocastOp,
        CastPolicy,
    };
    pub use module_optim::{GradScaler, GradScalerOptions};
}

/// PyTorch's `torch.backends`: what the runtime's kernels run on.
pub mod backends {
    /// PyTorch's `torch.backends.cpu`: the instruction sets the CPU kernels use, chosen at run time
    /// for the host (`get_cpu_capability`, `ATEN_CPU_CAPABILITY`), a per-thread setting that forces
    /// one (`with_cpu_capability`), and the choice each operation takes (`kernel_choice`).
    pub mod cpu {
        pub use module_kernels::{
            get_cpu_capability, kernel_choice, with_cpu_capability, CpuCapability, KernelChoice,
        };
    }
}
pub use module_nn::{Build, Lazy, LazyExt, Recurrent};
pub use module_state::{
    permute_rows, Checkpoint, FromPyValue, GgufFile, GgufValue, IncompatibleKeys, LoadOptions,
    LoadPostHookFn, PthValues, PyValue, StateDict,
};
// Load transforms and state-dict hooks (issue 43).
pub use module_core::{TransformError, TransformReport};
pub use module_state::{
    HookTarget, LoadPreHookFn, LoadingStateDict, StateDictHookHandle, StateDictHooks,
    StateDictPostHookFn,
};

/// `#[derive(Module)]`: implements [`Module`](trait@Module) by walking the fields.
///
/// The documentation below (`module_derive`'s, whose examples are its doctests) shows what the
/// derive lists and how it names it, then each attribute with a runnable example: on fields
/// `#[module(skip)]`, `#[module(rename = "…")]` and `#[module(flatten)]`; on the type
/// `#[module(extra_state)]` (with [`ExtraState`]), `#[module(extra_repr)]` (with [`ExtraRepr`]),
/// `#[module(no_display)]`, `#[module(class_name = …)]` ([`Module::type_class_name`]),
/// `#[module(paths)]` ([`typed_path`]),
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
/// [`enable_grad`], [`without_grad`], [`build_empty`], [`manual_seed`], and [`Tolerance`] for
/// [`expect_outputs`](crate::FunctionalExt::expect_outputs), and [`quantize`](crate::nn::quantize)
/// with its kinds ([`GgmlDType`](crate::nn::GgmlDType)) for quantized weights.
///
/// And what a training loop needs from [`optim`], with `torch.optim`'s names: the
/// [`Optimizer`](crate::optim::Optimizer) trait, [`SGD`](crate::optim::SGD),
/// [`Adam`](crate::optim::Adam), [`AdamW`](crate::optim::AdamW),
/// [`ParamGroups`](crate::optim::ParamGroups), [`clip_grad_norm`](crate::optim::clip_grad_norm)
/// (`clip_grad_norm_`), [`clip_grad_value`](crate::optim::clip_grad_value),
/// [`GradAccumulator`](crate::optim::GradAccumulator), and the schedules
/// ([`LrScheduler`](crate::optim::LrScheduler), [`LambdaLr`](crate::optim::LambdaLr),
/// [`StepLr`](crate::optim::StepLr), [`ExponentialLr`](crate::optim::ExponentialLr)), and the
/// whole run's checkpoint ([`TrainingCheckpoint`](crate::optim::TrainingCheckpoint),
/// [`TrainerState`](crate::optim::TrainerState)). The
/// optimizers' own `Error` and `Result` stay in [`optim`]: the prelude's are the runtime's.
///
/// ```
/// use module_runtime::prelude::*;
/// let model = Linear::new(2, 1, &Device::Cpu)?;
/// let mut opt = AdamW::new(&model, AdamW::options().lr(0.1))?;
/// let x = Tensor::new(&[[1f32, 2.0]], &Device::Cpu)?;
/// let loss = model.call(&x)?.sqr()?.sum_all()?;
/// let mut grads = loss.backward()?;
/// clip_grad_norm(&mut grads, opt.params(), 1.0, 2.0, false)?;
/// opt.step(&grads)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub mod prelude {
    pub use crate::nn::{quantize, GgmlDType, Linear};
    pub use crate::optim::{
        clip_grad_norm, clip_grad_value, Adam, AdamW, ExponentialLr, GradAccumulator, LambdaLr,
        LrScheduler, Optimizer, ParamGroups, StepLr, TrainerState, TrainingCheckpoint, SGD,
    };
    pub use crate::Recurrent;
    pub use crate::{build_empty, enable_grad, manual_seed, no_grad, without_grad};
    pub use crate::{register_hook, BackwardHookOptions};
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
        module_hooks::scope::map_tree(tree, f)
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
