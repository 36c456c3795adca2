//! The hook registry: what a hook is, how it is registered, told about its call, and removed.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock, Weak};

use candle_core::Tensor;

use std::collections::HashMap;

use super::dispatch::SessionGuard;
use crate::error::{Error, Result};
use crate::identity::CallTarget;
use crate::module::Module;
use crate::pattern::PathPattern;
use crate::walk::{walk, Visit};

/// A forward pre-hook: sees the module's input tensors (in [`TensorTree`](crate::TensorTree) order) and may return new
/// ones (the same number) to run the module on. `Ok(None)` keeps the input.
pub type PreHookFn = dyn Fn(&HookCtx<'_>, &[Tensor]) -> Result<Option<Vec<Tensor>>> + Send + Sync;

/// A forward hook: sees the module's input and output tensors and may return new output tensors
/// (the same number). `Ok(None)` keeps the output.
pub type ForwardHookFn =
    dyn Fn(&HookCtx<'_>, &[Tensor], &[Tensor]) -> Result<Option<Vec<Tensor>>> + Send + Sync;

/// What a hook is told about the call it runs in.
pub struct HookCtx<'a> {
    pub(super) path: &'a str,
    pub(super) module: &'a dyn Module,
    pub(super) registry: &'a Arc<Registry>,
    pub(super) id: u64,
    pub(super) error: Option<&'a Error>,
    /// The output as its own type, in a forward hook of a call that has not failed.
    pub(super) output: Option<&'a dyn std::any::Any>,
    /// The input in its owned form ([`TensorTree::Owned`](crate::TensorTree::Owned)), in a
    /// forward hook of a call that has not failed, and the name of the input's type.
    pub(super) input: Option<&'a dyn std::any::Any>,
    pub(super) input_type: &'static str,
}

impl HookCtx<'_> {
    /// The path of the module being called (`""` for the root).
    pub fn path(&self) -> &str {
        self.path
    }

    /// The module being called; [`downcast_ref`](trait.Module.html#method.downcast_ref) gets its
    /// concrete type.
    pub fn module(&self) -> &dyn Module {
        self.module
    }

    /// Removes the hook that is running, from the next call on (this call's remaining hooks still
    /// run). Idempotent.
    pub fn remove_this_hook(&self) {
        self.registry.remove(self.id);
    }

    /// The error the call failed with, when this is an [`always_call`](HookOptions::always_call)
    /// forward hook running because the call failed (a pre-hook, `forward` or an earlier forward
    /// hook returned an error); `None` in a call that has not failed.
    ///
    /// PyTorch passes no exception to such a hook; it is given here so the hook can tell a failed
    /// call from a module that returns no tensors.
    pub fn error(&self) -> Option<&Error> {
        self.error
    }

    /// Whether the call failed (see [`error`](Self::error)).
    pub fn failed(&self) -> bool {
        self.error.is_some()
    }

    /// In a forward hook, the module's output as its own type (a `Tensor`, a tuple, a
    /// [`TensorStruct`](crate::TensorStruct)…), with the replacements of the hooks that ran before
    /// this one; `None` in a pre-hook, after a failure, or when `O` is not the output's type.
    /// The tensors the hook is given are this value's, in [`TensorTree`](crate::TensorTree) order.
    pub fn output<O: 'static>(&self) -> Option<&O> {
        self.output?.downcast_ref::<O>()
    }

    /// In a forward hook, the module's input in its owned form
    /// ([`TensorTree::Owned`](crate::TensorTree::Owned): a `Tensor` for a `&Tensor` input, a tuple
    /// of owned trees for a tuple…), as `forward` received it (after any pre-hook's replacement);
    /// `None` in a pre-hook, after a failure, when `I` is not the input's owned form, or for a
    /// [`TensorStruct`](crate::TensorStruct) input without a
    /// [`clone_tree`](crate::TensorStruct::clone_tree).
    pub fn input<I: 'static>(&self) -> Option<&I> {
        self.input?.downcast_ref::<I>()
    }

    /// The name of the type the module was called with (`&candle_core::tensor::Tensor`…), in a
    /// forward hook; `""` in a pre-hook.
    pub fn input_type(&self) -> &'static str {
        self.input_type
    }
}

