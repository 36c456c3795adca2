//! Lazy build: parameters, buffers and submodules whose shapes come from the first input
//! (PyTorch's `LazyLinear`, Keras' `build`, babilim's native modules).
//!
//! Three pieces, from the bottom up:
//!
//! - **Lazy parameters and buffers** ([`Param::lazy`], [`Buffer::lazy`](module_core::Buffer::lazy)): a [`LazyShape`](module_core::LazyShape) with
//!   unknown dimensions and an [`Init`](module_core::Init) recipe, materialized exactly once
//!   ([`Param::materialize`]) by whichever thread gets there first. Until then they are *unbuilt*:
//!   traversal lists them ([`Param::is_built`] says which), `to_device`/`to_dtype` record the
//!   target, loading a checkpoint materializes them from its shapes, and
//!   [`trainable_vars`](crate::ModuleExt::trainable_vars), [`state_dict`](crate::ModuleExt::state_dict)
//!   and saving fail with [`Error::Unbuilt`](module_core::Error::Unbuilt), listing every unbuilt path. The lazy layers of
//!   [`nn`](crate) (`LazyLinear`, `LazyConv2d`, …) are built on them.
//! - **[`Lazy<M>`]**: a field holding a submodule that a module of your own builds from its first
//!   input, once, with no interior mutability in your code; [`Build`] is the Keras-style way to
//!   write that build next to `forward`.
//! - **[`LazyExt::build`]**: an explicit dry run on a sample input that builds everything and
//!   records no gradient.
//!
//! ```
//! use module_runtime::prelude::*;
//! use module_runtime::nn::LazyLinear;
//!
//! let fc = LazyLinear::new(10, &Device::Cpu)?;
//! assert!(!fc.is_built());
//! assert!(fc.trainable_vars().is_err()); // "… unbuilt: weight, bias …"
//! let y = fc.call(&Tensor::zeros((5, 7), DType::F32, &Device::Cpu)?)?;
//! assert_eq!(y.dims(), [5, 10]);
//! assert_eq!(fc.weight.shape().dims(), [10, 7]);
//! # Ok::<(), module_runtime::Error>(())
//! ```

use std::fmt;
use std::sync::{Mutex, OnceLock, PoisonError};

use crate::error::Result;
use crate::ext::ModuleExt;
use crate::forward::Forward;
use crate::identity::CallTarget;
use crate::module::{Child, ChildMut, Mode, Module, Name};
use crate::param::Param;
use crate::walk::{walk, Visit};

/// A submodule built from the first input of the module holding it: the lazily-built state of a
/// module of your own (Keras' `build`, babilim's native modules), with no interior mutability in
/// your code.
///
/// Built once, by the first of [`get_or_build`](Self::get_or_build) (usually through
/// [`Build::built`] in `forward`), [`LazyExt::build`] or construction from a built value
/// ([`Lazy::from`]); thread-safe, and a built cell costs one atomic load to read (and
/// [`get_or_build`](Self::get_or_build) one thread-local read, to tell hooks about the build).
///
/// In traversal a built cell *is* the module it holds, at the field's path (like `Box`). An unbuilt
/// cell is a module with no children, listed by [`LazyExt::unbuilt_paths`]: its parameters do not
/// exist yet, so `trainable_vars`, `state_dict` and loading a checkpoint fail until it is built
/// (a checkpoint cannot say what a build would have made, unlike for a lazy parameter, whose
/// layout is fixed). Cloning a built cell clones the module (whose parameters stay the same
/// parameters); cloning an unbuilt one gives another unbuilt cell.
///
/// ```
/// use module_runtime::prelude::*;
///
/// /// Scales each feature by a learned factor; the number of features comes from the input.
/// #[derive(Module, Default)]
/// struct FeatureScale {
///     scale: Lazy<Param>,
/// }
///
/// impl Forward<&Tensor> for FeatureScale {
///     type Output = Tensor;
///     fn forward(&self, x: &Tensor) -> Result<Tensor> {
///         let scale = self.scale.get_or_build(|| {
///             Param::new(Tensor::ones(x.dim(D::Minus1)?, x.dtype(), x.device())?)
///         })?;
///         Ok(x.broadcast_mul(&scale.tensor()?)?)
///     }
/// }
///
/// let m = FeatureScale::default();
/// assert_eq!(m.unbuilt_paths(), ["scale"]);
/// m.call(&Tensor::ones((2, 3), DType::F32, &Device::Cpu)?)?;
/// assert_eq!(m.named_parameters()[0].0, "scale");
/// assert_eq!(m.named_parameters()[0].1.shape().dims(), [3]);
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub struct Lazy<M> {
    cell: OnceLock<M>,
    /// Serializes builds, so a build runs once even when it fails in one thread and another retries.
    building: Mutex<()>,
}

