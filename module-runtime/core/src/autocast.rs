//! Mixed precision for a scope: PyTorch's `torch.autocast(device_type, dtype, enabled,
//! cache_enabled)`.
//!
//! Inside [`autocast`] the runtime's operations choose their own precision per op, as PyTorch's
//! autocast does: products and convolutions run in the autocast dtype (bfloat16 or float16),
//! the ops PyTorch lists as needing range or precision (losses, and on CUDA softmax, norms and
//! reductions) run in float32, and everything else runs in the dtype of its inputs. The table of
//! which op does what is [`AutocastOp`](crate::autocast_policy::AutocastOp); this file is the
//! per-thread setting.
//!
//! The setting is per thread and per device type (`"cpu"`, `"cuda"`), like PyTorch's: an
//! `autocast("cpu", …)` scope changes only what CPU tensors do, on the thread that runs it. A
//! thread starts with autocast off; the kernels that split work over the barrier pool read the
//! setting on the calling thread, before they split. Scopes nest: each puts back, when it ends,
//! what was set before it (also when a panic unwinds through it), so an
//! `Autocast::new("cpu").enabled(false)` scope inside an enabled one runs its body in full
//! precision, as PyTorch's `torch.autocast("cpu", enabled=False)` does.
//!
//! # The weight cache
//!
//! As PyTorch does, the low-precision copy of a float32 parameter that records gradients (a
//! candle `Var`, PyTorch's leaf with `requires_grad`) is made once per outermost scope and
//! reused by every op that reads it there: a weight used by several products, or by every step of
//! a loop inside one scope, is cast once. The cache is emptied when the outermost scope on the
//! thread ends (PyTorch's `autocast_decrement_nesting() == 0`). Like PyTorch's, it does not see a
//! parameter changed in place inside the scope: step the optimizer outside `autocast`, as
//! PyTorch's documentation says. A parameter read under [`no_grad`](crate::no_grad) is a tensor
//! that records nothing and is cast on each use (PyTorch caches it there too; the values are the
//! same). `cache_enabled(false)` turns the cache off for a scope. Bfloat16 `Linear` products on
//! the AVX512-BF16 kernel need no copy: the kernel rounds a float32 parameter as it reads it (the
//! values of the cast) and hands its gradient back in float32, so there is no cast in the graph
//! and nothing is cached for them.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;

use candle_core::{DType, Device, Tensor, TensorId};

use crate::error::{Error, Result};

/// The device types autocast knows: PyTorch's `device_type` strings `"cpu"` and `"cuda"`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DeviceType {
    /// `"cpu"`: the CPU's lists (bfloat16 by default; float16 too).
    Cpu,
    /// `"cuda"`: the CUDA lists (float16 by default; bfloat16 too).
    Cuda,
}

impl DeviceType {
    /// The device type named as PyTorch names it (`"cpu"`, `"cuda"`); a typed error for any
    /// other name (PyTorch's `mps`, `xpu`, … lists are not implemented: candle's Metal device
    /// is not autocast).
    pub fn parse(device_type: &str) -> Result<Self> {
        match device_type {
            "cpu" => Ok(Self::Cpu),
            "cuda" => Ok(Self::Cuda),
            other => Err(Error::InvalidConfig {
                layer: "autocast",
                message: format!(
                    "device_type must be \"cpu\" or \"cuda\", got {other:?} (Metal tensors are \
                     not autocast)"
                ),
            }),
        }
    }

    /// The device type of a tensor on `device`, or `None` (Metal) where autocast never applies.
    pub fn of(device: &Device) -> Option<Self> {
        match device {
            Device::Cpu => Some(Self::Cpu),
            Device::Cuda(_) => Some(Self::Cuda),
            Device::Metal(_) => None,
        }
    }

    /// PyTorch's default autocast dtype for the device type (`torch.get_autocast_dtype` when
    /// never set): bfloat16 on the CPU, float16 on CUDA.
    pub fn default_dtype(self) -> DType {
        match self {
            Self::Cpu => DType::BF16,
            Self::Cuda => DType::F16,
        }
    }
}

thread_local! {
    static CPU: Cell<(bool, DType)> = const { Cell::new((false, DType::BF16)) };
    static CUDA: Cell<(bool, DType)> = const { Cell::new((false, DType::F16)) };
    static CACHE_ENABLED: Cell<bool> = const { Cell::new(true) };
    static NESTING: Cell<usize> = const { Cell::new(0) };
    static CACHE: RefCell<HashMap<(TensorId, &'static str), Tensor>> = RefCell::new(HashMap::new());
}

fn slot(device_type: DeviceType) -> &'static std::thread::LocalKey<Cell<(bool, DType)>> {
    match device_type {
        DeviceType::Cpu => &CPU,
        DeviceType::Cuda => &CUDA,
    }
}

