//! The one cell a [`Param`](crate::Param) and a [`Buffer`](crate::Buffer) keep their value in,
//! eager or lazy: a lock around the current value and, for lazy ones, the recipe that builds it
//! once ([`Init`], [`LazyShape`]).

use std::cell::Cell;
use std::fmt;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

use candle_core::{DType, Device, Shape, Tensor, Var};

use crate::error::{Error, Result};
use crate::lazy_shape::LazyShape;
use crate::random;

/// What a cell holds: a `Var` (parameters) or a `Tensor` (buffers).
pub trait CellValue: Sized {
    /// The value as a tensor.
    fn as_tensor(&self) -> &Tensor;
    /// A new value holding `t`.
    fn from_tensor(t: Tensor) -> Result<Self>;
}

impl CellValue for Var {
    fn as_tensor(&self) -> &Tensor {
        Var::as_tensor(self)
    }
    fn from_tensor(t: Tensor) -> Result<Self> {
        Ok(Var::from_tensor(&t)?)
    }
}

impl CellValue for Tensor {
    fn as_tensor(&self) -> &Tensor {
        self
    }
    fn from_tensor(t: Tensor) -> Result<Self> {
        // A buffer's own storage, writable in place; readers see it detached.
        Ok(own_storage(&t))
    }
}

/// A value behind a lock, with the lazy state of an unbuilt one.
pub struct LazyCell<T> {
    value: RwLock<T>,
    /// Present for lazy values only, so reading an eager one costs nothing more.
    lazy: Option<Box<LazyState>>,
}

impl<T: CellValue> LazyCell<T> {
    /// A built cell holding `value`.
    pub fn eager(value: T) -> Self {
        Self {
            value: RwLock::new(value),
            lazy: None,
        }
    }

    /// A cell of shape `shape` holding `init`'s value (given the layer's `fan_in`) — or, under
    /// [`empty_weights`], an unbuilt cell of that exact shape that only a load can fill.
    pub fn init(
        shape: &Shape,
        init: Init,
        fan_in: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        if deferring() {
            return Self::lazy(
                LazyShape::new(shape.dims().iter().map(|&d| Some(d))),
                init,
                dtype,
                device,
            );
        }
        Ok(Self::eager(T::from_tensor(
            init.tensor(shape, fan_in, dtype, device)?,
        )?))
    }

    /// An unbuilt cell: an empty `[0]` placeholder of `dtype` on `device` until it is built with a
    /// shape `shape` accepts. Made under [`empty_weights`], it awaits a load: materializing it from
    /// its recipe is an error ([`Error::NotLoaded`]).
    pub fn lazy(shape: LazyShape, init: Init, dtype: DType, device: &Device) -> Result<Self> {
        Ok(Self {
            value: RwLock::new(T::from_tensor(Tensor::zeros(0, dtype, device)?)?),
            lazy: Some(LazyState::new(shape, init, deferring())),
        })
    }

