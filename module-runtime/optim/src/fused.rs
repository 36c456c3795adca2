//! The fused CPU float32 update's side in the optimizers: which dtype a step runs in, which
//! tensors it takes, and the result rounded back into a half-precision parameter. The pass itself
//! (one pass over a parameter, its gradient and its state buffers, written in place and split over
//! candle's barrier pool) is `module-kernels`' `chunked_update` inside `update_in_place`.
//!
//! Each optimizer's element-wise rule is written so that it computes exactly what its composed
//! path (candle tensor ops, one per PyTorch op) computes, rounding for rounding: the same
//! operations on `f32` in the same order, with candle's `affine(a, 0)` spelled `x * a + 0.0`.
//! So the two paths give the same bits, and the choice between them is only one of speed.

use candle_core::{DType, Tensor};

use crate::error::Result;

/// The dtype an optimizer keeps a parameter's state in and updates it in: float32 for float16
/// and bfloat16 parameters (the step runs on float32 copies and its result is rounded back into
/// the parameter), the parameter's own dtype otherwise.
pub(crate) fn state_dtype(param: DType) -> DType {
    match param {
        DType::F16 | DType::BF16 => DType::F32,
        d => d,
    }
}

/// A parameter's value and gradient in [`state_dtype`]: the tensors themselves, or float32
/// copies for a half-precision parameter (whose step writes its result back with
/// [`write_back`]).
pub(crate) fn in_state_dtype(p: &Tensor, g: &Tensor) -> Result<(Tensor, Tensor)> {
    let dtype = state_dtype(p.dtype());
    Ok((p.to_dtype(dtype)?, g.to_dtype(dtype)?))
}

/// Rounds the result `new` of an in-place step (in [`state_dtype`]) into the parameter `var`; a
/// no-op for a parameter of its state dtype, which [`in_state_dtype`] handed over itself.
pub(crate) fn write_back(var: &candle_core::Var, new: &Tensor) -> Result<()> {
    if state_dtype(var.dtype()) == var.dtype() {
        return Ok(());
    }
    var.set(&new.to_dtype(var.dtype())?)?;
    Ok(())
}

/// Whether `t` is a contiguous float32 tensor on the CPU, which the fused update works on.
pub(crate) fn is_cpu_f32(t: &Tensor) -> bool {
    t.dtype() == DType::F32 && t.device().is_cpu() && t.is_contiguous()
}