/// The autocast dtype when autocast is on for `device_type` on this thread, else `None`: what an
/// op consults. One thread-local read.
#[inline]
pub fn active_dtype(device_type: DeviceType) -> Option<DType> {
    let (enabled, dtype) = slot(device_type).with(Cell::get);
    enabled.then_some(dtype)
}

/// Whether autocast is on for `device_type` (`"cpu"`, `"cuda"`) on this thread: PyTorch's
/// `torch.is_autocast_enabled(device_type)`. `false` for a device type autocast does not know.
///
/// ```
/// use module_runtime::amp::{autocast, is_autocast_enabled};
/// use module_runtime::candle_core::DType;
/// assert!(!is_autocast_enabled("cpu"));
/// autocast("cpu", DType::BF16, || {
///     assert!(is_autocast_enabled("cpu"));
///     assert!(!is_autocast_enabled("cuda"));
///     Ok::<_, module_runtime::Error>(())
/// })?;
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub fn is_autocast_enabled(device_type: &str) -> bool {
    DeviceType::parse(device_type).is_ok_and(|d| active_dtype(d).is_some())
}

/// The dtype autocast casts to on `device_type` on this thread: PyTorch's
/// `torch.get_autocast_dtype(device_type)`, the last one a scope set (kept while a nested scope
/// disables autocast), else the default (bfloat16 on `"cpu"`, float16 on `"cuda"`). A typed error
/// for a device type autocast does not know.
pub fn get_autocast_dtype(device_type: &str) -> Result<DType> {
    let device_type = DeviceType::parse(device_type)?;
    Ok(slot(device_type).with(Cell::get).1)
}

/// Runs `f` with autocast on for `device_type` (`"cpu"` or `"cuda"`) in `dtype` (`BF16` or
/// `F16`): PyTorch's `with torch.autocast(device_type, dtype=dtype):`. The shorthand of
/// [`Autocast::run`]; see the module docs for what it changes.
///
/// ```
/// use module_runtime::amp::autocast;
/// use module_runtime::prelude::*;
///
/// let fc = Linear::new(4, 3, &Device::Cpu)?;
/// let x = Tensor::ones((2, 4), DType::F32, &Device::Cpu)?;
/// let y = autocast("cpu", DType::BF16, || fc.call(&x))?;
/// assert_eq!(y.dtype(), DType::BF16); // the product ran in bfloat16
/// assert_eq!(fc.weight.dtype(), DType::F32); // the parameters stay float32
/// assert_eq!(fc.call(&x)?.dtype(), DType::F32); // nothing changes outside the scope
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub fn autocast<T, E: Into<Error>>(
    device_type: &str,
    dtype: DType,
    f: impl FnOnce() -> std::result::Result<T, E>,
) -> Result<T> {
    Autocast::new(device_type).dtype(dtype).run(f)
}

/// An autocast scope's settings, PyTorch's `torch.autocast(device_type, dtype=None, enabled=True,
/// cache_enabled=True)` arguments, run with [`run`](Self::run).
///
/// ```
/// use module_runtime::amp::{Autocast, is_autocast_enabled};
/// use module_runtime::prelude::*;
///
/// let fc = Linear::new(4, 3, &Device::Cpu)?;
/// let x = Tensor::ones((2, 4), DType::F32, &Device::Cpu)?;
/// let (inner, outer) = Autocast::new("cpu").run(|| {
///     // `torch.autocast("cpu", enabled=False)` inside: full precision again.
///     let inner = Autocast::new("cpu").enabled(false).run(|| fc.call(&x))?;
///     Ok::<_, Error>((inner, fc.call(&x)?))
/// })?;
/// assert_eq!((inner.dtype(), outer.dtype()), (DType::F32, DType::BF16));
/// # Ok::<(), module_runtime::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct Autocast {
    device_type: String,
    dtype: Option<DType>,
    enabled: bool,
    cache_enabled: bool,
}

impl Autocast {
    /// Autocast on `device_type` (`"cpu"`, `"cuda"`; checked by [`run`](Self::run)), in the
    /// thread's current autocast dtype (the device type's default, bfloat16 on the CPU and
    /// float16 on CUDA, unless an enclosing scope set another) unless [`dtype`](Self::dtype)
    /// says otherwise, enabled, with the weight cache.
    pub fn new(device_type: &str) -> Self {
        Self {
            device_type: device_type.to_owned(),
            dtype: None,
            enabled: true,
            cache_enabled: true,
        }
    }

    /// The low-precision dtype (`dtype`): `BF16` or `F16` (both device types take both, as
    /// PyTorch's CPU autocast does since 2.x); any other is refused by [`run`](Self::run).
    pub fn dtype(mut self, dtype: DType) -> Self {
        self.dtype = Some(dtype);
        self
    }

