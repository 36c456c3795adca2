//! Hook dispatch: the registries attached to each thread, the per-thread stack of running calls
//! (paths, no module references), and `call` with hooks around `forward`.
//!
//! A [`Hooks::run`] attaches a *session* to its thread: the root's `CallTable` (every module
//! by identity, from one walk), the registries, and the hooks each module fires, worked out from
//! the registries' patterns on the first call and again whenever a registry or the table changes.
//! A call looks its target up in the table, pushes its path and fires the hooks worked out for
//! its module. No module is referenced from the thread-local state: the module a hook is given is
//! the one `call` was made on.
//!
//! [`Hooks::run`]: super::Hooks::run

use std::cell::{Cell, RefCell};
use std::sync::{Arc, PoisonError};

use candle_core::Tensor;

use super::backward::BackwardCall;
use super::call_table::CallTable;
use super::hook::{Armed, BackwardHookFn, BackwardPreHookFn, Entry, ForwardHookFn, HookCtx};
use super::hook::{Lists, PreHookFn, Registry};
use crate::error::{Error, Result};
use crate::forward::Forward;
use crate::identity::CallTarget;
use crate::module::{Child, Module};
use crate::scope;
use crate::tensor_tree::TensorTree;

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

/// The hooks attached to one root on this thread.
struct Session {
    root: CallTarget,
    table: CallTable,
    registries: Vec<Arc<Registry>>,
    /// The hooks each node of the table fires (nodes of one module share them), worked out from
    /// the registries at the versions in `seen`; out of date when `plans` is not as long as the
    /// table or a registry's version moved on.
    plans: Vec<Arc<Plan>>,
    seen: Vec<u64>,
    /// The paths of the calls running on this thread, innermost last.
    frames: Vec<Arc<str>>,
}

impl Session {
    /// The plans, worked out again if a registry or the table changed since they were.
    fn plans(&mut self) -> &[Arc<Plan>] {
        let fresh = self.plans.len() == self.table.len()
            && self.seen.len() == self.registries.len()
            && self
                .registries
                .iter()
                .zip(&self.seen)
                .all(|(r, &seen)| r.version() == seen);
        if !fresh {
            self.resolve();
        }
        &self.plans
    }

    /// Works out the hooks of every node: the global hooks of every registry, then the targeted
    /// hooks whose pattern matches one of the module's paths, each group in registry order.
    fn resolve(&mut self) {
        let guards: Vec<_> = self
            .registries
            .iter()
            .map(|r| (r, r.lists.read().unwrap_or_else(PoisonError::into_inner)))
            .collect();
        // Read under the locks: the version of what the guards hold.
        self.seen = guards.iter().map(|(r, _)| r.version()).collect();
        let lists: Vec<(&Arc<Registry>, &Lists)> = guards.iter().map(|(r, l)| (*r, &**l)).collect();
        // The modules no targeted hook matches (all of them, without targeted hooks) share one
        // plan of the global hooks.
        let global = Arc::new(Plan {
            pre: armed(&lists, |l| (&l.global_pre, &l.pre), |_| false),
            post: armed(&lists, |l| (&l.global_post, &l.post), |_| false),
            bw_pre: armed(&lists, |l| (&l.global_bw_pre, &l.bw_pre), |_| false),
            bw: armed(&lists, |l| (&l.global_bw, &l.bw), |_| false),
        });
        let targeted = lists.iter().any(|(_, l)| {
            !l.pre.is_empty() || !l.post.is_empty() || !l.bw_pre.is_empty() || !l.bw.is_empty()
        });
        let mut plans: Vec<Arc<Plan>> = Vec::with_capacity(self.table.len());
        let table = &self.table;
        for i in 0..table.len() {
            if !targeted {
                plans.push(global.clone());
                continue;
            }
            let identity = table.identity(i);
            if identity != i {
                plans.push(plans[identity].clone());
                continue;
            }
            let plan = Plan {
                pre: armed(
                    &lists,
                    |l| (&l.global_pre, &l.pre),
                    |e| e.targets(table.paths_of(i)),
                ),
                post: armed(
                    &lists,
                    |l| (&l.global_post, &l.post),
                    |e| e.targets(table.paths_of(i)),
                ),
                bw_pre: armed(
                    &lists,
                    |l| (&l.global_bw_pre, &l.bw_pre),
                    |e| e.targets(table.paths_of(i)),
                ),
                bw: armed(
                    &lists,
                    |l| (&l.global_bw, &l.bw),
                    |e| e.targets(table.paths_of(i)),
                ),
            };
            let only_global = plan.pre.len() == global.pre.len()
                && plan.post.len() == global.post.len()
                && plan.bw_pre.len() == global.bw_pre.len()
                && plan.bw.len() == global.bw.len();
            plans.push(if only_global {
                global.clone()
            } else {
                Arc::new(plan)
            });
        }
        self.plans = plans;
    }
}

