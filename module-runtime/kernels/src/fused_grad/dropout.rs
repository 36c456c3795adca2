//! Dropout as one op with a one-pass backward.
//!
//! Composed, the mask is four tensors (draws, comparison, float mask, scaled mask) and the product
//! a multiplication whose backward also computes the gradient of the mask, which nothing reads.
//! Here the draws are compared and scaled where they are read, forward and backward.

use candle_core::{CpuStorage, DType, Layout, Shape, Tensor};

use crate::cpu::f32_slice;
use crate::error::Result;
use crate::fused_grad::{applies, map_rows, with_f32};

/// Whether [`dropout`] can replace the composed dropout of `x`.
pub(crate) fn can_fuse_dropout(x: &Tensor) -> bool {
    applies(&[x])
}

/// `x` with each element zeroed with probability `p` (for `0 < p < 1`) and the others scaled by
/// `1 / (1 - p)`, recording a one-pass backward. The draws are the runtime's generator's, as in the
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
        let x = f32_slice(x, x_layout, name)?;
        let draws = f32_slice(draws, draws_layout, name)?;
        if draws.len() != x.len() {
            return Err(candle_core::Error::Msg(format!(
                "{name}: {} draws for {} values",
                draws.len(),
                x.len()
            )));
        }
        Ok((
            CpuStorage::F32(self.apply(x, draws)),
            x_layout.shape().clone(),
        ))
    }

    /// `dx = g * mask`; the draws get no gradient.
    fn bwd(
        &self,
        x: &Tensor,
        draws: &Tensor,
        _y: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let grad = grad.contiguous()?;
        let dx = with_f32([&grad, draws], self.name(), |[g, draws]| {
            self.apply(g, draws)
        })?;
        Ok((Some(Tensor::from_vec(dx, x.shape(), x.device())?), None))
    }
}
