//! State dicts: `path -> Tensor` maps of a model's parameters and persistent buffers, and strict,
//! all-or-nothing loading with a report of everything that does not fit.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Shape, Tensor};

use crate::buffer::Buffer;
use crate::entries::Entries;
use crate::error::{Error, Result};
use crate::lazy_shape::LazyShape;
use crate::load_hooks::{IncompatibleKeys, PostHooks};
use crate::module::Module;
use crate::param::Param;
use crate::report::{LoadReport, Mismatch};
use crate::walk::{walk, Visit};
use crate::{KeyFix, KeyRule};
use module_core::quant::is_float_kind;

/// An ordered map from PyTorch-style paths to tensors: what [`state_dict`](../module_runtime/trait.ModuleExt.html#method.state_dict)
/// returns, [`read`](StateDict::read) reads from a file, and
/// [`load_state_dict`](../module_runtime/trait.ModuleExt.html#method.load_state_dict) takes.
///
/// Order is PyTorch's (each module's own parameters, own buffers, then submodules; insertion order
/// when built by hand), so a saved checkpoint lists its tensors the way
/// `print(model.state_dict().keys())` would.
#[derive(Clone, Debug, Default)]
pub struct StateDict {
    entries: Entries<Tensor>,
}

impl StateDict {
    /// An empty state dict.
    pub fn new() -> Self {
        Self::default()
    }

    /// Inserts or replaces `key`.
    pub fn insert(&mut self, key: impl Into<String>, value: Tensor) {
        self.entries.insert(key.into(), value);
    }

    /// Removes `key`, returning its value (Python's `state_dict.pop(key, None)`); the other keys
    /// keep their order.
    pub fn remove(&mut self, key: &str) -> Option<Tensor> {
        self.entries.remove(key)
    }

    module_core::dict_accessors!(Tensor, "tensor");

    /// The entries as a `HashMap` (what candle's safetensors writer takes).
    pub fn into_hash_map(self) -> HashMap<String, Tensor> {
        self.entries.into_iter().collect()
    }
}

impl<K: Into<String>> FromIterator<(K, Tensor)> for StateDict {
    fn from_iter<I: IntoIterator<Item = (K, Tensor)>>(iter: I) -> Self {
        let mut sd = StateDict::new();
        for (k, t) in iter {
            sd.insert(k, t);
        }
        sd
    }
}

impl From<HashMap<String, Tensor>> for StateDict {
    /// Keys are sorted, since a `HashMap` has no order.
    fn from(map: HashMap<String, Tensor>) -> Self {
        let mut entries: Vec<_> = map.into_iter().collect();
        entries.sort_by(|a, b| a.0.cmp(&b.0));
        entries.into_iter().collect()
    }
}

/// Options for [`load_state_dict`](../module_runtime/trait.ModuleExt.html#method.load_state_dict) (and, for
/// [`nested_in`](Self::nested_in), [`StateDict::read`]).
///
/// The default is PyTorch's: strict (every key of the model present in the checkpoint and nothing
/// else), no key rewriting, shapes must match exactly, and a value of another dtype is converted
/// to the model's dtype as `Tensor.copy_` does (a float64 checkpoint into a float32 model, an
/// integer value into a float parameter). [`exact_dtype`](Self::exact_dtype) asks for equal dtypes
/// instead. Tensors that do not map one to one onto the model's are split, concatenated or
/// transposed by the transforms ([`split`](Self::split), [`cat`](Self::cat),
/// [`transpose`](Self::transpose)), which run after the key rules.
///
/// ```
/// use module_runtime::LoadOptions;
/// let opts = LoadOptions::default().strip_prefix("module").rename("gamma", "weight").exact_dtype();
/// assert!(opts.is_strict());
/// ```
#[derive(Clone, Debug)]
pub struct LoadOptions {
    strict: bool,
    rules: Vec<KeyRule>,
    exact_dtype: bool,
    assign: bool,
    nested: Option<String>,
    post_hooks: PostHooks,
    pub(crate) transforms: Vec<crate::transform::Transform>,
    pub(crate) state_dict_hooks: Option<crate::state_dict_hooks::StateDictHooks>,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            strict: true,
            rules: Vec::new(),
            exact_dtype: false,
            assign: false,
            nested: None,
            post_hooks: PostHooks::default(),
            transforms: Vec::new(),
            state_dict_hooks: None,
        }
    }
}

