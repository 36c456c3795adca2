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
