//! Hook dispatch: the per-thread stack of running calls that finds a called module's path, and
//! `call` with hooks around `forward`.
//!
//! This file holds all of the hook machinery's `unsafe`. Two things need it, and each is confined
//! here with its reasoning:
//!
//! - the stack stores `*const dyn Module` pointers to modules borrowed by a [`Hooks::run`] or a
//!   `call` that is still on this thread's call stack; guards pop every entry (on unwinding too)
//!   before the borrow it came from ends, so every dereference is of a live module;
//! - a pre-hook may replace a *borrowed* input tensor (`&Tensor`): the replacement must live as long
//!   as the call it goes to, so it is kept in a [`Scope`] that only [`dispatch`] creates, on its own
//!   stack frame, and that outlives the `forward` call (whose output is `'static`, so it cannot
//!   keep a reference into the scope).
//!
//! [`Hooks::run`]: super::Hooks::run
#![deny(unsafe_op_in_unsafe_fn)]

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::sync::{Arc, PoisonError};

use candle_core::Tensor;

use super::registry::{Entry, ForwardHookFn, HookCtx, Lists, PreHookFn, Registry};
use crate::error::{Error, Result};
use crate::forward::Forward;
use crate::identity::CallTarget;
use crate::module::Module;
use crate::tensor_tree::TensorTree;
use crate::walk::find_call_target;

thread_local! {
    /// How many sessions are active on this thread: the one thing `call` reads when none is.
    static ACTIVE: Cell<usize> = const { Cell::new(0) };
    static SESSIONS: RefCell<Vec<Session>> = const { RefCell::new(Vec::new()) };
}

/// Whether any hook registry is attached on this thread.
#[inline]
pub fn active() -> bool {
    ACTIVE.with(Cell::get) != 0
}

struct Session {
    root: *const dyn Module,
    root_target: CallTarget,
    /// Every path of the modules reachable by more than one (see `ModuleTable`).
    aliases: HashMap<CallTarget, Vec<Arc<str>>>,
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

pub(super) struct SessionGuard {
    /// Whether the guard added a registry to an existing session rather than a new session.
    merged: bool,
}

impl SessionGuard {
    pub(super) fn enter(
        root: &dyn Module,
        root_target: CallTarget,
        registry: Arc<Registry>,
        aliases: HashMap<CallTarget, Vec<Arc<str>>>,
    ) -> Self {
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
                        aliases,
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
    always_call: bool,
}

impl<F: ?Sized> Armed<F> {
    fn ctx<'a>(&'a self, path: &'a str, module: &'a dyn Module) -> HookCtx<'a> {
        HookCtx {
            path,
            module,
            registry: &self.registry,
            id: self.id,
            error: None,
            output: None,
            input: None,
            input_type: "",
        }
    }
}

impl Plan {
    /// The call failed with `error` before forward hook `from` ran: runs the always-call forward
    /// hooks from `from` on, as PyTorch's `Module._call_impl` does in its `except` branch (the
    /// hooks not run yet, globals first; their results and errors are ignored, PyTorch only warns),
    /// and gives the error back.
    #[cold]
    fn fail(
        &self,
        path: &str,
        module: &dyn Module,
        from: usize,
        input: &[Tensor],
        output: &[Tensor],
        error: Error,
    ) -> Error {
        for hook in self.post.iter().skip(from).filter(|h| h.always_call) {
            let ctx = HookCtx {
                error: Some(&error),
                ..hook.ctx(path, module)
            };
            let _ignored = (hook.f)(&ctx, input, output);
        }
        error
    }

    fn has_always_call(&self) -> bool {
        self.post.iter().any(|h| h.always_call)
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
        let (module, path, called) = unsafe { locate(session, target) }?;
        let path: Arc<str> = path.into();
        let aliases = session.aliases.get(&called).map_or(&[][..], Vec::as_slice);
        let plan = plan_for(&session.registries, &path, aliases);
        session.frames.push(Frame {
            module,
            path: path.clone(),
        });
        Some((FrameGuard { path, module }, plan))
    })
}

/// The hooks to fire at `path`, group by group across the session's registries (global pre-hooks
/// of every registry, then targeted pre-hooks, …), each group in registry order.
fn plan_for(registries: &[Arc<Registry>], path: &str, aliases: &[Arc<str>]) -> Plan {
    let guards: Vec<_> = registries
        .iter()
        .map(|r| (r, r.lists.read().unwrap_or_else(PoisonError::into_inner)))
        .collect();
    let lists: Vec<(&Arc<Registry>, &Lists)> = guards.iter().map(|(r, l)| (*r, &**l)).collect();
    Plan {
        pre: armed(&lists, |l| (&l.global_pre, &l.pre), path, aliases),
        post: armed(&lists, |l| (&l.global_post, &l.post), path, aliases),
    }
}

