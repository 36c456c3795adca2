//! Non-trainable module state.

use std::sync::{Arc, PoisonError, RwLock};

use candle_core::{DType, Device, Shape, Tensor};

use crate::error::{Error, Result};

/// Non-trainable state of any dtype: PyTorch's `register_buffer`.
///
/// Running statistics, `position_ids`, masks. A buffer is saved in state dicts when it is
/// *persistent* (the default), and skipped when it is not (PyTorch's `persistent=False`); both kinds
/// are listed by `named_buffers` and moved by `to_device`.
///
/// Like [`Param`](crate::Param), a `Buffer` is a shared handle: a clone is the same buffer, and it
/// can be replaced through `&self` during a forward pass (BatchNorm updates its running statistics
/// this way). [`to_dtype`](crate::ModuleExt::to_dtype) converts floating-point buffers only, so
/// integer buffers such as `position_ids` keep their dtype.
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
    value: RwLock<Tensor>,
    persistent: bool,
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
        // Buffers never take part in autograd.
        let value = value.detach();
        Self(Arc::new(BufferInner {
            value: RwLock::new(value),
            persistent,
        }))
    }

    /// The current value.
    pub fn tensor(&self) -> Tensor {
        self.0
            .value
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Whether state dicts include this buffer.
    pub fn is_persistent(&self) -> bool {
        self.0.persistent
    }

    /// Replaces the value. The shape and dtype must stay the same (use [`replace`](Self::replace)
    /// to change them); the value is moved to the buffer's device.
    pub fn set(&self, value: &Tensor) -> Result<()> {
        let mut slot = self.0.value.write().unwrap_or_else(PoisonError::into_inner);
        if value.shape() != slot.shape() || value.dtype() != slot.dtype() {
            return Err(Error::ValueMismatch {
                path: String::new(),
                expected_shape: slot.shape().clone(),
                expected_dtype: slot.dtype(),
                shape: value.shape().clone(),
                dtype: value.dtype(),
            });
        }
        *slot = value.to_device(slot.device())?.detach();
        Ok(())
    }

    /// Replaces the value with one of any shape, dtype and device.
    pub fn replace(&self, value: Tensor) {
        *self.0.value.write().unwrap_or_else(PoisonError::into_inner) = value.detach();
    }

    /// The buffer's shape.
    pub fn shape(&self) -> Shape {
        self.tensor().shape().clone()
    }

    /// The buffer's dtype.
    pub fn dtype(&self) -> DType {
        self.tensor().dtype()
    }

    /// The device the buffer lives on.
    pub fn device(&self) -> Device {
        self.tensor().device().clone()
    }

    /// Moves the buffer to `device`.
    pub fn to_device(&self, device: &Device) -> Result<()> {
        let mut slot = self.0.value.write().unwrap_or_else(PoisonError::into_inner);
        if !slot.device().same_device(device) {
            *slot = slot.to_device(device)?;
        }
        Ok(())
    }

    /// Converts a floating-point buffer to `dtype`; integer and boolean-like buffers are left as
    /// they are (PyTorch's `Module.to(dtype)` rule).
    pub fn to_dtype(&self, dtype: DType) -> Result<()> {
        let mut slot = self.0.value.write().unwrap_or_else(PoisonError::into_inner);
        if slot.dtype().is_float() && dtype.is_float() && slot.dtype() != dtype {
            *slot = slot.to_dtype(dtype)?;
        }
        Ok(())
    }

    /// Whether `self` and `other` are the same buffer.
    pub fn same_as(&self, other: &Buffer) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }

    /// An identity usable as a map key: equal for clones, distinct otherwise.
    pub fn id(&self) -> usize {
        Arc::as_ptr(&self.0) as usize
    }

    /// Whether another handle to this buffer exists. A buffer with one handle is held by one
    /// field, so a walk can reach it twice only through a shared (`Arc`) module, which the walk
    /// dedups itself: traversal skips its memo set for such buffers.
    pub(crate) fn has_aliases(&self) -> bool {
        Arc::strong_count(&self.0) > 1
    }
}

impl std::fmt::Debug for Buffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let t = self.tensor();
        f.debug_struct("Buffer")
            .field("shape", &t.dims())
            .field("dtype", &t.dtype())
            .field("device", &t.device().location())
            .field("persistent", &self.is_persistent())
            .finish()
    }
}