impl<M> Lazy<M> {
    /// An unbuilt cell.
    pub fn new() -> Self {
        Self {
            cell: OnceLock::new(),
            building: Mutex::new(()),
        }
    }

    /// The module, once built.
    pub fn get(&self) -> Option<&M> {
        self.cell.get()
    }

    /// The module, mutably, once built (the parametrizations' registration reaches a layer in a
    /// cell through it).
    pub(crate) fn get_mut(&mut self) -> Option<&mut M> {
        self.cell.get_mut()
    }

    /// Whether the module has been built.
    pub fn is_built(&self) -> bool {
        self.cell.get().is_some()
    }

    /// The module, if built.
    pub fn into_inner(self) -> Option<M> {
        self.cell.into_inner()
    }
}

impl<M> Default for Lazy<M> {
    fn default() -> Self {
        Self::new()
    }
}

impl<M> From<M> for Lazy<M> {
    /// A cell built at construction.
    fn from(module: M) -> Self {
        Self {
            cell: OnceLock::from(module),
            building: Mutex::new(()),
        }
    }
}

impl<M: Clone> Clone for Lazy<M> {
    fn clone(&self) -> Self {
        match self.cell.get() {
            Some(m) => Self::from(m.clone()),
            None => Self::new(),
        }
    }
}

impl<M: fmt::Debug> fmt::Debug for Lazy<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.cell.get() {
            Some(m) => f.debug_tuple("Lazy").field(m).finish(),
            None => f.write_str("Lazy(<unbuilt>)"),
        }
    }
}

impl<M: Module> Lazy<M> {
    /// The module, building it with `build` if this is the first use. Concurrent first uses build
    /// once: the others wait and get the same module. If `build` fails, the cell stays unbuilt
    /// and the error is returned (a later call tries again).
    ///
    /// With hooks attached on this thread ([`Hooks::run`](module_hooks::Hooks::run)), a cell built
    /// during the run, here or on another thread, joins the hooked tree, so that the calls of the
    /// modules inside it find their paths and hooks.
    pub fn get_or_build(&self, build: impl FnOnce() -> Result<M>) -> Result<&M> {
        let m = match self.cell.get() {
            Some(m) => m,
            None => self.build(build)?,
        };
        if crate::hooks::dispatch::active() {
            crate::hooks::dispatch::grown(CallTarget::of(self), m);
        }
        Ok(m)
    }

    #[cold]
    fn build(&self, build: impl FnOnce() -> Result<M>) -> Result<&M> {
        let _building = self.building.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(m) = self.cell.get() {
            return Ok(m);
        }
        let m = build()?;
        Ok(self.cell.get_or_init(|| m))
    }
}

