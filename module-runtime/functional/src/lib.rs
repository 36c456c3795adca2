//! Functional calls: run a model on tensors given by path without changing it
//! (`torch.func.functional_call`), state as a value (Oryx's `call_and_update`, JAX-style
//! `flatten`), independent copies (`copy.deepcopy`), checking submodule outputs against
//! expected ones (Ivy's `expected_submod_rets`), and activation checkpointing
//! (`torch.utils.checkpoint`: [`checkpoint`]).
#![warn(missing_docs)]

mod checkpoint;
mod deep_clone;
mod expect;
mod flat;

use std::collections::HashMap;

use candle_core::Tensor;

use module_core::{
    buffer, error, forward, identity, module, names, param, report, scope, views, walk,
};
use module_hooks::{ext, hooks, tensor_tree};
use module_state::{state, suggest};

use crate::buffer::Buffer;
use crate::error::{Error, Result};
use crate::ext::ModuleExt;
use crate::forward::Forward;
use crate::identity::IdentitySet;
use crate::module::Module;
use crate::param::Param;
use crate::report::{LoadReport, Mismatch};
use crate::state::StateDict;
use crate::tensor_tree::TensorTree;
use crate::walk::{walk, Visit};
use module_core::Tolerance;
use module_hooks::Captures;

use crate::scope::{Frame, ScopeGuard};
pub use checkpoint::{
    apply_activation_checkpointing, checkpoint, remove_activation_checkpointing, CheckpointWrapper,
};
pub use flat::{FlatSpec, TensorSpec};

/// Options for [`FunctionalExt::functional_call_with`].
///
/// The default is PyTorch's `torch.func.functional_call(..., tie_weights=True, strict=False)`:
/// the given tensors may be any subset of the model's parameters and buffers (the others keep
/// their values), and a value given for one alias of a tied weight is used for all of them.
///
/// One deviation: a key that names no parameter or buffer of the model is an error even when not
/// strict (a typo would otherwise silently change nothing); [`allow_unexpected`](Self::allow_unexpected)
/// ignores such keys. In PyTorch such a key either fails with an `AttributeError` (no such
/// submodule) or sets a stray attribute that the forward never reads.
#[derive(Clone, Debug, Default)]
pub struct FunctionalOptions {
    strict: bool,
    allow_unexpected: bool,
}

impl FunctionalOptions {
    /// Every parameter and buffer of the model must be given a value (PyTorch's `strict=True`):
    /// missing keys fail the call with [`Error::Load`], as in a strict load. A value given for one
    /// alias of a tied weight counts for all its aliases (PyTorch unties the map before checking
    /// keys).
    pub fn strict(mut self) -> Self {
        self.strict = true;
        self
    }

    /// Whether missing keys fail the call.
    pub fn is_strict(&self) -> bool {
        self.strict
    }

    /// Ignores keys that name nothing in the model (not with [`strict`](Self::strict), which
    /// reports them as PyTorch does).
    pub fn allow_unexpected(mut self) -> Self {
        self.allow_unexpected = true;
        self
    }
}

