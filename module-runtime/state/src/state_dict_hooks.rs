//! State-dict hooks by path pattern or module type, with removable handles: load pre-hooks
//! (PyTorch's `_register_load_state_dict_pre_hook`), which see and may rewrite the state dict
//! being loaded, and state-dict post-hooks (`register_state_dict_post_hook`), which rewrite what
//! a state dict holds. [`StateDictHooks`] keeps them.

use std::sync::{Arc, PoisonError, RwLock, Weak};

use candle_core::{DType, Device, Shape, Tensor};

use crate::error::{Error, Result, TransformError};
use crate::module::Module;
use crate::pattern::PathPattern;
use crate::pending::{Entry, Pending, Value};
use crate::report::TransformReport;
use crate::state::{LoadOptions, StateDict};
use crate::walk::{walk, Visit};

/// A load-state-dict pre-hook: called with the module it targets and the state dict being
/// loaded, which it may rewrite ([`LoadingStateDict`]).
pub type LoadPreHookFn = dyn Fn(&dyn Module, &mut LoadingStateDict<'_>) -> Result<()> + Send + Sync;

/// A state-dict post-hook: called with the module it targets, the module's prefix (`"enc."`,
/// `""` for the root) and the state dict taken so far, which it may rewrite.
pub type StateDictPostHookFn =
    dyn Fn(&dyn Module, &str, &mut StateDict) -> Result<()> + Send + Sync;

/// Which modules a state-dict hook is registered on: a path or [`PathPattern`] (`""` for the
/// root; a `&str` converts), or every module of a type ([`HookTarget::of_type`]).
#[derive(Clone)]
pub enum HookTarget {
    /// The modules whose path matches the pattern.
    Path(String),
    /// Every module of one type, by its class name (what the message of an error names).
    Type {
        /// The type's class name.
        name: String,
        /// Whether a module is of the type.
        is: fn(&dyn Module) -> bool,
    },
}

impl HookTarget {
    /// Every module of type `T`, wherever it is: PyTorch's hooks registered in a class's
    /// `__init__`, which every instance has.
    pub fn of_type<T: Module>() -> Self {
        fn is<T: Module>(m: &dyn Module) -> bool {
            m.downcast_ref::<T>().is_some()
        }
        HookTarget::Type {
            name: T::type_class_name(),
            is: is::<T>,
        }
    }

    fn matches(&self, path: &str, module: &dyn Module, pattern: Option<&PathPattern>) -> bool {
        match (self, pattern) {
            (HookTarget::Type { is, .. }, _) => is(module),
            (HookTarget::Path(p), None) => p.is_empty() && path.is_empty(),
            (HookTarget::Path(_), Some(pattern)) => pattern.matches(path),
        }
    }
}

impl From<&str> for HookTarget {
    fn from(pattern: &str) -> Self {
        HookTarget::Path(pattern.to_owned())
    }
}

impl std::fmt::Debug for HookTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HookTarget::Path(p) => write!(f, "{p:?}"),
            HookTarget::Type { name, .. } => write!(f, "type {name}"),
        }
    }
}

struct Hook<F: ?Sized> {
    id: u64,
    target: HookTarget,
    pattern: Option<PathPattern>,
    hook: Arc<F>,
}

#[derive(Default)]
struct Lists {
    next: u64,
    pre: Vec<Hook<LoadPreHookFn>>,
    post: Vec<Hook<StateDictPostHookFn>>,
}