/// One kind of hook's share of a [`Plan`]: the global hooks (the first list `kind` picks) of
/// every registry, then the targeted ones (the second) for which `fires` holds, each group in
/// registry order.
fn armed<F: ?Sized>(
    lists: &[(&Arc<Registry>, &Lists)],
    kind: impl Fn(&Lists) -> (&Vec<Entry<F>>, &Vec<Entry<F>>),
    fires: impl Fn(&Entry<F>) -> bool,
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
            .filter(|e| fires(e))
            .map(move |e| arm(e, r))
    });
    global.chain(targeted).collect()
}

/// Attaches a registry to this thread for as long as it lives ([`Hooks::run`](super::Hooks::run)).
pub(super) struct SessionGuard {
    /// Whether the guard added a registry to an existing session rather than a new session.
    merged: bool,
}

impl SessionGuard {
    /// Attaches `registry` to `root`: to the innermost session if it has the same root (the
    /// registries merge, and the session's table serves), else as a new session with the table of
    /// one walk of `root`. `check` vets the table before anything is attached (its error is
    /// returned and nothing changes).
    pub(super) fn enter<M: Module>(
        root: &M,
        registry: Arc<Registry>,
        check: impl Fn(&CallTable) -> Result<()>,
    ) -> Result<Self> {
        let target = root.__call_target();
        let merged = SESSIONS.with(|s| -> Result<bool> {
            let mut sessions = s.borrow_mut();
            match sessions.last_mut() {
                Some(top) if top.root == target => {
                    check(&top.table)?;
                    top.registries.push(registry.clone());
                    top.plans.clear();
                    Ok(true)
                }
                _ => Ok(false),
            }
        })?;
        if !merged {
            // Walked outside the thread-local's borrow.
            let table = CallTable::of(root);
            check(&table)?;
            SESSIONS.with(|s| {
                s.borrow_mut().push(Session {
                    root: target,
                    table,
                    registries: vec![registry],
                    plans: Vec::new(),
                    seen: Vec::new(),
                    frames: Vec::new(),
                });
            });
        }
        ACTIVE.with(|a| a.set(a.get() + 1));
        Ok(Self { merged })
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
                    top.plans.clear();
                }
            } else {
                sessions.pop();
            }
        });
    }
}

/// Tells the sessions of this thread that the unbuilt `Lazy` cell called as `cell` now holds
/// `built`: where the cell is part of a hooked tree, `built` and its submodules join the table
/// at the cell's path, so that their calls find their paths (the tree grew during a run). Cheap
/// when the cell is not in a table or was grafted already: one lookup per session. Not public API.
#[doc(hidden)]
pub fn grown<M: Module>(cell: CallTarget, built: &M) {
    let inner = CallTarget::of_dyn(called_module(built));
    SESSIONS.with(|s| {
        for session in s.borrow_mut().iter_mut() {
            if session.table.graft(cell, inner, built) {
                session.plans.clear();
            }
        }
    });
}

/// The hooks one call fires, in order.
#[derive(Default)]
struct Plan {
    pre: Vec<Armed<PreHookFn>>,
    post: Vec<Armed<ForwardHookFn>>,
    bw_pre: Vec<Armed<BackwardPreHookFn>>,
    bw: Vec<Armed<BackwardHookFn>>,
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
    fn is_empty(&self) -> bool {
        self.pre.is_empty() && self.post.is_empty() && !self.has_backward()
    }

    fn has_backward(&self) -> bool {
        !self.bw_pre.is_empty() || !self.bw.is_empty()
    }

