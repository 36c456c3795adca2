//! `a + s b` as one op: a residual branch added with a factor (a LoRA adapter's update onto its
//! base layer's output) without the scaled branch as a tensor of its own.
//!
//! Composed, `a + (b * s)` keeps `b * s` in the graph beside `a`, `b` and the sum, as large as
//! each, until the backward has run: for the LoRA adapters of a SmolLM-135M-shaped training step,
//! about 300 MB. The backward is the same either way: `g` for `a`, `s g` for `b`.

use candle_core::{CpuStorage, DType, Layout, Shape, Tensor};

use crate::cpu::f32_slice;
use crate::error::Result;
use crate::fused_grad::{applies, map_rows};

/// `a + s b` for two tensors of one shape (PyTorch's `torch.add(a, b, alpha=s)`), recording the
/// gradient `g` for `a` and `s g` for `b`: one op on float32 CPU tensors that record a gradient
/// (fusion on), candle's `a + b * s` elsewhere (or for shapes that differ, which candle refuses).
///
/// ```
/// use module_runtime::candle_core::{Device, Tensor, Var};
/// let a = Var::new(&[1f32, 2.], &Device::Cpu)?;
/// let b = Var::new(&[10f32, 20.], &Device::Cpu)?;
/// let y = module_kernels::add_scaled(a.as_tensor(), b.as_tensor(), 0.5)?;
/// assert_eq!(y.to_vec1::<f32>()?, [6., 12.]);
/// let grads = y.sum_all()?.backward()?;
/// assert_eq!(grads.get(&b).unwrap().to_vec1::<f32>()?, [0.5, 0.5]);
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub fn add_scaled(a: &Tensor, b: &Tensor, s: f64) -> Result<Tensor> {
    if a.shape() != b.shape() || !applies(&[a, b]) {
        return Ok((a + (b * s)?)?);
    }
    Ok(a.contiguous()?.apply_op2(&b.contiguous()?, AddScaled(s))?)
}

/// The candle op of [`add_scaled`]: the factor.
struct AddScaled(f64);

impl candle_core::CustomOp2 for AddScaled {
    fn name(&self) -> &'static str {
        "add-scaled-fused"
    }

    fn cpu_fwd(
        &self,
        a: &CpuStorage,
        a_layout: &Layout,
        b: &CpuStorage,
        b_layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let a = f32_slice(a, a_layout, self.name())?;
        let b = f32_slice(b, b_layout, self.name())?;
        // The factor rounded to float32 once, as candle's `b * s` on a float32 tensor.
        let s = self.0 as f32;
        let width = a_layout.shape().dims().last().copied().unwrap_or(1).max(1);
        let y = map_rows([a, b], width, |y, [a, b]| {
            for ((y, &a), &b) in y.iter_mut().zip(a).zip(b) {
                *y = a + b * s;
            }
        });
        Ok((CpuStorage::F32(y), a_layout.shape().clone()))
    }

    /// `da = g`, `db = s g`, each only for an argument that records a gradient.
    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        _out: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let da = a.track_op().then(|| grad.clone());
        let db = match b.track_op() {
            true => Some((grad.to_dtype(DType::F32)? * self.0)?),
            false => None,
        };
        Ok((da, db))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Var};

    use super::*;
    use crate::fusion::without_fusion;

    /// Fused or composed: the same bits, forward and backward, for both arguments.
    #[test]
    fn fused_add_scaled_matches_composed_bit_for_bit() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let a = Var::randn(0f32, 1., (4, 64, 300), &dev)?;
        let b = Var::randn(0f32, 1., (4, 64, 300), &dev)?;
        let upstream = Tensor::randn(0f32, 1., (4, 64, 300), &dev)?;
        let run = || -> candle_core::Result<Vec<Vec<f32>>> {
            let y =
                add_scaled(a.as_tensor(), b.as_tensor(), 0.3).map_err(candle_core::Error::wrap)?;
            let grads = (&y * &upstream)?.sum_all()?.backward()?;
            let flat = |t: &Tensor| t.flatten_all()?.to_vec1::<f32>();
            Ok(vec![
                flat(&y)?,
                flat(grads.get(&a).expect("a's gradient"))?,
                flat(grads.get(&b).expect("b's gradient"))?,
            ])
        };
        assert_eq!(run()?, without_fusion(run)?);
        Ok(())
    }
}