/// A registry of state-dict hooks. Loads run its pre-hooks when their options name it
/// ([`LoadOptions::state_dict_hooks`]); [`state_dict`](Self::state_dict) runs its post-hooks.
/// Cloning gives another handle to the same registry.
///
/// Modules have no hidden field to hold hooks, so, as with
/// [`LoadOptions::post_hook`], the hooks are kept apart from the model and given to the calls
/// that use them.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::LayerNorm;
/// use module_runtime::{HookTarget, StateDict, StateDictHooks};
///
/// #[derive(Module)]
/// struct Net { norm: LayerNorm, fc: Linear }
/// let dev = Device::Cpu;
/// let net = Net { norm: LayerNorm::new(4, &dev)?, fc: Linear::new(4, 2, &dev)? };
/// let hooks = StateDictHooks::new();
/// // An old checkpoint names LayerNorm's affine parameters `gamma` and `beta`.
/// let handle = hooks.register_load_state_dict_pre_hook(HookTarget::of_type::<LayerNorm>(), |_, sd| {
///     for (old, new) in [("gamma", "weight"), ("beta", "bias")] {
///         let (old, new) = (format!("{}{old}", sd.prefix()), format!("{}{new}", sd.prefix()));
///         if sd.contains(&old) {
///             sd.rename(&old, &new)?;
///         }
///     }
///     Ok(())
/// })?;
/// let mut old = StateDict::new();
/// for (k, v) in net.state_dict()?.iter() {
///     old.insert(k.replace("norm.weight", "norm.gamma").replace("norm.bias", "norm.beta"), v.clone());
/// }
/// let report = net.load_state_dict(&old, &LoadOptions::default().state_dict_hooks(&hooks))?;
/// assert_eq!(report.transforms[0].consumed, ["norm.gamma", "norm.beta"]);
/// assert!(handle.remove());
/// assert!(net.load_state_dict(&old, &LoadOptions::default().state_dict_hooks(&hooks)).is_err());
/// # Ok::<(), module_runtime::Error>(())
/// ```
#[derive(Clone, Default)]
pub struct StateDictHooks(Arc<RwLock<Lists>>);

impl std::fmt::Debug for StateDictHooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let lists = self.0.read().unwrap_or_else(PoisonError::into_inner);
        let targets = |t: &[HookTarget]| format!("{t:?}");
        let pre: Vec<HookTarget> = lists.pre.iter().map(|h| h.target.clone()).collect();
        let post: Vec<HookTarget> = lists.post.iter().map(|h| h.target.clone()).collect();
        f.debug_struct("StateDictHooks")
            .field("load_pre_hooks", &targets(&pre))
            .field("post_hooks", &targets(&post))
            .finish()
    }
}

/// Removes the hook it was returned for ([`StateDictHooks`]): PyTorch's `RemovableHandle`.
/// Dropping it keeps the hook.
#[derive(Clone, Debug)]
pub struct StateDictHookHandle {
    registry: Weak<RwLock<Lists>>,
    id: u64,
}

impl StateDictHookHandle {
    /// Removes the hook; returns whether it was still registered.
    pub fn remove(&self) -> bool {
        let Some(registry) = self.registry.upgrade() else {
            return false;
        };
        let mut lists = registry.write().unwrap_or_else(PoisonError::into_inner);
        let before = lists.pre.len() + lists.post.len();
        lists.pre.retain(|h| h.id != self.id);
        lists.post.retain(|h| h.id != self.id);
        before != lists.pre.len() + lists.post.len()
    }
}

