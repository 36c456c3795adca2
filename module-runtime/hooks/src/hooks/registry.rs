//! [`Hooks`], the registry users hold: registering hooks by pattern or globally, and attaching
//! them to a model for a run.

use std::sync::{Arc, PoisonError};

use candle_core::Tensor;

use super::dispatch::SessionGuard;
use super::hook::{
    ForwardHookFn, HookCtx, HookHandle, HookOptions, PreHookFn, PreHookOptions, Registry, Target,
};
use crate::error::{Error, Result};
use crate::module::Module;

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

impl std::fmt::Debug for Hooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let lists = self.0.lists.read().unwrap_or_else(PoisonError::into_inner);
        f.debug_struct("Hooks")
            .field("hooks", &lists.len())
            .finish()
    }
}

impl Hooks {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers a forward pre-hook on the modules whose path matches `pattern` (PyTorch's
    /// `register_forward_pre_hook(hook, prepend=…)`): a path (`""` for the root), or a
    /// [`PathPattern`](crate::pattern::PathPattern) with `*` for one segment and `**` for any number.
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
        // One walk lists the tree's modules by identity (none inside a run on the same root, whose
        // table serves); dispatch finds each call's path and hooks in it (see the module docs).
        let patterns = self.0.patterns();
        let _session = SessionGuard::enter(root, self.0.clone(), |table| {
            patterns
                .iter()
                .try_for_each(|pattern| table.check(pattern, "hook"))
        })?;
        f(root)
    }
}
