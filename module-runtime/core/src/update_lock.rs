//! Atomic weight updates: a call sees the weights of before a concurrent update, or those of after.
//!
//! Parameters and buffers are copied into in place (so optimizers and aliases keep seeing them),
//! which left a forward running on one thread free to read some tensors before a
//! `load_state_dict` on another thread and some after: torn weights. Every top-level
//! [`call`](../module_runtime/trait.ModuleExt.html#method.call) now holds a shared lock for its
//! whole run, and every update holds it exclusively:
//!
//! - **updates**: a load's commit ([`load_state_dict`](../module_runtime/trait.ModuleExt.html#method.load_state_dict),
//!   after everything is read and checked), a model's `to_device`/`to_dtype`/`quantize`, and each of
//!   [`Param`](crate::Param)'s and [`Buffer`](crate::Buffer)'s writes (`set`, `assign`, moves,
//!   `quantize`, `dequantize`, `set_quantized`); [`atomic_update`] makes several of them one;
//! - **calls**: the outermost `call` on a thread takes the lock, the calls inside it only read a
//!   thread-local flag.
//!
//! So a call started before an update finishes with the old weights (the update waits for it), and
//! one started after runs with the new ones (it waits for the update's copies, which are all that
//! runs under the exclusive lock: a load reads and converts its file before).
//!
//! What a caller may not assume:
//!
//! - An update made *inside* a call (a forward hook or a layer writing a parameter, batch norm's
//!   running statistics in training) is not isolated from other threads' calls: the thread already
//!   holds the shared lock and cannot wait for the others to finish.
//! - `forward` called directly at the top is not a call: it takes no lock.
//! - An output that *is* a weight (a view of a parameter returned as is) changes with a later
//!   in-place update, as in PyTorch.
//! - A call blocked in a collective of `LocalGroup` (ranks that are threads) lets go of its share
//!   while it waits ([`release_call_while`]): another rank's update then runs without waiting for it.
//! - A call that hands work to other threads which call modules while an update waits: those threads
//!   wait [`CALL_WAIT`] for the update, then join the call already running (so this cannot
//!   deadlock, and costs that wait once per update).
//! - Training steps (`Optimizer::step`) write through candle's variables, outside this lock: serving
//!   and training one model from several threads at once is not covered.

use std::cell::{Cell, RefCell};
use std::time::Duration;

use parking_lot::{const_rwlock, RwLock, RwLockReadGuard, RwLockWriteGuard};

/// The lock: shared by calls, exclusive for updates. One for the process, so an update of one
/// model also waits for calls of another: updates are rare and short (copies only).
static LOCK: RwLock<()> = const_rwlock(());

/// How long a call waits for a pending update before it joins the calls already running (see the
/// module docs: a call's helper threads must not wait for an update that waits for that call).
pub const CALL_WAIT: Duration = Duration::from_secs(1);

#[derive(Clone, Copy, PartialEq, Eq)]
enum Held {
    None,
    Call,
    Update,
}

thread_local! {
    /// What this thread holds: nested calls and updates do not take the lock again.
    static HELD: Cell<Held> = const { Cell::new(Held::None) };
    /// The outermost call's share of the lock, while this thread's call holds it (let go and
    /// taken again by [`release_call_while`]).
    static CALL_LOCK: RefCell<Option<RwLockReadGuard<'static, ()>>> = const { RefCell::new(None) };
}

/// Held for a top-level call's run (see the module docs); nothing for a nested call.
#[doc(hidden)]
#[must_use]
pub struct CallGuard(bool);

impl Drop for CallGuard {
    fn drop(&mut self) {
        if self.0 {
            CALL_LOCK.with(|c| c.borrow_mut().take());
            HELD.set(Held::None);
        }
    }
}

/// Runs `wait` with this thread's call's share of the lock let go, and takes it again after.
/// For a call that blocks on other threads' progress (the collectives of ranks that are threads
/// of one process, `LocalGroup`): another rank may be making an update (a broadcast's `set`),
/// which would otherwise wait for this call while this call waits for that rank. An update that
/// runs meanwhile is not isolated from this call. Outside a call, `wait()` as it is.
#[doc(hidden)]
pub fn release_call_while<R>(wait: impl FnOnce() -> R) -> R {
    let held = CALL_LOCK.with(|c| c.borrow_mut().take());
    if held.is_none() {
        return wait();
    }
    drop(held);
    let out = wait();
    let guard = acquire_shared();
    CALL_LOCK.with(|c| *c.borrow_mut() = Some(guard));
    out
}

/// Enters a call: the shared lock when this thread holds nothing yet, else only a flag read.
#[doc(hidden)]
#[inline]
pub fn enter_call() -> CallGuard {
    if HELD.get() != Held::None {
        return CallGuard(false);
    }
    enter_outermost_call()
}

#[cold]
#[inline(never)]
fn enter_outermost_call() -> CallGuard {
    let guard = acquire_shared();
    CALL_LOCK.with(|c| *c.borrow_mut() = Some(guard));
    HELD.set(Held::Call);
    CallGuard(true)
}

/// A call's share of the lock.
fn acquire_shared() -> RwLockReadGuard<'static, ()> {
    match LOCK.try_read_for(CALL_WAIT) {
        Some(guard) => guard,
        // A pending update still waiting after `CALL_WAIT`: join the calls running, whose helper
        // this thread may be. (It still waits while an update holds the lock.)
        None => LOCK.read_recursive(),
    }
}

struct UpdateGuard(Option<RwLockWriteGuard<'static, ()>>);

impl Drop for UpdateGuard {
    fn drop(&mut self) {
        if self.0.is_some() {
            HELD.set(Held::None);
        }
    }
}

/// Runs `update` as one atomic weight update: every top-level call on another thread sees either
/// none of its writes or all of them (see the module docs for what is covered). Waits for the calls
/// running to finish, and holds new ones back until `update` returns, so put only the writes
/// inside it: read and convert the new values before.
///
/// Updates nest (an update inside one is part of it), and inside a call `update` runs as it is
/// (the call's thread cannot wait for itself). `load_state_dict` and each parameter's and buffer's
/// own writes are updates already: this is for several of them together.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::atomic_update;
///
/// let dev = Device::Cpu;
/// let model = Linear::new(4, 2, &dev)?;
/// let (w, b) = (Tensor::ones((2, 4), DType::F32, &dev)?, Tensor::zeros(2, DType::F32, &dev)?);
/// // Another thread calling `model` sees the old weight and bias, or the new ones, never a mix.
/// atomic_update(|| {
///     model.weight.set(&w)?;
///     model.bias.as_ref().unwrap().set(&b)
/// })?;
/// assert_eq!(model.call(&Tensor::ones((1, 4), DType::F32, &dev)?)?.to_vec2::<f32>()?, [[4., 4.]]);
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub fn atomic_update<R>(update: impl FnOnce() -> R) -> R {
    let _guard = match HELD.get() {
        Held::None => {
            let guard = LOCK.write();
            HELD.set(Held::Update);
            UpdateGuard(Some(guard))
        }
        Held::Call | Held::Update => UpdateGuard(None),
    };
    update()
}