impl StateDictHooks {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers a load-state-dict pre-hook on the modules `target` names (PyTorch's
    /// `module._register_load_state_dict_pre_hook(hook, with_module=True)`), for the loads whose
    /// options name this registry. Fails if `target` is a malformed pattern.
    ///
    /// Before anything is matched against the model, each module the hook targets, in PyTorch's
    /// order (a module before its submodules, each module's hooks in registration order), has the
    /// hook called with the module and the state dict being loaded: the checkpoint's keys after
    /// the key rules and the transforms, full paths from the model the load is called on (the
    /// module's own keys start with [`prefix`](LoadingStateDict::prefix)). The hook may rename,
    /// remove or insert entries, and read values. What it changed is in the load report's
    /// [`transforms`](module_core::LoadReport::transforms); its error fails the load
    /// ([`Error::Hook`]) with the model unchanged. A path pattern that matches no module of
    /// the model fails the load ([`Error::NoModuleMatch`]).
    #[doc(alias = "_register_load_state_dict_pre_hook")]
    pub fn register_load_state_dict_pre_hook(
        &self,
        target: impl Into<HookTarget>,
        hook: impl Fn(&dyn Module, &mut LoadingStateDict<'_>) -> Result<()> + Send + Sync + 'static,
    ) -> Result<StateDictHookHandle> {
        let hook: Arc<LoadPreHookFn> = Arc::new(hook);
        self.add(target.into(), |l, h| l.pre.push(h), hook)
    }

    /// Registers a state-dict post-hook on the modules `target` names (PyTorch's
    /// `register_state_dict_post_hook`): [`state_dict`](Self::state_dict) calls it with the
    /// module, its prefix and the state dict, which it may rewrite (rename, remove, insert
    /// entries). Hooks on submodules run before the hooks of the modules above them, as PyTorch's
    /// `state_dict` recursion runs them. Fails if `target` is a malformed pattern.
    pub fn register_state_dict_post_hook(
        &self,
        target: impl Into<HookTarget>,
        hook: impl Fn(&dyn Module, &str, &mut StateDict) -> Result<()> + Send + Sync + 'static,
    ) -> Result<StateDictHookHandle> {
        let hook: Arc<StateDictPostHookFn> = Arc::new(hook);
        self.add(target.into(), |l, h| l.post.push(h), hook)
    }

    fn add<F: ?Sized>(
        &self,
        target: HookTarget,
        push: impl FnOnce(&mut Lists, Hook<F>),
        hook: Arc<F>,
    ) -> Result<StateDictHookHandle> {
        let pattern = match &target {
            HookTarget::Path(p) if !p.is_empty() => Some(PathPattern::new(p)?),
            _ => None,
        };
        let mut lists = self.0.write().unwrap_or_else(PoisonError::into_inner);
        lists.next += 1;
        let id = lists.next;
        let hook = Hook {
            id,
            target,
            pattern,
            hook,
        };
        push(&mut lists, hook);
        Ok(StateDictHookHandle {
            registry: Arc::downgrade(&self.0),
            id,
        })
    }

    /// `model`'s state dict with the post-hooks applied: PyTorch's `model.state_dict()` on a
    /// model whose modules registered `register_state_dict_post_hook`s. Fails as
    /// `state_dict` does, with [`Error::Hook`] if a hook fails, or with
    /// [`Error::NoModuleMatch`] if a path pattern matches no module.
    ///
    /// ```
    /// use module_runtime::prelude::*;
    /// use module_runtime::{HookTarget, StateDictHooks};
    ///
    /// let fc = Linear::new(3, 2, &Device::Cpu)?;
    /// let hooks = StateDictHooks::new();
    /// // Save the weight as GPT-2's `Conv1D` would: `[in, out]`.
    /// hooks.register_state_dict_post_hook(HookTarget::of_type::<Linear>(), |_, prefix, sd| {
    ///     let key = format!("{prefix}weight");
    ///     let w = sd.get(&key).expect("a Linear has a weight").t()?.contiguous()?;
    ///     sd.insert(key, w);
    ///     Ok(())
    /// })?;
    /// assert_eq!(hooks.state_dict(&fc)?.get("weight").unwrap().dims(), [3, 2]);
    /// # Ok::<(), module_runtime::Error>(())
    /// ```
    pub fn state_dict(&self, model: &dyn Module) -> Result<StateDict> {
        crate::views::ensure_built(model, "take the state dict of")?;
        let mut sd = crate::state::state_dict(model)?;
        let hooks: Vec<(HookTarget, Option<PathPattern>, Arc<StateDictPostHookFn>)> = {
            let lists = self.0.read().unwrap_or_else(PoisonError::into_inner);
            (lists.post.iter())
                .map(|h| (h.target.clone(), h.pattern.clone(), h.hook.clone()))
                .collect()
        };
        if hooks.is_empty() {
            return Ok(sd);
        }
        let modules = post_order(modules(model));
        check_patterns(hooks.iter().map(|h| (&h.0, h.1.as_ref())), &modules)?;
        for (path, module) in modules {
            for (target, pattern, hook) in &hooks {
                if target.matches(&path, module, pattern.as_ref()) {
                    hook(module, &prefix(&path), &mut sd).map_err(|e| Error::Hook {
                        path: path.clone(),
                        hook: "state_dict post-hook",
                        source: Box::new(e),
                    })?;
                }
            }
        }
        Ok(sd)
    }

    /// Runs the load pre-hooks on `pending`, a module before its submodules; a report for each
    /// call that changed anything.
    pub(crate) fn run_load_pre_hooks(
        &self,
        root: &dyn Module,
        pending: &mut Pending<'_>,
        strict: bool,
        reports: &mut Vec<TransformReport>,
    ) -> Result<()> {
        let hooks: Vec<(HookTarget, Option<PathPattern>, Arc<LoadPreHookFn>)> = {
            let lists = self.0.read().unwrap_or_else(PoisonError::into_inner);
            (lists.pre.iter())
                .map(|h| (h.target.clone(), h.pattern.clone(), h.hook.clone()))
                .collect()
        };
        if hooks.is_empty() {
            return Ok(());
        }
        let modules = modules(root);
        check_patterns(hooks.iter().map(|h| (&h.0, h.1.as_ref())), &modules)?;
        for (path, module) in modules {
            for (target, pattern, hook) in &hooks {
                if !target.matches(&path, module, pattern.as_ref()) {
                    continue;
                }
                let mut sd = LoadingStateDict {
                    pending: &mut *pending,
                    prefix: prefix(&path),
                    path: &path,
                    strict,
                    consumed: Vec::new(),
                    produced: Vec::new(),
                };
                hook(module, &mut sd).map_err(|e| Error::Hook {
                    path: path.clone(),
                    hook: "load_state_dict pre-hook",
                    source: Box::new(e),
                })?;
                if !sd.consumed.is_empty() || !sd.produced.is_empty() {
                    reports.push(TransformReport {
                        rule: format!("load_state_dict pre-hook on {path:?}"),
                        consumed: sd.consumed,
                        produced: sd.produced,
                    });
                }
            }
        }
        Ok(())
    }
}

impl LoadOptions {
    /// Runs `hooks`' load-state-dict pre-hooks in the load
    /// ([`StateDictHooks::register_load_state_dict_pre_hook`]); replaces the registry given
    /// before, if any.
    pub fn state_dict_hooks(mut self, hooks: &StateDictHooks) -> Self {
        self.state_dict_hooks = Some(hooks.clone());
        self
    }
}

/// What the mutating store of a load pre-hook is: the pending state dict of the load.
trait Store {
    fn entries(&mut self) -> &mut Vec<Entry>;
    fn entries_ref(&self) -> &[Entry];
    fn read(&self, value: &Value) -> Result<Tensor>;
}

impl Store for Pending<'_> {
    fn entries(&mut self) -> &mut Vec<Entry> {
        &mut self.entries
    }
    fn entries_ref(&self) -> &[Entry] {
        &self.entries
    }
    fn read(&self, value: &Value) -> Result<Tensor> {
        self.eval(value, &Device::Cpu)
    }
}

/// The state dict a load pre-hook sees: PyTorch's `state_dict` argument of a
/// `_register_load_state_dict_pre_hook` hook, with its `prefix` and `strict`. Keys are full paths
/// from the model the load is called on; values are read only when asked for
/// ([`get`](Self::get)), so a hook that only renames keys reads nothing.
pub struct LoadingStateDict<'a> {
    pending: &'a mut dyn Store,
    prefix: String,
    path: &'a str,
    strict: bool,
    consumed: Vec<String>,
    produced: Vec<String>,
}

