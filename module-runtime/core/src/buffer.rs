//! Non-trainable module state.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use candle_core::{DType, Device, Shape, Tensor, Var};

use crate::error::Result;
use crate::identity::{self, ModeMarks};
use crate::lazy_cell::{
    check_built_dims, check_same_layout, is_cannot_set, own_storage, Init, LazyCell,
};
use crate::lazy_shape::LazyShape;
use crate::update_lock::atomic_update;

/// Non-trainable state of any dtype: PyTorch's `register_buffer`.
///
/// Running statistics, `position_ids`, masks. A buffer is saved in state dicts when it is
/// *persistent* (the default), and skipped when it is not (PyTorch's `persistent=False`); both kinds
/// are listed by `named_buffers` and moved by `to_device`.
///
/// Like [`Param`](crate::Param), a `Buffer` is a shared handle: a clone is the same buffer, and it
/// can be replaced through `&self` during a forward pass (BatchNorm updates its running statistics
/// this way). [`to_dtype`](../module_runtime/trait.ModuleExt.html#method.to_dtype) converts floating-point buffers only, so
/// integer buffers such as `position_ids` keep their dtype.
///
/// Like a [`Param`](crate::Param), a buffer may be lazy ([`Buffer::lazy`]): unbuilt, until it is
/// materialized with the shape the first input decides or the value a checkpoint holds. Reading
/// an unbuilt buffer ([`tensor`](Self::tensor)) is [`Error::NotLoaded`](crate::Error::NotLoaded);
/// its [`shape`](Self::shape) is `[0]` until then.
///
/// ```
/// use module_runtime::{Buffer, candle_core::{Device, Tensor, DType}};
/// let ids = Buffer::new(Tensor::arange(0i64, 4, &Device::Cpu)?);
/// assert_eq!(ids.dtype(), DType::I64);
/// assert!(ids.is_persistent());
/// # Ok::<(), module_runtime::Error>(())
/// ```
#[derive(Clone)]
pub struct Buffer(Arc<BufferInner>);

struct BufferInner {
    /// Train/eval flags of the modules this is the first leaf of.
    modes: ModeMarks,
    /// A variable tensor, so [`Buffer::set`] can write into its storage in place (candle's
    /// `Var::set`); readers get detached views of it, which take no part in autograd.
    value: LazyCell<Tensor>,
    persistent: bool,
    /// Whether a strict load accepts a checkpoint without this buffer (keeping its value).
    missing_ok: AtomicBool,
}

impl Buffer {
    /// A persistent buffer (saved in state dicts).
    pub fn new(value: Tensor) -> Self {
        Self::with_persistence(value, true)
    }

    /// A buffer that state dicts leave out (PyTorch's `persistent=False`).
    pub fn non_persistent(value: Tensor) -> Self {
        Self::with_persistence(value, false)
    }

    fn with_persistence(value: Tensor, persistent: bool) -> Self {
        Self(Arc::new(BufferInner {
            modes: ModeMarks::default(),
            value: LazyCell::eager(own_storage(&value)),
            persistent,
            missing_ok: AtomicBool::new(false),
        }))
    }

    /// Lets a strict load accept a checkpoint that lacks this buffer, keeping the buffer's value
    /// (the rule PyTorch's BatchNorm applies to `num_batches_tracked`, which checkpoints older than
    /// PyTorch 0.4.1 lack: `_NormBase._load_from_state_dict` in `torch/nn/modules/batchnorm.py`).
    /// Applies to every alias of the buffer.
    ///
    /// ```
    /// use module_runtime::{Buffer, LoadOptions, ModuleExt, StateDict};
    /// use module_runtime::candle_core::{Device, Tensor};
    /// #[derive(module_runtime::Module)]
    /// struct Counter { steps: Buffer }
    /// let c = Counter { steps: Buffer::new(Tensor::new(7i64, &Device::Cpu)?).allow_missing() };
    /// c.load_state_dict(&StateDict::new(), &LoadOptions::default())?; // strict, yet accepted
    /// assert_eq!(c.steps.tensor()?.to_scalar::<i64>()?, 7);
    /// # Ok::<(), module_runtime::Error>(())
    /// ```
    pub fn allow_missing(self) -> Self {
        self.0.missing_ok.store(true, Ordering::Relaxed);
        self
    }