/// Functional calls and state as a value, on every [`Module`](trait@Module). In the
/// [prelude](../module_runtime/prelude/index.html).
///
/// # How a functional call works
///
/// PyTorch swaps the given tensors into the module's attributes for the duration of the call and
/// swaps the originals back afterwards (`torch/nn/utils/stateless.py`, `_reparametrize_module`), so
/// two threads cannot make functional calls on one module at once. Here nothing in the model is
/// touched: a *scope* on the calling thread maps parameter and buffer identities
/// ([`Param::id`], [`Buffer::id`]) to the tensors to use, and [`Param::tensor`]/[`Buffer::tensor`]
/// (and their `value`) read from it while it is open. So any number of threads may make functional
/// calls on one `Arc<Model>` at once, each seeing only its own tensors, while plain calls on other
/// threads see the model's. Outside a scope, reading a parameter pays one thread-local read.
///
/// The scope covers what the closure does *on the calling thread*: work a forward pass hands to
/// other threads of its own reads the model's tensors.
pub trait FunctionalExt: Module + Sized {
    /// Calls the model on `input` with the tensors of `tensors` in place of the parameters and
    /// buffers they name (any subset, by state-dict path): `torch.func.functional_call(model,
    /// tensors, input)`. The model is not changed, and calls on other threads do not see the
    /// tensors. Hooks fire as in any call.
    ///
    /// Values must have the shape, dtype and device of what they replace (no conversion, so that
    /// gradients reach the given tensors): otherwise [`Error::Load`] lists every mismatch, as a
    /// load does, and [`Error::DeviceMismatch`] names a value on another device.
    ///
    /// A model made under [`empty_weights`](module_core::empty_weights), or with unbuilt lazy
    /// parameters, can be called when every unbuilt parameter and buffer is given (any shape its
    /// lazy shape accepts), and stays unbuilt (PyTorch's `functional_call` on a model on the
    /// `meta` device); an unbuilt one left out is [`Error::Unbuilt`]. A value given for
    /// one alias of a tied weight is used for every alias; two different values for aliases of one
    /// weight are [`Error::TiedValues`]. A key that names nothing in the model is an error (see
    /// [`FunctionalOptions`]).
    ///
    /// Gradients flow into the given tensors that are candle variables: a backward pass from the
    /// output gives their gradients (the model's own parameters get none where replaced). Under
    /// [`no_grad`](module_core::no_grad) the given tensors are read detached, as parameters are.
    ///
    /// ```
    /// use module_runtime::prelude::*;
    ///
    /// let model = Linear::new(3, 2, &Device::Cpu)?;
    /// let x = Tensor::ones((1, 3), DType::F32, &Device::Cpu)?;
    /// let mut tensors = StateDict::new();
    /// tensors.insert("weight", Tensor::zeros((2, 3), DType::F32, &Device::Cpu)?);
    /// tensors.insert("bias", Tensor::new(&[1f32, 2.], &Device::Cpu)?);
    /// let y = model.functional_call(&tensors, &x)?;
    /// assert_eq!(y.to_vec2::<f32>()?, [[1., 2.]]);
    /// assert_ne!(model.call(&x)?.to_vec2::<f32>()?, [[1., 2.]]); // the model is unchanged
    /// # Ok::<(), module_runtime::Error>(())
    /// ```
    #[doc(alias = "stateless")]
    fn functional_call<In>(
        &self,
        tensors: &StateDict,
        input: In,
    ) -> Result<<Self as Forward<In>>::Output>
    where
        Self: Forward<In>,
        In: TensorTree,
        <Self as Forward<In>>::Output: TensorTree + 'static,
    {
        self.functional_call_with(tensors, &FunctionalOptions::default(), |m| m.call(input))
    }

    /// Runs `run` with the tensors of `tensors` in place of the parameters and buffers they name,
    /// as [`functional_call`](Self::functional_call) does, with `options`. Every read of the
    /// model's parameters and buffers in `run`, on this thread, sees the tensors; the model is not
    /// changed. Scopes nest: the innermost value of a tensor wins.
    ///
    /// Writes to buffers ([`Buffer::set`], as BatchNorm's running statistics in training mode) go
    /// to the call's own copies and are dropped at the end (use
    /// [`call_and_update`](Self::call_and_update) to get them). **Deviation:** PyTorch writes them
    /// in place, into the module's buffers or into the tensors passed for them; here neither the
    /// model nor the given tensors are ever written, so that calls on other threads are not
    /// disturbed.
    ///
    /// ```
    /// use module_runtime::prelude::*;
    /// use module_runtime::FunctionalOptions;
    ///
    /// let model = Linear::new(3, 2, &Device::Cpu)?;
    /// let mut tensors = StateDict::new();
    /// tensors.insert("weight", Tensor::zeros((2, 3), DType::F32, &Device::Cpu)?);
    /// // Strict: every parameter must be given, as in a strict load.
    /// let err = model
    ///     .functional_call_with(&tensors, &FunctionalOptions::default().strict(), |m| {
    ///         m.weight.tensor()
    ///     })
    ///     .unwrap_err();
    /// assert!(matches!(&err, Error::Load(report) if report.missing == ["bias"]));
    /// # Ok::<(), module_runtime::Error>(())
    /// ```
    fn functional_call_with<R>(
        &self,
        tensors: &StateDict,
        options: &FunctionalOptions,
        run: impl FnOnce(&Self) -> Result<R>,
    ) -> Result<R> {
        let mut frame = plan(self.as_dyn(), tensors, options)?.frame;
        capture_buffers(self.as_dyn(), &mut frame, false)?;
        let _scope = ScopeGuard::enter(frame);
        run(self)
    }