/// One kind of hook's share of a [`Plan`]: the global hooks (the first list `kind` picks) of
/// every registry, then the targeted ones (the second) that target `path`, each group in registry
/// order.
fn armed<F: ?Sized>(
    lists: &[(&Arc<Registry>, &Lists)],
    kind: impl Fn(&Lists) -> (&Vec<Entry<F>>, &Vec<Entry<F>>),
    path: &str,
    aliases: &[Arc<str>],
) -> Vec<Armed<F>> {
    let arm = |e: &Entry<F>, registry: &Arc<Registry>| Armed {
        f: e.f.clone(),
        id: e.id,
        registry: registry.clone(),
        always_call: e.always_call,
    };
    let global = lists
        .iter()
        .flat_map(|&(r, l)| kind(l).0.iter().map(move |e| arm(e, r)));
    let targeted = lists.iter().flat_map(|&(r, l)| {
        kind(l)
            .1
            .iter()
            .filter(move |e| e.targets(path, aliases))
            .map(move |e| arm(e, r))
    });
    global.chain(targeted).collect()
}

/// The module called as `target` and its path: among the descendants of the running module first,
/// then anywhere under the root.
///
/// # Safety
///
/// The session's pointers must be live (see [`enter_call`]).
unsafe fn locate(
    session: &Session,
    target: CallTarget,
) -> Option<(*const dyn Module, String, CallTarget)> {
    // SAFETY: per the function's contract.
    let root = unsafe { &*session.root };
    let found = |(m, p): (&dyn Module, String)| {
        let any: &dyn std::any::Any = m;
        (erase(m), p, CallTarget::of_dyn(any))
    };
    let Some(frame) = session.frames.last() else {
        if session.root_target == target {
            return Some(found((root, String::new())));
        }
        return find_call_target(root, target, String::new()).map(found);
    };
    // SAFETY: per the function's contract.
    let running = unsafe { &*frame.module };
    if let Some(hit) = find_call_target(running, target, frame.path.to_string()) {
        return Some(found(hit));
    }
    if session.root_target == target {
        return Some(found((root, String::new())));
    }
    find_call_target(root, target, String::new()).map(found)
}

/// `call` with hooks attached: see the module docs.
pub fn dispatch<M, In>(module: &M, input: In) -> Result<M::Output>
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
    // SAFETY: the scope lives on this frame until the function returns, after `forward`; the
    // rebuilt input only goes to `forward`, whose output is `'static` and cannot borrow from it.
    let scope = unsafe { Scope::new() };
    let mut input = input;
    // On an error, the always-call forward hooks run before it is returned (see `Plan::fail`).
    if !plan.pre.is_empty() {
        let mut tensors = input.tensors();
        let mut replaced = false;
        for hook in &plan.pre {
            let new = (hook.f)(&hook.ctx(path, as_dyn), &tensors);
            let new = checked(path, "forward pre-hook", tensors.len(), new);
            match new {
                Ok(Some(new)) => {
                    tensors = new;
                    replaced = true;
                }
                Ok(None) => {}
                Err(e) => return Err(plan.fail(path, as_dyn, 0, &tensors, &[], e)),
            }
        }
        if replaced {
            let kept = if plan.has_always_call() {
                tensors.clone()
            } else {
                Vec::new()
            };
            input = match rebuild::<In>(path, input, tensors, &scope) {
                Ok(input) => input,
                Err(e) => return Err(plan.fail(path, as_dyn, 0, &kept, &[], e)),
            };
        }
    }
    // What the forward hooks see of the input, which `forward` consumes: its tensors, and its
    // owned form for typed hooks (both only reference-count the tensors).
    let (input_tensors, owned_input) = if plan.post.is_empty() {
        (Vec::new(), None)
    } else {
        (input.tensors(), input.to_owned_tree())
    };
    let mut output = match module.forward(input) {
        Ok(output) => output,
        Err(e) => return Err(plan.fail(path, as_dyn, 0, &input_tensors, &[], e)),
    };
    if !plan.post.is_empty() {
        let mut tensors = output.tensors();
        for (i, hook) in plan.post.iter().enumerate() {
            let new = {
                let mut ctx = hook.ctx(path, as_dyn);
                ctx.output = Some(&output as &dyn std::any::Any);
                ctx.input = owned_input.as_ref().map(|i| i as &dyn std::any::Any);
                ctx.input_type = std::any::type_name::<In>();
                (hook.f)(&ctx, &input_tensors, &tensors)
            };
            match checked(path, "forward hook", tensors.len(), new) {
                // The next hook sees the replaced output as a typed value too. An owned
                // (`'static`) output holds no references, so the scope stays unused.
                Ok(Some(new)) => match rebuild::<M::Output>(path, output, new.clone(), &scope) {
                    Ok(rebuilt) => {
                        output = rebuilt;
                        tensors = new;
                    }
                    Err(e) => {
                        return Err(plan.fail(path, as_dyn, i + 1, &input_tensors, &tensors, e))
                    }
                },
                Ok(None) => {}
                Err(e) => return Err(plan.fail(path, as_dyn, i + 1, &input_tensors, &tensors, e)),
            }
        }
    }
    drop(scope);
    Ok(output)
}