impl LoadingStateDict<'_> {
    /// The hooked module's prefix: its path and a dot (`"encoder.layer.0."`), `""` for the
    /// module the load is called on.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// Whether the load is strict.
    pub fn is_strict(&self) -> bool {
        self.strict
    }

    /// Every key, in order.
    pub fn keys(&self) -> Vec<String> {
        let entries = self.pending.entries_ref();
        entries.iter().map(|e| e.name.clone()).collect()
    }

    /// Whether `key` is there.
    pub fn contains(&self, key: &str) -> bool {
        self.position(key).is_some()
    }

    /// `key`'s shape and dtype, without reading its value.
    pub fn shape(&self, key: &str) -> Option<(Shape, DType)> {
        let e = &self.pending.entries_ref()[self.position(key)?];
        Some((e.shape.clone(), e.dtype))
    }

    /// `key`'s value, read on the CPU (after the transforms, if any made it).
    pub fn get(&self, key: &str) -> Result<Tensor> {
        let at = self.existing(key)?;
        self.pending.read(&self.pending.entries_ref()[at].value)
    }

    /// Inserts or replaces `key`.
    pub fn insert(&mut self, key: impl Into<String>, value: Tensor) {
        let key = key.into();
        self.produced.push(key.clone());
        let entry = Entry {
            name: key.clone(),
            shape: value.shape().clone(),
            dtype: value.dtype(),
            value: Value::Tensor(value),
            rule: None,
        };
        match self.position(&key) {
            Some(at) => self.pending.entries()[at] = entry,
            None => self.pending.entries().push(entry),
        }
    }

    /// Removes `key`; returns whether it was there.
    pub fn remove(&mut self, key: &str) -> bool {
        let Some(at) = self.position(key) else {
            return false;
        };
        self.pending.entries().remove(at);
        self.consumed.push(key.to_owned());
        true
    }

    /// Renames `from` to `to` (Python's `state_dict[to] = state_dict.pop(from)`: an entry
    /// already named `to` is replaced), reading nothing. Fails with
    /// [`TransformError::NoKey`] if there is no `from`.
    pub fn rename(&mut self, from: &str, to: &str) -> Result<()> {
        let at = self.existing(from)?;
        if from == to {
            return Ok(());
        }
        self.pending.entries()[at].name = to.to_owned();
        let entries = self.pending.entries();
        if let Some(old) = (0..entries.len()).find(|&i| i != at && entries[i].name == to) {
            entries.remove(old);
        }
        self.consumed.push(from.to_owned());
        self.produced.push(to.to_owned());
        Ok(())
    }

    fn position(&self, key: &str) -> Option<usize> {
        self.pending
            .entries_ref()
            .iter()
            .position(|e| e.name == key)
    }

    fn existing(&self, key: &str) -> Result<usize> {
        self.position(key).ok_or_else(|| {
            TransformError::NoKey {
                path: self.path.to_owned(),
                key: key.to_owned(),
            }
            .into()
        })
    }
}