/// A registry of forward hooks, attached to a model by [`run`](Hooks::run).
///
/// Cloning gives another handle to the same registry; it is `Send + Sync`, so one registry can
/// serve several threads. Hooks fire in this order on every call of a module they target: global
/// pre-hooks, pre-hooks, `forward`, global forward hooks, forward hooks — each group in registration
/// order, hooks registered with [`prepend`](HookOptions::prepend) first (the latest first).
///
/// A hook's error aborts the call and comes back as [`Error::Hook`](module_core::Error::Hook) naming the module's path. A
/// panic in a hook or a `forward` unwinds through the call and leaves no per-call state behind.
///
/// # What PyTorch has that candle makes impossible
///
/// - **Backward hooks** (`register_full_backward_hook`, `register_full_backward_pre_hook`, the
///   deprecated `register_backward_hook`, `Tensor.register_hook`): candle's autograd builds no
///   graph object that code can attach to, and `Tensor::backward` runs to the end and returns a
///   [`GradStore`](candle_core::backprop::GradStore). To see gradients by name, call `backward`
///   and look each parameter up: `grads.get(&param.var()?)` for every `(name, param)` of
///   [`named_parameters`](crate::ModuleExt::named_parameters). To see an activation's gradient,
///   keep the activation (a forward hook, or [`capture`](crate::ModuleExt::capture)) and look it
///   up in the same store. Gradients cannot be changed in flight; change them in the store
///   before the optimizer step.
/// - **`with_kwargs`**: Rust calls have no keyword arguments; a module's input is one
///   [`TensorTree`](crate::TensorTree) (a tuple or a [`TensorStruct`](crate::TensorStruct)), all
///   of whose tensors the hooks see.
#[derive(Clone, Default)]
pub struct Hooks(Arc<Registry>);

#[derive(Default)]
pub(super) struct Registry {
    pub(super) lists: RwLock<Lists>,
    next_id: AtomicU64,
}

/// The hooks of a registry, group by group, each in firing order.
#[derive(Default)]
pub(super) struct Lists {
    pub(super) global_pre: Vec<Entry<PreHookFn>>,
    pub(super) pre: Vec<Entry<PreHookFn>>,
    pub(super) global_post: Vec<Entry<ForwardHookFn>>,
    pub(super) post: Vec<Entry<ForwardHookFn>>,
}

pub(super) struct Entry<F: ?Sized> {
    pub(super) id: u64,
    target: Target,
    pub(super) f: Arc<F>,
    /// Runs when the call fails too (forward hooks registered with [`HookOptions::always_call`]).
    pub(super) always_call: bool,
}

/// Which calls a hook sees.
enum Target {
    /// Every call (global hooks).
    All,
    /// Calls of the root (the pattern `""`).
    Root,
    /// Calls of the modules whose path matches.
    Matching(PathPattern),
}

impl Target {
    fn parse(pattern: &str) -> Result<Self> {
        Ok(match pattern {
            "" => Self::Root,
            p => Self::Matching(PathPattern::new(p)?),
        })
    }
}

impl<F: ?Sized> Entry<F> {
    /// Whether the hook fires for a call of the module at `path`, which is also reachable at
    /// `aliases` (a module shared through `Arc`): hooks attach to modules, not to path strings,
    /// as in PyTorch, where a hook registered on `model.a` fires however that module is reached.
    pub(super) fn targets(&self, path: &str, aliases: &[Arc<str>]) -> bool {
        match &self.target {
            Target::All => true,
            Target::Root => path.is_empty(),
            Target::Matching(p) => p.matches(path) || aliases.iter().any(|a| p.matches(a)),
        }
    }
}

/// The modules under a root: every path (a module shared through `Arc` under each of its paths),
/// and for modules reachable by more than one path, all of them.
pub(super) struct ModuleTable {
    pub(super) paths: Vec<String>,
    pub(super) aliases: HashMap<CallTarget, Vec<Arc<str>>>,
}