    /// The backward hooks of this call, if the module has any and the call records gradients
    /// (PyTorch sets them up only when grad mode is on).
    fn backward_call(&self, path: &Arc<str>, module: &dyn Module) -> Option<Arc<BackwardCall>> {
        if !self.has_backward() || !module_core::is_grad_enabled() {
            return None;
        }
        let (hooks, pre) = (self.bw.clone(), self.bw_pre.clone());
        Some(BackwardCall::new(
            path.clone(),
            module.class_name(),
            hooks,
            pre,
        ))
    }

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

/// The running call's entry on the frame stack; popped on drop (on unwinding too).
struct FrameGuard {
    path: Arc<str>,
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

/// Finds the node called as `target`, pushes its frame and returns the hooks to fire (`None`:
/// none), or `None` when it is not part of the hooked tree.
fn enter_call(target: CallTarget) -> Option<(FrameGuard, Option<Arc<Plan>>)> {
    SESSIONS.with(|s| {
        let mut sessions = s.borrow_mut();
        let session = sessions.last_mut()?;
        let running = session.frames.last().map(|p| &**p);
        let node = session.table.find(target, running)?;
        let plan = &session.plans()[node];
        let plan = (!plan.is_empty()).then(|| plan.clone());
        let path = session.table.nodes()[node].path.clone();
        session.frames.push(path.clone());
        Some((FrameGuard { path }, plan))
    })
}

/// The module a call is a call of, as the tree holds it: for `Box` and `Arc`, the module inside.
fn called_module<M: Module>(module: &M) -> &dyn Module {
    match module.as_child() {
        Child::Module { module, .. } => module,
        _ => module,
    }
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
    // The frame stays pushed until this function returns: calls made by `forward` find their
    // paths under it.
    let Some(plan) = plan else {
        return module.forward(input);
    };
    let path: &str = &frame.path;
    let as_dyn = called_module(module);

    // On an error, the always-call forward hooks run before it is returned (see `Plan::fail`).
    let mut replaced: Option<Vec<Tensor>> = None;
    if !plan.pre.is_empty() {
        let mut tensors = input.tensors();
        let mut changed = false;
        for hook in &plan.pre {
            let new = (hook.f)(&hook.ctx(path, as_dyn), &tensors);
            match checked(path, "forward pre-hook", tensors.len(), new) {
                Ok(Some(new)) => {
                    tensors = new;
                    changed = true;
                }
                Ok(None) => {}
                Err(e) => return Err(plan.fail(path, as_dyn, 0, &tensors, &[], e)),
            }
        }
        if changed {
            replaced = Some(tensors);
        }
    }
    // Full backward hooks: the inputs (as the pre-hooks left them) go through identities whose
    // backward runs the hooks (see `backward.rs`), as PyTorch's `BackwardHook.setup_input_hook`.
    let backward = plan.backward_call(&frame.path, as_dyn);
    if let Some(call) = &backward {
        let tensors = replaced.take().unwrap_or_else(|| input.tensors());
        match call.wrap_inputs(&tensors) {
            Ok(wrapped) => replaced = Some(wrapped.unwrap_or(tensors)),
            Err(e) => return Err(plan.fail(path, as_dyn, 0, &tensors, &[], e)),
        }
    }
    let backward = backward.as_ref();
    let run = |input: In| forward_then_hooks(module, input, &plan, (path, backward), as_dyn);
    match replaced {
        None => run(input),
        Some(tensors) => {
            let kept = if plan.has_always_call() {
                tensors.clone()
            } else {
                Vec::new()
            };
            match scope::forward_replaced(input, tensors, run) {
                Ok(result) => result,
                Err(mismatch) => {
                    let e = mismatch.into_error(path);
                    Err(plan.fail(path, as_dyn, 0, &kept, &[], e))
                }
            }
        }
    }
}

/// `forward` on the input as the pre-hooks left it, then the forward hooks.
fn forward_then_hooks<M, In>(
    module: &M,
    input: In,
    plan: &Plan,
    (path, backward): (&str, Option<&Arc<BackwardCall>>),
    as_dyn: &dyn Module,
) -> Result<M::Output>
where
    M: Module + Forward<In>,
    In: TensorTree,
    M::Output: TensorTree + 'static,
{
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
    if plan.post.is_empty() {
        return with_backward_hooks(output, path, backward);
    }
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
            // The next hook sees the replaced output as a typed value too.
            Ok(Some(new)) => match scope::rebuild_owned(output, new.clone()) {
                Ok(rebuilt) => {
                    output = rebuilt;
                    tensors = new;
                }
                Err(mismatch) => {
                    let e = mismatch.into_error(path);
                    return Err(plan.fail(path, as_dyn, i + 1, &input_tensors, &tensors, e));
                }
            },
            Ok(None) => {}
            Err(e) => return Err(plan.fail(path, as_dyn, i + 1, &input_tensors, &tensors, e)),
        }
    }
    with_backward_hooks(output, path, backward)
}

/// The output (as the forward hooks left it) with its tensors behind identities whose backward
/// runs the backward pre-hooks, as PyTorch's `BackwardHook.setup_output_hook`.
fn with_backward_hooks<O: TensorTree + 'static>(
    output: O,
    path: &str,
    backward: Option<&Arc<BackwardCall>>,
) -> Result<O> {
    let Some(call) = backward else {
        return Ok(output);
    };
    match call.wrap_outputs(&output.tensors())? {
        None => Ok(output),
        Some(wrapped) => scope::rebuild_owned(output, wrapped).map_err(|m| m.into_error(path)),
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