/// Every module with its path, in pre-order (a module before its submodules).
fn modules(root: &dyn Module) -> Vec<(String, &dyn Module)> {
    let mut out = Vec::new();
    walk(root, false, &mut |path, v| {
        if let Visit::Module(m) = v {
            out.push((path.to_owned(), m));
        }
        true
    });
    out
}

/// Pre-order made post-order (every module after its submodules, siblings in order).
fn post_order(pre: Vec<(String, &dyn Module)>) -> Vec<(String, &dyn Module)> {
    let mut out = Vec::with_capacity(pre.len());
    let mut open: Vec<(String, &dyn Module)> = Vec::new();
    for (path, m) in pre {
        while let Some((top, _)) = open.last() {
            if is_under(&path, top) {
                break;
            }
            out.push(open.pop().expect("not empty"));
        }
        open.push((path, m));
    }
    out.extend(open.into_iter().rev());
    out
}

fn is_under(path: &str, module: &str) -> bool {
    module.is_empty()
        || (path.starts_with(module) && path.as_bytes().get(module.len()) == Some(&b'.'))
}

fn prefix(path: &str) -> String {
    if path.is_empty() {
        String::new()
    } else {
        format!("{path}.")
    }
}

/// Fails if a path pattern matches no module (a typo that would never fire).
fn check_patterns<'h>(
    targets: impl Iterator<Item = (&'h HookTarget, Option<&'h PathPattern>)>,
    modules: &[(String, &dyn Module)],
) -> Result<()> {
    for (target, pattern) in targets {
        let HookTarget::Path(p) = target else {
            continue;
        };
        if !modules
            .iter()
            .any(|(path, m)| target.matches(path, *m, pattern))
        {
            let keys = modules.iter().map(|(p, _)| p.as_str());
            return Err(Error::NoModuleMatch {
                what: "state-dict hook",
                pattern: p.clone(),
                near: crate::transform::near(p, keys),
            });
        }
    }
    Ok(())
}