    /// Calls the model on `input` in training mode and returns the output with the buffers as the
    /// call left them (BatchNorm's running statistics and `num_batches_tracked`), as a state dict
    /// of the model's persistent buffers: Oryx's `call_and_update`, state as a value. The model
    /// is not changed (its buffers, and its train/eval mode: the training mode is the call's only).
    ///
    /// `state` holds tensors to use in place of the model's, as in
    /// [`functional_call`](Self::functional_call): parameters, and buffers (pass the state the
    /// previous step returned to thread it through a loop).
    ///
    /// ```
    /// use module_runtime::prelude::*;
    /// use module_runtime::nn::BatchNorm1d;
    ///
    /// let bn = BatchNorm1d::new(2, &Device::Cpu)?;
    /// let x = Tensor::new(&[[0f32, 10.], [2., 20.]], &Device::Cpu)?;
    /// let (_, state) = bn.call_and_update(&StateDict::new(), &x)?;
    /// assert_eq!(state.keys().collect::<Vec<_>>(), ["running_mean", "running_var", "num_batches_tracked"]);
    /// assert_eq!(state.get("num_batches_tracked").unwrap().to_scalar::<i64>()?, 1);
    /// assert_eq!(state.get("running_mean").unwrap().to_vec1::<f32>()?, [0.1, 1.5]);
    /// // The model's own buffers are untouched; thread the state into the next step.
    /// assert_eq!(bn.num_batches_tracked.as_ref().unwrap().tensor()?.to_scalar::<i64>()?, 0);
    /// let (_, state) = bn.call_and_update(&state, &x)?;
    /// assert_eq!(state.get("num_batches_tracked").unwrap().to_scalar::<i64>()?, 2);
    /// # Ok::<(), module_runtime::Error>(())
    /// ```
    fn call_and_update<In>(
        &self,
        state: &StateDict,
        input: In,
    ) -> Result<(<Self as Forward<In>>::Output, StateDict)>
    where
        Self: Forward<In>,
        In: TensorTree,
        <Self as Forward<In>>::Output: TensorTree + 'static,
    {
        self.call_and_update_with(state, |m| m.call(input))
    }

    /// [`call_and_update`](Self::call_and_update) around any closure: runs `run` in training mode
    /// with `state` substituted and every buffer captured, and returns its result with the
    /// persistent buffers as `run` left them.
    fn call_and_update_with<R>(
        &self,
        state: &StateDict,
        run: impl FnOnce(&Self) -> Result<R>,
    ) -> Result<(R, StateDict)> {
        let root = self.as_dyn();
        let Plan { mut frame, modes } = plan(root, state, &FunctionalOptions::default())?;
        // Copies: a plain training call on another thread writes the model's storage in place,
        // which must not show through in the returned state.
        capture_buffers(root, &mut frame, true)?;
        frame.training = Some((true, modes));
        let scope = ScopeGuard::enter(frame);
        let out = run(self)?;
        let mut updated = StateDict::new();
        for (path, slot) in crate::state::slots(root) {
            if let crate::state::Slot::Buffer(b) = slot
                && let Some(t) = scope.buffer(b.id())
            {
                updated.insert(path, t);
            }
        }
        Ok((out, updated))
    }