    pub fn read(&self) -> RwLockReadGuard<'_, T> {
        // A panic while holding the lock cannot leave a half-written value (assignment is the last
        // step of every write), so a poisoned lock is safe to use.
        self.value.read().unwrap_or_else(PoisonError::into_inner)
    }

    pub fn write(&self) -> RwLockWriteGuard<'_, T> {
        self.value.write().unwrap_or_else(PoisonError::into_inner)
    }

    /// Swaps in a new value, for every alias at once.
    pub fn replace(&self, value: T) {
        *self.write() = value;
    }

    pub fn dtype(&self) -> DType {
        self.read().as_tensor().dtype()
    }

    pub fn device(&self) -> Device {
        self.read().as_tensor().device().clone()
    }

    pub fn is_built(&self) -> bool {
        self.lazy.as_ref().is_none_or(|l| l.is_built())
    }

    pub fn lazy_shape(&self) -> Option<LazyShape> {
        self.lazy.as_ref().and_then(|l| l.shape())
    }

    fn unbuilt(&self) -> Option<&LazyState> {
        self.lazy.as_deref().filter(|l| !l.is_built())
    }

    /// The error for reading the values of an unbuilt cell (`what` is `"parameter"` or
    /// `"buffer"`), or `None` when it is built.
    pub fn unbuilt_error(&self, what: &'static str) -> Option<Error> {
        let lazy = self.unbuilt()?;
        Some(Error::NotLoaded {
            what,
            shape: lazy.shape().map(|s| s.to_string()).unwrap_or_default(),
            awaits_load: lazy.awaits_load,
        })
    }

    /// Takes `value` as the cell's new value (a load with `assign`): an unbuilt cell is built from
    /// it if its layout accepts the shape; a built one must have the shape already. The dtype is
    /// `value`'s, whatever the cell held.
    pub fn assign(&self, value: Tensor) -> Result<()> {
        if let Some(lazy) = self.unbuilt() {
            let built = lazy.build_once(|recipe| {
                check_accepts(&recipe.shape, value.dims())?;
                self.replace(T::from_tensor(value.clone())?);
                Ok(())
            })?;
            if built {
                return Ok(());
            }
        }
        let current = self.read().as_tensor().shape().clone();
        if *value.shape() != current {
            return Err(Error::LazyShape {
                expected: format!("{:?}", current.dims()),
                shape: value.shape().clone(),
            });
        }
        self.replace(T::from_tensor(value)?);
        Ok(())
    }

    /// Builds an unbuilt cell with shape `dims` from its recipe (given the layer's `fan_in`), once.
    /// A built cell is left alone: the caller checks its dims.
    pub fn materialize(&self, dims: &[usize], fan_in: usize) -> Result<()> {
        if let Some(lazy) = self.unbuilt() {
            if lazy.awaits_load {
                return Err(Error::NotLoaded {
                    what: "parameter",
                    shape: format!("{dims:?}"),
                    awaits_load: true,
                });
            }
            lazy.build_once(|recipe| {
                check_accepts(&recipe.shape, dims)?;
                let shape = Shape::from(dims.to_vec());
                let value = recipe
                    .init
                    .tensor(&shape, fan_in, self.dtype(), &self.device())?;
                self.replace(T::from_tensor(value)?);
                Ok(())
            })?;
        }
        Ok(())
    }

    /// Builds an unbuilt cell as one of shape `dims` that holds `stand_in` (a quantized
    /// parameter's empty stand-in: its values live in the quantized weight), its recipe unused:
    /// `dims` must be a shape it accepts. Returns whether this call built it; `false` for a built
    /// cell.
    pub fn build_as(&self, dims: &[usize], stand_in: T) -> Result<bool> {
        let Some(lazy) = self.unbuilt() else {
            return Ok(false);
        };
        lazy.build_once(|recipe| {
            check_accepts(&recipe.shape, dims)?;
            self.replace(stand_in);
            Ok(())
        })
    }

    /// Builds an unbuilt cell from `value` (its recipe unused): the shape must be one it accepts and
    /// the dtype its own. Returns whether this call built it; `false` for a built cell.
    pub fn build_from(&self, value: &Tensor) -> Result<bool> {
        let Some(lazy) = self.unbuilt() else {
            return Ok(false);
        };
        lazy.build_once(|recipe| {
            check_accepts(&recipe.shape, value.dims())?;
            if value.dtype() != self.dtype() {
                return Err(Error::ValueMismatch {
                    expected_shape: value.shape().clone(),
                    expected_dtype: self.dtype(),
                    shape: value.shape().clone(),
                    dtype: value.dtype(),
                });
            }
            self.replace(T::from_tensor(value.to_device(&self.device())?)?);
            Ok(())
        })
    }
}

fn check_accepts(shape: &LazyShape, dims: &[usize]) -> Result<()> {
    if shape.accepts(dims) {
        return Ok(());
    }
    Err(Error::LazyShape {
        expected: shape.to_string(),
        shape: Shape::from(dims.to_vec()),
    })
}

/// [`Error::ValueMismatch`] unless `value` has `current`'s shape and dtype: what a write into an
/// existing tensor needs.
pub fn check_same_layout(current: &Tensor, value: &Tensor) -> Result<()> {
    if value.shape() != current.shape() || value.dtype() != current.dtype() {
        return Err(Error::ValueMismatch {
            expected_shape: current.shape().clone(),
            expected_dtype: current.dtype(),
            shape: value.shape().clone(),
            dtype: value.dtype(),
        });
    }
    Ok(())
}

/// `t`, the value of a parameter or buffer that is now built, if it has the `dims` an input asked
/// for; otherwise the error that says it was built with other ones.
pub fn check_built_dims(t: Tensor, dims: &[usize]) -> Result<Tensor> {
    if t.dims() != dims {
        return Err(Error::LazyShape {
            expected: format!("{:?}", t.dims()),
            shape: Shape::from(dims.to_vec()),
        });
    }
    Ok(t)
}

/// A custom initializer: `(shape, fan_in, dtype, device) -> value`.
pub type InitFn = dyn Fn(&Shape, usize, DType, &Device) -> Result<Tensor> + Send + Sync;

