//! Forward hooks: observe and change what flows through any submodule.
//!
//! A [`Hooks`] registry holds hooks targeted by path pattern (or global ones that see every call),
//! and [`Hooks::run`] runs a closure with the registry attached to a model:
//!
//! ```
//! use module_runtime::prelude::*;
//! use module_runtime::Hooks;
//!
//! #[derive(Module)]
//! struct Net {
//!     fc1: Linear,
//!     fc2: Linear,
//! }
//!
//! impl Forward<&Tensor> for Net {
//!     type Output = Tensor;
//!     fn forward(&self, x: &Tensor) -> Result<Tensor> {
//!         let h = self.fc1.call(x)?.relu()?;
//!         self.fc2.call(&h)
//!     }
//! }
//!
//! let dev = Device::Cpu;
//! let net = Net { fc1: Linear::new(4, 8, &dev)?, fc2: Linear::new(8, 2, &dev)? };
//! let x = Tensor::ones((3, 4), DType::F32, &dev)?;
//!
//! let hooks = Hooks::new();
//! // Zero the output of `fc1` (PyTorch's `register_forward_hook` returning a new output).
//! let handle = hooks.register_forward_hook("fc1", |_ctx, _input, output| {
//!     Ok(Some(vec![output[0].zeros_like()?]))
//! })?;
//! let y = hooks.run(&net, |net| net.call(&x))?;
//! // With fc1 zeroed, the output is fc2's bias on every row.
//! let bias = net.fc2.bias.as_ref().unwrap().tensor();
//! assert_eq!(y.to_vec2::<f32>()?[1], bias.to_vec1::<f32>()?);
//!
//! handle.remove();
//! let y = hooks.run(&net, |net| net.call(&x))?;
//! assert_eq!(y.to_vec2::<f32>()?, net.call(&x)?.to_vec2::<f32>()?);
//! # Ok::<(), module_runtime::Error>(())
//! ```
//!
//! # How a call finds its path
//!
//! Modules carry no hidden field. While [`Hooks::run`] is active, each thread keeps a stack of the
//! modules it is running; [`call`](crate::ModuleExt::call) on a module looks for it (by address and
//! type) among the descendants of the module running it, which gives its path. So:
//!
//! - run submodules with `call`, not `forward`: a `forward` is invisible to hooks;
//! - a module called three times fires its hooks three times;
//! - a module shared through `Arc` and reached by two paths reports the path of the `Arc` it was
//!   called through (`self.a.call(x)` vs `self.b.call(x)`); called through a plain reference to the
//!   module inside, it reports its first path;
//! - a module that is not part of the tree (a temporary) runs without hooks;
//! - calls made on other threads (spawned by a `forward`) see no hooks; two threads running one model
//!   at once each see their own calls and paths, and hooks may be shared by both;
//! - two zero-sized fields of one type can share an address: the runtime's own parameterless layers
//!   are not zero-sized, and a zero-sized module of your own reports the first of such fields.
//!
//! When no registry is active, `call` costs one thread-local read on top of `forward`.

use std::cell::{Cell, RefCell};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock, Weak};

use candle_core::Tensor;

use crate::error::{Error, Result};
use crate::forward::Forward;
use crate::module::{CallTarget, Child, Module};
use crate::pattern::PathPattern;
use crate::tree::{Scope, TensorTree};

