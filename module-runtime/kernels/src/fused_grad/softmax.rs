//! Softmax over the last dimension as one op with a one-pass backward.
//!
//! Composed, a softmax is five nodes (max, shift, exp, sum, divide) whose backward is a dozen
//! tensor ops, broadcasts and reductions among them; here each row's gradient
//! `dx = y (g - Σ g y)` is one pass over the forward's output and the incoming gradient.

use candle_core::{CpuStorage, Layout, Shape, Tensor};

use crate::cpu::f32_slice;
use crate::error::Result;
use crate::fused_grad::{applies, map_rows, with_f32};

/// Whether [`softmax_last_dim`] can replace the composed softmax of `x` along its last dimension.
pub(crate) fn can_fuse_softmax_last_dim(x: &Tensor) -> bool {
    x.rank() > 0 && applies(&[x])
}

/// `exp(x - max) / Σ exp(x - max)` along the last dimension of `x`, recording a one-pass
/// backward.
pub(crate) fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    Ok(x.contiguous()?.apply_op1(SoftmaxLastDim)?)
}

/// The candle op of [`softmax_last_dim`].
struct SoftmaxLastDim;

/// The width of `shape`'s rows (its last dimension), or `None` for an empty tensor.
fn row_width(shape: &Shape) -> Option<usize> {
    shape.dims().last().copied().filter(|&w| w > 0)
}

impl candle_core::CustomOp1 for SoftmaxLastDim {
    fn name(&self) -> &'static str {
        "softmax-last-dim-fused"
    }

    fn cpu_fwd(&self, x: &CpuStorage, layout: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = f32_slice(x, layout, self.name())?;
        let Some(width) = row_width(layout.shape()) else {
            return Ok((CpuStorage::F32(vec![0f32; x.len()]), layout.shape().clone()));
        };
        let y = map_rows([x], width, |y, [x]| {
            for (y, x) in y.chunks_exact_mut(width).zip(x.chunks_exact(width)) {
                let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let mut sum = 0f32;
                for (y, &x) in y.iter_mut().zip(x) {
                    *y = (x - max).exp();
                    sum += *y;
                }
                y.iter_mut().for_each(|y| *y /= sum);
            }
        });
        Ok((CpuStorage::F32(y), layout.shape().clone()))
    }

    /// `dx = y (g - Σ g y)` along each row.
    fn bwd(&self, x: &Tensor, y: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let Some(width) = row_width(y.shape()) else {
            return Ok(Some(x.zeros_like()?));
        };
        let grad = grad.contiguous()?;
        let dx = with_f32([y, &grad], self.name(), |inputs| {
            map_rows(inputs, width, |dx, [y, g]| {
                let rows = dx
                    .chunks_exact_mut(width)
                    .zip(y.chunks_exact(width))
                    .zip(g.chunks_exact(width));
                for ((dx, y), g) in rows {
                    let dot: f32 = y.iter().zip(g).map(|(y, g)| y * g).sum();
                    for ((dx, &y), &g) in dx.iter_mut().zip(y).zip(g) {
                        *dx = y * (g - dot);
                    }
                }
            })
        })?;
        Ok(Some(Tensor::from_vec(dx, x.shape(), x.device())?))
    }
}
