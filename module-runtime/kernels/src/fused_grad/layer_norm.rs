//! LayerNorm over the last dimension, with a weight and a bias, as one op with a one-pass
//! backward.
//!
//! Composed, the norm is nine nodes (mean, centre, square, mean, add, square root, divide, scale,
//! shift), and its backward some twenty tensor ops with broadcasts and reductions. Here the
//! forward is one pass over each row (mean and variance as the mean of squared deviations, as
//! PyTorch's CPU kernel takes them) and the backward another: each row's statistics are recomputed
//! from the row, which is in cache, rather than kept from the forward, and the input, weight and
//! bias gradients come out of the same pass
//! (`x̂ = (x - μ) σ⁻¹`, `ĝ = g w`, `dx = σ⁻¹ (ĝ - mean(ĝ) - x̂ mean(ĝ x̂))`, `dw = Σ g x̂`, `db = Σ g`).

use candle_core::{CpuStorage, Layout, Shape, Tensor};

use crate::cpu::f32_slice;
use crate::cpu::lane_sum;
use crate::error::Result;
use crate::fused_grad::{applies, map_blocks, map_rows, with_f32};

/// Whether [`layer_norm`] can normalize `x` over its last dimension with `weight` and `bias`:
/// one value of each per element of a non-empty last dimension.
pub(crate) fn can_fuse_layer_norm(x: &Tensor, weight: &Tensor, bias: &Tensor) -> bool {
    let width = x.dims().last().copied().unwrap_or(0);
    width > 0 && weight.dims() == [width] && bias.dims() == [width] && applies(&[x, weight, bias])
}

/// `(x - mean) / sqrt(var + eps) * weight + bias` over the last dimension, with the biased
/// variance, recording a one-pass backward (see [`can_fuse_layer_norm`]).
pub(crate) fn layer_norm(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    let op = LayerNorm { eps: eps as f32 };
    Ok(x.contiguous()?
        .apply_op3(&weight.contiguous()?, &bias.contiguous()?, op)?)
}

/// The candle op of [`layer_norm`]: its arguments are the input, the weight and the bias.
struct LayerNorm {
    eps: f32,
}

impl LayerNorm {
    /// A row's mean and `1 / sqrt(var + eps)`.
    fn stats(&self, x: &[f32]) -> (f32, f32) {
        let n = x.len() as f32;
        let mean = lane_sum(x, |v| v) / n;
        let var = lane_sum(x, |v| (v - mean) * (v - mean)) / n;
        (mean, (var + self.eps).sqrt().recip())
    }

    /// The input gradient of one row into `dx`, and its share of the weight and bias gradients
    /// added to `dw` and `db`.
    fn row_grad(
        &self,
        x: &[f32],
        g: &[f32],
        w: &[f32],
        dx: &mut [f32],
        dw: &mut [f32],
        db: &mut [f32],
    ) {
        let (mean, inv_std) = self.stats(x);
        let n = x.len() as f32;
        // Σ ĝ and Σ ĝ x̂ in eight lanes each (see `lane_sum`).
        let (mut sum_g, mut sum_gx) = ([0f32; 8], [0f32; 8]);
        for (i, ((&x, &g), &w)) in x.iter().zip(g).zip(w).enumerate() {
            let xhat = (x - mean) * inv_std;
            let gw = g * w;
            sum_g[i % 8] += gw;
            sum_gx[i % 8] += gw * xhat;
        }
        let mean_g = sum_g.iter().sum::<f32>() / n;
        let mean_gx = sum_gx.iter().sum::<f32>() / n;
        for (((((dx, dw), db), &x), &g), &w) in dx.iter_mut().zip(dw).zip(db).zip(x).zip(g).zip(w) {
            let xhat = (x - mean) * inv_std;
            *dx = inv_std * (g * w - mean_g - xhat * mean_gx);
            *dw += g * xhat;
            *db += g;
        }
    }
}

impl candle_core::CustomOp3 for LayerNorm {
    fn name(&self) -> &'static str {
        "layer-norm-fused"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        x_layout: &Layout,
        w: &CpuStorage,
        w_layout: &Layout,
        b: &CpuStorage,
        b_layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let name = self.name();
        let x = f32_slice(x, x_layout, name)?;
        let w = f32_slice(w, w_layout, name)?;
        let b = f32_slice(b, b_layout, name)?;
        let width = w.len();
        if width == 0 || b.len() != width || x_layout.shape().dims().last() != Some(&width) {
            return Err(candle_core::Error::Msg(format!(
                "{name}: expects a weight and a bias of the input's non-empty last dimension"
            )));
        }
        let y = map_rows([x], width, |y, [x]| {
            for (y, x) in y.chunks_exact_mut(width).zip(x.chunks_exact(width)) {
                let (mean, inv_std) = self.stats(x);
                for (((y, &x), &w), &b) in y.iter_mut().zip(x).zip(w).zip(b) {
                    *y = (x - mean) * inv_std * w + b;
                }
            }
        });
        Ok((CpuStorage::F32(y), x_layout.shape().clone()))
    }

    /// The three gradients in one pass over the rows; each thread sums the weight and bias
    /// gradients of its block of rows, and the blocks' sums are added at the end. A gradient that
    /// nothing records (a frozen weight or bias, an input that is a constant) is not returned.
    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _y: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let grad = grad.contiguous()?;
        let (dx, dw, db) = with_f32([x, &grad, w], self.name(), |[x, g, w]| {
            let width = w.len();
            let (dx, blocks) = map_blocks([x, g], width, |dx, [x, g]| {
                let (mut dw, mut db) = (vec![0f32; width], vec![0f32; width]);
                let rows = dx
                    .chunks_exact_mut(width)
                    .zip(x.chunks_exact(width))
                    .zip(g.chunks_exact(width));
                for ((dx, x), g) in rows {
                    self.row_grad(x, g, w, dx, &mut dw, &mut db);
                }
                (dw, db)
            });
            let mut blocks = blocks.into_iter();
            let (mut dw, mut db) = blocks
                .next()
                .unwrap_or_else(|| (vec![0f32; width], vec![0f32; width]));
            for (bw, bb) in blocks {
                dw.iter_mut().zip(bw).for_each(|(a, b)| *a += b);
                db.iter_mut().zip(bb).for_each(|(a, b)| *a += b);
            }
            (dx, dw, db)
        })?;
        let keep = |t: &Tensor, values: Vec<f32>| -> candle_core::Result<Option<Tensor>> {
            t.track_op()
                .then(|| Tensor::from_vec(values, t.shape(), t.device()))
                .transpose()
        };
        Ok((keep(x, dx)?, keep(w, dw)?, keep(b, db)?))
    }
}
