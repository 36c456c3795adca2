//! What the CPU passes read and write: a tensor's float32 values in place, the test of a tensor
//! they may work on, and the lane-wise sum they share.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Layout, Tensor};

/// Whether `t` is what the runtime's in-place and fused CPU passes work on: float32, on the CPU,
/// contiguous, and recording no gradient.
pub fn is_plain_cpu_f32(t: &Tensor) -> bool {
    !t.track_op() && t.dtype() == DType::F32 && t.device().is_cpu() && t.is_contiguous()
}

/// The contiguous float32 values of `storage` under `layout`, for the CPU op `op`.
pub(crate) fn f32_slice<'a>(
    storage: &'a CpuStorage,
    layout: &Layout,
    op: &'static str,
) -> candle_core::Result<&'a [f32]> {
    let CpuStorage::F32(data) = storage else {
        return Err(candle_core::Error::UnsupportedDTypeForOp(
            storage.dtype(),
            op,
        ));
    };
    match layout.contiguous_offsets() {
        Some((start, end)) => Ok(&data[start..end]),
        None => Err(candle_core::Error::RequiresContiguous { op }),
    }
}

/// [`f32_slice`], mutably.
pub(crate) fn f32_slice_mut<'a>(
    storage: &'a mut CpuStorage,
    layout: &Layout,
    op: &'static str,
) -> candle_core::Result<&'a mut [f32]> {
    let dtype = storage.dtype();
    let CpuStorage::F32(data) = storage else {
        return Err(candle_core::Error::UnsupportedDTypeForOp(dtype, op));
    };
    match layout.contiguous_offsets() {
        Some((start, end)) => Ok(&mut data[start..end]),
        None => Err(candle_core::Error::RequiresContiguous { op }),
    }
}

/// `Σ f(v)` with eight running sums, which the compiler keeps in one vector register (a single
/// float sum must be added in order and does not vectorize). Always inlined, so it vectorizes
/// for the instruction set of its caller (the attention's AVX2 build included).
#[inline(always)]
pub(crate) fn lane_sum(values: &[f32], f: impl Fn(f32) -> f32) -> f32 {
    let mut lanes = [0f32; 8];
    let chunks = values.chunks_exact(8);
    let rest: f32 = chunks.remainder().iter().map(|&v| f(v)).sum();
    for chunk in chunks {
        for (lane, &v) in lanes.iter_mut().zip(chunk) {
            *lane += f(v);
        }
    }
    lanes.iter().sum::<f32>() + rest
}

/// The largest absolute difference between two tensors of one shape: what the crate's unit tests
/// compare paths with.
#[cfg(test)]
pub(crate) fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

/// The bit patterns of a bfloat16 tensor's values, flattened: what the crate's unit tests compare
/// bfloat16 paths with, bit for bit.
#[cfg(test)]
pub(crate) fn bf16_bit_patterns(t: &Tensor) -> Vec<u16> {
    let values = t.flatten_all().unwrap().to_vec1::<half::bf16>().unwrap();
    values.iter().map(|v| v.to_bits()).collect()
}

/// The half-precision dtype (`bf16`, `f16`) of CPU tensors that the entries compute in float32:
/// `Some(dtype)` when the first tensor is a CPU half-precision one (the others may be float32, a
/// bfloat16 input with float32 parameters as autocast leaves a norm's). The entries then widen
/// every tensor to float32, take their float32 kernels (the barrier pool's products, the fused
/// training ops) and round the result once to `dtype`: what PyTorch's CPU kernels for reduced
/// precision do (float32 accumulation, one rounding), and faster than candle's, which widens a
/// bfloat16 product too but multiplies on one `gemm` call.
pub(crate) fn cpu_half_dtype(tensors: &[&Tensor]) -> Option<DType> {
    let first = tensors.first()?;
    let dtype = first.dtype();
    let ok = matches!(dtype, DType::BF16 | DType::F16)
        && tensors.iter().all(|t| {
            t.device().is_cpu() && matches!(t.dtype(), DType::BF16 | DType::F16 | DType::F32)
        });
    ok.then_some(dtype)
}

/// `t` widened to float32 (a no-op for a float32 tensor), recording the gradient.
pub(crate) fn widen(t: &Tensor) -> candle_core::Result<Tensor> {
    t.to_dtype(DType::F32)
}