impl ModuleTable {
    pub(super) fn of(root: &dyn Module) -> Self {
        let mut paths = Vec::new();
        let mut aliases: HashMap<CallTarget, Vec<Arc<str>>> = HashMap::new();
        walk(root, false, &mut |path, v| {
            if let Visit::Module(m) = v {
                paths.push(path.to_owned());
                let m: &dyn std::any::Any = m;
                aliases
                    .entry(CallTarget::of_dyn(m))
                    .or_default()
                    .push(path.into());
            }
            true
        });
        aliases.retain(|_, paths| paths.len() > 1);
        Self { paths, aliases }
    }

    /// Fails with [`Error::NoModuleMatch`] if `pattern` matches no module path.
    pub(super) fn check(&self, pattern: &PathPattern, what: &'static str) -> Result<()> {
        if self.paths.iter().any(|p| pattern.matches(p)) {
            return Ok(());
        }
        Err(Error::NoModuleMatch {
            what,
            pattern: pattern.as_str().to_owned(),
            near: near(pattern.as_str(), &self.paths),
        })
    }
}

/// Up to five of `paths`, the most like `pattern` first.
pub(super) fn near(pattern: &str, paths: &[String]) -> Vec<String> {
    let mut ranked: Vec<(usize, &String)> = paths
        .iter()
        .filter(|p| !p.is_empty())
        .map(|p| (strsim::levenshtein(pattern, p), p))
        .collect();
    ranked.sort();
    ranked.dedup_by(|a, b| a.1 == b.1);
    ranked.into_iter().take(5).map(|(_, p)| p.clone()).collect()
}

impl Registry {
    fn add<F: ?Sized>(
        self: &Arc<Self>,
        list: impl FnOnce(&mut Lists) -> &mut Vec<Entry<F>>,
        target: Target,
        how: HookOptions,
        f: Arc<F>,
    ) -> HookHandle {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let entry = Entry {
            id,
            target,
            f,
            always_call: how.always_call,
        };
        let mut lists = self.lists.write().unwrap_or_else(PoisonError::into_inner);
        let list = list(&mut lists);
        if how.prepend {
            list.insert(0, entry);
        } else {
            list.push(entry);
        }
        HookHandle {
            registry: Arc::downgrade(self),
            id,
        }
    }

    /// The patterns of the targeted hooks.
    fn patterns(&self) -> Vec<PathPattern> {
        let lists = self.lists.read().unwrap_or_else(PoisonError::into_inner);
        let targets = lists.pre.iter().map(|e| &e.target);
        targets
            .chain(lists.post.iter().map(|e| &e.target))
            .filter_map(|t| match t {
                Target::Matching(p) => Some(p.clone()),
                _ => None,
            })
            .collect()
    }

    pub(super) fn remove(&self, id: u64) -> bool {
        let mut lists = self.lists.write().unwrap_or_else(PoisonError::into_inner);
        let before = lists.len();
        lists.global_pre.retain(|e| e.id != id);
        lists.pre.retain(|e| e.id != id);
        lists.global_post.retain(|e| e.id != id);
        lists.post.retain(|e| e.id != id);
        lists.len() != before
    }
}

impl Lists {
    fn len(&self) -> usize {
        self.global_pre.len() + self.pre.len() + self.global_post.len() + self.post.len()
    }
}

/// Removes the hook it was returned for. Removal is idempotent, may happen inside a hook (effective
/// from the next call), and outlives the registry harmlessly. Dropping the handle keeps the hook.
#[derive(Clone, Debug)]
pub struct HookHandle {
    registry: Weak<Registry>,
    id: u64,
}

impl HookHandle {
    /// Removes the hook. Returns whether it was still registered.
    pub fn remove(&self) -> bool {
        self.registry.upgrade().is_some_and(|r| r.remove(self.id))
    }
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry").finish_non_exhaustive()
    }
}

impl std::fmt::Debug for Hooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let lists = self.0.lists.read().unwrap_or_else(PoisonError::into_inner);
        f.debug_struct("Hooks")
            .field("hooks", &lists.len())
            .finish()
    }
}

/// How a forward hook is registered: PyTorch's `prepend=` and `always_call=` keyword arguments of
/// `register_forward_hook`, as a value (`HookOptions::default()`: neither).
///
/// ```
/// use module_runtime::HookOptions;
/// let options = HookOptions::default().prepend().always_call();
/// assert!(options.is_prepend() && options.is_always_call());
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HookOptions {
    prepend: bool,
    always_call: bool,
}

