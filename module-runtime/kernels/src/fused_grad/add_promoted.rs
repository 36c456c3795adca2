//! `a + b` for a bfloat16 `a` and a float32 `b` (a block's output under autocast joining the
//! float32 residual stream), with PyTorch's type promotion, as one op.
//!
//! Composed, the sum is two graph nodes: the cast of `a` to float32, then the float32 sum; during
//! the backward candle sums each one's gradient into a zero-filled buffer and the cast's backward
//! rounds on candle's scalar conversion. Here `a` is widened as it is read, and the backward hands
//! `b` the gradient and `a` the gradient rounded once to bfloat16: the same bits.

use candle_core::{CpuStorage, DType, Layout, Shape, Tensor};

use crate::bf16_gemm::to_bf16;
use crate::cpu::f32_slice;
use crate::error::Result;
use crate::fused_grad::map_rows;
use crate::fusion::is_fusion_enabled;

/// PyTorch's `a + b` between floating tensors: both promoted to the wider dtype
/// ([`promote`](module_core::autocast_policy::promote)), then added with candle's `+` (one
/// shape: candle does not broadcast it, a mismatch is its shape error). A bfloat16 `a` and a float32 `b` of one shape on the CPU, either recording a gradient
/// (fusion on), take one op whose output is float32: the values and gradients of the cast and
/// the sum, bit for bit. What `LayerNorm::call_residual` adds with under autocast.
///
/// ```
/// use module_runtime::candle_core::{DType, Device, Tensor, Var};
/// let a = Var::new(&[1f32, 2.5], &Device::Cpu)?;
/// let a = a.as_tensor().to_dtype(DType::BF16)?;
/// let b = Tensor::new(&[0.25f32, 1.], &Device::Cpu)?;
/// let y = module_kernels::add_promoted(&a, &b)?;
/// assert_eq!(y.dtype(), DType::F32);
/// assert_eq!(y.to_vec1::<f32>()?, [1.25, 3.5]);
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub fn add_promoted(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let one_op = is_fusion_enabled()
        && a.dtype() == DType::BF16
        && b.dtype() == DType::F32
        && a.shape() == b.shape()
        && a.device().is_cpu()
        && b.device().is_cpu()
        && (a.track_op() || b.track_op());
    if one_op {
        return Ok(a.contiguous()?.apply_op2(&b.contiguous()?, AddPromoted)?);
    }
    let [a, b] = module_core::autocast_policy::promote([a, b])?;
    Ok((a + b)?)
}

/// The candle op of [`add_promoted`]: its arguments are the bfloat16 and the float32 tensor.
struct AddPromoted;

impl candle_core::CustomOp2 for AddPromoted {
    fn name(&self) -> &'static str {
        "add-bf16-f32-fused"
    }

    fn cpu_fwd(
        &self,
        a: &CpuStorage,
        a_layout: &Layout,
        b: &CpuStorage,
        b_layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let name = self.name();
        let a = super::gelu_bf16::widen(a, a_layout, name)?;
        let b = f32_slice(b, b_layout, name)?;
        if a.len() != b.len() {
            return Err(candle_core::Error::ShapeMismatchBinaryOp {
                lhs: a_layout.shape().clone(),
                rhs: b_layout.shape().clone(),
                op: name,
            });
        }
        let width = a_layout.shape().dims().last().copied().unwrap_or(1).max(1);
        let y = map_rows([&a, b], width, |y, [a, b]| {
            for ((y, &a), &b) in y.iter_mut().zip(a).zip(b) {
                *y = a + b;
            }
        });
        Ok((CpuStorage::F32(y), a_layout.shape().clone()))
    }

    /// `da = g` rounded to bfloat16 (the cast's backward), `db = g`, each only for an argument
    /// that records a gradient.
    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        _out: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let da = match a.track_op() {
            true => {
                let g = grad.contiguous()?;
                let values = super::with_f32([&g], self.name(), |[g]| to_bf16(g))?;
                Some(Tensor::from_vec(values, a.shape(), a.device())?)
            }
            false => None,
        };
        Ok((da, b.track_op().then(|| grad.clone())))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Var};

    use super::*;

    /// The one op against the cast and candle's sum: the same bits, forward and backward, and
    /// one node over its two arguments.
    #[test]
    fn equals_the_cast_and_the_sum() -> Result<()> {
        let dev = Device::Cpu;
        let a =
            Var::from_tensor(&Tensor::randn(0f32, 2., (3, 50, 17), &dev)?.to_dtype(DType::BF16)?)?;
        let b = Var::randn(0f32, 1., (3, 50, 17), &dev)?;
        let upstream = Tensor::randn(0f32, 1., (3, 50, 17), &dev)?;
        let fused = add_promoted(a.as_tensor(), b.as_tensor())?;
        assert_eq!(fused.dtype(), DType::F32);
        assert_eq!(
            fused.sorted_nodes().len(),
            3,
            "the op and its two arguments"
        );
        let composed = (a.as_tensor().to_dtype(DType::F32)? + b.as_tensor())?;
        let flat = |t: &Tensor| -> Vec<u32> {
            let t = t.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
            t.to_vec1::<f32>()
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect()
        };
        assert_eq!(flat(&fused), flat(&composed));
        let loss = |y: &Tensor| (y * &upstream)?.sum_all();
        let (gf, gc) = (loss(&fused)?.backward()?, loss(&composed)?.backward()?);
        for v in [&a, &b] {
            let (x, y) = (
                gf.get(v.as_tensor()).unwrap(),
                gc.get(v.as_tensor()).unwrap(),
            );
            assert_eq!(x.dtype(), v.dtype());
            assert_eq!(flat(x), flat(y));
        }
        // Elsewhere: promotion, then candle's sum; shapes must agree.
        let plain = add_promoted(&a.as_tensor().detach(), &b.as_tensor().detach())?;
        assert_eq!(flat(&plain), flat(&composed));
        let row = Tensor::ones(17, DType::F32, &dev)?;
        assert!(add_promoted(a.as_tensor(), &row).is_err());
        Ok(())
    }
}
