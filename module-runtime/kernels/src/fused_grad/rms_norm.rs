//! RMSNorm over the last dimension, with a weight, as one op with a one-pass backward.
//!
//! Composed, the norm is six nodes (square, mean, add, square root, divide, scale) that keep two
//! tensors of the input's size in the graph beside the output, and its backward a dozen tensor ops
//! with broadcasts and reductions; a Llama training step runs two per layer and one at the end.
//! Here the forward is one pass over each row (candle-nn's inference kernel's arithmetic, bit for
//! bit) and the backward another, each row's `r = 1 / sqrt(mean(x²) + eps)` recomputed from the
//! row (in cache)
//! (`x̂ = x r`, `ĝ = g w`, `dx = r (ĝ - x̂ mean(ĝ x̂))`, `dw = Σ g x̂`).

use candle_core::{CpuStorage, Layout, Shape, Tensor};

use crate::cpu::f32_slice;
use crate::error::Result;
use crate::fused_grad::{applies, map_blocks, map_rows, with_f32};

/// Whether [`rms_norm`] can normalize `x` over its last dimension with `weight`: one weight per
/// element of a non-empty last dimension.
pub(crate) fn can_fuse_rms_norm(x: &Tensor, weight: &Tensor) -> bool {
    let width = x.dims().last().copied().unwrap_or(0);
    width > 0 && weight.dims() == [width] && applies(&[x, weight])
}

/// `x / sqrt(mean(x²) + eps) * weight` over the last dimension, recording a one-pass backward
/// (see [`can_fuse_rms_norm`]).
pub(crate) fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    let op = RmsNorm { eps: eps as f32 };
    Ok(x.contiguous()?.apply_op2(&weight.contiguous()?, op)?)
}

/// The candle op of [`rms_norm`]: its arguments are the input and the weight.
struct RmsNorm {
    eps: f32,
}

impl RmsNorm {
    /// A row's `sqrt(mean(x²) + eps)`, summed in order as candle-nn's inference kernel does, so
    /// the forward gives its bits (a model's training and evaluation forwards agree exactly).
    fn rms(&self, x: &[f32]) -> f32 {
        let sum: f32 = x.iter().map(|v| v * v).sum();
        (sum / x.len() as f32 + self.eps).sqrt()
    }
}

impl candle_core::CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "rms-norm-fused"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        x_layout: &Layout,
        w: &CpuStorage,
        w_layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let name = self.name();
        let x = f32_slice(x, x_layout, name)?;
        let w = f32_slice(w, w_layout, name)?;
        let width = w.len();
        if width == 0 || x_layout.shape().dims().last() != Some(&width) {
            return Err(candle_core::Error::Msg(format!(
                "{name}: expects a weight of the input's non-empty last dimension"
            )));
        }
        let y = map_rows([x], width, |y, [x]| {
            for (y, x) in y.chunks_exact_mut(width).zip(x.chunks_exact(width)) {
                let m = self.rms(x);
                for ((y, &x), &w) in y.iter_mut().zip(x).zip(w) {
                    *y = x / m * w;
                }
            }
        });
        Ok((CpuStorage::F32(y), x_layout.shape().clone()))
    }

    /// Both gradients in one pass over the rows; each thread sums the weight gradient of its
    /// block of rows, and the blocks' sums are added at the end. A gradient that nothing records
    /// (a frozen weight, an input that is a constant) is not returned.
    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let grad = grad.contiguous()?;
        let (dx, dw) = with_f32([x, &grad, w], self.name(), |[x, g, w]| {
            let width = w.len();
            let (dx, blocks) = map_blocks([x, g], width, |dx, [x, g]| {
                let mut dw = vec![0f32; width];
                let rows = dx
                    .chunks_exact_mut(width)
                    .zip(x.chunks_exact(width))
                    .zip(g.chunks_exact(width));
                for ((dx, x), g) in rows {
                    let r = self.rms(x).recip();
                    // mean(ĝ x̂) in eight lanes (see `lane_sum`).
                    let mut sum = [0f32; 8];
                    for (i, ((&x, &g), &w)) in x.iter().zip(g).zip(w).enumerate() {
                        sum[i % 8] += g * w * x * r;
                    }
                    let mean = sum.iter().sum::<f32>() / width as f32;
                    for ((((dx, dw), &x), &g), &w) in
                        dx.iter_mut().zip(&mut dw).zip(x).zip(g).zip(w)
                    {
                        let xhat = x * r;
                        *dx = r * (g * w - xhat * mean);
                        *dw += g * xhat;
                    }
                }
                dw
            });
            let mut blocks = blocks.into_iter();
            let mut dw = blocks.next().unwrap_or_else(|| vec![0f32; width]);
            for block in blocks {
                dw.iter_mut().zip(block).for_each(|(a, b)| *a += b);
            }
            (dx, dw)
        })?;
        let keep = |t: &Tensor, values: Vec<f32>| -> candle_core::Result<Option<Tensor>> {
            t.track_op()
                .then(|| Tensor::from_vec(values, t.shape(), t.device()))
                .transpose()
        };
        Ok((keep(x, dx)?, keep(w, dw)?))
    }
}