    /// Whether the scope turns autocast on (`enabled`, default `true`); `false` turns it off for
    /// the scope, inside an enabled one.
    pub fn enabled(mut self, enabled: bool) -> Self {
        self.enabled = enabled;
        self
    }

    /// Whether the scope caches the casts of float32 parameters (`cache_enabled`, default
    /// `true`).
    pub fn cache_enabled(mut self, cache_enabled: bool) -> Self {
        self.cache_enabled = cache_enabled;
        self
    }

    /// Runs `f` under these settings and puts back the previous ones afterwards (also when `f`
    /// panics). Errors, before `f` runs: a device type other than `"cpu"`/`"cuda"`, a dtype
    /// other than `BF16`/`F16` (PyTorch warns and disables autocast; a typed error is clearer).
    pub fn run<T, E: Into<Error>>(
        self,
        f: impl FnOnce() -> std::result::Result<T, E>,
    ) -> Result<T> {
        let device_type = DeviceType::parse(&self.device_type)?;
        // PyTorch's `dtype=None`: the dtype current on the thread (the default unless a scope
        // set another), so a nested `enabled(false)` keeps the outer scope's.
        let dtype = self
            .dtype
            .unwrap_or_else(|| slot(device_type).with(Cell::get).1);
        if !matches!(dtype, DType::BF16 | DType::F16) {
            return Err(Error::InvalidConfig {
                layer: "autocast",
                message: format!(
                    "dtype must be BF16 or F16 on {:?}, got {dtype:?}",
                    self.device_type
                ),
            });
        }
        let _guard = ScopeGuard::enter(device_type, self.enabled, dtype, self.cache_enabled);
        f().map_err(Into::into)
    }
}

/// What a scope replaced, put back on drop.
struct ScopeGuard {
    device_type: DeviceType,
    previous: (bool, DType),
    previous_cache_enabled: bool,
}

impl ScopeGuard {
    fn enter(device_type: DeviceType, enabled: bool, dtype: DType, cache_enabled: bool) -> Self {
        let previous = slot(device_type).with(|s| s.replace((enabled, dtype)));
        let previous_cache_enabled = CACHE_ENABLED.with(|c| c.replace(cache_enabled));
        NESTING.with(|n| n.set(n.get() + 1));
        Self {
            device_type,
            previous,
            previous_cache_enabled,
        }
    }
}

impl Drop for ScopeGuard {
    fn drop(&mut self) {
        let left = NESTING.with(|n| {
            n.set(n.get().saturating_sub(1));
            n.get()
        });
        if left == 0 {
            clear_autocast_cache();
        }
        slot(self.device_type).with(|s| s.set(self.previous));
        CACHE_ENABLED.with(|c| c.set(self.previous_cache_enabled));
    }
}

/// This thread's autocast settings (both device types, the cache flag), taken to run code later
/// as it would have run now: what `torch.utils.checkpoint` keeps of a forward so that its
/// recomputation in the backward, outside the scope, casts as the forward did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AutocastState {
    cpu: (bool, DType),
    cuda: (bool, DType),
    cache_enabled: bool,
}

impl AutocastState {
    /// The settings current on this thread.
    pub fn current() -> Self {
        Self {
            cpu: CPU.with(Cell::get),
            cuda: CUDA.with(Cell::get),
            cache_enabled: CACHE_ENABLED.with(Cell::get),
        }
    }

    /// Runs `f` under these settings (a scope of its own: its casts are cached for it alone),
    /// then puts back the thread's, also when `f` panics.
    pub fn run<R>(self, f: impl FnOnce() -> R) -> R {
        let _cpu = ScopeGuard::enter(DeviceType::Cpu, self.cpu.0, self.cpu.1, self.cache_enabled);
        let _cuda = ScopeGuard::enter(
            DeviceType::Cuda,
            self.cuda.0,
            self.cuda.1,
            self.cache_enabled,
        );
        f()
    }
}

/// Empties this thread's cache of parameter casts: PyTorch's `torch.clear_autocast_cache()`.
/// The outermost scope's end does it; call it inside a long scope after changing parameters in
/// place.
pub fn clear_autocast_cache() {
    // Taken out before dropping: a tensor's drop never re-enters the cache, but be safe.
    let cache = CACHE.with(|c| std::mem::take(&mut *c.borrow_mut()));
    drop(cache);
}

/// `t` in `dtype`, through the cache when it is a float32 `Var` cast to the low-precision dtype
/// inside a scope with the cache on (PyTorch's `cached_cast`).
pub(crate) fn cached_cast(t: &Tensor, dtype: DType, lower: DType) -> Result<Tensor> {
    if dtype != lower {
        return Ok(t.to_dtype(dtype)?);
    }
    let tag = if dtype == DType::BF16 { "bf16" } else { "f16" };
    autocast_cached(t, tag, |t| Ok(t.to_dtype(dtype)?))
}

