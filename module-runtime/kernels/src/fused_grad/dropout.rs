//! Dropout as one op with a one-pass backward.
//!
//! Composed, the mask is four tensors (draws, comparison, float mask, scaled mask) and the product
//! a multiplication whose backward also computes the gradient of the mask, which nothing reads.
//! Here the draws are compared and scaled where they are read, forward and backward.
//!
//! A bfloat16 input (an activation under autocast) is widened as it is read and the product
//! rounded once, forward and backward: the same bits as the float32 op between two casts, with one
//! graph node where they made three.

use candle_core::{CpuStorage, DType, Layout, Shape, Storage, Tensor};

use crate::bf16_gemm::to_bf16;
use crate::cpu::f32_slice;
use crate::error::Result;
use crate::fused_grad::gelu_bf16::widen as widen_bf16;
use crate::fused_grad::linear_bf16::to_storage;
use crate::fused_grad::{applies, map_rows, with_f32};

/// Whether [`dropout`] can replace the composed dropout of `x`.
pub(crate) fn can_fuse_dropout(x: &Tensor) -> bool {
    applies(&[x])
}

/// `x` (float32, or bfloat16: see the module's documentation) with each element zeroed with
/// probability `p` (for `0 < p < 1`) and the others scaled by `1 / (1 - p)`, recording a one-pass
/// backward. The draws are the runtime's generator's, as in the
/// composed path, and an element is kept where its draw is at least `p`: with the same draws the
/// two paths give the same bits.
pub(crate) fn dropout(x: &Tensor, p: f64) -> Result<Tensor> {
    let draws = crate::random::rand(0., 1., x.shape(), DType::F32, x.device())?;
    let op = Dropout {
        p: p as f32,
        scale: (1.0 / (1.0 - p)) as f32,
    };
    Ok(x.contiguous()?.apply_op2(&draws, op)?)
}

/// The candle op of [`dropout`]: its arguments are the input and the uniform draws.
struct Dropout {
    /// An element is dropped where its draw is below `p`.
    p: f32,
    /// What a kept element is multiplied by.
    scale: f32,
}

impl Dropout {
    /// `out = v * mask`, the mask `scale` where the draw is kept and `0` elsewhere (a product,
    /// not a select, so a dropped infinity or NaN stays NaN as in the composed path).
    fn apply(&self, v: &[f32], draws: &[f32]) -> Vec<f32> {
        map_rows([v, draws], 1, |out, [v, draws]| {
            for ((o, &v), &u) in out.iter_mut().zip(v).zip(draws) {
                *o = v * if u >= self.p { self.scale } else { 0.0 };
            }
        })
    }
}

impl candle_core::CustomOp2 for Dropout {
    fn name(&self) -> &'static str {
        "dropout-fused"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        x_layout: &Layout,
        draws: &CpuStorage,
        draws_layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let name = self.name();
        let widened;
        let (values, dtype) = match x {
            CpuStorage::BF16(_) => {
                widened = widen_bf16(x, x_layout, name)?;
                (&widened[..], DType::BF16)
            }
            _ => (f32_slice(x, x_layout, name)?, DType::F32),
        };
        let draws = f32_slice(draws, draws_layout, name)?;
        if draws.len() != values.len() {
            return Err(candle_core::Error::Msg(format!(
                "{name}: {} draws for {} values",
                draws.len(),
                values.len()
            )));
        }
        let out = self.apply(values, draws);
        let out = match dtype {
            DType::BF16 => to_storage(&out, DType::BF16),
            _ => CpuStorage::F32(out),
        };
        Ok((out, x_layout.shape().clone()))
    }

    /// `dx = g * mask`; the draws get no gradient.
    fn bwd(
        &self,
        x: &Tensor,
        draws: &Tensor,
        _y: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let name = self.name();
        let grad = grad.contiguous()?;
        if grad.dtype() == DType::BF16 {
            // The bfloat16 op's: the float32 product of the widened gradient, rounded once.
            let g = {
                let (storage, layout) = grad.storage_and_layout();
                match &*storage {
                    Storage::Cpu(cpu) => widen_bf16(cpu, layout, name)?,
                    _ => {
                        return Err(candle_core::Error::Msg(format!(
                            "{name}: expects CPU tensors"
                        )))
                    }
                }
            };
            let dx = with_f32([draws], name, |[draws]| self.apply(&g, draws))?;
            return Ok((
                Some(Tensor::from_vec(to_bf16(&dx), x.shape(), x.device())?),
                None,
            ));
        }
        let dx = with_f32([&grad, draws], name, |[g, draws]| self.apply(g, draws))?;
        Ok((Some(Tensor::from_vec(dx, x.shape(), x.device())?), None))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Var};

    use super::*;
    use crate::cpu::bf16_bit_patterns as bits;

    /// With the same draws, the bfloat16 op's output and gradient are the float32 op's between
    /// two casts, bit for bit, and the op is one node over its input.
    #[test]
    fn bfloat16_equals_the_float32_op_between_casts() -> Result<()> {
        let dev = Device::Cpu;
        let x = Tensor::randn(0f32, 3.0, (37, 29), &dev)?.to_dtype(DType::BF16)?;
        let x = Var::from_tensor(&x)?;
        let draws = Tensor::rand(0f32, 1.0, (37, 29), &dev)?;
        let op = || Dropout {
            p: 0.1,
            scale: (1.0 / 0.9f64) as f32,
        };
        let fused = x.as_tensor().apply_op2(&draws, op())?;
        assert_eq!(fused.dtype(), DType::BF16);
        assert_eq!(fused.sorted_nodes().len(), 2, "the op and the input");
        let cast = x
            .as_tensor()
            .to_dtype(DType::F32)?
            .apply_op2(&draws, op())?
            .to_dtype(DType::BF16)?;
        assert_eq!(bits(&fused), bits(&cast));
        let g = Tensor::randn(0f32, 1.0, (37, 29), &dev)?;
        let loss = |y: &Tensor| (y.to_dtype(DType::F32)? * &g)?.sum_all();
        let (gf, gc) = (loss(&fused)?.backward()?, loss(&cast)?.backward()?);
        let (a, c) = (
            gf.get(x.as_tensor()).unwrap(),
            gc.get(x.as_tensor()).unwrap(),
        );
        assert_eq!(a.dtype(), DType::BF16);
        assert_eq!(bits(a), bits(c));
        Ok(())
    }
}
