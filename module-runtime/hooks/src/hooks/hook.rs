//! What a hook is and where it is kept: the hook function types, what a hook is told about its call
//! ([`HookCtx`]), how it is registered ([`HookOptions`], [`PreHookOptions`]) and removed
//! ([`HookHandle`]), and a registry's lists of hooks, each with the calls it targets.
//!
//! The bottom of the hook machinery: dispatch reads these lists, and [`Hooks`](super::Hooks) fills
//! them.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock, Weak};

use candle_core::Tensor;

use crate::error::{Error, Result};
use crate::module::Module;
use crate::pattern::PathPattern;

/// A forward pre-hook: sees the module's input tensors (in [`TensorTree`](crate::TensorTree) order) and may return new
/// ones (the same number) to run the module on. `Ok(None)` keeps the input.
pub type PreHookFn = dyn Fn(&HookCtx<'_>, &[Tensor]) -> Result<Option<Vec<Tensor>>> + Send + Sync;

/// A forward hook: sees the module's input and output tensors and may return new output tensors
/// (the same number). `Ok(None)` keeps the output.
pub type ForwardHookFn =
    dyn Fn(&HookCtx<'_>, &[Tensor], &[Tensor]) -> Result<Option<Vec<Tensor>>> + Send + Sync;

/// A full backward hook: sees the gradients with respect to the module's input tensors
/// (`grad_input`, in [`TensorTree`](crate::TensorTree) order; `None` for an input that needs no
/// gradient) and output tensors (`grad_output`; `None` for an output that received none) and may
/// return new input gradients (the same number). `Ok(None)` keeps them.
pub type BackwardHookFn = dyn Fn(
        &BackwardHookCtx<'_>,
        &[Option<Tensor>],
        &[Option<Tensor>],
    ) -> Result<Option<Vec<Option<Tensor>>>>
    + Send
    + Sync;

/// A full backward pre-hook: sees the gradients with respect to the module's output tensors
/// (`None` for an output that received none) and may return new ones (the same number).
/// `Ok(None)` keeps them.
pub type BackwardPreHookFn = dyn Fn(&BackwardHookCtx<'_>, &[Option<Tensor>]) -> Result<Option<Vec<Option<Tensor>>>>
    + Send
    + Sync;

/// What a backward hook is told about the module it runs for.
///
/// A backward hook runs inside `loss.backward()`, after the module's call has returned, so it is
/// not given the module itself (PyTorch passes the module object): it is given the path the module
/// was called through and its class name.
pub struct BackwardHookCtx<'a> {
    pub(super) path: &'a str,
    pub(super) class_name: &'a str,
    pub(super) registry: &'a Arc<Registry>,
    pub(super) id: u64,
}

impl BackwardHookCtx<'_> {
    /// The path the module was called through (`""` for the root).
    pub fn path(&self) -> &str {
        self.path
    }

    /// The module's class name ([`Module::class_name`]: `Linear`, `BatchNorm1d`).
    pub fn class_name(&self) -> &str {
        self.class_name
    }

    /// Removes the hook that is running, from the next call on (the gradients of calls made
    /// before the removal still reach it when they flow back). Idempotent.
    pub fn remove_this_hook(&self) {
        self.registry.remove(self.id);
    }
}

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

/// The hooks one [`Hooks`](super::Hooks) holds (every clone of it shares them).
#[derive(Default)]
pub(super) struct Registry {
    pub(super) lists: RwLock<Lists>,
    next_id: AtomicU64,
    /// Counts the changes to `lists`, so that dispatch knows when the hooks it worked out for each
    /// module are out of date (a hook registered or removed during a run counts from the next
    /// call). Changed only under the write lock.
    version: AtomicU64,
}

/// The hooks of a registry, group by group, each in firing order.
#[derive(Default)]
pub(super) struct Lists {
    pub(super) global_pre: Vec<Entry<PreHookFn>>,
    pub(super) pre: Vec<Entry<PreHookFn>>,
    pub(super) global_post: Vec<Entry<ForwardHookFn>>,
    pub(super) post: Vec<Entry<ForwardHookFn>>,
    pub(super) global_bw_pre: Vec<Entry<BackwardPreHookFn>>,
    pub(super) bw_pre: Vec<Entry<BackwardPreHookFn>>,
    pub(super) global_bw: Vec<Entry<BackwardHookFn>>,
    pub(super) bw: Vec<Entry<BackwardHookFn>>,
}

/// One registered hook.
pub(super) struct Entry<F: ?Sized> {
    pub(super) id: u64,
    pub(super) target: Target,
    pub(super) f: Arc<F>,
    /// Runs when the call fails too (forward hooks registered with [`HookOptions::always_call`]).
    pub(super) always_call: bool,
}

/// Which calls a hook sees.
pub(super) enum Target {
    /// Every call (global hooks).
    All,
    /// Calls of the root (the pattern `""`).
    Root,
    /// Calls of the modules whose path matches.
    Matching(PathPattern),
}

impl Target {
    /// The target of a pattern: the root for `""`, else the modules whose path matches.
    pub(super) fn parse(pattern: &str) -> Result<Self> {
        Ok(match pattern {
            "" => Self::Root,
            p => Self::Matching(PathPattern::new(p)?),
        })
    }
}

impl<F: ?Sized> Entry<F> {
    /// Whether the hook fires for the calls of a module reachable at `paths` (more than one for a
    /// module shared through `Arc`): hooks attach to modules, not to path strings, as in PyTorch,
    /// where a hook registered on `model.a` fires however that module is reached.
    pub(super) fn targets<'p>(&self, mut paths: impl Iterator<Item = &'p str>) -> bool {
        match &self.target {
            Target::All => true,
            Target::Root => paths.any(str::is_empty),
            Target::Matching(p) => paths.any(|path| p.matches(path)),
        }
    }
}

