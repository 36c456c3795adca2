//! State dicts: `path -> Tensor` maps of a model's parameters and persistent buffers, and strict,
//! all-or-nothing loading with a report of everything that does not fit.

use std::collections::{HashMap, HashSet};

use candle_core::{DType, Device, Shape, Tensor};

use crate::buffer::Buffer;
use crate::error::{Error, Result};
use crate::lazy_shape::LazyShape;
use crate::module::Module;
use crate::param::Param;
use crate::report::{LoadReport, Mismatch};
use crate::walk::{walk, Visit};

/// An ordered map from PyTorch-style paths to tensors: what [`state_dict`](crate::ModuleExt::state_dict)
/// returns and [`load_state_dict`](crate::ModuleExt::load_state_dict) takes.
///
/// Order is PyTorch's (each module's own parameters, own buffers, then submodules; insertion order
/// when built by hand), so a saved checkpoint lists its tensors the way
/// `print(model.state_dict().keys())` would.
#[derive(Clone, Debug, Default)]
pub struct StateDict {
    entries: Vec<(String, Tensor)>,
    index: HashMap<String, usize>,
}

impl StateDict {
    /// An empty state dict.
    pub fn new() -> Self {
        Self::default()
    }

    /// Inserts or replaces `key`.
    pub fn insert(&mut self, key: impl Into<String>, value: Tensor) {
        let key = key.into();
        match self.index.get(&key) {
            Some(&i) => self.entries[i].1 = value,
            None => {
                self.index.insert(key.clone(), self.entries.len());
                self.entries.push((key, value));
            }
        }
    }

    /// The tensor at `key`.
    pub fn get(&self, key: &str) -> Option<&Tensor> {
        self.index.get(key).map(|&i| &self.entries[i].1)
    }

    /// Whether `key` is present.
    pub fn contains_key(&self, key: &str) -> bool {
        self.index.contains_key(key)
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether there are no entries.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The keys, in order.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.entries.iter().map(|(k, _)| k.as_str())
    }

    /// The entries, in order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Tensor)> {
        self.entries.iter().map(|(k, t)| (k.as_str(), t))
    }

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

/// How a checkpoint's keys are rewritten before they are matched against the model's paths.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KeyRule {
    /// Removes a leading `prefix.` where present (`module.` from `DataParallel`, `bert.`); the
    /// prefix may be given with or without its trailing dot.
    StripPrefix(String),
    /// Puts `prefix.` in front of every key; the prefix may be given with or without its
    /// trailing dot.
    AddPrefix(String),
    /// Replaces a run of whole path segments: `Rename("gamma", "weight")` turns `ln.gamma` into
    /// `ln.weight`, and leaves `ln.gammas` alone.
    Rename(String, String),
}

impl KeyRule {
    fn apply(&self, key: &str) -> String {
        match self {
            // `module` and `module.` are one prefix: PyTorch's
            // `consume_prefix_in_state_dict_if_present(sd, "module.")` is spelled with the dot.
            KeyRule::StripPrefix(prefix) => key
                .strip_prefix(prefix.trim_end_matches('.'))
                .and_then(|rest| rest.strip_prefix('.'))
                .unwrap_or(key)
                .to_owned(),
            KeyRule::AddPrefix(prefix) => match prefix.trim_end_matches('.') {
                "" => key.to_owned(),
                prefix => format!("{prefix}.{key}"),
            },
            KeyRule::Rename(from, to) => {
                let padded = format!(".{key}.");
                match padded.find(&format!(".{from}.")) {
                    Some(at) => {
                        let mut out = padded.clone();
                        out.replace_range(at + 1..at + 1 + from.len(), to);
                        out[1..out.len() - 1].to_owned()
                    }
                    None => key.to_owned(),
                }
            }
        }
    }
}

/// Options for [`load_state_dict`](crate::ModuleExt::load_state_dict) and the file loaders.
///
/// The default is PyTorch's: strict (every key of the model present in the checkpoint and nothing
/// else), no key rewriting, shapes must match exactly, and a value of another dtype is converted
/// to the model's dtype as `Tensor.copy_` does (a float64 checkpoint into a float32 model, an
/// integer value into a float parameter). [`exact_dtype`](Self::exact_dtype) asks for equal dtypes
/// instead.
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
    nested: Option<String>,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            strict: true,
            rules: Vec::new(),
            exact_dtype: false,
            nested: None,
        }
    }
}