impl From<&KeyFix> for LoadOptions {
    /// The options a load report's [`KeyFix`] names (its own rules, without the load's).
    fn from(fix: &KeyFix) -> Self {
        fix.rules
            .iter()
            .fold(Self::default(), |options, rule| options.rule(rule.clone()))
    }
}

impl LoadOptions {
    /// Tolerates missing and unexpected keys (they are still reported). Shape and dtype mismatches
    /// stay errors, as in PyTorch.
    pub fn non_strict(mut self) -> Self {
        self.strict = false;
        self
    }

    /// Whether missing or unexpected keys fail the load.
    pub fn is_strict(&self) -> bool {
        self.strict
    }

    /// Adds a key rule; rules apply in order to every checkpoint key.
    pub fn rule(mut self, rule: KeyRule) -> Self {
        self.rules.push(rule);
        self
    }

    /// Strips `prefix.` from checkpoint keys that have it: `strip_prefix("module")` and
    /// `strip_prefix("module.")` (PyTorch's spelling in `consume_prefix_in_state_dict_if_present`)
    /// are the same rule.
    pub fn strip_prefix(self, prefix: impl Into<String>) -> Self {
        self.rule(KeyRule::StripPrefix(prefix.into()))
    }

    /// Prepends `prefix.` to every checkpoint key (`add_prefix("bert")` loads a bare `BertModel`
    /// checkpoint into a model that holds it as its `bert` field); a trailing dot is optional.
    pub fn add_prefix(self, prefix: impl Into<String>) -> Self {
        self.rule(KeyRule::AddPrefix(prefix.into()))
    }

    /// Renames whole path segments in checkpoint keys.
    pub fn rename(self, from: impl Into<String>, to: impl Into<String>) -> Self {
        self.rule(KeyRule::Rename(from.into(), to.into()))
    }

    /// Renames whole checkpoint keys by pattern ([`KeyRule::RenameKey`]: a `*` segment matches
    /// any one segment and is put back where `to` has `*`): a file that names its tensors its
    /// own way, as llama.cpp's GGUF files do.
    ///
    /// ```
    /// use module_runtime::LoadOptions;
    /// let options = LoadOptions::default()
    ///     .rename_key("token_embd.weight", "model.embed_tokens.weight")
    ///     .rename_key("blk.*.attn_q.weight", "model.layers.*.self_attn.q_proj.weight");
    /// assert_eq!(options.map_key("blk.7.attn_q.weight"), "model.layers.7.self_attn.q_proj.weight");
    /// assert_eq!(options.map_key("lm_head.weight"), "lm_head.weight"); // no rule matches
    /// ```
    pub fn rename_key(self, from: impl Into<String>, to: impl Into<String>) -> Self {
        self.rule(KeyRule::RenameKey(from.into(), to.into()))
    }

    /// Requires every checkpoint value to have the model's dtype exactly: a value of another dtype
    /// is reported as a mismatch instead of being converted (the default converts, as PyTorch's
    /// `load_state_dict` does through `Tensor.copy_`).
    pub fn exact_dtype(mut self) -> Self {
        self.exact_dtype = true;
        self
    }

    /// Whether values must have the model's dtype exactly.
    pub fn is_exact_dtype(&self) -> bool {
        self.exact_dtype
    }