impl Registry {
    /// Adds a hook to the list `list` picks: first with [`HookOptions::prepend`], else last.
    pub(super) fn add<F: ?Sized>(
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
        self.version.fetch_add(1, Ordering::Release);
        HookHandle {
            registry: Arc::downgrade(self),
            id,
        }
    }

    /// The patterns of the targeted hooks.
    pub(super) fn patterns(&self) -> Vec<PathPattern> {
        let lists = self.lists.read().unwrap_or_else(PoisonError::into_inner);
        let targets = lists.pre.iter().map(|e| &e.target);
        targets
            .chain(lists.post.iter().map(|e| &e.target))
            .chain(lists.bw_pre.iter().map(|e| &e.target))
            .chain(lists.bw.iter().map(|e| &e.target))
            .filter_map(|t| match t {
                Target::Matching(p) => Some(p.clone()),
                _ => None,
            })
            .collect()
    }

    /// Removes the hook `id`; returns whether it was registered.
    pub(super) fn remove(&self, id: u64) -> bool {
        let mut lists = self.lists.write().unwrap_or_else(PoisonError::into_inner);
        let before = lists.len();
        lists.global_pre.retain(|e| e.id != id);
        lists.pre.retain(|e| e.id != id);
        lists.global_post.retain(|e| e.id != id);
        lists.post.retain(|e| e.id != id);
        lists.global_bw_pre.retain(|e| e.id != id);
        lists.bw_pre.retain(|e| e.id != id);
        lists.global_bw.retain(|e| e.id != id);
        lists.bw.retain(|e| e.id != id);
        let removed = lists.len() != before;
        if removed {
            self.version.fetch_add(1, Ordering::Release);
        }
        removed
    }

    /// The lists' version: it changes whenever a hook is added or removed. Read under the lists'
    /// lock, it is the version of what that lock guards.
    pub(super) fn version(&self) -> u64 {
        self.version.load(Ordering::Acquire)
    }
}

impl Lists {
    /// How many hooks the lists hold.
    pub(super) fn len(&self) -> usize {
        let forward = self.global_pre.len() + self.pre.len() + self.global_post.len();
        let backward = self.global_bw_pre.len() + self.bw_pre.len() + self.global_bw.len();
        forward + self.post.len() + backward + self.bw.len()
    }
}

/// A hook as a call fires it: the function and where to remove it from
/// ([`HookCtx::remove_this_hook`]).
pub(super) struct Armed<F: ?Sized> {
    pub(super) f: Arc<F>,
    pub(super) id: u64,
    pub(super) registry: Arc<Registry>,
    pub(super) always_call: bool,
}

impl<F: ?Sized> Clone for Armed<F> {
    fn clone(&self) -> Self {
        Self {
            f: self.f.clone(),
            id: self.id,
            registry: self.registry.clone(),
            always_call: self.always_call,
        }
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
    pub(super) prepend: bool,
    pub(super) always_call: bool,
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

/// How a full backward hook or pre-hook is registered: PyTorch's `prepend=` keyword argument of
/// `register_full_backward_hook` and `register_full_backward_pre_hook`
/// (`BackwardHookOptions::default()`: last in its group).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BackwardHookOptions {
    prepend: bool,
}

impl BackwardHookOptions {
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

impl From<BackwardHookOptions> for HookOptions {
    fn from(options: BackwardHookOptions) -> Self {
        HookOptions {
            prepend: options.prepend,
            always_call: false,
        }
    }
}
