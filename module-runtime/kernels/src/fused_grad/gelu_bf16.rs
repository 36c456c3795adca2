//! The exact GELU of a bfloat16 tensor that records a gradient (an activation under autocast) as
//! one op: computed in float32 and rounded once, which is what the float32 op between two casts
//! computes, bit for bit, with one graph node where that path has three (each a gradient candle
//! accumulates into a zero-filled buffer during the backward).

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Layout, Shape, Storage, Tensor};
use half::bf16;

use crate::bf16_gemm::{bf16_value, to_bf16};
use crate::elementwise::gelu_erf_vectorized;
use crate::error::Result;
use crate::fused_grad::gelu::gelu_erf_grad;
use crate::fused_grad::linear_bf16::to_storage;
use crate::fused_grad::map_rows;

/// [`gelu_erf`](crate::gelu_erf) of a bfloat16 CPU tensor `x`, recording a one-pass backward
/// whose gradient is rounded to bfloat16 as the cast's backward rounds it.
pub(crate) fn gelu_erf_bf16(x: &Tensor) -> Result<Tensor> {
    Ok(x.contiguous()?.apply_op1(GeluErfBf16)?)
}

/// The candle op of [`gelu_erf_bf16`].
struct GeluErfBf16;

/// The float32 values of contiguous bfloat16 CPU storage (exact; the loop vectorizes).
pub(super) fn widen(
    storage: &CpuStorage,
    layout: &Layout,
    op: &'static str,
) -> candle_core::Result<Vec<f32>> {
    let CpuStorage::BF16(data) = storage else {
        return Err(candle_core::Error::UnsupportedDTypeForOp(
            storage.dtype(),
            op,
        ));
    };
    let (start, end) = layout
        .contiguous_offsets()
        .ok_or(candle_core::Error::RequiresContiguous { op })?;
    let bits: &[u16] = half::slice::HalfFloatSliceExt::reinterpret_cast(&data[start..end]);
    Ok(bits.iter().map(|&b| bf16_value(b)).collect())
}

/// The float32 values of a contiguous bfloat16 CPU tensor.
fn widen_tensor(t: &Tensor, op: &'static str) -> candle_core::Result<Vec<f32>> {
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        Storage::Cpu(cpu) => widen(cpu, layout, op),
        _ => Err(candle_core::Error::Msg(format!(
            "{op}: expects CPU tensors"
        ))),
    }
}

impl candle_core::CustomOp1 for GeluErfBf16 {
    fn name(&self) -> &'static str {
        "gelu-erf-bf16-fused"
    }

    fn cpu_fwd(&self, x: &CpuStorage, layout: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = widen(x, layout, self.name())?;
        Ok((
            to_storage(&gelu_values(&x), DType::BF16),
            layout.shape().clone(),
        ))
    }

    /// `dx = g (Φ(x) + x φ(x))` as the float32 op's backward computes it, with `Φ(x) = GELU(x) / x`
    /// from the forward's float32 value (computed again: the output kept is rounded), then
    /// rounded to bfloat16.
    fn bwd(&self, x: &Tensor, _: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let name = self.name();
        let (xs, gs) = (
            widen_tensor(&x.contiguous()?, name)?,
            widen_tensor(&grad.contiguous()?, name)?,
        );
        let dx = gelu_grad_bf16(&xs, &gs);
        Ok(Some(Tensor::from_vec(dx, x.shape(), x.device())?))
    }
}

/// The exact GELU of each float32 value (rounded by the caller).
pub(super) fn gelu_values(x: &[f32]) -> Vec<f32> {
    map_rows([x], 1, |y, [x]| {
        for (y, &x) in y.iter_mut().zip(x) {
            *y = gelu_erf_vectorized(x);
        }
    })
}

/// `g (Φ(x) + x φ(x))` for each value `x` and incoming gradient `g`, as the float32 op's
/// backward computes it, rounded to bfloat16.
pub(super) fn gelu_grad_bf16(x: &[f32], g: &[f32]) -> Vec<bf16> {
    let dx = map_rows([x, g], 1, |dx, [x, g]| {
        for ((dx, &x), &g) in dx.iter_mut().zip(x).zip(g) {
            *dx = gelu_erf_grad(x, gelu_erf_vectorized(x), g);
        }
    });
    to_bf16(&dx)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device, Var};

    /// The same bits as the float32 op between two casts, forward and gradient.
    #[test]
    fn equals_the_float32_op_between_casts() -> Result<()> {
        let dev = Device::Cpu;
        let x =
            Var::from_tensor(&Tensor::randn(0f32, 2.0, (61, 37), &dev)?.to_dtype(DType::BF16)?)?;
        let g = Tensor::randn(0f32, 1.0, (61, 37), &dev)?.to_dtype(DType::BF16)?;
        let fused = gelu_erf_bf16(x.as_tensor())?;
        let cast = crate::fused_grad::gelu_erf(&x.as_tensor().to_dtype(DType::F32)?)?
            .to_dtype(DType::BF16)?;
        let bits = |t: &Tensor| -> Result<Vec<u16>> {
            Ok(t.flatten_all()?
                .to_vec1::<bf16>()?
                .iter()
                .map(|v| v.to_bits())
                .collect())
        };
        assert_eq!(bits(&fused)?, bits(&cast)?);
        let gf = (fused.to_dtype(DType::F32)? * g.to_dtype(DType::F32)?)?
            .sum_all()?
            .backward()?;
        let gc = (cast.to_dtype(DType::F32)? * g.to_dtype(DType::F32)?)?
            .sum_all()?
            .backward()?;
        assert_eq!(bits(gf.get(&x).unwrap())?, bits(gc.get(&x).unwrap())?);
        Ok(())
    }
}