    /// The model's tensors as a flat vector in state-dict order (tied weights once per alias, as
    /// in [`state_dict`](crate::ModuleExt::state_dict)), and a [`FlatSpec`] with each one's path,
    /// shape and dtype, whose [`unflatten`](FlatSpec::unflatten) builds the state dict back
    /// (JAX's `tree_flatten`/`tree_unflatten`).
    ///
    /// ```
    /// use module_runtime::prelude::*;
    ///
    /// let model = Linear::new(3, 2, &Device::Cpu)?;
    /// let (tensors, spec) = model.flatten()?;
    /// assert_eq!(spec.paths().collect::<Vec<_>>(), ["weight", "bias"]);
    /// let doubled = tensors.iter().map(|t| t * 2.0).collect::<candle_core::Result<Vec<_>>>()?;
    /// let y = model.functional_call(&spec.unflatten(doubled)?, &Tensor::ones((1, 3), DType::F32, &Device::Cpu)?)?;
    /// assert_eq!(y.dims(), [1, 2]);
    /// # Ok::<(), module_runtime::Error>(())
    /// ```
    fn flatten(&self) -> Result<(Vec<Tensor>, FlatSpec)> {
        Ok(FlatSpec::split(&self.state_dict()?))
    }

    /// An independent copy of the model: PyTorch users' `copy.deepcopy(model)` (EMA and target
    /// networks). Every parameter and buffer is copied into a fresh one (a clone of a `Param`
    /// would be the same parameter); weights tied inside the model stay tied in the copy, and
    /// `requires_grad`, persistence and train/eval flags are kept. Hooks, which belong to
    /// [`Hooks`](module_hooks::Hooks) registries and not to modules, are not copied.
    ///
    /// Needs `Clone` on the model (derive it next to `Module`). Fails with
    /// [`Error::Unbuilt`] on an unbuilt model, and with [`Error::SharedModule`] when a module
    /// shared through an `Arc` holds parameters or buffers (its clone shares the `Arc`, which
    /// cannot be re-pointed).
    ///
    /// ```
    /// use module_runtime::prelude::*;
    ///
    /// let online = Linear::new(3, 2, &Device::Cpu)?;
    /// let target = online.deep_clone()?;
    /// assert!(!target.weight.same_as(&online.weight));
    /// online.weight.set(&Tensor::zeros((2, 3), DType::F32, &Device::Cpu)?)?;
    /// assert_ne!(target.weight.tensor()?.abs()?.sum_all()?.to_scalar::<f32>()?, 0.0);
    /// # Ok::<(), module_runtime::Error>(())
    /// ```
    #[doc(alias = "deepcopy")]
    fn deep_clone(&self) -> Result<Self>
    where
        Self: Clone,
    {
        deep_clone::deep_clone(self)
    }

    /// Runs `run` and checks the outputs of the submodules `expected` names against its tensors
    /// (Ivy's `expected_submod_rets`): each call of a module at a path of `expected` is compared,
    /// in order, with that path's calls in `expected` (typically captured from a reference run with
    /// [`capture`](crate::ModuleExt::capture)), as `torch.allclose` does with `tolerance`.
    ///
    /// The tolerance is the caller's choice (see [`Tolerance`]): expected outputs from PyTorch
    /// differ from ours in float32 by rounding, so compare them with
    /// `Tolerance::for_dtype(DType::F32)` (`torch.testing.assert_close`'s defaults), not
    /// [`Tolerance::allclose`]; outputs captured from this framework on the same machine with
    /// [`Tolerance::exact`].
    ///
    /// Fails with [`Error::OutputMismatch`] naming the first diverging call in call order (the
    /// order the calls started, so a parent before its children) with its largest absolute
    /// difference, and the other diverging paths; with [`Error::NotRun`] when a path of `expected`
    /// is called fewer times than `expected` has calls for it. Extra calls are not checked.
    ///
    /// ```
    /// use module_runtime::prelude::*;
    /// use module_runtime::{nn::Sequential, Tolerance};
    ///
    /// let dev = Device::Cpu;
    /// let model = Sequential::new().add(Linear::new(3, 3, &dev)?).add(Linear::new(3, 2, &dev)?);
    /// let x = Tensor::ones((1, 3), DType::F32, &dev)?;
    /// let (_, reference) = model.capture(&["0", "1"], |m| m.call(&x))?;
    /// model.expect_outputs(&reference, Tolerance::for_dtype(DType::F32), |m| m.call(&x))?;
    /// // Change the second layer: the check names it.
    /// let mut tensors = StateDict::new();
    /// tensors.insert("1.bias", Tensor::ones(2, DType::F32, &dev)?);
    /// let err = model
    ///     .expect_outputs(&reference, Tolerance::for_dtype(DType::F32), |m| m.functional_call(&tensors, &x))
    ///     .unwrap_err();
    /// assert!(matches!(err, Error::OutputMismatch(ref d) if d.path == "1"));
    /// # Ok::<(), module_runtime::Error>(())
    /// ```
    #[doc(alias = "expected_submod_rets")]
    fn expect_outputs<R>(
        &self,
        expected: &Captures,
        tolerance: Tolerance,
        run: impl FnOnce(&Self) -> Result<R>,
    ) -> Result<R> {
        expect::expect_outputs(self, expected, tolerance, run)
    }
}

