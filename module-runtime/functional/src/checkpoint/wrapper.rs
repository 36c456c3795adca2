//! Activation checkpointing by path pattern: [`CheckpointWrapper`] marks where a model can be
//! checkpointed, [`apply_activation_checkpointing`] turns it on by pattern (PyTorch's
//! `checkpoint_wrapper` and `apply_activation_checkpointing`; transformers'
//! `GradientCheckpointingLayer` and `gradient_checkpointing_enable`).
//!
//! Why a wrapper: the recomputation runs during the backward pass, after the forward's `call`
//! returned, so it must own the module and its input. The wrapper holds its module in an `Arc`
//! (as a shared module is held, and with the same transparency: paths, state dict, hooks and
//! `print(model)` are the module's), and checkpoints owned inputs (`Tensor`, tuples of tensors, a
//! `TensorStruct`), which it keeps for the recomputation.
//!
//! Turning a wrapper on from a pattern: every wrapper registers its module's address in a
//! process-wide table (removed when the last clone of the wrapper is dropped);
//! [`apply_activation_checkpointing`] walks the model, matches paths, and finds each matched
//! module's wrapper there.

use std::collections::HashMap;
use std::ops::Deref;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError, Weak};

use candle_core::Tensor;
use module_core::module::{Child, ChildMut, Module, Name};
use module_core::pattern::PathPattern;
use module_core::{CallTarget, Shared};
use module_hooks::scope::map_tree;

use super::checkpoint;
use crate::error::{CheckpointError, Error, Result};
use crate::ext::ModuleExt;
use crate::forward::Forward;
use crate::tensor_tree::TensorTree;

/// A module that activation checkpointing can be turned on for by path:
/// [`apply_activation_checkpointing`]`(&model, "layers.*")` (PyTorch's `CheckpointWrapper`, which
/// `checkpoint_wrapper(module)` makes; transformers' layers derive from
/// `GradientCheckpointingLayer` for the same reason).
///
/// Declare a field as `CheckpointWrapper<Block>` (or `Vec<CheckpointWrapper<Block>>`) and call it
/// as the block: the wrapper is transparent, as an `Arc` is — the block's paths, state-dict keys,
/// hooks, train/eval mode and `print(model)` line are unchanged, and `Deref` reaches the block's
/// fields. Off (the default), a call is the block's call. On, while gradients are recorded, the
/// call runs the block through [`checkpoint`]: its activations are dropped after the forward and
/// recomputed when the backward reaches its outputs, and the gradients are the plain run's, bit
/// for bit, dropout included (see [`checkpoint`]).
///
/// The checkpointed call keeps its input for the recomputation, so the block's input must be
/// owned (`Tensor`, a tuple of tensors, a [`TensorStruct`](module_hooks::TensorStruct)): a block that
/// takes `&Tensor` is called with a `Tensor` once it implements `Forward<Tensor>` too. Forward
/// hooks on the block fire in the forward; during the recomputation the block's own `forward`
/// runs (not its `call`), so hooks on modules inside it fire again (in a hooks run) and hooks
/// on the block itself do not.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::{Dropout, ReLU};
/// use module_runtime::{apply_activation_checkpointing, CheckpointWrapper};
///
/// #[derive(Module)]
/// struct Block {
///     fc: Linear,
///     drop: Dropout,
/// }
///
/// impl Forward<Tensor> for Block {
///     type Output = Tensor;
///     fn forward(&self, x: Tensor) -> Result<Tensor> {
///         Ok(self.drop.call(&self.fc.call(&x)?.relu()?)?)
///     }
/// }
///
/// #[derive(Module)]
/// struct Net {
///     layers: Vec<CheckpointWrapper<Block>>,
/// }
///
/// let dev = Device::Cpu;
/// let block = || -> Result<CheckpointWrapper<Block>> {
///     Ok(CheckpointWrapper::new(Block { fc: Linear::new(8, 8, &dev)?, drop: Dropout::new(0.1) }))
/// };
/// let net = Net { layers: vec![block()?, block()?] };
/// // The paths are the blocks' own.
/// assert_eq!(net.state_dict()?.keys().next(), Some("layers.0.fc.weight"));
///
/// let run = |net: &Net| -> Result<Vec<f32>> {
///     manual_seed(7);
///     let mut h = Tensor::ones((4, 8), DType::F32, &dev)?;
///     for layer in &net.layers {
///         h = layer.call(h)?;
///     }
///     let grads = h.sum_all()?.backward()?;
///     let w = net.layers[0].fc.weight.tensor()?;
///     Ok(grads.get(&w).unwrap().flatten_all()?.to_vec1()?)
/// };
/// let plain = run(&net)?;
/// // torch.distributed.algorithms._checkpoint.checkpoint_wrapper.apply_activation_checkpointing
/// assert_eq!(apply_activation_checkpointing(&net, "layers.*")?, ["layers.0", "layers.1"]);
/// assert_eq!(run(&net)?, plain);
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub struct CheckpointWrapper<M>(Arc<Wrapped<M>>);