/// How an unbuilt parameter or buffer gets its first value when it is materialized.
///
/// The recipe runs with the full shape, the layer's `fan_in` (which a bias cannot infer from its
/// own shape: PyTorch bounds a `Linear` bias by the weight's fan-in) and the dtype and device the
/// value was last moved to.
///
/// The random recipes draw from the runtime's generator ([`manual_seed`](crate::manual_seed)),
/// on the CPU, and move the values to the device: a seed gives the same values on every device.
/// A `Custom` recipe that should be reproducible draws with [`rand`](crate::rand) and
/// [`randn`](crate::randn) too.
#[derive(Clone)]
pub enum Init {
    /// All zeros.
    Zeros,
    /// All ones.
    Ones,
    /// Uniform on `±1/sqrt(fan_in)`: PyTorch's default for `Linear` and convolution weights and
    /// biases.
    UniformFanIn,
    /// Uniform on `[low, high)` (PyTorch's `nn.init.uniform_`; Xavier's uniform with
    /// `±sqrt(6 / (fan_in + fan_out))`).
    Uniform {
        /// The lower bound.
        low: f64,
        /// The upper bound.
        high: f64,
    },
    /// Normal with mean `mean` and standard deviation `std` (PyTorch's `nn.init.normal_`;
    /// `Embedding`'s default is `N(0, 1)`).
    Normal {
        /// The mean.
        mean: f64,
        /// The standard deviation.
        std: f64,
    },
    /// Any function of the shape, fan-in, dtype and device.
    Custom(Arc<InitFn>),
}

impl Init {
    /// The initial value of shape `shape`.
    pub fn tensor(
        &self,
        shape: &Shape,
        fan_in: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Tensor> {
        Ok(match self {
            Init::Zeros => Tensor::zeros(shape, dtype, device)?,
            Init::Ones => Tensor::ones(shape, dtype, device)?,
            Init::UniformFanIn => {
                let bound = 1.0 / (fan_in.max(1) as f64).sqrt();
                random::rand(-bound, bound, shape, dtype, &Device::Cpu)?.to_device(device)?
            }
            Init::Uniform { low, high } => {
                random::rand(*low, *high, shape, dtype, &Device::Cpu)?.to_device(device)?
            }
            Init::Normal { mean, std } => {
                random::randn(*mean, *std, shape, dtype, &Device::Cpu)?.to_device(device)?
            }
            Init::Custom(f) => {
                let t = f(shape, fan_in, dtype, device)?;
                if t.shape() != shape {
                    return Err(Error::LazyShape {
                        expected: format!("{:?}", shape.dims()),
                        shape: t.shape().clone(),
                    });
                }
                t.to_dtype(dtype)?.to_device(device)?
            }
        })
    }
}

impl fmt::Debug for Init {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Init::Zeros => "Zeros",
            Init::Ones => "Ones",
            Init::UniformFanIn => "UniformFanIn",
            Init::Uniform { low, high } => return write!(f, "Uniform({low}, {high})"),
            Init::Normal { mean, std } => return write!(f, "Normal({mean}, {std})"),
            Init::Custom(_) => "Custom(..)",
        })
    }
}

/// The lazy part of a `Param` or `Buffer`: whether it is built, and how to build it.
///
/// The dtype and device to build with are not stored here: they are those of the placeholder the
/// parameter holds while unbuilt, so `to_device`/`to_dtype` record them without knowing about
/// laziness.
struct LazyState {
    /// Read on every use of a built lazy value: one atomic load.
    built: AtomicBool,
    /// Made under [`empty_weights`]: only a load may build it, never its recipe.
    awaits_load: bool,
    /// Serializes building: held while the first value is made and committed.
    recipe: Mutex<Recipe>,
}

struct Recipe {
    shape: LazyShape,
    init: Init,
}

impl LazyState {
    pub fn new(shape: LazyShape, init: Init, awaits_load: bool) -> Box<Self> {
        Box::new(Self {
            built: AtomicBool::new(false),
            awaits_load,
            recipe: Mutex::new(Recipe { shape, init }),
        })
    }

    pub fn is_built(&self) -> bool {
        self.built.load(Ordering::Acquire)
    }

    /// The shape it will have, while unbuilt.
    pub fn shape(&self) -> Option<LazyShape> {
        if self.is_built() {
            return None;
        }
        let recipe = self.lock();
        (!self.is_built()).then(|| recipe.shape.clone())
    }