impl<M: Module> FunctionalExt for M {}

/// Gives every buffer of `root` that `frame` does not substitute a copy in the frame (a view of
/// its value, or with `copy` a copy), so that writes during the call go to the frame and never to
/// the model.
fn capture_buffers(root: &dyn Module, frame: &mut Frame, copy: bool) -> Result<()> {
    for (_, b) in crate::names::named_buffers(root, &crate::names::Names::new()) {
        if let std::collections::hash_map::Entry::Vacant(slot) = frame.buffers.entry(b.id()) {
            // `current`, not the buffer's own value: inside an outer scope, that scope's value.
            slot.insert(if copy {
                b.current().copy()?
            } else {
                b.current()
            });
        }
    }
    Ok(())
}

/// What [`Error::Unbuilt`] says a functional call could not do.
const ACTION: &str = "make a functional call on";

/// A checked substitution and the model's train/eval flags.
struct Plan {
    frame: Frame,
    modes: IdentitySet,
}

/// A parameter or buffer under one of its paths.
enum Leaf {
    Param(Param),
    Buffer(Buffer),
}

impl Leaf {
    fn id(&self) -> usize {
        match self {
            Leaf::Param(p) => p.id(),
            Leaf::Buffer(b) => b.id(),
        }
    }

    /// The shape, dtype and device of the model's own value (not a scope's: it is what a
    /// substitution must fit); an unbuilt leaf's shape is its empty placeholder's, `[0]`, with
    /// the dtype and device it will have.
    fn layout(&self) -> (candle_core::Shape, candle_core::DType, candle_core::Device) {
        match self {
            Leaf::Param(p) => (p.shape(), p.dtype(), p.device()),
            Leaf::Buffer(b) => {
                let own = b.own_tensor();
                (own.shape().clone(), own.dtype(), own.device().clone())
            }
        }
    }

    /// The shapes an unbuilt leaf takes; `None` once built.
    fn lazy_shape(&self) -> Option<module_core::LazyShape> {
        match self {
            Leaf::Param(p) => p.lazy_shape(),
            Leaf::Buffer(b) => b.lazy_shape(),
        }
    }
}