    /// Whether a load accepts a checkpoint without this buffer; see
    /// [`allow_missing`](Self::allow_missing).
    pub fn is_missing_ok(&self) -> bool {
        self.0.missing_ok.load(Ordering::Relaxed)
    }

    /// An unbuilt persistent buffer of `dtype` on `device`, to be built with a shape that `shape`
    /// accepts and the value `init` gives (PyTorch's `UninitializedBuffer`).
    pub fn lazy(shape: LazyShape, init: Init, dtype: DType, device: &Device) -> Result<Self> {
        Ok(Self(Arc::new(BufferInner {
            modes: ModeMarks::default(),
            value: LazyCell::lazy(shape, init, dtype, device)?,
            persistent: true,
            missing_ok: AtomicBool::new(false),
        })))
    }

    /// A persistent buffer of shape `shape` holding `init`'s value; under
    /// [`empty_weights`](crate::empty_weights), left empty for a load (see
    /// [`Param::init`](crate::Param::init)).
    pub fn init(
        shape: impl Into<Shape>,
        init: Init,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        Ok(Self(Arc::new(BufferInner {
            modes: ModeMarks::default(),
            value: LazyCell::init(&shape.into(), init, 0, dtype, device)?,
            persistent: true,
            missing_ok: AtomicBool::new(false),
        })))
    }

    /// Whether the buffer has a value: always for an eager buffer, once materialized for a lazy
    /// one.
    pub fn is_built(&self) -> bool {
        self.0.value.is_built()
    }

    /// The shape an unbuilt buffer will be built with; `None` once built.
    pub fn lazy_shape(&self) -> Option<LazyShape> {
        self.0.value.lazy_shape()
    }

    /// Builds an unbuilt buffer with shape `dims`, once (see
    /// [`Param::materialize`](crate::Param::materialize)), and returns its value. On a built buffer
    /// this only checks that `dims` is its shape.
    ///
    /// Inside a functional call that substitutes or captures this buffer, nothing is built: the
    /// call's value is checked against `dims` and returned.
    pub fn materialize(&self, dims: &[usize]) -> Result<Tensor> {
        if let Some(t) = self.substituted() {
            return check_built_dims(t, dims);
        }
        self.0.value.materialize(dims, 0)?;
        check_built_dims(self.current(), dims)
    }

    /// The current value: a view of the buffer's storage, so it sees later in-place updates
    /// ([`set`](Self::set), a load, a BatchNorm training step), as PyTorch's buffer tensors do;
    /// [`Error::NotLoaded`](crate::Error::NotLoaded) when the buffer has none yet (see
    /// [`Param::tensor`](crate::Param::tensor)).
    ///
    /// Inside a functional call ([`FunctionalExt`](../module_runtime/trait.FunctionalExt.html)) that substitutes or
    /// captures this buffer, it reads as the call's copy instead.
    pub fn tensor(&self) -> Result<Tensor> {
        if let Some(t) = self.substituted() {
            return Ok(t);
        }
        match self.0.value.unbuilt_error("buffer") {
            None => Ok(self.current()),
            Some(e) => Err(e),
        }
    }

    /// What [`tensor`](Self::tensor) returns, without the unbuilt check (an unbuilt buffer's
    /// empty `[0]` placeholder): for metadata and the runtime's own walks.
    pub fn current(&self) -> Tensor {
        if let Some(t) = self.substituted() {
            return t;
        }
        self.0.value.read().detach()
    }

    /// Takes `value` (its dtype included) as the buffer's new value instead of copying into the
    /// current one: a load with [`LoadOptions::assign`](../module_runtime/struct.LoadOptions.html#method.assign). The shape
    /// must be the buffer's, or one an unbuilt buffer accepts.
    pub fn assign(&self, value: &Tensor) -> Result<()> {
        let value = value.to_device(&self.0.value.device())?;
        atomic_update(|| self.0.value.assign(value))
    }

    /// Whether state dicts include this buffer.
    pub fn is_persistent(&self) -> bool {
        self.0.persistent
    }