/// `make(t)`, made once per outermost autocast scope when `t` is a float32 parameter that records
/// gradients (a candle `Var`) and the scope caches casts; `tag` tells apart the forms cached of
/// one parameter. What the kernels call for a form of a weight other than the plain cast (the
/// CPU products' weight rounded to the autocast dtype, kept in float32). Outside a scope, or for
/// any other tensor, `make(t)` each time.
pub fn autocast_cached(
    t: &Tensor,
    tag: &'static str,
    make: impl FnOnce(&Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    let cacheable = t.dtype() == DType::F32
        && t.is_variable()
        && CACHE_ENABLED.with(Cell::get)
        && NESTING.with(Cell::get) > 0;
    if !cacheable {
        return make(t);
    }
    if let Some(hit) = CACHE.with(|c| c.borrow().get(&(t.id(), tag)).cloned()) {
        return Ok(hit);
    }
    let made = make(t)?;
    CACHE.with(|c| c.borrow_mut().insert((t.id(), tag), made.clone()));
    Ok(made)
}

/// How many parameter casts this thread's cache holds (for tests and diagnostics).
pub fn autocast_cache_len() -> usize {
    CACHE.with(|c| c.borrow().len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scopes_nest_and_restore() -> Result<()> {
        assert_eq!(active_dtype(DeviceType::Cpu), None);
        autocast("cpu", DType::F16, || {
            assert_eq!(active_dtype(DeviceType::Cpu), Some(DType::F16));
            Autocast::new("cpu").enabled(false).run(|| {
                assert_eq!(active_dtype(DeviceType::Cpu), None);
                assert_eq!(get_autocast_dtype("cpu")?, DType::F16);
                Ok::<_, Error>(())
            })?;
            assert_eq!(active_dtype(DeviceType::Cuda), None);
            Ok::<_, Error>(())
        })?;
        assert_eq!(active_dtype(DeviceType::Cpu), None);
        assert_eq!(get_autocast_dtype("cpu")?, DType::BF16);
        Ok(())
    }

    #[test]
    fn another_thread_starts_with_autocast_off() -> Result<()> {
        autocast("cpu", DType::BF16, || {
            let other = std::thread::spawn(|| active_dtype(DeviceType::Cpu)).join();
            assert_eq!(other.ok(), Some(None));
            assert_eq!(active_dtype(DeviceType::Cpu), Some(DType::BF16));
            Ok::<_, Error>(())
        })
    }

    #[test]
    fn a_state_replays_later() -> Result<()> {
        let state = autocast("cpu", DType::F16, || {
            Ok::<_, Error>(AutocastState::current())
        })?;
        assert_eq!(active_dtype(DeviceType::Cpu), None);
        state.run(|| assert_eq!(active_dtype(DeviceType::Cpu), Some(DType::F16)));
        assert_eq!(active_dtype(DeviceType::Cpu), None);
        assert_eq!(NESTING.with(Cell::get), 0);
        Ok(())
    }

    #[test]
    fn bad_arguments_are_typed_errors() {
        let e = autocast("mps", DType::F16, || Ok::<_, Error>(())).unwrap_err();
        assert!(e.to_string().contains("\"mps\""), "{e}");
        let e = autocast("cpu", DType::F64, || Ok::<_, Error>(())).unwrap_err();
        assert!(e.to_string().contains("F64"), "{e}");
        assert!(get_autocast_dtype("tpu").is_err());
    }

    #[test]
    fn a_panic_restores_the_setting() {
        let caught = std::panic::catch_unwind(|| {
            autocast("cpu", DType::BF16, || -> Result<()> { panic!("inside") })
        });
        assert!(caught.is_err());
        assert_eq!(active_dtype(DeviceType::Cpu), None);
        assert_eq!(NESTING.with(Cell::get), 0);
    }

    #[test]
    fn the_cache_holds_vars_within_the_outermost_scope() -> Result<()> {
        let w = candle_core::Var::ones((2, 2), DType::F32, &Device::Cpu)?;
        let plain = Tensor::ones((2, 2), DType::F32, &Device::Cpu)?;
        autocast("cpu", DType::BF16, || {
            let a = cached_cast(w.as_tensor(), DType::BF16, DType::BF16)?;
            let b = cached_cast(w.as_tensor(), DType::BF16, DType::BF16)?;
            assert_eq!(a.id(), b.id());
            cached_cast(&plain, DType::BF16, DType::BF16)?;
            assert_eq!(autocast_cache_len(), 1);
            Ok::<_, Error>(())
        })?;
        assert_eq!(autocast_cache_len(), 0);
        Ok(())
    }
}