impl LoadOptions {
    /// Strict loading (the default).
    pub fn strict() -> Self {
        Self::default()
    }

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

    /// Takes the state dict stored under `key` in a pickled training checkpoint
    /// (`torch.save({"epoch": 3, "model": model.state_dict(), "optimizer": ...})`), for the file
    /// loaders. Without it, a file whose top level is not a state dict is an error that lists the
    /// keys holding one.
    pub fn nested_in(mut self, key: impl Into<String>) -> Self {
        self.nested = Some(key.into());
        self
    }

    /// The key given to [`nested_in`](Self::nested_in).
    pub fn nested_key(&self) -> Option<&str> {
        self.nested.as_deref()
    }

    /// The model path a checkpoint key maps to.
    pub fn map_key(&self, key: &str) -> String {
        self.rules
            .iter()
            .fold(key.to_owned(), |key, rule| rule.apply(&key))
    }
}

/// A parameter or persistent buffer a checkpoint can fill.
#[derive(Clone)]
pub(crate) enum Slot {
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

    fn tensor(&self) -> Tensor {
        match self {
            Slot::Param(p) => p.var().as_tensor().detach(),
            Slot::Buffer(b) => b.tensor(),
        }
    }
}

/// Every parameter and persistent buffer under every path (tied weights appear once per alias, as
/// in PyTorch's `state_dict`).
pub(crate) fn slots(root: &dyn Module) -> Vec<(String, Slot)> {
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

pub(crate) fn state_dict(root: &dyn Module) -> StateDict {
    slots(root)
        .into_iter()
        .map(|(k, s)| (k, s.tensor()))
        .collect()
}

/// Where checkpoint values come from: an in-memory state dict or a file read lazily.
pub(crate) trait Source {
    /// Every key with its shape and dtype, without reading values.
    fn entries(&self) -> Result<Vec<(String, Shape, DType)>>;
    /// The value of `key` on `device`.
    fn load(&self, key: &str, device: &Device) -> Result<Tensor>;
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
pub(crate) fn load(
    root: &dyn Module,
    source: &dyn Source,
    options: &LoadOptions,
) -> Result<LoadReport> {
    crate::views::ensure_cells_built(root, "load a checkpoint into")?;
    let targets = slots(root);
    let mut by_model_key: HashMap<String, (String, Shape, DType)> = HashMap::new();
    let mut unexpected = Vec::new();
    let model_keys: HashSet<&str> = targets.iter().map(|(k, _)| k.as_str()).collect();
    for (key, shape, dtype) in source.entries()? {
        let mapped = options.map_key(&key);
        if model_keys.contains(mapped.as_str()) && !by_model_key.contains_key(&mapped) {
            by_model_key.insert(mapped, (key, shape, dtype));
        } else {
            unexpected.push((mapped, shape));
        }
    }
    let mut missing = Vec::new();

    let mut report = LoadReport::default();
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
        let dtype_ok = *dtype == expected_dtype || !options.exact_dtype;
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
    unexpected.sort_by(|a, b| a.0.cmp(&b.0));
    let keys: Vec<&str> = targets.iter().map(|(k, _)| k.as_str()).collect();
    let found = crate::suggest::suggest(&keys, &missing, &unexpected, &options.rules);
    report.key_fix = found.fix;
    report.suggestions = found.pairs;
    report.missing = missing.into_iter().map(|(k, _)| k).collect();
    report.unexpected = unexpected.into_iter().map(|(k, _)| k).collect();

    let failed = !report.mismatched.is_empty()
        || (options.strict && (!report.missing.is_empty() || !report.unexpected.is_empty()));
    if failed {
        return Err(Error::Load(Box::new(report)));
    }

    // Stage: read and convert every value before touching the model.
    let mut staged = Vec::with_capacity(plan.len());
    for (slot, key, dtype) in plan {
        let value = source.load(key, &slot.device())?;
        let value = if value.dtype() == dtype {
            value
        } else {
            value.to_dtype(dtype)?
        };
        staged.push((slot, value));
    }
    // Commit: shapes, dtypes and devices are known to match, so these copies cannot fail on input.
    for (slot, value) in &staged {
        match slot {
            Slot::Param(p) => p.set(value)?,
            Slot::Buffer(b) => b.set(value)?,
        }
    }
    report.loaded = staged.len();
    Ok(report)
}
