//! Traversal: one walk over the derive's `visit_children`, and every view PyTorch users know built
//! on it (`named_parameters`, `named_modules`, `get_submodule`, `train`/`eval`, `to_device`, …).

use std::collections::HashSet;
use std::hash::{BuildHasherDefault, Hasher};

use candle_core::{DType, Device, Tensor, Var};

use crate::buffer::Buffer;
use crate::error::{Error, Result};
use crate::forward::Forward;
use crate::hooks::{Captures, Hooks};
use crate::module::{Child, ChildMut, Mode, Module, Name};
use crate::param::Param;
use crate::pattern::PathPattern;
use crate::state::{LoadOptions, LoadReport, StateDict};
use crate::tree::TensorTree;

/// What a walk reaches.
pub(crate) enum Visit<'a> {
    Module(&'a dyn Module),
    Param(&'a Param),
    Buffer(&'a Buffer),
    Mode(&'a Mode),
}

/// Walks `root` depth-first in declaration order, calling `f` with each node's dotted path
/// (`""` for the root). `f` returns whether to descend into a module. With `dedup`, a module shared
/// through `Arc`, a parameter or a buffer reached a second time is skipped with everything under it
/// (PyTorch's memo set: the first path wins).
pub(crate) fn walk<'a>(
    root: &'a dyn Module,
    dedup: bool,
    f: &mut dyn FnMut(&str, Visit<'a>) -> bool,
) {
    let mut walker = Walker {
        path: String::new(),
        dedup,
        seen: IdentitySet::default(),
        f,
    };
    if (walker.f)("", Visit::Module(root)) {
        walker.children(root);
    }
}

/// A set of identities (addresses of shared allocations). SipHash, the standard hasher, resists
/// adversarial keys, which addresses are not; a multiplicative hash makes the memo set of a walk
/// several times cheaper (`named_parameters` on BERT-base: see BENCHMARKS.md).
pub(crate) type IdentitySet = HashSet<usize, BuildHasherDefault<AddressHasher>>;

/// Fibonacci hashing of one `usize`: a multiply by 2^64/φ spreads aligned addresses (whose low bits
/// are zero) over the whole table.
#[derive(Default)]
pub(crate) struct AddressHasher(u64);

impl Hasher for AddressHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }

    fn write_usize(&mut self, n: usize) {
        self.0 = (n as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

struct Walker<'a, 'f> {
    path: String,
    dedup: bool,
    seen: IdentitySet,
    f: &'f mut dyn FnMut(&str, Visit<'a>) -> bool,
}

impl<'a> Walker<'a, '_> {
    fn children(&mut self, module: &'a dyn Module) {
        module.visit_children(&mut |name, child| self.child(name, child));
    }

    fn child(&mut self, name: Name<'_>, child: Child<'a>) {
        let identity = match child {
            Child::Module { shared, .. } => shared.map(|s| s.id),
            Child::Param(p) => p.has_aliases().then(|| p.id()),
            Child::Buffer(b) => b.has_aliases().then(|| b.id()),
            Child::Mode(_) | Child::Absent => None,
        };
        if self.dedup && identity.is_some_and(|id| !self.seen.insert(id)) {
            return;
        }
        let len = self.path.len();
        name.push_to(&mut self.path);
        match child {
            Child::Module { module, .. } => {
                if (self.f)(&self.path, Visit::Module(module)) {
                    self.children(module);
                }
            }
            Child::Param(p) => {
                (self.f)(&self.path, Visit::Param(p));
            }
            Child::Buffer(b) => {
                (self.f)(&self.path, Visit::Buffer(b));
            }
            Child::Mode(m) => {
                (self.f)(&self.path, Visit::Mode(m));
            }
            Child::Absent => {}
        }
        self.path.truncate(len);
    }
}

/// `std::any::type_name` without module paths: `alloc::vec::Vec<my::Block>` → `Vec<Block>`.
pub fn short_type_name(full: &str) -> String {
    let mut out = String::with_capacity(full.len());
    let mut token_start = 0;
    let is_path_char = |c: char| c.is_alphanumeric() || c == '_' || c == ':';
    for (i, c) in full
        .char_indices()
        .chain(std::iter::once((full.len(), ' ')))
    {
        if i < full.len() && is_path_char(c) {
            continue;
        }
        let token = &full[token_start..i];
        out.push_str(token.rsplit("::").next().unwrap_or(token));
        if i < full.len() {
            out.push(c);
        }
        token_start = i + c.len_utf8();
    }
    out
}

/// Every PyTorch `nn.Module` method, for every [`Module`]. In the prelude; implemented for all
/// modules and for `dyn Module`.
///
/// Paths are PyTorch's: dotted field names, list elements by position (`layers.0.weight`), the root
/// module as `""`. Traversals list each parameter, buffer and `Arc`-shared module once, under the
/// first path that reaches it, unless their name says `with_aliases`.
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
    /// them. With no hooks attached on this thread, `call` is `forward` plus one thread-local read.
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
        if !crate::hooks::active() {
            return self.forward(input);
        }
        crate::hooks::dispatch(self, input)
    }

    /// Runs `run` with `hooks` attached to this module (the root of the paths): shorthand for
    /// [`hooks.run(self, run)`](Hooks::run).
    fn with_hooks<R>(&self, hooks: &Hooks, run: impl FnOnce(&Self) -> R) -> R
    where
        Self: Sized,
    {
        hooks.run(self, run)
    }

    /// Runs `run` and returns, beside its result, the outputs of every call of a module whose path
    /// matches one of `patterns`, in call order (like torchvision's `create_feature_extractor`).
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
        crate::hooks::capture(self, patterns, run)
    }

    /// Runs `run` and returns, beside its result, the path of every module call in the order the
    /// calls started (Ivy's `track_submod_call_order`).
    fn call_order<R>(&self, run: impl FnOnce(&Self) -> Result<R>) -> Result<(R, Vec<String>)>
    where
        Self: Sized,
    {
        crate::hooks::call_order(self, run)
    }

    /// [`summary`](Self::summary) with each module's input and output shapes, from running `run`
    /// (torchinfo's `summary(model, input_size)`). Modules that `run` does not call have no shapes.
    fn summary_with<R>(&self, run: impl FnOnce(&Self) -> Result<R>) -> Result<crate::Summary>
    where
        Self: Sized,
    {
        let shapes = crate::hooks::record_shapes(self, run)?;
        let mut summary = crate::Summary::of(self.as_dyn());
        for row in &mut summary.rows {
            if let Some((_, input, output)) = shapes.iter().find(|(p, _, _)| *p == row.path) {
                row.input_shape = Some(input.clone());
                row.output_shape = Some(output.clone());
            }
        }
        Ok(summary)
    }

    /// Every parameter with its path, each once (the first path that reaches it), in declaration
    /// order.
    fn named_parameters(&self) -> Vec<(String, Param)> {
        collect_params(self.as_dyn(), true)
    }

    /// Every parameter under every path that reaches it: a tied weight appears once per alias
    /// (PyTorch's `named_parameters(remove_duplicate=False)`).
    fn named_parameters_with_aliases(&self) -> Vec<(String, Param)> {
        collect_params(self.as_dyn(), false)
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
        let mut out = Vec::new();
        walk(self.as_dyn(), true, &mut |path, v| {
            if let Visit::Buffer(b) = v {
                out.push((path.to_owned(), b.clone()));
            }
            true
        });
        out
    }

    /// Every buffer, each once.
    fn buffers(&self) -> Vec<Buffer> {
        self.named_buffers().into_iter().map(|(_, b)| b).collect()
    }

    /// Every module, this one first as `""`, depth-first in declaration order; a module shared through
    /// `Arc` once, under its first path. Lists (`Vec`, arrays, tuples) and maps are modules here, as
    /// `ModuleList` and `ModuleDict` are in PyTorch; `Option` and `Box` are transparent.
    fn named_modules(&self) -> Vec<(String, &dyn Module)> {
        let mut out = Vec::new();
        walk(self.as_dyn(), true, &mut |path, v| {
            if let Visit::Module(m) = v {
                out.push((path.to_owned(), m));
            }
            true
        });
        out
    }

    /// The direct submodules, each once.
    fn named_children(&self) -> Vec<(String, &dyn Module)> {
        let mut out = Vec::new();
        walk(self.as_dyn(), true, &mut |path, v| {
            if let Visit::Module(m) = v {
                if !path.is_empty() {
                    out.push((path.to_owned(), m));
                    return false;
                }
                return true;
            }
            false
        });
        out
    }

    /// The submodule at `path` (`""` is `self`) as a trait object.
    fn get_submodule_dyn(&self, path: &str) -> Result<&dyn Module> {
        let mut current = self.as_dyn();
        let mut walked = String::new();
        for segment in segments(path) {
            let mut found = None;
            let mut children = Vec::new();
            current.visit_children(&mut |name, child| {
                if found.is_none() && name.matches(segment) {
                    found = Some(child);
                } else if !matches!(child, Child::Absent) {
                    children.push(name.to_string());
                }
            });
            match found {
                Some(Child::Module { module, .. }) => current = module,
                Some(Child::Param(_)) => return Err(wrong_kind(path, "parameter")),
                Some(Child::Buffer(_)) => return Err(wrong_kind(path, "buffer")),
                Some(Child::Mode(_)) => return Err(wrong_kind(path, "train/eval flag")),
                Some(Child::Absent) | None => {
                    return Err(no_submodule(path, walked, current, segment, children));
                }
            }
            Name::Field(segment).push_to(&mut walked);
        }
        Ok(current)
    }

    /// The submodule at `path`, downcast to `T`.
    ///
    /// Fails with [`Error::NoSubmodule`] naming the first segment that is missing (and what is
    /// there instead), or [`Error::WrongModuleType`] naming the type that is there.
    fn get_submodule<T: Module>(&self, path: &str) -> Result<&T> {
        let m = self.get_submodule_dyn(path)?;
        m.downcast_ref::<T>()
            .ok_or_else(|| wrong_type::<T>(path, m))
    }

    /// The submodule at `path` as a mutable trait object. A module shared through an `Arc` with other
    /// owners cannot be borrowed mutably ([`Error::SharedModule`]).
    fn get_submodule_dyn_mut(&mut self, path: &str) -> Result<&mut dyn Module> {
        let mut current = self.as_dyn_mut();
        let mut walked = String::new();
        for segment in segments(path) {
            let mut found = None;
            let mut children = Vec::new();
            let parent_type = current.type_name();
            current.visit_children_mut(&mut |name, child| {
                if found.is_none() && name.matches(segment) {
                    found = Some(child);
                } else if !matches!(child, ChildMut::Absent) {
                    children.push(name.to_string());
                }
            });
            match found {
                Some(ChildMut::Module(module)) => current = module,
                Some(ChildMut::Shared(_)) => {
                    Name::Field(segment).push_to(&mut walked);
                    return Err(Error::SharedModule { path: walked });
                }
                Some(ChildMut::Param(_)) => return Err(wrong_kind(path, "parameter")),
                Some(ChildMut::Buffer(_)) => return Err(wrong_kind(path, "buffer")),
                Some(ChildMut::Mode(_)) => return Err(wrong_kind(path, "train/eval flag")),
                Some(ChildMut::Absent) | None => {
                    return Err(Error::NoSubmodule {
                        path: path.to_owned(),
                        parent: walked,
                        parent_type,
                        missing: segment.to_owned(),
                        children,
                    });
                }
            }
            Name::Field(segment).push_to(&mut walked);
        }
        Ok(current)
    }

    /// The submodule at `path`, mutably, downcast to `T`.
    fn get_submodule_mut<T: Module>(&mut self, path: &str) -> Result<&mut T> {
        let m = self.get_submodule_dyn_mut(path)?;
        if m.is::<T>() {
            Ok(m.downcast_mut::<T>().expect("type checked above"))
        } else {
            Err(wrong_type::<T>(path, m))
        }
    }

    /// The parameter at `path` (`fc1.weight`).
    fn get_parameter(&self, path: &str) -> Result<Param> {
        match leaf_at(self.as_dyn(), path)? {
            Child::Param(p) => Ok(p.clone()),
            other => Err(wrong_kind_of(path, "parameter", other)),
        }
    }

    /// The buffer at `path` (`embeddings.position_ids`).
    fn get_buffer(&self, path: &str) -> Result<Buffer> {
        match leaf_at(self.as_dyn(), path)? {
            Child::Buffer(b) => Ok(b.clone()),
            other => Err(wrong_kind_of(path, "buffer", other)),
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
    /// Fails with [`Error::Unbuilt`], listing every unbuilt path, if the model is not built: an
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
        crate::lazy::ensure_built(self.as_dyn(), "list the trainable variables of")?;
        Ok(self
            .parameters()
            .iter()
            .filter(|p| p.requires_grad())
            .map(Param::var)
            .collect())
    }

    /// Freezes every parameter at or under a path matching `pattern` (see [`PathPattern`]):
    /// `freeze("encoder")` and `freeze("encoder.*")` freeze the whole encoder, `freeze("**.bias")`
    /// every bias. Returns how many parameters matched. A pattern that matches nothing is an error
    /// ([`Error::NoMatch`]), since it is almost always a typo.
    fn freeze(&self, pattern: &str) -> Result<usize> {
        set_requires_grad(self.as_dyn(), pattern, false)
    }

    /// Unfreezes every parameter at or under a path matching `pattern`; see [`freeze`](Self::freeze).
    fn unfreeze(&self, pattern: &str) -> Result<usize> {
        set_requires_grad(self.as_dyn(), pattern, true)
    }

    /// Calls `f` on every module, children before their parent, each once (PyTorch's `apply`, for
    /// instance to initialize weights by layer type).
    fn apply(&self, f: &mut dyn FnMut(&dyn Module)) {
        fn post_order(m: &dyn Module, seen: &mut IdentitySet, f: &mut dyn FnMut(&dyn Module)) {
            m.visit_children(&mut |_, child| {
                if let Child::Module { module, shared } = child {
                    if shared.is_none_or(|s| seen.insert(s.id)) {
                        post_order(module, seen, f);
                    }
                }
            });
            f(m);
        }
        post_order(self.as_dyn(), &mut IdentitySet::default(), f);
    }

    /// A static, torchinfo-style summary: every module with its path, type and parameter count, and
    /// the totals (see [`Summary`](crate::Summary)).
    fn summary(&self) -> crate::Summary {
        crate::summary::Summary::of(self.as_dyn())
    }

    /// Puts every module of the tree in training mode (sets every [`Mode`] flag).
    fn train(&self) {
        self.set_training(true);
    }

    /// Puts every module of the tree in evaluation mode (PyTorch's `eval()`).
    fn eval(&self) {
        self.set_training(false);
    }

    /// Sets training (`true`) or evaluation (`false`) mode on every module of the tree.
    fn set_training(&self, training: bool) {
        walk(self.as_dyn(), false, &mut |_, v| {
            if let Visit::Mode(m) = v {
                m.set_training(training);
            }
            true
        });
    }

    /// Whether the module is in training mode: the first [`Mode`] flag in the tree (its own, if it has
    /// one). A tree with no mode-dependent layer behaves the same in both modes and reports `true`,
    /// PyTorch's default.
    fn is_training(&self) -> bool {
        let mut found = None;
        walk(self.as_dyn(), false, &mut |_, v| {
            if let (Visit::Mode(m), None) = (&v, found) {
                found = Some(m.is_training());
            }
            found.is_none()
        });
        found.unwrap_or(true)
    }

    /// Every parameter and persistent buffer by path, in declaration order (PyTorch's
    /// `state_dict()`): a tied weight appears under each of its paths, non-persistent buffers not
    /// at all. The tensors share storage with the model. Fails with [`Error::Unbuilt`] if the model
    /// is not built.
    fn state_dict(&self) -> Result<StateDict> {
        crate::lazy::ensure_built(self.as_dyn(), "take the state dict of")?;
        Ok(crate::state::state_dict(self.as_dyn()))
    }

    /// Loads `state` strictly: every path of the model must be present, with its shape and dtype,
    /// and nothing else. See [`load_state_dict_with`](Self::load_state_dict_with).
    fn load_state_dict(&self, state: &StateDict) -> Result<LoadReport> {
        self.load_state_dict_with(state, &LoadOptions::default())
    }

    /// Loads `state` with `options` (non-strict, key rules, dtype casting).
    ///
    /// All or nothing: every key is checked first, and on any problem the model is left exactly as it
    /// was and [`Error::Load`] lists every missing key, unexpected key and shape or dtype mismatch at
    /// once, with "did you mean" pairs. Values are copied into the existing parameters, so tied
    /// weights stay tied and optimizers built before the load keep working.
    ///
    /// Unbuilt lazy parameters and buffers are built from the checkpoint's values, whose shapes
    /// must fit their known dimensions (a failed load leaves them unbuilt). A model holding an
    /// unbuilt [`Lazy`](crate::Lazy) cell cannot be loaded ([`Error::Unbuilt`]): what the cell
    /// would hold is only known once it is built.
    ///
    /// ```
    /// use module_runtime::prelude::*;
    /// let a = Linear::new(3, 2, &Device::Cpu)?;
    /// let b = Linear::new(3, 2, &Device::Cpu)?;
    /// b.load_state_dict(&a.state_dict()?)?;
    /// let diff = (a.weight.tensor() - b.weight.tensor())?.abs()?.sum_all()?;
    /// assert_eq!(diff.to_scalar::<f32>()?, 0.0);
    ///
    /// let err = Linear::no_bias(3, 2, &Device::Cpu)?.load_state_dict(&a.state_dict()?).unwrap_err();
    /// assert!(err.to_string().contains("unexpected key(s): \"bias\""));
    /// # Ok::<(), module_runtime::Error>(())
    /// ```
    fn load_state_dict_with(&self, state: &StateDict, options: &LoadOptions) -> Result<LoadReport> {
        crate::state::load(self.as_dyn(), state, options)
    }

    /// Saves the state dict as a safetensors file, atomically: a temporary file beside `path`,
    /// flushed, then renamed over it, so a failed save never destroys the previous checkpoint.
    ///
    /// Fails with [`Error::Unbuilt`] if the model is not built.
    fn save_safetensors(&self, path: impl AsRef<std::path::Path>) -> Result<()> {
        crate::lazy::ensure_built(self.as_dyn(), "save")?;
        crate::io::save_safetensors(self.state_dict()?, path.as_ref())
    }

    /// Loads a safetensors checkpoint strictly (memory-mapped; all or nothing).
    fn load_safetensors(&self, path: impl AsRef<std::path::Path>) -> Result<LoadReport> {
        self.load_safetensors_with(path, &LoadOptions::default())
    }

    /// Loads a safetensors checkpoint with `options`; see
    /// [`load_state_dict_with`](Self::load_state_dict_with).
    fn load_safetensors_with(
        &self,
        path: impl AsRef<std::path::Path>,
        options: &LoadOptions,
    ) -> Result<LoadReport> {
        let file = crate::io::SafetensorsFile::open(path.as_ref())?;
        crate::state::load(self.as_dyn(), &file, options)
    }

    /// Loads a PyTorch pickle checkpoint (`torch.save(model.state_dict(), "x.pth")`, or a Hugging
    /// Face `pytorch_model.bin`) with `options`. `key` selects a nested dict such as
    /// `"state_dict"`.
    fn load_pth_with(
        &self,
        path: impl AsRef<std::path::Path>,
        key: Option<&str>,
        options: &LoadOptions,
    ) -> Result<LoadReport> {
        let state = crate::io::read_pth(path.as_ref(), key)?;
        crate::state::load(self.as_dyn(), &state, options)
    }

    /// Moves every parameter and buffer to `device`, in place: every alias of a tied weight follows.
    /// All or nothing: if one tensor fails to move, nothing has moved. Build optimizers after moving.
    /// Unbuilt lazy parameters and buffers record the device and are built there.
    fn to_device(&self, device: &Device) -> Result<()> {
        convert(
            self.as_dyn(),
            |p| match p.device().same_device(device) {
                true => Ok(None),
                false => Ok(Some(p.var().as_tensor().to_device(device)?)),
            },
            |b| match b.device().same_device(device) {
                true => Ok(None),
                false => Ok(Some(b.tensor().to_device(device)?)),
            },
        )
    }

    /// Converts every floating-point parameter and buffer to the floating-point `dtype`, in place;
    /// integer buffers keep their dtype (PyTorch's `Module.to(dtype)`). All or nothing. Unbuilt lazy
    /// parameters and buffers record the dtype and are built with it.
    fn to_dtype(&self, dtype: DType) -> Result<()> {
        if !dtype.is_float() {
            return Err(Error::NonFloatParam {
                dtype,
                shape: candle_core::Shape::from(()),
            });
        }
        convert(
            self.as_dyn(),
            |p| match p.dtype() == dtype {
                true => Ok(None),
                false => Ok(Some(p.var().as_tensor().to_dtype(dtype)?)),
            },
            |b| match !b.dtype().is_float() || b.dtype() == dtype {
                true => Ok(None),
                false => Ok(Some(b.tensor().to_dtype(dtype)?)),
            },
        )
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

fn collect_params(root: &dyn Module, dedup: bool) -> Vec<(String, Param)> {
    let mut out = Vec::new();
    walk(root, dedup, &mut |path, v| {
        if let Visit::Param(p) = v {
            out.push((path.to_owned(), p.clone()));
        }
        true
    });
    out
}

fn set_requires_grad(root: &dyn Module, pattern: &str, on: bool) -> Result<usize> {
    let pattern = PathPattern::new(pattern)?;
    let mut matched: Vec<Param> = Vec::new();
    let mut available = Vec::new();
    for (path, p) in collect_params(root, false) {
        if pattern.matches_at_or_above(&path) {
            if !matched.iter().any(|m| m.same_as(&p)) {
                matched.push(p);
            }
        } else if available.len() < 8 {
            available.push(path);
        }
    }
    if matched.is_empty() {
        return Err(Error::NoMatch {
            pattern: pattern.as_str().to_owned(),
            available,
        });
    }
    for p in &matched {
        p.set_requires_grad(on);
    }
    Ok(matched.len())
}

/// Converts every parameter and buffer, committing only once every conversion has succeeded.
fn convert(
    root: &dyn Module,
    param: impl Fn(&Param) -> Result<Option<Tensor>>,
    buffer: impl Fn(&Buffer) -> Result<Option<Tensor>>,
) -> Result<()> {
    let params = root.parameters();
    let buffers = root.buffers();
    let new_params = params.iter().map(&param).collect::<Result<Vec<_>>>()?;
    let new_buffers = buffers.iter().map(&buffer).collect::<Result<Vec<_>>>()?;
    let new_vars = new_params
        .into_iter()
        .map(|t| t.map(|t| Var::from_tensor(&t)).transpose())
        .collect::<candle_core::Result<Vec<_>>>()?;
    for (p, var) in params.iter().zip(new_vars) {
        if let Some(var) = var {
            p.replace_var(var);
        }
    }
    for (b, t) in buffers.iter().zip(new_buffers) {
        if let Some(t) = t {
            b.replace(t);
        }
    }
    Ok(())
}

fn segments(path: &str) -> impl Iterator<Item = &str> {
    path.split('.').filter(|_| !path.is_empty())
}

/// The leaf (parameter or buffer) at `path`.
fn leaf_at<'a>(root: &'a dyn Module, path: &str) -> Result<Child<'a>> {
    let (parent_path, last) = match path.rsplit_once('.') {
        Some((parent, last)) => (parent, last),
        None => ("", path),
    };
    let parent = root.get_submodule_dyn(parent_path)?;
    let mut found = None;
    let mut children = Vec::new();
    parent.visit_children(&mut |name, child| {
        if found.is_none() && name.matches(last) {
            found = Some(child);
        } else if !matches!(child, Child::Absent) {
            children.push(name.to_string());
        }
    });
    match found {
        Some(Child::Absent) | None => Err(no_submodule(
            path,
            parent_path.to_owned(),
            parent,
            last,
            children,
        )),
        Some(child) => Ok(child),
    }
}

fn no_submodule(
    path: &str,
    parent: String,
    parent_module: &dyn Module,
    missing: &str,
    children: Vec<String>,
) -> Error {
    Error::NoSubmodule {
        path: path.to_owned(),
        parent,
        parent_type: parent_module.type_name(),
        missing: missing.to_owned(),
        children,
    }
}

fn wrong_kind(path: &str, found: &'static str) -> Error {
    Error::WrongKind {
        path: path.to_owned(),
        expected: "module",
        found,
    }
}

fn wrong_kind_of(path: &str, expected: &'static str, found: Child<'_>) -> Error {
    Error::WrongKind {
        path: path.to_owned(),
        expected,
        found: match found {
            Child::Module { .. } => "module",
            Child::Param(_) => "parameter",
            Child::Buffer(_) => "buffer",
            Child::Mode(_) => "train/eval flag",
            Child::Absent => "nothing",
        },
    }
}

fn wrong_type<T: Module>(path: &str, found: &dyn Module) -> Error {
    Error::WrongModuleType {
        path: path.to_owned(),
        expected: short_type_name(std::any::type_name::<T>()),
        found: short_type_name(found.type_name()),
    }
}
