//! Identity functions whose backward calls code: the candle custom ops that backward hooks are
//! made of, and tensor gradient hooks ([`register_hook`], PyTorch's `Tensor.register_hook`).
//!
//! PyTorch builds its backward hooks from identity autograd functions placed on a module's inputs
//! and outputs (`BackwardHookFunction`); candle's [`CustomOp1`](candle_core::CustomOp1) (and its
//! two- and three-argument peers) with a `bwd` allow the same. An identity op copies its argument
//! in the forward (candle ops make a new storage) on any backend, through candle's backend traits.

use std::sync::Arc;

use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::{CpuStorage, DType, Layout, Shape, Tensor};

use crate::error::{carry, BackwardHookError, Error, Result};

/// The argument, copied: the forward of an identity op.
pub(super) fn copy<S: BackendStorage<Device: BackendDevice<Storage = S>>>(
    storage: &S,
    layout: &Layout,
) -> candle_core::Result<(S, Shape)> {
    let mut out = storage
        .device()
        .zeros_impl(layout.shape(), storage.dtype())?;
    storage.copy_strided_src(&mut out, 0, layout)?;
    Ok((out, layout.shape().clone()))
}

/// The argument, copied, on the CPU: one copy of the elements for a contiguous float tensor (the
/// tensors hooks see), [`copy`] otherwise.
pub(super) fn copy_cpu(
    storage: &CpuStorage,
    layout: &Layout,
) -> candle_core::Result<(CpuStorage, Shape)> {
    let Some((start, end)) = layout.contiguous_offsets() else {
        return copy(storage, layout);
    };
    let out = match storage {
        CpuStorage::F32(v) => CpuStorage::F32(v[start..end].to_vec()),
        CpuStorage::F64(v) => CpuStorage::F64(v[start..end].to_vec()),
        CpuStorage::BF16(v) => CpuStorage::BF16(v[start..end].to_vec()),
        CpuStorage::F16(v) => CpuStorage::F16(v[start..end].to_vec()),
        _ => return copy(storage, layout),
    };
    Ok((out, layout.shape().clone()))
}

/// A scalar `0.0` (f32) on the storage's device: the forward of a gate, whose value nothing reads.
pub(super) fn scalar<S: BackendStorage<Device: BackendDevice<Storage = S>>>(
    storage: &S,
) -> candle_core::Result<(S, Shape)> {
    let shape = Shape::from(());
    Ok((storage.device().zeros_impl(&shape, DType::F32)?, shape))
}

/// A runtime error carried through candle's backward (which returns candle's error type);
/// [`Error`]'s `From<candle_core::Error>` gives it back as it was.
pub(super) fn to_candle(e: Error) -> candle_core::Error {
    carry(e)
}

/// Checks that `new` can replace a gradient of `expected`'s shape and dtype.
pub(super) fn check_grad(
    new: &Tensor,
    shape: &Shape,
    dtype: DType,
    what: (&str, &'static str, &'static str, usize),
) -> Result<()> {
    if new.shape() == shape && new.dtype() == dtype {
        return Ok(());
    }
    let (path, hook, side, index) = what;
    Err(Error::from(BackwardHookError::GradMismatch {
        path: path.to_owned(),
        hook,
        side,
        index,
        expected_shape: shape.dims().to_vec(),
        expected_dtype: dtype,
        got_shape: new.dims().to_vec(),
        got_dtype: new.dtype(),
    }))
}

/// A tensor gradient hook: sees the gradient with respect to a tensor and may return a new one
/// (same shape and dtype). `Ok(None)` keeps it.
pub type TensorHookFn = dyn Fn(&Tensor) -> Result<Option<Tensor>> + Send + Sync;

/// Registers a gradient hook on `tensor` (PyTorch's `Tensor.register_hook(hook)`): every time a
/// gradient with respect to the returned tensor is computed, `hook` is called with it, and what it
/// returns (`Ok(Some(new))`) replaces it, for everything upstream — the gradients of the tensors
/// and parameters `tensor` was computed from.
///
/// Candle tensors are immutable, so the hook cannot be attached to `tensor` itself: the returned
/// tensor (an identity of `tensor`, a copy of its values) carries it, and the rest of the forward
/// must use it in `tensor`'s place. A forward hook does exactly that by returning it as the
/// module's new output. To remove the hook, use `tensor` instead (PyTorch's handle `remove()`
/// has no counterpart: the graph is built already).
///
/// Fails with [`BackwardHookError::NoGrad`] for a tensor that records no gradient (neither a
/// variable nor computed from one), as PyTorch does. The hook's error, or a replacement of
/// another shape or dtype ([`BackwardHookError::GradMismatch`]), makes `backward()` fail with it
/// (`?` into this crate's [`Error`] gives it back as it was).
///
/// ```
/// use module_runtime::candle_core::Var;
/// use module_runtime::prelude::*;
///
/// let w = Var::new(&[1.0f32, 2.0, 3.0], &Device::Cpu)?;
/// let y = (w.as_tensor() * 2.0)?;
/// // The gradient at `y`, negated on its way back (PyTorch: `y.register_hook(lambda g: -g)`).
/// let y = register_hook(&y, |grad| Ok(Some(grad.neg()?)))?;
/// let grads = y.sum_all()?.backward()?;
/// assert_eq!(grads.get(&w).unwrap().to_vec1::<f32>()?, [-2.0, -2.0, -2.0]);
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub fn register_hook(
    tensor: &Tensor,
    hook: impl Fn(&Tensor) -> Result<Option<Tensor>> + Send + Sync + 'static,
) -> Result<Tensor> {
    if !requires_grad(tensor) {
        return Err(Error::from(BackwardHookError::NoGrad {
            shape: tensor.dims().to_vec(),
            dtype: tensor.dtype(),
        }));
    }
    let op = TensorHook {
        hook: Arc::new(hook),
    };
    Ok(tensor.apply_op1(op)?)
}

/// Whether candle's backward computes a gradient for `t`: a floating-point variable, or a
/// floating-point result of an operation on one (PyTorch's `requires_grad`).
pub(super) fn requires_grad(t: &Tensor) -> bool {
    t.track_op() && t.dtype().is_float()
}

/// The identity that carries a tensor hook.
struct TensorHook {
    hook: Arc<TensorHookFn>,
}

impl candle_core::CustomOp1 for TensorHook {
    fn name(&self) -> &'static str {
        "tensor-hook"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        copy_cpu(s, l)
    }

    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        copy(s, l)
    }

    fn metal_fwd(
        &self,
        s: &candle_core::MetalStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::MetalStorage, Shape)> {
        copy(s, l)
    }

    fn bwd(
        &self,
        arg: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let new = (self.hook)(grad).map_err(to_candle)?;
        let Some(new) = new else {
            return Ok(Some(grad.clone()));
        };
        let what = ("", "tensor hook", "tensor", 0);
        check_grad(&new, arg.shape(), arg.dtype(), what).map_err(to_candle)?;
        Ok(Some(new))
    }
}