    /// Makes the checkpoint's tensors the model's values instead of copying them into the current
    /// ones: PyTorch's `load_state_dict(sd, assign=True)`, the zero-copy path for a model built
    /// only to be loaded ([`empty_weights`](module_core::empty_weights)).
    ///
    /// As in PyTorch, the values keep the checkpoint's dtype (a float16 checkpoint makes a float16
    /// model; a parameter still needs a floating-point value), shapes must still match, and whether
    /// a parameter is trained is the model's. Values read from a file are candle variables and
    /// become the parameters without a copy. Differences from PyTorch: values move to the
    /// parameter's device (the model stays on one device), and tied parameters stay tied, taking the
    /// value loaded last (PyTorch's assign unties them). Optimizers hold the old `Var`s: build them
    /// after the load.
    ///
    /// ```
    /// use module_runtime::prelude::*;
    ///
    /// let source = Linear::new(3, 2, &Device::Cpu)?;
    /// source.to_dtype(DType::F16)?;
    /// let model = Linear::new(3, 2, &Device::Cpu)?;
    /// model.load_state_dict(&source.state_dict()?, &LoadOptions::default().assign())?;
    /// assert_eq!(model.weight.dtype(), DType::F16); // the checkpoint's dtype
    /// # Ok::<(), module_runtime::Error>(())
    /// ```
    pub fn assign(mut self) -> Self {
        self.assign = true;
        self
    }

    /// Whether the load takes the checkpoint's tensors ([`assign`](Self::assign)).
    pub fn is_assign(&self) -> bool {
        self.assign
    }

    /// Takes the state dict stored under `key` in a pickled training checkpoint
    /// (`torch.save({"epoch": 3, "model": model.state_dict(), "optimizer": ...})`) when
    /// [`load_state_dict`](../module_runtime/trait.ModuleExt.html#method.load_state_dict) or [`StateDict::read`] reads a file:
    /// a `.pth`/`.pt`/`.bin` in either pickle format, directly, through a shard index or in a model
    /// folder. Dotted keys (`"model.ema"`) descend further. Without it, a pickle whose top level is
    /// not a state dict is an error that lists the keys holding one. A safetensors file holds one
    /// flat state dict, and a [`StateDict`] given to `load_state_dict` is already one: neither
    /// has anything to pick, and the key is not used.
    pub fn nested_in(mut self, key: impl Into<String>) -> Self {
        self.nested = Some(key.into());
        self
    }

    /// The key given to [`nested_in`](Self::nested_in).
    pub fn nested_key(&self) -> Option<&str> {
        self.nested.as_deref()
    }