/// Built: the module inside, at this path. Unbuilt: an empty module that reports itself unbuilt.
#[diagnostic::do_not_recommend]
impl<M: Module> Module for Lazy<M> {
    fn visit_children<'a>(&'a self, f: &mut dyn FnMut(Name<'_>, Child<'a>)) {
        if let Some(m) = self.cell.get() {
            m.visit_children(f);
        }
    }
    fn visit_children_mut<'a>(&'a mut self, f: &mut dyn FnMut(Name<'_>, ChildMut<'a>)) {
        if let Some(m) = self.cell.get_mut() {
            m.visit_children_mut(f);
        }
    }
    fn type_name(&self) -> &'static str {
        match self.cell.get() {
            Some(m) => m.type_name(),
            None => std::any::type_name::<Self>(),
        }
    }
    fn class_name(&self) -> String {
        match self.cell.get() {
            Some(m) => m.class_name(),
            None => Self::type_class_name(),
        }
    }
    fn type_class_name() -> String {
        let args = [(std::any::type_name::<M>(), M::type_class_name())];
        module_core::generic_class_name(std::any::type_name::<Self>(), &args)
    }
    fn extra_repr(&self) -> String {
        self.cell.get().map_or_else(String::new, |m| m.extra_repr())
    }
    fn as_child(&self) -> Child<'_> {
        match self.cell.get() {
            Some(m) => m.as_child(),
            None => Child::Module {
                module: self,
                shared: None,
            },
        }
    }
    fn as_child_mut(&mut self) -> ChildMut<'_> {
        if self.cell.get().is_some() {
            self.cell
                .get_mut()
                .map_or(ChildMut::Absent, M::as_child_mut)
        } else {
            ChildMut::Module(self)
        }
    }
    fn __call_target(&self) -> CallTarget {
        match self.cell.get() {
            Some(m) => m.__call_target(),
            None => CallTarget::of(self),
        }
    }
    fn __unbuilt(&self) -> bool {
        self.cell.get().is_none()
    }
}

/// A module of your own that builds part of itself from its first input (Keras' `Layer.build`,
/// babilim's `build`): the configuration stays in ordinary fields, what the input decides goes in
/// a [`Lazy`] field, and `forward` starts with [`built`](Self::built).
///
/// `build_state` runs once, with the same input as the first `forward` (whether that is the first
/// call or an explicit [`LazyExt::build`] dry run); to build at construction instead, fill the
/// field with `Lazy::from(state)`.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::{LayerNorm, Linear};
///
/// /// A residual block `x + proj(norm(x))` whose width is the input's.
/// #[derive(Module)]
/// struct Residual {
///     block: Lazy<Block>,
/// }
///
/// #[derive(Module)]
/// struct Block {
///     norm: LayerNorm,
///     proj: Linear,
/// }
///
/// impl Build<&Tensor> for Residual {
///     type State = Block;
///     fn state(&self) -> &Lazy<Block> {
///         &self.block
///     }
///     fn build_state(&self, x: &Tensor) -> Result<Block> {
///         let width = x.dim(D::Minus1)?;
///         Ok(Block {
///             norm: LayerNorm::new(width, x.device())?,
///             proj: Linear::new(width, width, x.device())?,
///         })
///     }
/// }
///
/// impl Forward<&Tensor> for Residual {
///     type Output = Tensor;
///     fn forward(&self, x: &Tensor) -> Result<Tensor> {
///         let block = self.built(x)?;
///         Ok((x + block.proj.call(&block.norm.call(x)?)?)?)
///     }
/// }
///
/// let model = Residual { block: Lazy::new() };
/// model.build(&Tensor::zeros((1, 6), DType::F32, &Device::Cpu)?)?;
/// let names: Vec<_> = model.named_parameters().into_iter().map(|(n, _)| n).collect();
/// assert_eq!(names, ["block.norm.weight", "block.norm.bias", "block.proj.weight", "block.proj.bias"]);
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub trait Build<In> {
    /// What the first input decides: parameters, sublayers.
    type State: Module;

    /// The field holding the state.
    fn state(&self) -> &Lazy<Self::State>;

    /// Makes the state from the first input.
    fn build_state(&self, input: In) -> Result<Self::State>;

    /// The state, built from `input` if this is the first use (once, thread-safe).
    fn built(&self, input: In) -> Result<&Self::State> {
        self.state().get_or_build(|| self.build_state(input))
    }
}

