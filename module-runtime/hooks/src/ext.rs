//! [`ModuleExt`]: every PyTorch `nn.Module` method, for every [`Module`], as thin delegations to
//! the files that own each feature (traversal views in `views.rs`, path lookup in `path.rs`,
//! conversions in `convert.rs`, state dicts in `state.rs`, files in `io.rs`, hooks in `hooks/`,
//! lazy build in `lazy.rs`, summaries in `summary.rs`).

use candle_core::{DType, Device, Var};

use crate::buffer::Buffer;
use crate::error::Result;
use crate::forward::Forward;
use crate::hooks::Captures;
use crate::module::{Child, Module};
use crate::names::Names;
use crate::param::Param;
use crate::report::LoadReport;
use crate::state::{LoadOptions, StateDict};
use crate::tensor_tree::TensorTree;
use crate::{path, views};

/// Every PyTorch `nn.Module` method, for every [`Module`]. In the prelude; implemented for all
/// modules and for `dyn Module`.
///
/// Paths are PyTorch's: dotted field names, list elements by position (`layers.0.weight`), the root
/// module as `""`.
///
/// What Rust rules out: `register_parameter`, `register_buffer` and `add_module` on a model at
/// runtime (a struct's fields are fixed when it is compiled: declare an `Option<Param>` field, or
/// hold a `ModuleDict`/`BTreeMap<String, _>` for children named at runtime). Hooks, forward and
/// backward, live in a [`Hooks`](crate::Hooks) registry attached for a run rather than on the
/// module. Traversals list each parameter, buffer and `Arc`-shared module once, under the
/// first path that reaches it, unless [`Names::keep_duplicates`] says otherwise.
///
/// ```
/// use module_runtime::prelude::*;
///
/// #[derive(Module)]
/// struct Net {
///     fc1: Linear,
///     fc2: Linear,
/// }
///
/// let dev = Device::Cpu;
/// let net = Net { fc1: Linear::new(2, 3, &dev)?, fc2: Linear::new(3, 1, &dev)? };
/// let names: Vec<String> = net.named_parameters().into_iter().map(|(n, _)| n).collect();
/// assert_eq!(names, ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]);
/// assert_eq!(net.num_parameters(), 2 * 3 + 3 + 3 + 1);
/// let fc2: &Linear = net.get_submodule("fc2")?;
/// assert_eq!(fc2.out_features(), 1);
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub trait ModuleExt: Module {
    /// `self` as a trait object.
    fn as_dyn(&self) -> &dyn Module;

    /// `self` as a mutable trait object.
    fn as_dyn_mut(&mut self) -> &mut dyn Module;

    /// Runs the module: [`Forward::forward`], with the hooks of an active [`Hooks::run`] around it
    /// (PyTorch's `module(x)`). Call submodules through `call`, not `forward`, so that hooks see
    /// them. With no hooks attached on this thread, a nested `call` is `forward` plus two
    /// thread-local reads; the outermost one also takes the shared side of the weights' lock, so
    /// that it runs with the weights of before a concurrent update or with those of after, never
    /// a mix ([`atomic_update`](module_core::atomic_update)).
    ///
    /// An error from `forward` comes back as [`Error::Forward`](module_core::Error::Forward), naming the
    /// submodule that failed by its path from `self` and its type
    /// (`forward of `encoder.layer.3.intermediate.dense` (Linear) failed: …`); the path is worked
    /// out only when an error passes, so a successful call pays nothing for it.
    ///
    /// The input and output must be [`TensorTree`]s (tensors, references to them, tuples, `Vec`,
    /// `Option`, numbers, your own [`TensorStruct`](crate::TensorStruct)s), and the output owns its
    /// tensors.
    ///
    /// [`Hooks::run`]: crate::Hooks::run
    #[inline]
    fn call<In>(&self, input: In) -> Result<<Self as Forward<In>>::Output>
    where
        Self: Forward<In> + Sized,
        In: TensorTree,
        <Self as Forward<In>>::Output: TensorTree + 'static,
    {
        // The outermost call on a thread holds weight updates back until it returns (a nested call
        // reads one thread-local flag): `module_core::update_lock`.
        let _weights = module_core::update_lock::enter_call();
        let result = if !crate::hooks::dispatch::active() {
            self.forward(input)
        } else {
            crate::hooks::dispatch::dispatch(self, input)
        };
        match result {
            Ok(output) => Ok(output),
            // Cold: names the failing submodule by path (see `Error::Forward`).
            Err(error) => Err(crate::trace::forward_error(self, error)),
        }
    }

    /// Runs `run` and returns, beside its result, the outputs of every call of a module whose path
    /// matches one of `patterns`, in call order (like torchvision's `create_feature_extractor`).
    /// A pattern that matches no module ([`Error::NoModuleMatch`](module_core::Error::NoModuleMatch)),
    /// or whose modules none ran ([`Error::NotRun`](module_core::Error::NotRun)), is an error rather
    /// than an empty capture.
    ///
    /// To check a later run against what was captured, pass the captures to
    /// [`expect_outputs`](../module_runtime/trait.FunctionalExt.html#method.expect_outputs) with a
    /// [`Tolerance`](module_core::Tolerance) chosen for the outputs' dtype and origin:
    /// `Tolerance::for_dtype(DType::F32)` for float32 outputs of PyTorch, `Tolerance::exact()` for
    /// our own on the same machine.
    ///
    /// ```
    /// use module_runtime::prelude::*;
    ///
    /// #[derive(Module)]
    /// struct Mlp {
    ///     layers: Vec<Linear>,
    /// }
    ///
    /// impl Forward<&Tensor> for Mlp {
    ///     type Output = Tensor;
    ///     fn forward(&self, x: &Tensor) -> Result<Tensor> {
    ///         let mut x = x.clone();
    ///         for layer in &self.layers {
    ///             x = layer.call(&x)?.relu()?;
    ///         }
    ///         Ok(x)
    ///     }
    /// }
    ///
    /// let dev = Device::Cpu;
    /// let mlp = Mlp { layers: vec![Linear::new(4, 8, &dev)?, Linear::new(8, 3, &dev)?] };
    /// let x = Tensor::ones((2, 4), DType::F32, &dev)?;
    /// let (_, captured) = mlp.capture(&["layers.*"], |m| m.call(&x))?;
    /// assert_eq!(captured.paths().collect::<Vec<_>>(), ["layers.0", "layers.1"]);
    /// assert_eq!(captured.get("layers.1").unwrap().dims(), [2, 3]);
    /// # Ok::<(), module_runtime::Error>(())
    /// ```
    fn capture<R>(
        &self,
        patterns: &[&str],
        run: impl FnOnce(&Self) -> Result<R>,
    ) -> Result<(R, Captures)>
    where
        Self: Sized,
    {
        crate::hooks::observe::capture(self, patterns, run)
    }

    /// Runs `run` and returns, beside its result, the path of every module call in the order the
    /// calls started (Ivy's `track_submod_call_order`).
    fn call_order<R>(&self, run: impl FnOnce(&Self) -> Result<R>) -> Result<(R, Vec<String>)>
    where
        Self: Sized,
    {
        crate::hooks::observe::call_order(self, run)
    }

    /// [`summary`](Self::summary) with each module's input and output shapes, from running `run`
    /// (torchinfo's `summary(model, input_size)`). Modules that `run` does not call have no shapes.
    fn summary_with<R>(&self, run: impl FnOnce(&Self) -> Result<R>) -> Result<module_core::Summary>
    where
        Self: Sized,
    {
        let shapes = crate::hooks::observe::record_shapes(self, run)?;
        Ok(module_core::Summary::of(self.as_dyn()).with_shapes(&shapes))
    }

    /// The dataflow graph of `run` (Ivy's `show_graph`, PyTorch's torchview): a node per module
    /// call (path, type, input/output shapes, parameters), edges following tensors from one call's
    /// output to another's input by identity (a residual is an edge that skips a block), and
    /// tensor-level work outside submodules as ops nodes in the module that did it.
    /// [`Dataflow::collapse`](crate::Dataflow::collapse) gives depth-limited views,
    /// [`to_dot`](crate::Dataflow::to_dot) Graphviz DOT, [`render`](crate::Dataflow::render) an
    /// SVG or PNG. See [`Dataflow`](crate::Dataflow) for how edges are found and the limits.
    ///
    /// The run is a trace: the value `run` returns is dropped, and gradients do not flow across
    /// module boundaries inside it.
    fn dataflow<R>(&self, run: impl FnOnce(&Self) -> Result<R>) -> Result<crate::Dataflow>
    where
        Self: Sized,
    {
        crate::dataflow::dataflow(self, run)
    }

    /// Every parameter with its path, each once (the first path that reaches it), in PyTorch's
    /// order: a module's own parameters before its submodules', whatever the field order.
    fn named_parameters(&self) -> Vec<(String, Param)> {
        crate::names::named_parameters(self.as_dyn(), &Names::new())
    }

    /// [`named_parameters`](Self::named_parameters) with PyTorch's `prefix`, `recurse` and
    /// `remove_duplicate` arguments (see [`Names`]): `named_parameters_with(&Names::new().prefix("model"))`
    /// is PyTorch's `named_parameters(prefix="model")`, `Names::new().recurse(false)` lists only the
    /// module's own parameters, `Names::new().keep_duplicates()` (PyTorch's `remove_duplicate=False`)
    /// every alias of a tied one.
    fn named_parameters_with(&self, names: &Names) -> Vec<(String, Param)> {
        crate::names::named_parameters(self.as_dyn(), names)
    }

    /// Every parameter, each once.
    fn parameters(&self) -> Vec<Param> {
        self.named_parameters()
            .into_iter()
            .map(|(_, p)| p)
            .collect()
    }

    /// Every buffer (persistent or not) with its path, each once.
    fn named_buffers(&self) -> Vec<(String, Buffer)> {
        crate::names::named_buffers(self.as_dyn(), &Names::new())
    }

    /// [`named_buffers`](Self::named_buffers) with PyTorch's `prefix`, `recurse` and
    /// `remove_duplicate` arguments (see [`Names`]). Non-persistent buffers are listed too, as in
    /// PyTorch.
    fn named_buffers_with(&self, names: &Names) -> Vec<(String, Buffer)> {
        crate::names::named_buffers(self.as_dyn(), names)
    }

    /// Every buffer, each once.
    fn buffers(&self) -> Vec<Buffer> {
        self.named_buffers().into_iter().map(|(_, b)| b).collect()
    }

    /// Every module, this one first as `""`, depth-first in declaration order; a module shared through
    /// `Arc` once, under its first path. Lists (`Vec`, arrays, tuples) and maps are modules here, as
    /// `ModuleList` and `ModuleDict` are in PyTorch; `Option` and `Box` are transparent.
    fn named_modules(&self) -> Vec<(String, &dyn Module)> {
        crate::names::named_modules(self.as_dyn(), &Names::new())
    }

    /// [`named_modules`](Self::named_modules) with PyTorch's `prefix` and `remove_duplicate`
    /// arguments (see [`Names`]): the root is named by the prefix (`""` without one), and with
    /// [`keep_duplicates`](Names::keep_duplicates) a module shared through `Arc` is listed under
    /// every path. [`recurse`](Names::recurse) does not apply (PyTorch's `named_modules` has no
    /// such argument): every module is listed.
    fn named_modules_with(&self, names: &Names) -> Vec<(String, &dyn Module)> {
        crate::names::named_modules(self.as_dyn(), names)
    }

    /// The direct submodules, each once.
    fn named_children(&self) -> Vec<(String, &dyn Module)> {
        crate::names::named_children(self.as_dyn())
    }

    /// The submodule at `path` (`""` is `self`) as a trait object.
    fn get_submodule_dyn(&self, path: &str) -> Result<&dyn Module> {
        path::submodule(self.as_dyn(), path)
    }

    /// The submodule at `path`, downcast to `T`.
    ///
    /// Fails with [`Error::NoSubmodule`](module_core::Error::NoSubmodule) naming the first segment that is missing (and what is
    /// there instead), or [`Error::WrongModuleType`](module_core::Error::WrongModuleType) naming the type that is there.
    fn get_submodule<T: Module>(&self, path: &str) -> Result<&T> {
        path::downcast(path, self.get_submodule_dyn(path)?)
    }

    /// The submodule at `path` as a mutable trait object. A module shared through an `Arc` with other
    /// owners cannot be borrowed mutably ([`Error::SharedModule`](module_core::Error::SharedModule)).
    fn get_submodule_dyn_mut(&mut self, path: &str) -> Result<&mut dyn Module> {
        path::submodule_mut(self.as_dyn_mut(), path)
    }

    /// The submodule at `path`, mutably, downcast to `T`.
    fn get_submodule_mut<T: Module>(&mut self, path: &str) -> Result<&mut T> {
        path::downcast_mut(path, self.get_submodule_dyn_mut(path)?)
    }

    /// The parameter at `path` (`fc1.weight`).
    fn get_parameter(&self, path: &str) -> Result<Param> {
        match path::leaf(self.as_dyn(), path, "parameter")? {
            Child::Param(p) => Ok(p.clone()),
            _ => unreachable!("`leaf` checked the kind"),
        }
    }

    /// The buffer at `path` (`embeddings.position_ids`).
    fn get_buffer(&self, path: &str) -> Result<Buffer> {
        match path::leaf(self.as_dyn(), path, "buffer")? {
            Child::Buffer(b) => Ok(b.clone()),
            _ => unreachable!("`leaf` checked the kind"),
        }
    }

    /// Number of scalar parameters, each parameter counted once.
    fn num_parameters(&self) -> usize {
        self.parameters().iter().map(Param::elem_count).sum()
    }

    /// Number of scalar parameters that are trained (not frozen), each counted once.
    fn num_trainable_parameters(&self) -> usize {
        self.parameters()
            .iter()
            .filter(|p| p.requires_grad())
            .map(Param::elem_count)
            .sum()
    }

    /// The `Var`s to hand to a candle optimizer: every parameter that is not frozen, once each.
    ///
    /// Fails with [`Error::Unbuilt`](module_core::Error::Unbuilt), listing every unbuilt path, if the model is not built: an
    /// optimizer holding a lazy parameter's placeholder would never train the real one.
    ///
    /// ```
    /// use module_runtime::prelude::*;
    /// use candle_nn::Optimizer;
    ///
    /// let model = Linear::new(4, 2, &Device::Cpu)?;
    /// let mut opt = candle_nn::AdamW::new_lr(model.trainable_vars()?, 1e-3)?;
    /// let x = Tensor::ones((3, 4), DType::F32, &Device::Cpu)?;
    /// let loss = model.call(&x)?.sqr()?.sum_all()?;
    /// opt.backward_step(&loss)?;
    /// # Ok::<(), module_runtime::Error>(())
    /// ```
    fn trainable_vars(&self) -> Result<Vec<Var>> {
        crate::views::ensure_built(self.as_dyn(), "list the trainable variables of")?;
        self.parameters()
            .iter()
            .filter(|p| p.requires_grad())
            .map(Param::var)
            .collect()
    }

    /// Freezes every parameter at or under a path matching `pattern` (see [`PathPattern`](module_core::PathPattern)):
    /// `freeze("encoder")` and `freeze("encoder.*")` freeze the whole encoder, `freeze("**.bias")`
    /// every bias. Returns how many parameters matched. A pattern that matches nothing is an error
    /// ([`Error::NoMatch`](module_core::Error::NoMatch)), since it is almost always a typo.
    fn freeze(&self, pattern: &str) -> Result<usize> {
        views::set_requires_grad(self.as_dyn(), pattern, false)
    }

    /// Unfreezes every parameter at or under a path matching `pattern`; see [`freeze`](Self::freeze).
    fn unfreeze(&self, pattern: &str) -> Result<usize> {
        views::set_requires_grad(self.as_dyn(), pattern, true)
    }

    /// Calls `f` on every module, children before their parent (PyTorch's `apply`, for instance to
    /// initialize weights by layer type). As in PyTorch, the recursion goes through each module's
    /// children: a module shared (through `Arc`) at two depths is visited at each, a module shared
    /// by two fields of one parent once.
    fn apply(&self, f: &mut dyn FnMut(&dyn Module)) {
        views::apply(self.as_dyn(), f)
    }

    /// A static, torchinfo-style summary: every module with its path, type and parameter count, and
    /// the totals (see [`Summary`](module_core::Summary)).
    fn summary(&self) -> module_core::Summary {
        crate::summary::Summary::of(self.as_dyn())
    }

    /// Puts every module of the tree in training mode (sets every [`Mode`](module_core::Mode) flag).
    fn train(&self) {
        self.set_training(true);
    }

    /// Puts every module of the tree in evaluation mode (PyTorch's `eval()`).
    fn eval(&self) {
        self.set_training(false);
    }

    /// Sets training (`true`) or evaluation (`false`) mode on every module of the tree.
    fn set_training(&self, training: bool) {
        views::set_training(self.as_dyn(), training)
    }

    /// Whether the module is in training mode: PyTorch's `module.training`, the flag the last
    /// [`train`](Self::train)/[`eval`](Self::eval) on this module or on a module above it set,
    /// `true` if there was none (new modules are in training mode). After `model.eval()`,
    /// `model.is_training()` is `false` even with no mode-dependent layer inside, and
    /// `model.child.eval()` changes what the child reports, never the parent: on a new model,
    /// `model.drop.eval()` leaves `model.is_training()` `true`, as in PyTorch.
    ///
    /// A module holding a [`Mode`](module_core::Mode) as a direct field (the runtime's Dropout,
    /// BatchNorm, activations) reports that flag. Other Rust structs have no hidden field to hold
    /// a flag, so `train`/`eval` record it in the module's first parameter, buffer or `Mode` (under
    /// the path from the module to it). A module with none of these behaves the same in both
    /// modes and always reports `true`.
    ///
    /// ```
    /// use module_runtime::prelude::*;
    /// use module_runtime::nn::Dropout;
    /// #[derive(Module)]
    /// struct Mlp { drop: Dropout, fc1: Linear, fc2: Linear }
    /// let dev = Device::Cpu;
    /// let m = Mlp { drop: Dropout::new(0.1), fc1: Linear::new(4, 8, &dev)?, fc2: Linear::new(8, 2, &dev)? };
    /// m.drop.eval();
    /// assert!(m.is_training() && !m.drop.is_training()); // the child's flag only
    /// m.eval();
    /// assert!(!m.is_training() && !m.fc1.is_training());
    /// m.fc1.train();
    /// assert!(m.fc1.is_training() && !m.is_training());
    /// # Ok::<(), module_runtime::Error>(())
    /// ```
    fn is_training(&self) -> bool {
        views::is_training(self.as_dyn())
    }

    /// Every parameter and persistent buffer by path, in PyTorch's `state_dict()` order: each
    /// module's own parameters, then its own buffers, then its submodules' (field order within each
    /// group, whatever the order of the fields of different kinds). A tied weight appears under each of its paths, non-persistent buffers not
    /// at all. The tensors share storage with the model. Fails with [`Error::Unbuilt`](module_core::Error::Unbuilt) if the model
    /// is not built. State-dict post-hooks (PyTorch's `register_state_dict_post_hook`) run in
    /// [`StateDictHooks::state_dict`](module_state::StateDictHooks::state_dict).
    fn state_dict(&self) -> Result<StateDict> {
        crate::views::ensure_built(self.as_dyn(), "take the state dict of")?;
        crate::state::state_dict(self.as_dyn())
    }

    /// Loads a state dict, PyTorch's `load_state_dict(state_dict, strict=True, assign=False)`:
    /// `state` is a [`StateDict`] (`&sd`) or the path of a checkpoint file or model folder (see
    /// [`Checkpoint`](module_state::Checkpoint)), `options` says how ([`LoadOptions::default()`]: strict,
    /// as PyTorch's default; [`non_strict`](LoadOptions::non_strict), key rules,
    /// [`assign`](LoadOptions::assign), [`nested_in`](LoadOptions::nested_in) for a training
    /// checkpoint, post-hooks, transforms such as [`split`](LoadOptions::split) for tensors that
    /// do not map one to one, pre-hooks through [`state_dict_hooks`](LoadOptions::state_dict_hooks)).
    ///
    /// All or nothing: every key is checked first, and on any problem the model is left exactly as it
    /// was and [`Error::Load`](module_core::Error::Load) lists every missing key, unexpected key and shape or dtype mismatch at
    /// once, with "did you mean" pairs. Values are copied into the existing parameters, so tied
    /// weights stay tied and optimizers built before the load keep working.
    ///
    /// A path is read in any format [`StateDict::read`] reads (safetensors, a PyTorch `.pth`/`.pt`/
    /// `.bin` in the zip or the legacy format, a Hugging Face shard index, a model folder), told
    /// from the file's first bytes. Every key is checked before any value is read, and values are
    /// read one at a time, straight to each parameter's device; shards load as one state dict,
    /// every shard opened and checked before anything is copied.
    /// Files are not memory-mapped: a header is checked when its file is opened and each value is
    /// read with positioned reads, so a file truncated or rewritten by another process during the
    /// load is an error, never a SIGBUS.
    ///
    /// Unbuilt lazy parameters and buffers are built from the checkpoint's values, whose shapes
    /// must fit their known dimensions (a failed load leaves them unbuilt). A model holding an
    /// unbuilt [`Lazy`](../module_runtime/struct.Lazy.html) cell cannot be loaded ([`Error::Unbuilt`](module_core::Error::Unbuilt)): what the cell
    /// would hold is only known once it is built.
    ///
    /// ```
    /// use module_runtime::prelude::*;
    /// let a = Linear::new(3, 2, &Device::Cpu)?;
    /// let b = Linear::new(3, 2, &Device::Cpu)?;
    /// b.load_state_dict(&a.state_dict()?, &LoadOptions::default())?;
    /// let diff = (a.weight.tensor()? - b.weight.tensor()?)?.abs()?.sum_all()?;
    /// assert_eq!(diff.to_scalar::<f32>()?, 0.0);
    ///
    /// let err = Linear::no_bias(3, 2, &Device::Cpu)?
    ///     .load_state_dict(&a.state_dict()?, &LoadOptions::default())
    ///     .unwrap_err();
    /// assert!(err.to_string().contains("unexpected key(s): \"bias\""));
    /// # Ok::<(), module_runtime::Error>(())
    /// ```
    ///
    /// From a file:
    ///
    /// ```no_run
    /// # use module_runtime::prelude::*;
    /// # let model = Linear::new(2, 2, &Device::Cpu)?;
    /// model.load_state_dict("model.safetensors", &LoadOptions::default())?;
    /// // torch.save({"epoch": 3, "model": model.module.state_dict(), ...}) from DataParallel:
    /// model.load_state_dict(
    ///     "checkpoint.pt",
    ///     &LoadOptions::default().nested_in("model").strip_prefix("module"),
    /// )?;
    /// # Ok::<(), module_runtime::Error>(())
    /// ```
    fn load_state_dict<'a>(
        &self,
        state: impl Into<module_state::Checkpoint<'a>>,
        options: &LoadOptions,
    ) -> Result<LoadReport> {
        crate::checkpoint::load(self.as_dyn(), state.into(), options)
    }

    /// Saves the state dict as a safetensors file: `torch.save(model.state_dict(), path)`, through
    /// [`StateDict::save_safetensors`], atomically (a temporary file beside `path`, flushed, then
    /// renamed over it), so a failed save never destroys the previous checkpoint.
    ///
    /// Fails with [`Error::Unbuilt`](module_core::Error::Unbuilt) if the model is not built.
    fn save_safetensors(&self, path: impl AsRef<std::path::Path>) -> Result<()> {
        crate::views::ensure_built(self.as_dyn(), "save")?;
        self.state_dict()?.save_safetensors(path)
    }

    /// Moves every parameter and buffer to `device`, in place: every alias of a tied weight follows.
    /// All or nothing: if one tensor fails to move, nothing has moved. Build optimizers after moving.
    /// Unbuilt lazy parameters and buffers record the device and are built there.
    fn to_device(&self, device: &Device) -> Result<()> {
        crate::convert::to_device(self.as_dyn(), device)
    }

    /// Converts every floating-point parameter and buffer to the floating-point `dtype`, in place;
    /// integer buffers keep their dtype (PyTorch's `Module.to(dtype)`). All or nothing. Unbuilt lazy
    /// parameters and buffers record the dtype and are built with it.
    fn to_dtype(&self, dtype: DType) -> Result<()> {
        crate::convert::to_dtype(self.as_dyn(), dtype)
    }
}

impl<M: Module> ModuleExt for M {
    fn as_dyn(&self) -> &dyn Module {
        self
    }
    fn as_dyn_mut(&mut self) -> &mut dyn Module {
        self
    }
}

impl ModuleExt for dyn Module {
    fn as_dyn(&self) -> &dyn Module {
        self
    }
    fn as_dyn_mut(&mut self) -> &mut dyn Module {
        self
    }
}
