//! Gradient recording on or off for a scope: PyTorch's `torch.no_grad()` and `torch.enable_grad()`.
//!
//! candle records an operation for backpropagation when one of its inputs is a variable (a `Var`)
//! or was computed from one. A [`Param`](crate::Param) is a `Var`, so a forward pass through an
//! unfrozen model records every operation — and the runtime's layers must then take the
//! differentiable (unfused) path. Under [`no_grad`], parameters read as tensors that record
//! nothing, exactly as frozen ones do, so inference runs the fused kernels and keeps no graph,
//! without freezing anything: [`freeze`](../module_runtime/trait.ModuleExt.html#method.freeze) stays the tool for fine-tuning.
//!
//! The mode is per thread, like PyTorch's: a guard on one thread changes nothing on another, and a
//! thread starts with gradients enabled. Guards nest: each restores, when dropped, the mode that
//! was current when it was made — also when the scope is left by a panic.
//!
//! Differences from PyTorch: the mode governs what reading a `Param` gives (the value of a
//! [`Param::tensor`](crate::Param::tensor) call), not candle's operations themselves — a `Var` you
//! hold yourself still records under `no_grad`. There is no separate `inference_mode`: candle has no
//! version counters to skip, so `no_grad` already is the fast path ([`inference_mode`] is an alias
//! for PyTorch users).

use std::cell::Cell;
use std::marker::PhantomData;

thread_local! {
    static GRAD_ENABLED: Cell<bool> = const { Cell::new(true) };
}

/// Whether parameters read on this thread record gradients (PyTorch's `torch.is_grad_enabled()`).
/// `true` unless a [`no_grad`] guard is alive on this thread (and no [`enable_grad`] guard made
/// after it).
#[inline]
pub fn is_grad_enabled() -> bool {
    GRAD_ENABLED.with(Cell::get)
}

/// Sets the mode for as long as the guard lives; dropping it restores the previous one.
///
/// Made by [`no_grad`] and [`enable_grad`]. It is bound to the thread that made it (neither `Send`
/// nor `Sync`), since the mode it restores is that thread's.
#[must_use = "the mode is restored when the guard is dropped: bind it, `let _guard = no_grad();`"]
pub struct GradModeGuard {
    previous: bool,
    _thread_bound: PhantomData<*const ()>,
}

impl GradModeGuard {
    fn set(enabled: bool) -> Self {
        let previous = GRAD_ENABLED.with(|g| g.replace(enabled));
        Self {
            previous,
            _thread_bound: PhantomData,
        }
    }
}

impl Drop for GradModeGuard {
    fn drop(&mut self) {
        GRAD_ENABLED.with(|g| g.set(self.previous));
    }
}

impl std::fmt::Debug for GradModeGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GradModeGuard")
            .field("restores_grad_enabled", &self.previous)
            .finish()
    }
}

/// Turns gradient recording off on this thread until the guard is dropped: PyTorch's
/// `with torch.no_grad():`. Use it with [`eval`](../module_runtime/trait.ModuleExt.html#method.eval) for inference.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::{is_grad_enabled, no_grad};
///
/// let model = Linear::new(4, 2, &Device::Cpu)?;
/// model.eval();
/// let x = Tensor::ones((3, 4), DType::F32, &Device::Cpu)?;
/// let y = {
///     let _guard = no_grad();
///     assert!(!is_grad_enabled());
///     model.call(&x)? // no graph is recorded; the fused kernels run
/// };
/// assert!(is_grad_enabled());
/// assert!(!y.track_op());
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub fn no_grad() -> GradModeGuard {
    GradModeGuard::set(false)
}

/// Turns gradient recording back on inside a [`no_grad`] scope until the guard is dropped:
/// PyTorch's `torch.enable_grad()`.
pub fn enable_grad() -> GradModeGuard {
    GradModeGuard::set(true)
}

/// The same as [`no_grad`], under the name PyTorch users write for inference
/// (`torch.inference_mode()`). candle keeps no version counters, so there is nothing more to skip.
pub fn inference_mode() -> GradModeGuard {
    no_grad()
}

/// Runs `f` with gradient recording off on this thread (a [`no_grad`] guard around the call).
///
/// ```
/// use module_runtime::prelude::*;
///
/// let model = Linear::new(4, 2, &Device::Cpu)?;
/// let x = Tensor::ones((3, 4), DType::F32, &Device::Cpu)?;
/// let y = module_runtime::without_grad(|| model.call(&x))?;
/// assert!(!y.track_op());
/// assert!(model.call(&x)?.track_op()); // outside, the graph is recorded again
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub fn without_grad<R>(f: impl FnOnce() -> R) -> R {
    let _guard = no_grad();
    f()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guards_nest_and_restore_in_order() {
        assert!(is_grad_enabled());
        let outer = no_grad();
        assert!(!is_grad_enabled());
        {
            let _inner = enable_grad();
            assert!(is_grad_enabled());
            let _again = no_grad();
            assert!(!is_grad_enabled());
        }
        assert!(!is_grad_enabled());
        drop(outer);
        assert!(is_grad_enabled());
    }
}