    /// Writes `value` into the buffer, in place: tensors read from the buffer before (a state dict
    /// taken earlier included) see the new value, as in PyTorch. The shape and dtype must stay the
    /// same (use [`replace`](Self::replace) to change them); the value is moved to the buffer's
    /// device.
    ///
    /// An unbuilt buffer is built from `value`: the shape must be one its
    /// [`lazy_shape`](Self::lazy_shape) accepts and the dtype its own.
    ///
    /// Inside a functional call that substitutes or captures this buffer, the write goes to the
    /// call's copy and the buffer itself is left unchanged.
    pub fn set(&self, value: &Tensor) -> Result<()> {
        if crate::scope::active() && crate::scope::assign_buffer(self.id(), value)? {
            return Ok(());
        }
        let value = value.to_device(&self.0.value.device())?;
        atomic_update(|| {
            if self.0.value.build_from(&value)? {
                return Ok(());
            }
            let mut slot = self.0.value.write();
            check_same_layout(&slot, &value)?;
            if !slot.is_variable() {
                // Only after a failed allocation in `own_storage`: take the value's copy as
                // storage.
                *slot = own_storage(&value);
                return Ok(());
            }
            let var = Var::from_tensor(&slot)?; // the same storage, not a copy
            match var.set(&value) {
                // `value` is a view of this buffer: candle refuses to copy a storage onto itself.
                Err(e) if is_cannot_set(&e) => Ok(var.set(&value.copy()?)?),
                other => Ok(other?),
            }
        })
    }

    /// Replaces the value with one of any shape, dtype and device (a new storage: tensors read
    /// before keep the old value).
    ///
    /// Inside a functional call that substitutes or captures this buffer, the call's copy is
    /// replaced and the buffer itself is left unchanged.
    pub fn replace(&self, value: Tensor) {
        let value = if crate::scope::active() {
            match crate::scope::write_buffer(self.id(), value.detach()) {
                Ok(()) => return,
                Err(value) => value,
            }
        } else {
            value
        };
        let value = own_storage(&value);
        atomic_update(|| self.0.value.replace(value));
    }

    /// The buffer's shape.
    pub fn shape(&self) -> Shape {
        self.current().shape().clone()
    }

    /// The buffer's dtype.
    pub fn dtype(&self) -> DType {
        self.current().dtype()
    }

    /// The device the buffer lives on.
    pub fn device(&self) -> Device {
        self.current().device().clone()
    }

    /// Moves the buffer to `device`.
    pub fn to_device(&self, device: &Device) -> Result<()> {
        atomic_update(|| {
            let mut slot = self.0.value.write();
            if !slot.device().same_device(device) {
                *slot = own_storage(&slot.to_device(device)?);
            }
            Ok(())
        })
    }

    /// Converts a floating-point buffer to `dtype`; integer and boolean-like buffers are left as
    /// they are (PyTorch's `Module.to(dtype)` rule).
    pub fn to_dtype(&self, dtype: DType) -> Result<()> {
        atomic_update(|| {
            let mut slot = self.0.value.write();
            if slot.dtype().is_float() && dtype.is_float() && slot.dtype() != dtype {
                *slot = own_storage(&slot.to_dtype(dtype)?);
            }
            Ok(())
        })
    }

    /// The value a functional scope holds for this buffer (substituted or captured), if one is
    /// active and holds it.
    #[inline]
    fn substituted(&self) -> Option<Tensor> {
        if crate::scope::active() {
            crate::scope::buffer(self.id())
        } else {
            None
        }
    }

    /// The buffer's own value, whatever a functional scope substitutes.
    pub fn own_tensor(&self) -> Tensor {
        self.0.value.read().detach()
    }

    /// A new buffer holding a copy of this one's value, with its persistence and
    /// [`allow_missing`](Self::allow_missing) (a deep copy: not an alias). Built buffers only.
    pub fn deep_copy(&self) -> Result<Self> {
        Ok(Self(Arc::new(BufferInner {
            modes: self.0.modes.snapshot(),
            value: LazyCell::eager(own_storage(&self.own_tensor().copy()?)),
            persistent: self.0.persistent,
            missing_ok: AtomicBool::new(self.is_missing_ok()),
        })))
    }
}

identity::leaf_identity!(Buffer, "buffer");

impl std::fmt::Debug for Buffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let lazy_shape = self.lazy_shape();
        let t = self.current();
        let mut f = f.debug_struct("Buffer");
        match &lazy_shape {
            Some(shape) => f.field("unbuilt", &format_args!("{shape}")),
            None => f.field("shape", &t.dims()),
        };
        f.field("dtype", &t.dtype())
            .field("device", &t.device().location())
            .field("persistent", &self.is_persistent())
            .finish()
    }
}
