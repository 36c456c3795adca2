//! `LayerNorm(x + residual)` in one pass and one fresh output: the residual sum and the norm after
//! it, during CPU float32 inference.

use candle_core::{CpuStorage, Layout, Shape, Tensor};

use crate::cpu::{f32_slice, is_plain_cpu_f32, lane_sum};
use crate::error::Result;
use crate::pool::{block_len, par_map};

/// Whether [`residual_layer_norm`] can run: `x` and `residual` of one shape, with a non-empty last
/// dimension that `weight` and `bias` (if any) have one value for each element of, all float32
/// contiguous CPU tensors that record no gradient.
pub fn can_fuse_residual_norm(
    x: &Tensor,
    residual: &Tensor,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
) -> bool {
    let width = x.dims().last().copied().unwrap_or(0);
    let per_feature = |p: Option<&Tensor>| {
        p.is_none_or(|p| is_plain_cpu_f32(p) && p.rank() == 1 && p.elem_count() == width)
    };
    width > 0
        && x.shape() == residual.shape()
        && is_plain_cpu_f32(x)
        && is_plain_cpu_f32(residual)
        && per_feature(weight)
        && per_feature(bias)
}

/// `LayerNorm(x + residual)` over the last dimension, in one pass and one fresh output (see
/// [`can_fuse_residual_norm`]): each row's sum is written to the output, its mean and biased
/// variance taken from there (two passes over a row that is in cache, as PyTorch's CPU kernel
/// does, rather than candle's `E[x²] - E[x]²`), and the row normalized and scaled in place.
pub fn residual_layer_norm(
    x: &Tensor,
    residual: &Tensor,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    eps: f64,
) -> Result<Tensor> {
    let values = |p: Option<&Tensor>| p.map(Tensor::to_vec1::<f32>).transpose();
    let op = ResidualLayerNorm {
        weight: values(weight)?,
        bias: values(bias)?,
        eps: eps as f32,
    };
    Ok(x.apply_op2_no_bwd(residual, &op)?)
}

/// The forward-only candle op of [`residual_layer_norm`], holding the affine parameters' values.
struct ResidualLayerNorm {
    weight: Option<Vec<f32>>,
    bias: Option<Vec<f32>>,
    eps: f32,
}

impl ResidualLayerNorm {
    fn row(&self, x: &[f32], residual: &[f32], out: &mut [f32]) {
        for ((o, a), b) in out.iter_mut().zip(x).zip(residual) {
            *o = a + b;
        }
        let n = out.len() as f32;
        let mean = lane_sum(out, |v| v) / n;
        let var = lane_sum(out, |v| (v - mean) * (v - mean)) / n;
        let inv_std = (var + self.eps).sqrt().recip();
        match (&self.weight, &self.bias) {
            (Some(w), Some(b)) => {
                for ((o, w), b) in out.iter_mut().zip(w).zip(b) {
                    *o = (*o - mean) * inv_std * w + b;
                }
            }
            (Some(w), None) => {
                for (o, w) in out.iter_mut().zip(w) {
                    *o = (*o - mean) * inv_std * w;
                }
            }
            (None, Some(b)) => {
                for (o, b) in out.iter_mut().zip(b) {
                    *o = (*o - mean) * inv_std + b;
                }
            }
            (None, None) => out.iter_mut().for_each(|o| *o = (*o - mean) * inv_std),
        }
    }
}

impl candle_core::CustomOp2 for ResidualLayerNorm {
    fn name(&self) -> &'static str {
        "residual-layer-norm"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        x_layout: &Layout,
        residual: &CpuStorage,
        residual_layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let name = candle_core::CustomOp2::name(self);
        let x = f32_slice(x, x_layout, name)?;
        let residual = f32_slice(residual, residual_layout, name)?;
        let shape = x_layout.shape();
        let width = shape.dims().last().copied().unwrap_or(0);
        if width == 0 || residual.len() != x.len() {
            return Err(candle_core::Error::Msg(format!(
                "{name}: expects two inputs of one shape with a non-empty last dimension"
            )));
        }
        let mut out = vec![0f32; x.len()];
        let rows = |x: &[f32], r: &[f32], o: &mut [f32]| {
            for ((x, r), o) in x
                .chunks_exact(width)
                .zip(r.chunks_exact(width))
                .zip(o.chunks_exact_mut(width))
            {
                self.row(x, r, o);
            }
        };
        let block = block_len(x.len(), width);
        let jobs = out
            .chunks_mut(block)
            .zip(x.chunks(block))
            .zip(residual.chunks(block))
            .collect();
        par_map(jobs, |((o, x), r)| rows(x, r, o));
        Ok((CpuStorage::F32(out), shape.clone()))
    }
}
