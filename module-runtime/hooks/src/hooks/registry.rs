//! [`Hooks`], the registry users hold: registering hooks by pattern or globally, and attaching
//! them to a model for a run.

use std::sync::{Arc, PoisonError};

use candle_core::Tensor;

use super::dispatch::SessionGuard;
use super::hook::{BackwardHookCtx, BackwardHookFn, BackwardHookOptions, BackwardPreHookFn};
use super::hook::{
    ForwardHookFn, HookCtx, HookHandle, HookOptions, PreHookFn, PreHookOptions, Registry, Target,
};
use crate::error::{Error, Result};
use crate::module::Module;

/// A registry of forward and backward hooks, attached to a model by [`run`](Hooks::run).
///
/// Cloning gives another handle to the same registry; it is `Send + Sync`, so one registry can
/// serve several threads. Hooks fire in this order on every call of a module they target: global
/// pre-hooks, pre-hooks, `forward`, global forward hooks, forward hooks — each group in registration
/// order, hooks registered with [`prepend`](HookOptions::prepend) first (the latest first).
///
/// A hook's error aborts the call and comes back as [`Error::Hook`](module_core::Error::Hook) naming the module's path. A
/// panic in a hook or a `forward` unwinds through the call and leaves no per-call state behind.
///
/// Backward hooks (`register_full_backward_hook`, `register_full_backward_pre_hook`, and their
/// global forms) live in the same registry and are attached the same way: a call under
/// [`run`](Hooks::run) sets up the hooks of its module, which fire in the `backward()` of a loss
/// computed from its outputs. A gradient at any tensor (PyTorch's `Tensor.register_hook`) is
/// [`register_hook`](crate::register_hook)'s.
///
/// # Not provided
///
/// - The deprecated `register_backward_hook` (not "full": PyTorch documents its gradients as
///   wrong for modules of several ops); use `register_full_backward_hook`.
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

    /// Registers a full backward hook on the modules whose path matches `pattern` (PyTorch's
    /// `register_full_backward_hook(hook, prepend=…)`): in `loss.backward()`, once the gradients
    /// with respect to a call's inputs are computed, the hook is given them (`grad_input`, one per
    /// input tensor in [`TensorTree`](crate::TensorTree) order) and those with respect to its
    /// outputs (`grad_output`, as the backward pre-hooks left them). What it returns
    /// (`Ok(Some(new))`, one entry per input) replaces `grad_input`, and so every gradient
    /// upstream of the module, its own parameters' excepted (they are inside the call).
    ///
    /// As in PyTorch:
    ///
    /// - an input that does not require a gradient (data, integer ids, a tensor computed
    ///   without grad mode) is `None` in `grad_input`; one that requires a gradient but received
    ///   none is zeros; an output that received no gradient is `None` in `grad_output`;
    /// - when no input requires a gradient (the first layer of a model, on data), the hook runs
    ///   when the output gradients are known, with `None` for every input, and may return only
    ///   `None`s ([`BackwardHookError::NoInputGrad`](crate::error::BackwardHookError::NoInputGrad));
    /// - hooks fire as the backward reaches the modules: inner-most first, each call of a
    ///   module called several times once; the hooks of one call fire global first, then in
    ///   registration order ([`prepend`](BackwardHookOptions::prepend) first). The order of
    ///   calls on parallel branches is candle's topological order, which gives PyTorch's on the
    ///   tested models (`tests/integration/backward_hooks.rs`) but is not promised for every graph;
    /// - the hooks are set up when the module is called (inside [`run`](Hooks::run), with grad
    ///   mode on); a hook removed before `backward()` still fires for the calls made before its
    ///   removal (PyTorch reads its dict at backward time).
    ///
    /// Where this differs: the hook is given the module's path and class name
    /// ([`BackwardHookCtx`]), not the module; `grad_input` lists the input's tensors as its
    /// [`TensorTree`](crate::TensorTree) does (a `None` option lists none, a
    /// [`TensorStruct`](crate::TensorStruct) all of its tensors), where PyTorch has an entry per
    /// positional argument and leaves keyword arguments out; a `None` entry in a returned
    /// `grad_input` for an input that requires a gradient gives it a zero gradient (PyTorch gives
    /// none). A hook's error, or a replacement of another shape or dtype
    /// ([`GradMismatch`](crate::error::BackwardHookError::GradMismatch)), fails the `backward()`
    /// (`?` gives the error back as this crate's).
    ///
    /// ```
    /// use std::sync::{Arc, Mutex};
    /// use module_runtime::prelude::*;
    /// use module_runtime::BackwardHookOptions;
    ///
    /// #[derive(Module)]
    /// struct Net { fc1: Linear, fc2: Linear }
    /// impl Forward<&Tensor> for Net {
    ///     type Output = Tensor;
    ///     fn forward(&self, x: &Tensor) -> Result<Tensor> {
    ///         self.fc2.call(&self.fc1.call(x)?.relu()?)
    ///     }
    /// }
    ///
    /// let net = Net { fc1: Linear::new(4, 8, &Device::Cpu)?, fc2: Linear::new(8, 2, &Device::Cpu)? };
    /// let hooks = Hooks::new();
    /// let seen = Arc::new(Mutex::new(Vec::new()));
    /// let log = seen.clone();
    /// hooks.register_full_backward_hook("fc2", move |ctx, grad_input, grad_output| {
    ///     log.lock().unwrap().push((ctx.path().to_owned(), grad_input[0].as_ref().unwrap().dims().to_vec(),
    ///                               grad_output[0].as_ref().unwrap().dims().to_vec()));
    ///     // Stop every gradient before fc2: fc1's parameters get zeros.
    ///     Ok(Some(vec![Some(grad_input[0].as_ref().unwrap().zeros_like()?)]))
    /// }, BackwardHookOptions::default())?;
    /// let x = Tensor::ones((3, 4), DType::F32, &Device::Cpu)?;
    /// let loss = hooks.run(&net, |net| net.call(&x))?.sum_all()?;
    /// let grads = loss.backward()?;
    /// assert_eq!(*seen.lock().unwrap(), [("fc2".to_owned(), vec![3, 8], vec![3, 2])]);
    /// let w1 = net.fc1.weight.var()?;
    /// let g = grads.get(&w1).unwrap();
    /// assert_eq!(g.abs()?.sum_all()?.to_scalar::<f32>()?, 0.0);
    /// # Ok::<(), module_runtime::Error>(())
    /// ```
    pub fn register_full_backward_hook(
        &self,
        pattern: &str,
        hook: impl Fn(
                &BackwardHookCtx<'_>,
                &[Option<Tensor>],
                &[Option<Tensor>],
            ) -> Result<Option<Vec<Option<Tensor>>>>
            + Send
            + Sync
            + 'static,
        options: BackwardHookOptions,
    ) -> Result<HookHandle> {
        let target = Target::parse(pattern)?;
        let hook: Arc<BackwardHookFn> = Arc::new(hook);
        Ok(self.0.add(|l| &mut l.bw, target, options.into(), hook))
    }

    /// Registers a full backward pre-hook on the modules whose path matches `pattern` (PyTorch's
    /// `register_full_backward_pre_hook(hook, prepend=…)`): in `loss.backward()`, once the
    /// gradients with respect to a call's outputs are known, before any gradient inside the module
    /// is computed, the hook is given them (`None` for an output that received none). What it
    /// returns (`Ok(Some(new))`, one entry per output) replaces them, for the module's own
    /// parameters and everything upstream; the full backward hooks see the replacement as
    /// `grad_output`. Fires and differs from PyTorch as
    /// [`register_full_backward_hook`](Hooks::register_full_backward_hook) says.
    ///
    /// ```
    /// use module_runtime::prelude::*;
    /// use module_runtime::BackwardHookOptions;
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
    /// // Double the gradient reaching fc's output: its bias gradient doubles.
    /// hooks.register_full_backward_pre_hook("fc", |_ctx, grad_output| {
    ///     Ok(Some(vec![Some((grad_output[0].as_ref().unwrap() * 2.0)?)]))
    /// }, BackwardHookOptions::default())?;
    /// let x = Tensor::ones((3, 4), DType::F32, &Device::Cpu)?;
    /// let grads = hooks.run(&net, |net| net.call(&x))?.sum_all()?.backward()?;
    /// let bias = net.fc.bias.as_ref().unwrap().var()?;
    /// let db = grads.get(&bias).unwrap();
    /// assert_eq!(db.to_vec1::<f32>()?, [6.0, 6.0]); // 3 rows × 2
    /// # Ok::<(), module_runtime::Error>(())
    /// ```
    pub fn register_full_backward_pre_hook(
        &self,
        pattern: &str,
        hook: impl Fn(&BackwardHookCtx<'_>, &[Option<Tensor>]) -> Result<Option<Vec<Option<Tensor>>>>
            + Send
            + Sync
            + 'static,
        options: BackwardHookOptions,
    ) -> Result<HookHandle> {
        let target = Target::parse(pattern)?;
        let hook: Arc<BackwardPreHookFn> = Arc::new(hook);
        Ok(self.0.add(|l| &mut l.bw_pre, target, options.into(), hook))
    }

    /// Registers a full backward hook that sees every module call (PyTorch's
    /// `register_module_full_backward_hook`), before the targeted ones.
    pub fn register_global_full_backward_hook(
        &self,
        hook: impl Fn(
                &BackwardHookCtx<'_>,
                &[Option<Tensor>],
                &[Option<Tensor>],
            ) -> Result<Option<Vec<Option<Tensor>>>>
            + Send
            + Sync
            + 'static,
        options: BackwardHookOptions,
    ) -> HookHandle {
        let hook: Arc<BackwardHookFn> = Arc::new(hook);
        self.0
            .add(|l| &mut l.global_bw, Target::All, options.into(), hook)
    }

    /// Registers a full backward pre-hook that sees every module call (PyTorch's
    /// `register_module_full_backward_pre_hook`), before the targeted ones.
    pub fn register_global_full_backward_pre_hook(
        &self,
        hook: impl Fn(&BackwardHookCtx<'_>, &[Option<Tensor>]) -> Result<Option<Vec<Option<Tensor>>>>
            + Send
            + Sync
            + 'static,
        options: BackwardHookOptions,
    ) -> HookHandle {
        let hook: Arc<BackwardPreHookFn> = Arc::new(hook);
        self.0
            .add(|l| &mut l.global_bw_pre, Target::All, options.into(), hook)
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