/// The wrapped module and whether it is checkpointed.
struct Wrapped<M> {
    enabled: AtomicBool,
    module: M,
}

/// A wrapper's switch, as the registry sees it.
trait Switch: Send + Sync {
    fn set(&self, on: bool);
}

impl<M: Send + Sync> Switch for Wrapped<M> {
    fn set(&self, on: bool) {
        self.enabled.store(on, Ordering::Relaxed);
    }
}

impl<M> Drop for Wrapped<M> {
    fn drop(&mut self) {
        let key = address(&self.module);
        let mut table = registry().lock().unwrap_or_else(PoisonError::into_inner);
        // The entry is this one's unless the address was reused already, which cannot be while
        // this value still occupies it; a dead entry is removed either way.
        if table.get(&key).is_some_and(|w| w.strong_count() == 0) {
            table.remove(&key);
        }
    }
}

/// Wrapped modules by address, to their switches.
fn registry() -> &'static Mutex<HashMap<usize, Weak<dyn Switch>>> {
    static TABLE: OnceLock<Mutex<HashMap<usize, Weak<dyn Switch>>>> = OnceLock::new();
    TABLE.get_or_init(Default::default)
}

fn address<T: ?Sized>(value: &T) -> usize {
    value as *const T as *const () as usize
}

impl<M: Module> CheckpointWrapper<M> {
    /// Wraps `module`, not checkpointed until [`apply_activation_checkpointing`] (or
    /// [`set_checkpointing`](Self::set_checkpointing)) turns it on.
    pub fn new(module: M) -> Self {
        let wrapped = Arc::new(Wrapped {
            enabled: AtomicBool::new(false),
            module,
        });
        let switch: Arc<dyn Switch> = wrapped.clone();
        registry()
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(address(&wrapped.module), Arc::downgrade(&switch));
        Self(wrapped)
    }

    /// Whether calls are checkpointed (while gradients are recorded).
    pub fn is_checkpointing(&self) -> bool {
        self.0.enabled.load(Ordering::Relaxed)
    }

    /// Turns checkpointing of this module's calls on or off.
    pub fn set_checkpointing(&self, on: bool) {
        self.0.set(on);
    }
}

impl<M> Clone for CheckpointWrapper<M> {
    /// Another handle to the same module (and switch), as an `Arc` clone.
    fn clone(&self) -> Self {
        Self(self.0.clone())
    }
}

impl<M> Deref for CheckpointWrapper<M> {
    type Target = M;

    fn deref(&self) -> &M {
        &self.0.module
    }
}

impl<M: std::fmt::Debug> std::fmt::Debug for CheckpointWrapper<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.module.fmt(f)
    }
}

/// Transparent, as an `Arc<M>`: the module inside is the node, with the wrapper's identity for
/// calls made through it.
impl<M: Module> Module for CheckpointWrapper<M> {
    fn visit_children<'a>(&'a self, f: &mut dyn FnMut(Name<'_>, Child<'a>)) {
        self.0.module.visit_children(f);
    }
    fn visit_children_mut<'a>(&'a mut self, f: &mut dyn FnMut(Name<'_>, ChildMut<'a>)) {
        if let Some(w) = Arc::get_mut(&mut self.0) {
            w.module.visit_children_mut(f);
        }
    }
    fn type_name(&self) -> &'static str {
        self.0.module.type_name()
    }
    fn class_name(&self) -> String {
        self.0.module.class_name()
    }
    fn type_class_name() -> String {
        M::type_class_name()
    }
    fn extra_repr(&self) -> String {
        self.0.module.extra_repr()
    }
    fn __repr_collapses_repeats(&self) -> bool {
        self.0.module.__repr_collapses_repeats()
    }
    fn __repr_child(&self, child: &str) -> module_core::ChildRepr {
        self.0.module.__repr_child(child)
    }
    fn __repr_class(&self) -> Option<String> {
        self.0.module.__repr_class()
    }
    fn is_config() -> bool {
        M::is_config()
    }
    fn extra_state(&self) -> Option<&dyn module_core::ExtraState> {
        self.0.module.extra_state()
    }
    fn __flattened<'a>(&'a self, f: &mut dyn FnMut(&'static str, &'a dyn Module)) {
        self.0.module.__flattened(f);
    }
    fn as_child(&self) -> Child<'_> {
        match self.0.module.as_child() {
            Child::Module { module, .. } => Child::Module {
                module,
                shared: Some(Shared {
                    id: address(&*self.0),
                    holder: CallTarget::of(self),
                }),
            },
            other => other,
        }
    }
    fn as_child_mut(&mut self) -> ChildMut<'_> {
        if Arc::get_mut(&mut self.0).is_some() {
            Arc::get_mut(&mut self.0).map_or(ChildMut::Absent, |w| w.module.as_child_mut())
        } else {
            match self.0.module.as_child() {
                Child::Module { module, .. } => ChildMut::Shared(module),
                _ => ChildMut::Absent,
            }
        }
    }
}

