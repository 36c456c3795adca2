//! `x Wᵀ + b` as one op whose backward computes the three gradients directly.
//!
//! Composed, a linear layer is five nodes (fold the batch dimensions, transpose the weight,
//! matmul, broadcast the bias, add), and their backward hands the weight its gradient transposed
//! (`xᵀ g`, `[in, out]`, added into `[out, in]` with strided reads) and sums the bias gradient with
//! candle's reduction over the first dimension, which computes an index per element. Here the
//! forward is one product on the barrier pool with the bias written into the output first
//! ([`matmul::product`](crate::matmul::product)), and the backward is `dx = g W`, `dW = gᵀ x`
//! (already `[out, in]`) and `db = Σ g` over rows, in one pass split over threads.
//!
//! Unlike the other fused training ops it also serves inference (nothing records a gradient): the
//! op then records nothing, and the bias costs no pass over the output of its own.

use candle_core::{CpuStorage, DType, Layout, Shape, Tensor};

use crate::cpu::f32_slice;
use crate::error::Result;
use crate::fused_grad::with_f32;
use crate::fusion::is_fusion_enabled;
use crate::matmul::{matmul_candle, product, Matrix};
use crate::pool::{block_len, par_map};

/// Whether [`linear`] can compute `x Wᵀ + b`: `x` `[…, in]` and `weight` `[out, in]` with a
/// `bias` `[out]`, none of the sizes zero, all float32 CPU tensors, fusion on.
pub(crate) fn can_fuse_linear(x: &Tensor, weight: &Tensor, bias: &Tensor) -> bool {
    let (Some(&in_features), [out_features, w_in]) = (x.dims().last(), weight.dims()) else {
        return false;
    };
    x.elem_count() > 0
        && *w_in == in_features
        && *out_features > 0
        && bias.dims() == [*out_features]
        && is_fusion_enabled()
        && [x, weight, bias]
            .iter()
            .all(|t| t.dtype() == DType::F32 && t.device().is_cpu())
}

/// `x Wᵀ + b` over the last dimension of `x` (see [`can_fuse_linear`]), recording, when any of
/// them records a gradient, a backward that computes the input, weight and bias gradients
/// directly.
pub(crate) fn linear(x: &Tensor, weight: &Tensor, bias: &Tensor) -> Result<Tensor> {
    Ok(x.contiguous()?
        .apply_op3(&weight.contiguous()?, &bias.contiguous()?, Linear)?)
}

/// The number of rows of `x` with its batch dimensions folded, and its last dimension.
fn fold(x: &Tensor) -> (usize, usize) {
    let in_features = x.dims().last().copied().unwrap_or(1).max(1);
    (x.elem_count() / in_features, in_features)
}

/// The candle op of [`linear`]: its arguments are the input, the weight and the bias.
struct Linear;

impl candle_core::CustomOp3 for Linear {
    fn name(&self) -> &'static str {
        "linear-fused"
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
        let (x, w, bias) = (
            f32_slice(x, x_layout, name)?,
            f32_slice(w, w_layout, name)?,
            f32_slice(b, b_layout, name)?,
        );
        let (out_features, in_features) = w_layout.shape().dims2()?;
        if in_features == 0 || x.len() % in_features != 0 {
            return Err(candle_core::Error::ShapeMismatchBinaryOp {
                lhs: x_layout.shape().clone(),
                rhs: w_layout.shape().clone(),
                op: name,
            });
        }
        let rows = x.len() / in_features;
        let y = product(
            Matrix::rows(x, in_features),
            Matrix::transposed(w, in_features),
            (rows, out_features, in_features),
            Some(bias),
        )?;
        let mut dims = x_layout.shape().dims().to_vec();
        if let Some(last) = dims.last_mut() {
            *last = out_features;
        }
        Ok((CpuStorage::F32(y), Shape::from(dims)))
    }

    /// `dx = g W`, `dW = gᵀ x` and `db = Σ g`, each only for an argument that records a gradient.
    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _y: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (rows, in_features) = fold(x);
        let out_features = b.elem_count();
        let g = grad.contiguous()?.reshape((rows, out_features))?;
        let dx = if x.track_op() {
            Some(matmul_candle(&g, &w.detach())?.reshape(x.shape())?)
        } else {
            None
        };
        let dw = if w.track_op() {
            Some(matmul_candle(
                &g.t()?,
                &x.detach().reshape((rows, in_features))?,
            )?)
        } else {
            None
        };
        let db = if b.track_op() {
            let sums = with_f32([&g], self.name(), |[g]| column_sums(g, out_features))?;
            Some(Tensor::from_vec(sums, out_features, b.device())?)
        } else {
            None
        };
        Ok((dx, dw, db))
    }
}

/// The sums of the columns of the rows of `width` values in `values`: each thread sums a block of
/// rows, and the blocks' sums are added at the end.
pub(super) fn column_sums(values: &[f32], width: usize) -> Vec<f32> {
    let block_sums = |block: &[f32]| {
        let mut sums = vec![0f32; width];
        for row in block.chunks_exact(width) {
            sums.iter_mut().zip(row).for_each(|(s, v)| *s += v);
        }
        sums
    };
    let block = block_len(values.len(), width);
    let mut blocks = par_map(values.chunks(block).collect(), block_sums).into_iter();
    let mut sums = blocks.next().unwrap_or_else(|| vec![0f32; width]);
    for block in blocks {
        sums.iter_mut().zip(block).for_each(|(s, b)| *s += b);
    }
    sums
}