impl HookOptions {
    /// Puts the hook first in its group, before the hooks registered earlier (PyTorch's
    /// `prepend=True`).
    pub fn prepend(mut self) -> Self {
        self.prepend = true;
        self
    }

    /// Runs the hook when the call fails too (PyTorch 2's `always_call=True`).
    ///
    /// When a pre-hook, `forward` or a forward hook of the call returns an error, every
    /// always-call forward hook of the call that has not run yet runs, in the usual order, as
    /// PyTorch's `Module._call_impl` does in its `except` branch. It is given the input (as
    /// replaced by the pre-hooks that ran) and the output so far: none when the call failed
    /// before or in `forward`, `forward`'s output (as replaced by the forward hooks that ran)
    /// when a forward hook failed. [`HookCtx::error`] holds the error. What it returns is
    /// ignored, and so is its own error: the call fails with the first error, as in PyTorch
    /// (which also ignores it, with a warning). A panic unwinds without running them (PyTorch
    /// catches `Exception`, not `BaseException`). In a call that succeeds, an always-call hook
    /// is an ordinary forward hook.
    ///
    /// ```
    /// use std::sync::{Arc, Mutex};
    /// use module_runtime::prelude::*;
    /// use module_runtime::HookOptions;
    ///
    /// #[derive(Module)]
    /// struct Net { fc: Linear }
    /// impl Forward<&Tensor> for Net {
    ///     type Output = Tensor;
    ///     fn forward(&self, x: &Tensor) -> Result<Tensor> { self.fc.call(x) }
    /// }
    ///
    /// let net = Net { fc: Linear::new(4, 2, &Device::Cpu)? };
    /// let hooks = Hooks::new();
    /// let seen = Arc::new(Mutex::new(Vec::new()));
    /// let log = seen.clone();
    /// let always = HookOptions::default().always_call();
    /// hooks.register_forward_hook("fc", move |ctx, _input, output| {
    ///     log.lock().unwrap().push((ctx.failed(), output.len()));
    ///     Ok(None)
    /// }, always)?;
    /// let bad = Tensor::ones((1, 3), DType::F32, &Device::Cpu)?; // 3 features, not 4
    /// assert!(hooks.run(&net, |net| net.call(&bad)).is_err());
    /// let good = Tensor::ones((1, 4), DType::F32, &Device::Cpu)?;
    /// hooks.run(&net, |net| net.call(&good))?;
    /// assert_eq!(*seen.lock().unwrap(), [(true, 0), (false, 1)]);
    /// # Ok::<(), module_runtime::Error>(())
    /// ```
    pub fn always_call(mut self) -> Self {
        self.always_call = true;
        self
    }

    /// Whether the hook goes first in its group.
    pub fn is_prepend(&self) -> bool {
        self.prepend
    }

    /// Whether the hook runs when the call fails too.
    pub fn is_always_call(&self) -> bool {
        self.always_call
    }
}

/// How a forward pre-hook is registered: PyTorch's `prepend=` keyword argument of
/// `register_forward_pre_hook` (`PreHookOptions::default()`: last in its group). Pre-hooks have no
/// `always_call`, as in PyTorch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PreHookOptions {
    prepend: bool,
}

impl PreHookOptions {
    /// Puts the hook first in its group, before the hooks registered earlier (PyTorch's
    /// `prepend=True`).
    pub fn prepend(mut self) -> Self {
        self.prepend = true;
        self
    }

    /// Whether the hook goes first in its group.
    pub fn is_prepend(&self) -> bool {
        self.prepend
    }
}

impl From<PreHookOptions> for HookOptions {
    fn from(options: PreHookOptions) -> Self {
        HookOptions {
            prepend: options.prepend,
            always_call: false,
        }
    }
}