/// Building and inspecting lazy models; in the prelude, implemented for every module.
pub trait LazyExt: ModuleExt {
    /// Builds every lazy part of the model with a dry run of `forward` on `sample` (PyTorch's
    /// "call it once on a dummy batch", as one explicit step).
    ///
    /// The dry run records no gradient and changes no state but the build itself: every parameter
    /// (built or not) is read frozen, so no autograd graph is recorded, and the model runs in
    /// evaluation mode, so Dropout is off and BatchNorm's running statistics are not updated. The
    /// `requires_grad` flags and train/eval modes are restored afterwards, also on error; the
    /// output is dropped. (Parameters that a [`Lazy`] cell *creates* during the run are read as
    /// usual, but nothing of the run is kept.) The flags being the model's own, do not build a
    /// model while another thread trains it.
    ///
    /// ```
    /// use module_runtime::prelude::*;
    /// use module_runtime::nn::LazyLinear;
    ///
    /// let fc = LazyLinear::new(3, &Device::Cpu)?;
    /// fc.build(&Tensor::zeros((1, 8), DType::F32, &Device::Cpu)?)?;
    /// assert!(fc.is_built());
    /// assert!(fc.weight.requires_grad());
    /// assert_eq!(fc.weight.shape().dims(), [3, 8]);
    /// # Ok::<(), module_runtime::Error>(())
    /// ```
    fn build<In>(&self, sample: In) -> Result<()>
    where
        Self: Forward<In> + Sized,
    {
        let _dry_run = DryRun::enter(self.as_dyn());
        self.forward(sample).map(drop)
    }

    /// The path of every unbuilt parameter, buffer and [`Lazy`] cell, each once, in declaration
    /// order.
    fn unbuilt_paths(&self) -> Vec<String> {
        crate::views::unbuilt_paths(self.as_dyn())
    }

    /// Whether nothing in the model is unbuilt.
    fn is_built(&self) -> bool {
        self.unbuilt_paths().is_empty()
    }
}

impl<T: ModuleExt + ?Sized> LazyExt for T {}

/// Freezes every parameter and puts every module in evaluation mode until dropped, then restores
/// each flag as it was.
struct DryRun<'a> {
    params: Vec<(Param, bool)>,
    modes: Vec<(&'a Mode, bool)>,
}

impl<'a> DryRun<'a> {
    fn enter(root: &'a dyn Module) -> Self {
        let mut params = Vec::new();
        let mut modes = Vec::new();
        walk(root, true, &mut |_, v| {
            match v {
                Visit::Param(p) => params.push((p.clone(), p.requires_grad())),
                Visit::Mode(m) => modes.push((m, m.is_training())),
                Visit::Module(_) | Visit::Buffer(_) | Visit::Extra(_) => {}
            }
            true
        });
        for (p, _) in &params {
            p.set_requires_grad(false);
        }
        for (m, _) in &modes {
            m.set_training(false);
        }
        Self { params, modes }
    }
}

impl Drop for DryRun<'_> {
    fn drop(&mut self) {
        for (p, requires_grad) in &self.params {
            p.set_requires_grad(*requires_grad);
        }
        for (m, training) in &self.modes {
            m.set_training(*training);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Error;
    use candle_core::{DType, Device, Tensor};

    #[test]
    fn a_failed_cell_build_leaves_it_unbuilt() {
        let cell: Lazy<Param> = Lazy::new();
        let err = cell.get_or_build(|| {
            Err(Error::Unbuilt {
                action: "test",
                paths: vec![],
            })
        });
        assert!(err.is_err());
        assert!(!cell.is_built());
        let p = cell
            .get_or_build(|| Param::new(Tensor::zeros(2, DType::F32, &Device::Cpu)?))
            .unwrap();
        assert_eq!(p.elem_count(), 2);
    }
}