/// A forward pre-hook: sees the module's input tensors (in [`TensorTree`] order) and may return new
/// ones (the same number) to run the module on. `Ok(None)` keeps the input.
pub type PreHookFn = dyn Fn(&HookCtx<'_>, &[Tensor]) -> Result<Option<Vec<Tensor>>> + Send + Sync;

/// A forward hook: sees the module's input and output tensors and may return new output tensors
/// (the same number). `Ok(None)` keeps the output.
pub type ForwardHookFn =
    dyn Fn(&HookCtx<'_>, &[Tensor], &[Tensor]) -> Result<Option<Vec<Tensor>>> + Send + Sync;

/// What a hook is told about the call it runs in.
pub struct HookCtx<'a> {
    path: &'a str,
    module: &'a dyn Module,
    registry: &'a Arc<Registry>,
    id: u64,
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
}

/// A registry of forward hooks, attached to a model by [`run`](Hooks::run).
///
/// Cloning gives another handle to the same registry; it is `Send + Sync`, so one registry can
/// serve several threads. Hooks fire in this order on every call of a module they target: global
/// pre-hooks, pre-hooks, `forward`, global forward hooks, forward hooks — each group in registration
/// order, hooks registered through [`prepend`](Hooks::prepend) first (the latest first).
///
/// A hook's error aborts the call and comes back as [`Error::Hook`] naming the module's path. A
/// panic in a hook or a `forward` unwinds through the call and leaves no per-call state behind.
#[derive(Clone, Default)]
pub struct Hooks(Arc<Registry>);

#[derive(Default)]
struct Registry {
    lists: RwLock<Lists>,
    next_id: AtomicU64,
}

#[derive(Default)]
struct Lists {
    global_pre: Vec<Entry<PreHookFn>>,
    pre: Vec<Entry<PreHookFn>>,
    global_post: Vec<Entry<ForwardHookFn>>,
    post: Vec<Entry<ForwardHookFn>>,
}

struct Entry<F: ?Sized> {
    id: u64,
    target: Target,
    f: Arc<F>,
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
    fn targets(&self, path: &str) -> bool {
        match &self.target {
            Target::All => true,
            Target::Root => path.is_empty(),
            Target::Matching(p) => p.matches(path),
        }
    }
}

impl Registry {
    fn add<F: ?Sized>(
        self: &Arc<Self>,
        list: impl FnOnce(&mut Lists) -> &mut Vec<Entry<F>>,
        target: Target,
        prepend: bool,
        f: Arc<F>,
    ) -> HookHandle {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let entry = Entry { id, target, f };
        let mut lists = self.lists.write().unwrap_or_else(PoisonError::into_inner);
        let list = list(&mut lists);
        if prepend {
            list.insert(0, entry);
        } else {
            list.push(entry);
        }
        HookHandle {
            registry: Arc::downgrade(self),
            id,
        }
    }

    fn remove(&self, id: u64) -> bool {
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

/// Registers hooks in front of the others: see [`Hooks::prepend`].
pub struct Prepend<'a>(&'a Hooks);

macro_rules! registration {
    ($prepend:expr) => {
        /// Registers a forward pre-hook on the modules whose path matches `pattern`: a path (`""`
        /// for the root), or a [`PathPattern`] with `*` for one segment and `**` for any number.
        pub fn register_forward_pre_hook(
            &self,
            pattern: &str,
            hook: impl Fn(&HookCtx<'_>, &[Tensor]) -> Result<Option<Vec<Tensor>>>
                + Send
                + Sync
                + 'static,
        ) -> Result<HookHandle> {
            let target = Target::parse(pattern)?;
            Ok(self.registry().add(
                |l| &mut l.pre,
                target,
                $prepend,
                Arc::new(hook) as Arc<PreHookFn>,
            ))
        }

        /// Registers a forward hook on the modules whose path matches `pattern`.
        pub fn register_forward_hook(
            &self,
            pattern: &str,
            hook: impl Fn(&HookCtx<'_>, &[Tensor], &[Tensor]) -> Result<Option<Vec<Tensor>>>
                + Send
                + Sync
                + 'static,
        ) -> Result<HookHandle> {
            let target = Target::parse(pattern)?;
            Ok(self.registry().add(
                |l| &mut l.post,
                target,
                $prepend,
                Arc::new(hook) as Arc<ForwardHookFn>,
            ))
        }

        /// Registers a pre-hook that sees every module call (PyTorch's
        /// `register_module_forward_pre_hook`), before the targeted pre-hooks.
        pub fn register_global_forward_pre_hook(
            &self,
            hook: impl Fn(&HookCtx<'_>, &[Tensor]) -> Result<Option<Vec<Tensor>>>
                + Send
                + Sync
                + 'static,
        ) -> HookHandle {
            self.registry().add(
                |l| &mut l.global_pre,
                Target::All,
                $prepend,
                Arc::new(hook) as Arc<PreHookFn>,
            )
        }

        /// Registers a forward hook that sees every module call (PyTorch's
        /// `register_module_forward_hook`), before the targeted forward hooks.
        pub fn register_global_forward_hook(
            &self,
            hook: impl Fn(&HookCtx<'_>, &[Tensor], &[Tensor]) -> Result<Option<Vec<Tensor>>>
                + Send
                + Sync
                + 'static,
        ) -> HookHandle {
            self.registry().add(
                |l| &mut l.global_post,
                Target::All,
                $prepend,
                Arc::new(hook) as Arc<ForwardHookFn>,
            )
        }
    };
}

impl Hooks {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    fn registry(&self) -> &Arc<Registry> {
        &self.0
    }

    registration!(false);

    /// Registration that puts the hook first in its group (PyTorch's `prepend=True`):
    /// `hooks.prepend().register_forward_hook("fc", f)`.
    pub fn prepend(&self) -> Prepend<'_> {
        Prepend(self)
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
    pub fn run<M: Module, R>(&self, root: &M, f: impl FnOnce(&M) -> R) -> R {
        let _session = SessionGuard::enter(root, root.__call_target(), self.0.clone());
        f(root)
    }
}

impl Prepend<'_> {
    fn registry(&self) -> &Arc<Registry> {
        &self.0 .0
    }

    registration!(true);
}

// ---------------------------------------------------------------------------------------------
// Per-thread call context.

thread_local! {
    /// How many sessions are active on this thread: the one thing `call` reads when none is.
    static ACTIVE: Cell<usize> = const { Cell::new(0) };
    static SESSIONS: RefCell<Vec<Session>> = const { RefCell::new(Vec::new()) };
}

/// Whether any hook registry is attached on this thread.
#[inline]
pub(crate) fn active() -> bool {
    ACTIVE.with(Cell::get) != 0
}

struct Session {
    root: *const dyn Module,
    root_target: CallTarget,
    registries: Vec<Arc<Registry>>,
    frames: Vec<Frame>,
}

struct Frame {
    module: *const dyn Module,
    path: Arc<str>,
}

/// Erases the lifetime of a module reference for the per-thread stack. Every pointer stored there
/// is popped (by a guard, also on unwinding) before the borrow it came from ends.
fn erase(module: &dyn Module) -> *const dyn Module {
    let ptr: *const (dyn Module + '_) = module;
    // SAFETY: only the trait object's lifetime bound changes; see above for why it is never
    // dereferenced after the borrow ends.
    unsafe { std::mem::transmute::<*const (dyn Module + '_), *const (dyn Module + 'static)>(ptr) }
}

struct SessionGuard {
    /// Whether the guard added a registry to an existing session rather than a new session.
    merged: bool,
}

impl SessionGuard {
    fn enter(root: &dyn Module, root_target: CallTarget, registry: Arc<Registry>) -> Self {
        let merged = SESSIONS.with(|s| {
            let mut sessions = s.borrow_mut();
            match sessions.last_mut() {
                Some(top) if top.root_target == root_target => {
                    top.registries.push(registry);
                    true
                }
                _ => {
                    sessions.push(Session {
                        root: erase(root),
                        root_target,
                        registries: vec![registry],
                        frames: Vec::new(),
                    });
                    false
                }
            }
        });
        ACTIVE.with(|a| a.set(a.get() + 1));
        Self { merged }
    }
}

impl Drop for SessionGuard {
    fn drop(&mut self) {
        ACTIVE.with(|a| a.set(a.get() - 1));
        SESSIONS.with(|s| {
            let mut sessions = s.borrow_mut();
            if self.merged {
                if let Some(top) = sessions.last_mut() {
                    top.registries.pop();
                }
            } else {
                sessions.pop();
            }
        });
    }
}

/// The hooks one call fires, in order.
#[derive(Default)]
struct Plan {
    pre: Vec<Armed<PreHookFn>>,
    post: Vec<Armed<ForwardHookFn>>,
}

struct Armed<F: ?Sized> {
    f: Arc<F>,
    id: u64,
    registry: Arc<Registry>,
}

impl<F: ?Sized> Armed<F> {
    fn ctx<'a>(&'a self, path: &'a str, module: &'a dyn Module) -> HookCtx<'a> {
        HookCtx {
            path,
            module,
            registry: &self.registry,
            id: self.id,
        }
    }
}

/// The running call's entry on the frame stack; popped on drop.
struct FrameGuard {
    path: Arc<str>,
    /// The called module as the tree holds it (for `Box` and `Arc`, the module inside).
    module: *const dyn Module,
}

impl Drop for FrameGuard {
    fn drop(&mut self) {
        SESSIONS.with(|s| {
            if let Some(top) = s.borrow_mut().last_mut() {
                top.frames.pop();
            }
        });
    }
}

/// Finds the module called as `target`, pushes its frame and returns the hooks to fire, or `None`
/// when it is not part of the hooked tree.
fn enter_call(target: CallTarget) -> Option<(FrameGuard, Plan)> {
    SESSIONS.with(|s| {
        let mut sessions = s.borrow_mut();
        let session = sessions.last_mut()?;
        // SAFETY: every pointer on the stack is to a module borrowed by a `run` or `call` that is
        // still on this thread's call stack (guards pop them before those borrows end).
        let (module, path) = unsafe { locate(session, target) }?;
        let path: Arc<str> = path.into();
        let plan = plan_for(&session.registries, &path);
        session.frames.push(Frame {
            module,
            path: path.clone(),
        });
        Some((FrameGuard { path, module }, plan))
    })
}

/// The hooks to fire at `path`, group by group across the session's registries (global pre-hooks
/// of every registry, then targeted pre-hooks, …), each group in registry order.
fn plan_for(registries: &[Arc<Registry>], path: &str) -> Plan {
    fn arm<F: ?Sized>(e: &Entry<F>, registry: &Arc<Registry>) -> Armed<F> {
        Armed {
            f: e.f.clone(),
            id: e.id,
            registry: registry.clone(),
        }
    }
    let lists: Vec<_> = registries
        .iter()
        .map(|r| (r, r.lists.read().unwrap_or_else(PoisonError::into_inner)))
        .collect();
    let mut plan = Plan::default();
    for (r, l) in &lists {
        plan.pre.extend(l.global_pre.iter().map(|e| arm(e, r)));
    }
    for (r, l) in &lists {
        plan.pre
            .extend(l.pre.iter().filter(|e| e.targets(path)).map(|e| arm(e, r)));
    }
    for (r, l) in &lists {
        plan.post.extend(l.global_post.iter().map(|e| arm(e, r)));
    }
    for (r, l) in &lists {
        plan.post
            .extend(l.post.iter().filter(|e| e.targets(path)).map(|e| arm(e, r)));
    }
    plan
}

/// The module called as `target` and its path: among the descendants of the running module first,
/// then anywhere under the root.
///
/// # Safety
///
/// The session's pointers must be live (see [`enter_call`]).
unsafe fn locate(session: &Session, target: CallTarget) -> Option<(*const dyn Module, String)> {
    // SAFETY: per the function's contract.
    let root = unsafe { &*session.root };
    let Some(frame) = session.frames.last() else {
        if session.root_target == target {
            return Some((session.root, String::new()));
        }
        return find(root, target, String::new()).map(|(m, p)| (erase(m), p));
    };
    // SAFETY: per the function's contract.
    let running = unsafe { &*frame.module };
    if let Some((m, p)) = find(running, target, frame.path.to_string()) {
        return Some((erase(m), p));
    }
    if session.root_target == target {
        return Some((session.root, String::new()));
    }
    find(root, target, String::new()).map(|(m, p)| (erase(m), p))
}

/// Breadth of one level, then depth: the direct children of `parent` are checked before any of
/// their own children, since that is where nearly every call goes.
fn find(parent: &dyn Module, target: CallTarget, base: String) -> Option<(&dyn Module, String)> {
    let mut found: Option<(&dyn Module, String)> = None;
    let mut submodules: Vec<(&dyn Module, String)> = Vec::new();
    parent.visit_children(&mut |name, child| {
        if found.is_some() {
            return;
        }
        if let Child::Module { module, shared } = child {
            let mut path = base.clone();
            name.push_to(&mut path);
            let hit =
                CallTarget::of_dyn(module) == target || shared.is_some_and(|s| s.holder == target);
            if hit {
                found = Some((module, path));
            } else {
                submodules.push((module, path));
            }
        }
    });
    if found.is_some() {
        return found;
    }
    submodules
        .into_iter()
        .find_map(|(module, path)| find(module, target, path))
}

/// `call` with hooks attached: see the module docs.
pub(crate) fn dispatch<M, In>(module: &M, input: In) -> Result<M::Output>
where
    M: Module + Forward<In>,
    In: TensorTree,
    M::Output: TensorTree + 'static,
{
    let Some((frame, plan)) = enter_call(module.__call_target()) else {
        return module.forward(input);
    };
    if plan.pre.is_empty() && plan.post.is_empty() {
        return module.forward(input);
    }
    let path: &str = &frame.path;
    // SAFETY: the pointer is to the module being called, or to the module inside the `Box` or `Arc`
    // being called, borrowed for the whole of this function through `module`.
    let as_dyn: &dyn Module = unsafe { &*frame.module };

    // Declared before the input it may hold replaced tensors for, so it outlives the forward call.
    let scope = Scope::default();
    let mut input = input;
    if !plan.pre.is_empty() {
        let mut tensors = input.tensors();
        let mut replaced = false;
        for hook in &plan.pre {
            let new = (hook.f)(&hook.ctx(path, as_dyn), &tensors)
                .map_err(|e| hook_error(path, "forward pre-hook", e))?;
            if let Some(new) = new {
                check_count(path, "forward pre-hook", tensors.len(), new.len())?;
                tensors = new;
                replaced = true;
            }
        }
        if replaced {
            let mut supply = tensors.into_iter();
            // SAFETY: `scope` lives until this function returns; the rebuilt input only goes to
            // `forward`, whose output is `'static` and so cannot borrow from it.
            input = unsafe { input.rebuild(&mut || next_tensor(&mut supply), &scope) };
        }
    }
    let input_tensors = if plan.post.is_empty() {
        Vec::new()
    } else {
        input.tensors()
    };
    let mut output = module.forward(input)?;
    if !plan.post.is_empty() {
        let mut tensors = output.tensors();
        let mut replaced = false;
        for hook in &plan.post {
            let new = (hook.f)(&hook.ctx(path, as_dyn), &input_tensors, &tensors)
                .map_err(|e| hook_error(path, "forward hook", e))?;
            if let Some(new) = new {
                check_count(path, "forward hook", tensors.len(), new.len())?;
                tensors = new;
                replaced = true;
            }
        }
        if replaced {
            let mut supply = tensors.into_iter();
            let empty = Scope::default();
            // SAFETY: `Output: 'static` holds no references, so the scope is never used.
            output = unsafe { output.rebuild(&mut || next_tensor(&mut supply), &empty) };
        }
    }
    drop(scope);
    Ok(output)
}

fn next_tensor(supply: &mut std::vec::IntoIter<Tensor>) -> Tensor {
    supply.next().expect(
        "a TensorStruct's `map_tensors` visited more tensors than its `for_each_tensor` lists",
    )
}

fn hook_error(path: &str, hook: &'static str, source: Error) -> Error {
    Error::Hook {
        path: path.to_owned(),
        hook,
        source: Box::new(source),
    }
}

fn check_count(path: &str, hook: &'static str, expected: usize, got: usize) -> Result<()> {
    if expected == got {
        return Ok(());
    }
    Err(Error::HookTensorCount {
        path: path.to_owned(),
        hook,
        expected,
        got,
    })
}

// ---------------------------------------------------------------------------------------------
// Built on hooks: capture, call order, shapes.

/// The outputs of the modules a [`capture`](crate::ModuleExt::capture) watched, in call order (a
/// module called twice appears twice).
#[derive(Clone, Debug, Default)]
pub struct Captures {
    entries: Vec<(String, Vec<Tensor>)>,
}

impl Captures {
    /// How many calls were captured.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether nothing was captured.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The (first) output tensor of the first call of the module at `path`.
    pub fn get(&self, path: &str) -> Option<&Tensor> {
        self.outputs(path).and_then(<[Tensor]>::first)
    }

    /// Every output tensor of the first call of the module at `path`.
    pub fn outputs(&self, path: &str) -> Option<&[Tensor]> {
        self.entries
            .iter()
            .find(|(p, _)| p == path)
            .map(|(_, t)| t.as_slice())
    }

    /// The captured paths, in call order.
    pub fn paths(&self) -> impl Iterator<Item = &str> {
        self.entries.iter().map(|(p, _)| p.as_str())
    }

    /// Every captured call: the path and the output tensors.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &[Tensor])> {
        self.entries.iter().map(|(p, t)| (p.as_str(), t.as_slice()))
    }

    /// The captured calls, owned.
    pub fn into_vec(self) -> Vec<(String, Vec<Tensor>)> {
        self.entries
    }
}

pub(crate) fn capture<M: Module, R>(
    root: &M,
    patterns: &[&str],
    run: impl FnOnce(&M) -> Result<R>,
) -> Result<(R, Captures)> {
    let hooks = Hooks::new();
    let store = Arc::new(Mutex::new(Vec::new()));
    for pattern in patterns {
        let store = store.clone();
        hooks.register_forward_hook(pattern, move |ctx, _input, output| {
            store
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push((ctx.path().to_owned(), output.to_vec()));
            Ok(None)
        })?;
    }
    let out = hooks.run(root, run)?;
    let entries = std::mem::take(&mut *store.lock().unwrap_or_else(PoisonError::into_inner));
    Ok((out, Captures { entries }))
}

pub(crate) fn call_order<M: Module, R>(
    root: &M,
    run: impl FnOnce(&M) -> Result<R>,
) -> Result<(R, Vec<String>)> {
    let hooks = Hooks::new();
    let order = Arc::new(Mutex::new(Vec::new()));
    let sink = order.clone();
    hooks.register_global_forward_pre_hook(move |ctx, _| {
        sink.lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(ctx.path().to_owned());
        Ok(None)
    });
    let out = hooks.run(root, run)?;
    let order = std::mem::take(&mut *order.lock().unwrap_or_else(PoisonError::into_inner));
    Ok((out, order))
}

/// Input and output shapes of every module call, for [`ModuleExt::summary_with`](crate::ModuleExt::summary_with):
/// `path -> (input shapes, output shapes)` of the first call.
pub(crate) fn record_shapes<M: Module, R>(
    root: &M,
    run: impl FnOnce(&M) -> Result<R>,
) -> Result<Vec<(String, String, String)>> {
    type Rows = Vec<(String, String, String)>;
    let hooks = Hooks::new();
    let rows: Arc<Mutex<Rows>> = Arc::default();
    let sink = rows.clone();
    hooks.register_global_forward_hook(move |ctx, input, output| {
        let mut rows = sink.lock().unwrap_or_else(PoisonError::into_inner);
        if !rows.iter().any(|(p, _, _)| p == ctx.path()) {
            rows.push((ctx.path().to_owned(), shapes(input), shapes(output)));
        }
        Ok(None)
    });
    hooks.run(root, run)?;
    let rows = std::mem::take(&mut *rows.lock().unwrap_or_else(PoisonError::into_inner));
    Ok(rows)
}

/// `[2, 3]`, or `[2, 3], [4]` for several tensors.
fn shapes(tensors: &[Tensor]) -> String {
    tensors
        .iter()
        .map(|t| format!("{:?}", t.dims()))
        .collect::<Vec<_>>()
        .join(", ")
}