impl<In, M> Forward<In> for CheckpointWrapper<M>
where
    M: Forward<In> + Module,
    In: TensorTree + Clone + Send + Sync + 'static,
    M::Output: TensorTree + Send + 'static,
{
    type Output = M::Output;

    fn forward(&self, input: In) -> Result<M::Output> {
        if !self.is_checkpointing() || !module_core::is_grad_enabled() {
            return self.0.module.forward(input);
        }
        let tensors = input.tensors();
        // The first run's output, its tensors detached: the structure the checkpoint's outputs
        // are put back into.
        let first: Arc<Mutex<Option<M::Output>>> = Arc::new(Mutex::new(None));
        let (inner, cell, ran) = (self.0.clone(), first.clone(), AtomicBool::new(false));
        let run = move |xs: &[Tensor]| -> Result<Vec<Tensor>> {
            let mut next = xs.iter();
            let input = map_tree(input.clone(), &mut |old| {
                next.next().cloned().unwrap_or(old)
            });
            let output = inner.module.forward(input)?;
            let tensors = output.tensors();
            if !ran.swap(true, Ordering::Relaxed) {
                let skeleton = map_tree(output, &mut |t| t.detach());
                *cell.lock().unwrap_or_else(PoisonError::into_inner) = Some(skeleton);
            }
            Ok(tensors)
        };
        let outputs = checkpoint(run, &tensors)?;
        let skeleton = first.lock().unwrap_or_else(PoisonError::into_inner).take();
        let skeleton = skeleton.ok_or(CheckpointError::NoOutput)?;
        let mut next = outputs.into_iter();
        Ok(map_tree(skeleton, &mut |old| next.next().unwrap_or(old)))
    }
}

/// Turns activation checkpointing on for every [`CheckpointWrapper`] of `model` whose path
/// matches `pattern` (`"layers.*"`, `"model.layers.*"`): PyTorch's
/// `apply_activation_checkpointing(model, check_fn=...)`, transformers'
/// `model.gradient_checkpointing_enable()`. Returns the paths turned on, in walk order.
///
/// A pattern that matches no module is [`Error::NoModuleMatch`] (with the paths most alike);
/// one whose matches include no wrapper is [`CheckpointError::NotWrapped`], naming the first
/// match and its class. Matched modules that are not wrappers (with `**`, a wrapper's
/// submodules) are left alone. Nothing changes on an error.
pub fn apply_activation_checkpointing<M: Module>(model: &M, pattern: &str) -> Result<Vec<String>> {
    switch_matching(model, pattern, true)
}

/// Turns activation checkpointing off for the [`CheckpointWrapper`]s of `model` whose path
/// matches `pattern` (transformers' `gradient_checkpointing_disable()`), with the errors of
/// [`apply_activation_checkpointing`]. Returns the paths turned off.
pub fn remove_activation_checkpointing<M: Module>(model: &M, pattern: &str) -> Result<Vec<String>> {
    switch_matching(model, pattern, false)
}

fn switch_matching<M: Module>(model: &M, pattern: &str, on: bool) -> Result<Vec<String>> {
    let compiled = PathPattern::new(pattern)?;
    let modules = model.named_modules();
    let matched: Vec<&(String, &dyn Module)> = modules
        .iter()
        .filter(|(path, _)| compiled.matches(path))
        .collect();
    let Some((first_path, first)) = matched.first() else {
        return Err(Error::NoModuleMatch {
            what: "activation checkpointing",
            pattern: pattern.to_owned(),
            near: module_state::transform::near(pattern, modules.iter().map(|(p, _)| p.as_str())),
        });
    };
    let switches: Vec<(String, Arc<dyn Switch>)> = {
        let table = registry().lock().unwrap_or_else(PoisonError::into_inner);
        matched
            .iter()
            .filter_map(|(path, m)| {
                let switch = table.get(&address(*m))?.upgrade()?;
                Some((path.clone(), switch))
            })
            .collect()
    };
    if switches.is_empty() {
        return Err(CheckpointError::NotWrapped {
            pattern: pattern.to_owned(),
            path: first_path.clone(),
            class: first.class_name(),
        }
        .into());
    }
    Ok(switches
        .into_iter()
        .map(|(path, switch)| {
            switch.set(on);
            path
        })
        .collect())
}