/// Rebuilds `tree` with `tensors` (as many as it lists), or fails if a
/// [`TensorStruct`](crate::TensorStruct) impl maps another number of tensors than it lists.
fn rebuild<T: TensorTree>(path: &str, tree: T, tensors: Vec<Tensor>, scope: &Scope) -> Result<T> {
    let listed = tensors.len();
    let mut supply = tensors.into_iter();
    let mut visited = 0;
    let rebuilt = tree.rebuild(
        &mut |old| {
            visited += 1;
            // Past the end, keep the old tensor: the count check below reports the mismatch.
            supply.next().unwrap_or_else(|| old.clone())
        },
        scope,
    );
    if visited != listed {
        return Err(Error::TensorTreeMismatch {
            path: path.to_owned(),
            type_name: std::any::type_name::<T>(),
            listed,
            visited,
        });
    }
    Ok(rebuilt)
}

/// Where replaced borrowed input tensors live while the call that uses them runs.
///
/// Only [`dispatch`] creates one (the constructor is `unsafe`): that is what makes
/// [`TensorTree::rebuild`], which hands out references into it, safe to call.
#[doc(hidden)]
pub struct Scope {
    // Boxed so that a reference handed out stays valid when the vector grows.
    #[allow(clippy::vec_box)]
    kept: RefCell<Vec<Box<Tensor>>>,
}

impl Scope {
    /// An empty scope.
    ///
    /// # Safety
    ///
    /// The scope must outlive every value rebuilt with it and everything derived from those values:
    /// [`keep`](Self::keep) hands out references of any lifetime into it.
    unsafe fn new() -> Self {
        Self {
            kept: RefCell::new(Vec::new()),
        }
    }

    /// Whether nothing was kept.
    fn is_empty(&self) -> bool {
        self.kept.borrow().is_empty()
    }

    /// Keeps `t` alive as long as the scope and returns a reference to it.
    pub fn keep<'a>(&self, t: Tensor) -> &'a Tensor {
        let boxed = Box::new(t);
        let ptr: *const Tensor = &*boxed;
        // The heap allocation does not move when the box is moved into the vector, and boxes are
        // only dropped with the scope.
        self.kept.borrow_mut().push(boxed);
        // SAFETY: `ptr` points into a live box owned by `self`, and the scope outlives every use of
        // the reference by the contract of `Scope::new`, its only constructor.
        unsafe { &*ptr }
    }
}

/// What a hook returned, checked: its error named by `path` and the kind of `hook`, and a
/// replacement of another length than the `len` tensors it was given refused.
fn checked(
    path: &str,
    hook: &'static str,
    len: usize,
    result: Result<Option<Vec<Tensor>>>,
) -> Result<Option<Vec<Tensor>>> {
    match result.map_err(|e| hook_error(path, hook, e))? {
        Some(new) => check_count(path, hook, len, new.len()).map(|()| Some(new)),
        None => Ok(None),
    }
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

/// Rebuilds `tree` with each tensor replaced by `f` of it, outside hook dispatch: what
/// `#[derive(TensorStruct)]`'s `map_tensors` does with each field.
///
/// A borrowed `&'static Tensor` leaf that `f` replaces needs a home that lives forever: the scope
/// that holds it is then leaked (a field type no derived struct has in practice); otherwise nothing
/// references the scope and it is dropped.
pub fn map_tree<T: TensorTree>(tree: T, f: &mut dyn FnMut(Tensor) -> Tensor) -> T {
    // SAFETY: the scope outlives every value rebuilt with it: when `keep` handed out a reference
    // the scope is leaked, and when it did not, no value refers to it.
    let scope = unsafe { Scope::new() };
    let rebuilt = tree.rebuild(&mut |old| f(old.clone()), &scope);
    if !scope.is_empty() {
        std::mem::forget(scope);
    }
    rebuilt
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn borrowed_tensors_are_replaced_through_the_scope() -> candle_core::Result<()> {
        let a = Tensor::new(&[1f32], &Device::Cpu)?;
        let b = Tensor::new(&[2f32], &Device::Cpu)?;
        let tree = (&a, (Some(&b), 3usize), vec![a.clone()]);
        assert_eq!(tree.tensor_count(), 3);
        // SAFETY: the scope outlives `rebuilt`, the only value rebuilt with it.
        let scope = unsafe { Scope::new() };
        let mut supply = vec![a.clone(), (&b * 10.)?, a.clone()].into_iter();
        let rebuilt = tree.rebuild(&mut |_| supply.next().unwrap(), &scope);
        // Unchanged borrowed tensors are the originals; replaced ones live in the scope.
        assert!(std::ptr::eq(rebuilt.0, &a));
        assert_eq!(rebuilt.1 .0.unwrap().to_vec1::<f32>()?, [20.]);
        assert_eq!(rebuilt.1 .1, 3);
        assert_eq!(scope.kept.borrow().len(), 1);
        Ok(())
    }
}