impl Hooks {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers a forward pre-hook on the modules whose path matches `pattern` (PyTorch's
    /// `register_forward_pre_hook(hook, prepend=…)`): a path (`""` for the root), or a
    /// [`PathPattern`] with `*` for one segment and `**` for any number.
    pub fn register_forward_pre_hook(
        &self,
        pattern: &str,
        hook: impl Fn(&HookCtx<'_>, &[Tensor]) -> Result<Option<Vec<Tensor>>> + Send + Sync + 'static,
        options: PreHookOptions,
    ) -> Result<HookHandle> {
        let target = Target::parse(pattern)?;
        let hook: Arc<PreHookFn> = Arc::new(hook);
        Ok(self.0.add(|l| &mut l.pre, target, options.into(), hook))
    }

    /// Registers a forward hook on the modules whose path matches `pattern` (PyTorch's
    /// `register_forward_hook(hook, prepend=…, always_call=…)`; see [`HookOptions`]).
    pub fn register_forward_hook(
        &self,
        pattern: &str,
        hook: impl Fn(&HookCtx<'_>, &[Tensor], &[Tensor]) -> Result<Option<Vec<Tensor>>>
            + Send
            + Sync
            + 'static,
        options: HookOptions,
    ) -> Result<HookHandle> {
        let target = Target::parse(pattern)?;
        let hook: Arc<ForwardHookFn> = Arc::new(hook);
        Ok(self.0.add(|l| &mut l.post, target, options, hook))
    }

    /// Registers a pre-hook that sees every module call (PyTorch's
    /// `register_module_forward_pre_hook`), before the targeted pre-hooks.
    pub fn register_global_forward_pre_hook(
        &self,
        hook: impl Fn(&HookCtx<'_>, &[Tensor]) -> Result<Option<Vec<Tensor>>> + Send + Sync + 'static,
        options: PreHookOptions,
    ) -> HookHandle {
        let hook: Arc<PreHookFn> = Arc::new(hook);
        self.0
            .add(|l| &mut l.global_pre, Target::All, options.into(), hook)
    }

    /// Registers a forward hook that sees every module call (PyTorch's
    /// `register_module_forward_hook(hook, always_call=…)`), before the targeted forward hooks.
    pub fn register_global_forward_hook(
        &self,
        hook: impl Fn(&HookCtx<'_>, &[Tensor], &[Tensor]) -> Result<Option<Vec<Tensor>>>
            + Send
            + Sync
            + 'static,
        options: HookOptions,
    ) -> HookHandle {
        let hook: Arc<ForwardHookFn> = Arc::new(hook);
        self.0
            .add(|l| &mut l.global_post, Target::All, options, hook)
    }

    /// How many hooks are registered.
    pub fn len(&self) -> usize {
        self.0
            .lists
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    /// Whether no hook is registered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Runs `f` with these hooks attached to `root`: every [`call`](crate::ModuleExt::call) of
    /// `root` or a module under it, on this thread, until `f` returns, fires the hooks that target
    /// its path. Paths are relative to `root`.
    ///
    /// Runs nest: inside another `run` on the same root, both registries' hooks fire (the outer
    /// one's first); on another root, the inner run replaces the outer one until it returns.
    ///
    /// A hook attaches to the *modules* its pattern matches, as in PyTorch: a module shared
    /// through `Arc` as `a` and `b` fires a hook registered on `"a"` whichever path calls it (the
    /// hook's [`path`](HookCtx::path) is the path it was called through).
    ///
    /// Fails before running `f` with [`Error::NoModuleMatch`] (listing the most alike paths) if a
    /// hook's pattern matches no module of `root`: a typo would otherwise never fire, silently.
    /// `f`'s error type only needs to convert from this crate's [`Error`].
    pub fn run<M: Module, R, E: From<Error>>(
        &self,
        root: &M,
        f: impl FnOnce(&M) -> std::result::Result<R, E>,
    ) -> std::result::Result<R, E> {
        // Only targeted hooks need the table (global hooks fire on every call).
        let patterns = self.0.patterns();
        let aliases = if patterns.is_empty() {
            HashMap::new()
        } else {
            let table = ModuleTable::of(root);
            for pattern in &patterns {
                table.check(pattern, "hook")?;
            }
            table.aliases
        };
        let _session = SessionGuard::enter(root, root.__call_target(), self.0.clone(), aliases);
        f(root)
    }
}