    /// Adds a load-state-dict post-hook on the module the load is called on (PyTorch's
    /// `register_load_state_dict_post_hook`): see [`post_hook_at`](Self::post_hook_at).
    ///
    /// ```
    /// use module_runtime::prelude::*;
    /// use module_runtime::{nn::Linear, StateDict};
    ///
    /// let full = Linear::new(3, 2, &Device::Cpu)?;
    /// let mut sd = StateDict::new();
    /// sd.insert("weight", full.weight.tensor()?); // no "bias"
    /// let model = Linear::new(3, 2, &Device::Cpu)?;
    /// assert!(model.load_state_dict(&sd, &LoadOptions::default()).is_err());
    /// // A hook that accepts a missing bias makes the strict load succeed.
    /// let opts = LoadOptions::default().post_hook(|_module, keys| {
    ///     keys.missing_keys.retain(|k| k != "bias");
    ///     Ok(())
    /// });
    /// let report = model.load_state_dict(&sd, &opts)?;
    /// assert!(report.missing.is_empty() && report.loaded == 1);
    /// # Ok::<(), module_runtime::Error>(())
    /// ```
    #[doc(alias = "register_load_state_dict_post_hook")]
    pub fn post_hook(
        self,
        hook: impl Fn(&dyn Module, &mut IncompatibleKeys<'_>) -> Result<()> + Send + Sync + 'static,
    ) -> Self {
        self.post_hook_at("", hook)
    }

    /// Adds a load-state-dict post-hook on the submodule at `path` (`""`: the module the load is
    /// called on), PyTorch's `model.get_submodule(path).register_load_state_dict_post_hook(hook)`.
    ///
    /// The hook is called with that submodule and the load's [`IncompatibleKeys`]: the missing
    /// and unexpected keys (full paths, after the key rules), which it may edit in place.
    /// Strictness is decided *after* the hooks, as in PyTorch's `Module.load_state_dict`: a hook
    /// that removes every missing and unexpected key makes a strict load succeed, one that adds a
    /// key makes it fail. Hooks on submodules run before the hooks on the modules above them
    /// (PyTorch runs a module's hooks after loading its children), hooks on one module in the
    /// order they were added. They run on strict and non-strict loads, and the returned
    /// [`LoadReport`] (or the error's) shows their edits.
    ///
    /// **Deviation, from all-or-nothing loading:** PyTorch runs the hooks after the values are
    /// copied; here they run after every key is checked and *before* anything is copied, since
    /// whether anything is copied depends on them. So a hook sees the model's old values, and an
    /// error from a hook ([`Error::Hook`]) fails the load with the model
    /// unchanged. To act on the loaded values, do it after the load returns. A `path` that
    /// names no submodule fails the load ([`Error::NoSubmodule`]).
    /// Modules have no hidden field to hold hooks, so they belong to the options, not to the
    /// module: pass the same options to every load that needs them.
    #[doc(alias = "register_load_state_dict_post_hook")]
    pub fn post_hook_at(
        mut self,
        path: impl Into<String>,
        hook: impl Fn(&dyn Module, &mut IncompatibleKeys<'_>) -> Result<()> + Send + Sync + 'static,
    ) -> Self {
        self.post_hooks.push(path.into(), Arc::new(hook));
        self
    }

    /// The model path a checkpoint key maps to.
    pub fn map_key(&self, key: &str) -> String {
        KeyRule::apply_all(&self.rules, key)
    }
}

/// A parameter or persistent buffer a checkpoint can fill.
#[derive(Clone)]
pub enum Slot {
    Param(Param),
    Buffer(Buffer),
}

impl Slot {
    fn shape(&self) -> Shape {
        match self {
            Slot::Param(p) => p.shape(),
            Slot::Buffer(b) => b.shape(),
        }
    }

    fn lazy_shape(&self) -> Option<LazyShape> {
        match self {
            Slot::Param(p) => p.lazy_shape(),
            Slot::Buffer(b) => b.lazy_shape(),
        }
    }

    fn dtype(&self) -> DType {
        match self {
            Slot::Param(p) => p.dtype(),
            Slot::Buffer(b) => b.dtype(),
        }
    }

    fn device(&self) -> Device {
        match self {
            Slot::Param(p) => p.device(),
            Slot::Buffer(b) => b.device(),
        }
    }

    /// The values, detached (a quantized parameter's dequantized into a fresh tensor).
    fn tensor(&self) -> Result<Tensor> {
        Ok(match self {
            Slot::Param(p) => p.own_tensor()?,
            Slot::Buffer(b) => b.current(),
        })
    }
}

/// Every parameter and persistent buffer under every path (tied weights appear once per alias, as
/// in PyTorch's `state_dict`).
pub fn slots(root: &dyn Module) -> Vec<(String, Slot)> {
    let mut out = Vec::new();
    walk(root, false, &mut |path, v| {
        match v {
            Visit::Param(p) => out.push((path.to_owned(), Slot::Param(p.clone()))),
            Visit::Buffer(b) if b.is_persistent() => {
                out.push((path.to_owned(), Slot::Buffer(b.clone())))
            }
            _ => {}
        }
        true
    });
    out
}

/// Every parameter and persistent buffer, and every module's extra state, in PyTorch's order
/// (each module's own parameters, own buffers, extra state, then submodules).
pub fn state_dict(root: &dyn Module) -> Result<StateDict> {
    crate::path::check_keys(root)?;
    let mut sd = StateDict::new();
    let mut failed = None;
    walk(root, false, &mut |path, v| {
        if failed.is_some() {
            return true;
        }
        let value = match v {
            Visit::Param(p) => Slot::Param(p.clone()).tensor(),
            Visit::Buffer(b) if b.is_persistent() => Slot::Buffer(b.clone()).tensor(),
            Visit::Extra(e) => e.get_extra_state().map_err(|source| Error::ExtraState {
                path: path.to_owned(),
                source: Box::new(source),
            }),
            _ => return true,
        };
        match value {
            Ok(value) => sd.insert(path, value),
            Err(e) => failed = Some(e),
        }
        true
    });
    match failed {
        Some(e) => Err(e),
        None => Ok(sd),
    }
}

/// Where checkpoint values come from: an in-memory state dict or a file read lazily.
pub trait Source {
    /// Every key with its shape and dtype, without reading values.
    fn entries(&self) -> Result<Vec<(String, Shape, DType)>>;
    /// The value of `key` on `device`.
    fn load(&self, key: &str, device: &Device) -> Result<Tensor>;
    /// The value of `key` as a quantized weight, when the source holds it quantized (a GGUF
    /// file's `Q8_0` tensor): a parameter takes it with [`Param::set_quantized`]. `None` (the
    /// default) loads [`load`](Self::load)'s float value.
    fn load_quantized(&self, _key: &str) -> Result<Option<Arc<QTensor>>> {
        Ok(None)
    }
}

impl Source for StateDict {
    fn entries(&self) -> Result<Vec<(String, Shape, DType)>> {
        Ok(self
            .iter()
            .map(|(k, t)| (k.to_owned(), t.shape().clone(), t.dtype()))
            .collect())
    }

    fn load(&self, key: &str, device: &Device) -> Result<Tensor> {
        let t = self.get(key).expect("key listed by entries");
        Ok(t.to_device(device)?)
    }
}

/// Validates everything, then stages every new value, then commits: a load that fails changes
/// nothing. Unbuilt lazy slots take any shape their layout accepts, and are built by the commit.
pub fn load(root: &dyn Module, source: &dyn Source, options: &LoadOptions) -> Result<LoadReport> {
    crate::views::ensure_cells_built(root, "load a checkpoint into")?;
    crate::path::check_keys(root)?;
    let targets = slots(root);
    let extras = crate::walk::extra_state_slots(root);
    let mut by_model_key: HashMap<String, (String, Shape, DType)> = HashMap::new();
    let mut unexpected = Vec::new();
    let model_keys: HashSet<&str> = (targets.iter().map(|(k, _)| k.as_str()))
        .chain(extras.iter().map(|(k, _)| k.as_str()))
        .collect();
    // The checkpoint's keys after the key rules, the transforms and the load pre-hooks.
    let (pending, transforms) = crate::pending::Pending::build(root, source, options, &model_keys)?;
    let source: &dyn Source = &pending;
    for (mapped, shape, dtype) in source.entries()? {
        let key = mapped.clone();
        if model_keys.contains(mapped.as_str()) && !by_model_key.contains_key(&mapped) {
            by_model_key.insert(mapped, (key, shape, dtype));
        } else {
            unexpected.push((mapped, shape));
        }
    }
    let mut missing = Vec::new();

    let mut report = LoadReport {
        transforms,
        ..LoadReport::default()
    };
    let mut plan = Vec::new();
    for (path, slot) in &targets {
        let Some((key, shape, dtype)) = by_model_key.get(path) else {
            if !matches!(slot, Slot::Buffer(b) if b.is_missing_ok()) {
                missing.push((
                    path.clone(),
                    crate::suggest::expected(slot.lazy_shape(), slot.shape()),
                ));
            }
            continue;
        };
        let (expected_shape, expected_dtype) = (slot.shape(), slot.dtype());
        let unbuilt = slot.lazy_shape();
        let shape_ok = match &unbuilt {
            Some(lazy) => lazy.accepts(shape.dims()),
            None => *shape == expected_shape,
        };
        // PyTorch copies with `param.copy_(input_param)`, which converts any dtype
        // (`torch/nn/modules/module.py`, `Module._load_from_state_dict`).
        // With `assign`, the checkpoint's dtype is taken; a parameter still needs a float.
        let dtype_ok = if options.assign {
            dtype.is_float() || matches!(slot, Slot::Buffer(_))
        } else {
            *dtype == expected_dtype || !options.exact_dtype
        };
        if !shape_ok || !dtype_ok {
            report.mismatched.push(Mismatch {
                key: path.clone(),
                expected_shape,
                expected_dtype,
                shape: shape.clone(),
                dtype: *dtype,
                unbuilt,
            });
            continue;
        }
        plan.push((slot, key.as_str(), expected_dtype));
    }
    // Extra state: a missing key is missing; any value is handed to `set_extra_state`.
    let mut extra_plan = Vec::new();
    for (path, extra) in &extras {
        match by_model_key.get(path) {
            Some((key, ..)) => extra_plan.push((path.as_str(), *extra, key.as_str())),
            None => missing.push((
                path.clone(),
                crate::suggest::Expected::Lazy(LazyShape::new([None])),
            )),
        }
    }
    unexpected.sort_by(|a, b| a.0.cmp(&b.0));
    report.missing = missing.iter().map(|(k, _)| k.clone()).collect();
    report.unexpected = unexpected.iter().map(|(k, _)| k.clone()).collect();
    // Post-hooks may edit the missing and unexpected keys; strictness and suggestions are decided
    // after them, on the keys they left (a key a hook added has no known shape).
    options.post_hooks.run(root, &mut report)?;
    let mut missing: HashMap<String, crate::suggest::Expected> = missing.into_iter().collect();
    let missing: Vec<_> = (report.missing.iter())
        .map(|k| {
            let expected = missing.remove(k);
            (
                k.clone(),
                expected.unwrap_or(crate::suggest::Expected::Lazy(LazyShape::new([None]))),
            )
        })
        .collect();
    let mut unexpected: HashMap<String, Shape> = unexpected.into_iter().collect();
    let unexpected: Vec<_> = (report.unexpected.iter())
        .map(|k| {
            (
                k.clone(),
                unexpected.remove(k).unwrap_or_else(|| Shape::from(())),
            )
        })
        .collect();
    let keys: Vec<&str> = targets.iter().map(|(k, _)| k.as_str()).collect();
    let found = crate::suggest::suggest(&keys, &missing, &unexpected, &options.rules);
    report.key_fix = found.fix;
    report.suggestions = found.pairs;

    let failed = !report.mismatched.is_empty()
        || (options.strict && (!report.missing.is_empty() || !report.unexpected.is_empty()));
    if failed {
        return Err(Error::Load(Box::new(report)));
    }

    // Stage: read and convert every value before touching the model. A quantized weight is moved
    // to its parameter's device here and taken as is (`set_quantized` dequantizes it).
    let mut staged = Vec::with_capacity(plan.len());
    let mut staged_quantized = Vec::new();
    for (slot, key, dtype) in plan {
        if let Slot::Param(p) = slot
            && let Some(q) = source.load_quantized(key)?
        {
            staged_quantized.push((p, module_core::quant::qtensor_on(&q, &p.device())?));
            continue;
        }
        let value = source.load(key, &slot.device())?;
        // Quantized as `Param::set` would (from the value as read, in row chunks), here: the
        // commit, which holds calls back, only installs.
        let requantize = |k: &GgmlDType| !options.assign && !is_float_kind(*k);
        if let Slot::Param(p) = slot
            && let Some(kind) = p.quantized_dtype().filter(requantize)
        {
            staged_quantized.push((p, module_core::quant::quantize_value(&value, kind)?));
            continue;
        }
        let value = if value.dtype() == dtype || options.assign {
            value
        } else {
            value.to_dtype(dtype)?
        };
        staged.push((slot, value));
    }
    let mut staged_extras = Vec::with_capacity(extra_plan.len());
    for (path, extra, key) in extra_plan {
        staged_extras.push((path, extra, source.load(key, &Device::Cpu)?));
    }
    // The commit is one update: a call on another thread runs with the weights of before or with
    // all of these (`module_core::update_lock`).
    module_core::atomic_update(|| {
        // Extra states first: `set_extra_state` may refuse its value, and puts the others back if
        // so.
        crate::extra_state::commit(&staged_extras)?;
        // Shapes, dtypes and devices are known to match, so these copies cannot fail on input.
        for (slot, value) in &staged {
            match (slot, options.assign) {
                (Slot::Param(p), false) => p.set(value)?,
                (Slot::Buffer(b), false) => b.set(value)?,
                (Slot::Param(p), true) => p.assign(value)?,
                (Slot::Buffer(b), true) => b.assign(value)?,
            }
        }
        for (p, q) in staged_quantized.iter() {
            p.set_quantized(q.clone())?;
        }
        Ok::<_, Error>(())
    })?;
    report.loaded = staged.len() + staged_quantized.len() + staged_extras.len();
    Ok(report)
}