/// Checks `tensors` against the model as `torch.func.functional_call` does (untie, then check
/// keys: `torch/nn/utils/stateless.py`, `_untie_named_tensors_map` and `_reparametrize_module`),
/// plus the shape, dtype and device checks of a load, and builds the scope's frame.
fn plan(root: &dyn Module, tensors: &StateDict, options: &FunctionalOptions) -> Result<Plan> {
    // A `Lazy` cell would build its module during the call; unbuilt parameters and buffers are
    // fine as long as they are given (checked below): nothing is built from them.
    crate::views::ensure_cells_built(root, ACTION)?;
    // Every parameter and buffer under every path (PyTorch's `named_parameters(remove_duplicate=
    // False)` and `named_buffers(remove_duplicate=False)`, non-persistent buffers included).
    let mut leaves: Vec<(String, Leaf)> = Vec::new();
    let mut modes = IdentitySet::default();
    walk(root, false, &mut |path, v| {
        match v {
            Visit::Param(p) => leaves.push((path.to_owned(), Leaf::Param(p.clone()))),
            Visit::Buffer(b) => leaves.push((path.to_owned(), Leaf::Buffer(b.clone()))),
            Visit::Mode(m) => {
                modes.insert(m.addr());
            }
            _ => {}
        }
        true
    });
    let index: HashMap<&str, usize> = (leaves.iter().enumerate())
        .map(|(i, (path, _))| (path.as_str(), i))
        .collect();

    let mut report = LoadReport::default();
    let mut unexpected = Vec::new();
    // Leaf id -> the given (key, value)s for it, in the order given.
    let mut given: HashMap<usize, Vec<(&str, &Tensor)>> = HashMap::new();
    for (key, value) in tensors.iter() {
        let Some(&i) = index.get(key) else {
            unexpected.push((key.to_owned(), value.shape().clone()));
            continue;
        };
        let leaf = &leaves[i].1;
        let (own_shape, own_dtype, own_device) = leaf.layout();
        let unbuilt = leaf.lazy_shape();
        let shape_ok = match &unbuilt {
            Some(lazy) => lazy.accepts(value.dims()),
            None => *value.shape() == own_shape,
        };
        if !shape_ok || value.dtype() != own_dtype {
            report.mismatched.push(Mismatch {
                key: key.to_owned(),
                expected_shape: own_shape,
                expected_dtype: own_dtype,
                shape: value.shape().clone(),
                dtype: value.dtype(),
                unbuilt,
            });
            continue;
        }
        if !value.device().same_device(&own_device) {
            return Err(Error::DeviceMismatch {
                path: key.to_owned(),
                expected: own_device.location(),
                got: value.device().location(),
            });
        }
        given.entry(leaf.id()).or_default().push((key, value));
    }

    // Two values for one tied weight: PyTorch compares the given tensors by identity.
    for values in given.values() {
        let first = values[0].1.id();
        if values.iter().any(|(_, t)| t.id() != first) {
            let mut keys: Vec<String> = values.iter().map(|(k, _)| (*k).to_owned()).collect();
            keys.sort();
            return Err(Error::TiedValues { keys });
        }
    }

    let missing: Vec<(String, crate::suggest::Expected)> = (leaves.iter())
        .filter(|(_, leaf)| !given.contains_key(&leaf.id()))
        .map(|(path, leaf)| {
            let shape = leaf.layout().0;
            (
                path.clone(),
                crate::suggest::expected(leaf.lazy_shape(), shape),
            )
        })
        .collect();
    let check_missing = options.strict;
    let check_unexpected = options.strict || !options.allow_unexpected;
    if !report.mismatched.is_empty()
        || (check_missing && !missing.is_empty())
        || (check_unexpected && !unexpected.is_empty())
    {
        if check_missing {
            report.missing = missing.iter().map(|(k, _)| k.clone()).collect();
        }
        if check_unexpected {
            unexpected.sort_by(|a, b| a.0.cmp(&b.0));
            report.unexpected = unexpected.iter().map(|(k, _)| k.clone()).collect();
            let keys: Vec<&str> = leaves.iter().map(|(k, _)| k.as_str()).collect();
            let found = crate::suggest::suggest(&keys, &missing, &unexpected, &[]);
            report.key_fix = found.fix;
            report.suggestions = found.pairs;
        }
        return Err(Error::Load(Box::new(report)));
    }

    // An unbuilt leaf the call would read has no value (and reading it could build it).
    let mut seen = IdentitySet::default();
    let unbuilt: Vec<String> = (leaves.iter())
        .filter(|(_, leaf)| leaf.lazy_shape().is_some() && !given.contains_key(&leaf.id()))
        .filter(|(_, leaf)| seen.insert(leaf.id()))
        .map(|(path, _)| path.clone())
        .collect();
    if !unbuilt.is_empty() {
        return Err(Error::Unbuilt {
            action: ACTION,
            paths: unbuilt,
        });
    }

    let mut frame = Frame::default();
    for (_, leaf) in &leaves {
        let Some(values) = given.get(&leaf.id()) else {
            continue;
        };
        let value = values[0].1.clone();
        match leaf {
            Leaf::Param(_) => frame.params.insert(leaf.id(), value),
            Leaf::Buffer(_) => frame.buffers.insert(leaf.id(), value),
        };
    }
    Ok(Plan { frame, modes })
}