    /// Runs `build` (which commits the first value) unless another thread built it first, then
    /// marks it built. Returns whether this call built it. An error leaves it unbuilt.
    pub fn build_once(&self, build: impl FnOnce(&Recipe) -> Result<()>) -> Result<bool> {
        let recipe = self.lock();
        if self.is_built() {
            return Ok(false);
        }
        build(&recipe)?;
        self.built.store(true, Ordering::Release);
        Ok(true)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Recipe> {
        // The recipe is never written after construction, so a panic cannot leave it half-written.
        self.recipe.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

thread_local! {
    static DEFERRING: Cell<bool> = const { Cell::new(false) };
}

/// Whether parameters and buffers made now on this thread are left empty for a load.
pub fn deferring() -> bool {
    DEFERRING.with(Cell::get)
}

/// While the guard lives, models built on this thread get *empty* parameters and buffers that a
/// checkpoint load fills: build only to load. PyTorch's `with torch.device("meta"):` followed by
/// `load_state_dict(sd, assign=True)`, or Hugging Face accelerate's `init_empty_weights()`.
///
/// Under the guard, every parameter or buffer a layer makes from an [`Init`] recipe
/// ([`Param::init`](crate::Param::init), [`Buffer::init`](crate::Buffer::init), and all of this
/// crate's layers) is created unbuilt with its full shape: no random numbers are drawn and no
/// memory is allocated for values about to be overwritten. A load then builds each one from the
/// checkpoint's value — a strict load still reports missing, unexpected and mismatched keys, and a
/// failed load leaves the model empty. Reading a parameter that was never loaded, or calling a layer
/// holding one, is [`Error::NotLoaded`]; so is building it from its recipe (a lazy layer's first
/// call).
///
/// Values given explicitly (`Param::new(tensor)`, `Buffer::new(tensor)`) are kept as they are:
/// they are already computed.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::{empty_weights, StateDict};
///
/// let trained = Linear::new(4, 2, &Device::Cpu)?;
/// let state = trained.state_dict()?;
///
/// let model = {
///     let _guard = empty_weights();
///     Linear::new(4, 2, &Device::Cpu)? // no values drawn
/// };
/// let x = Tensor::ones((1, 4), DType::F32, &Device::Cpu)?;
/// let err = model.call(&x).unwrap_err();
/// assert!(matches!(err.inner(), Error::NotLoaded { .. }), "{err}");
/// model.load_state_dict(&state, &LoadOptions::default())?; // strict: every key must be there
/// assert_eq!(model.call(&x)?.to_vec2::<f32>()?, trained.call(&x)?.to_vec2::<f32>()?);
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub fn empty_weights() -> EmptyWeightsGuard {
    EmptyWeightsGuard {
        previous: DEFERRING.with(|d| d.replace(true)),
        _thread_bound: PhantomData,
    }
}

/// Runs `build` under [`empty_weights`]: the model it returns holds no values until loaded.
///
/// ```
/// use module_runtime::prelude::*;
/// let model = module_runtime::build_empty(|| Linear::new(384, 384, &Device::Cpu))?;
/// assert!(!model.weight.is_built());
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub fn build_empty<R>(build: impl FnOnce() -> R) -> R {
    let _guard = empty_weights();
    build()
}

/// The guard [`empty_weights`] returns: restores the previous mode when dropped (also during a
/// panic). Bound to its thread.
#[must_use = "models are built empty only while the guard lives: `let _guard = empty_weights();`"]
pub struct EmptyWeightsGuard {
    previous: bool,
    _thread_bound: PhantomData<*const ()>,
}

impl Drop for EmptyWeightsGuard {
    fn drop(&mut self) {
        DEFERRING.with(|d| d.set(self.previous));
    }
}

impl fmt::Debug for EmptyWeightsGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EmptyWeightsGuard").finish_non_exhaustive()
    }
}

/// A copy of `value` in storage of its own, held as a candle variable so that `Buffer::set` can
/// write into it in place. Falls back to the value itself (detached) if the copy cannot be
/// allocated; `set` then takes a copy at the next write.
pub fn own_storage(value: &Tensor) -> Tensor {
    match Var::from_tensor(&value.detach()) {
        Ok(var) => var.into_inner(),
        Err(_) => value.detach(),
    }
}

/// Whether `e` is candle's refusal to set a variable (e.g. from a view of itself).
pub fn is_cannot_set(e: &candle_core::Error) -> bool {
    match e {
        candle_core::Error::CannotSetVar { .. } => true,
        candle_core::Error::WithBacktrace { inner, .. } => is_cannot_set(inner),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lazy_shape_display_and_accepts() {
        let s = LazyShape::new([None, Some(3), None]);
        assert_eq!(s.to_string(), "[?, 3, ?]");
        assert!(s.accepts(&[1, 3, 9]));
        assert!(!s.accepts(&[1, 4, 9]));
        assert!(!s.accepts(&[1, 3]));
        assert!(check_accepts(&s, &[2, 2, 2]).is_err());
    }

    #[test]
    fn custom_init_must_give_the_shape() {
        let bad = Init::Custom(Arc::new(|_, _, dtype, dev| {
            Ok(Tensor::zeros(3, dtype, dev)?)
        }));
        let err = bad
            .tensor(&Shape::from((2, 2)), 2, DType::F32, &Device::Cpu)
            .unwrap_err();
        assert!(err.to_string().contains("[2, 2]"), "{err}");
    }
}
