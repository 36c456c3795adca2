//! `x Wᵀ + b` as one op whose backward computes the three gradients directly.
//!
//! Composed, a linear layer is five nodes (fold the batch dimensions, transpose the weight,
//! matmul, broadcast the bias, add), and their backward hands the weight its gradient transposed
//! (`xᵀ g`, `[in, out]`, added into `[out, in]` with strided reads) and sums the bias gradient with
//! candle's reduction over the first dimension, which computes an index per element. Here the
//! backward is `dx = g W`, `dW = gᵀ x` (already `[out, in]`) and `db = Σ g` over rows, in one pass
//! split over threads.

use std::sync::Mutex;

use candle_core::{CpuStorage, Layout, Shape, Tensor};

use crate::common::f32_slice;
use crate::error::Result;
use crate::fused_grad::{applies, block_len, map_rows, par_map, with_f32};

/// Whether [`linear`] can compute `x Wᵀ + b`: `x` `[…, in]` and `weight` `[out, in]` with a
/// `bias` `[out]`, none of the sizes zero.
pub(crate) fn can_fuse_linear(x: &Tensor, weight: &Tensor, bias: &Tensor) -> bool {
    let (Some(&in_features), [out_features, w_in]) = (x.dims().last(), weight.dims()) else {
        return false;
    };
    x.elem_count() > 0
        && *w_in == in_features
        && *out_features > 0
        && bias.dims() == [*out_features]
        && applies(&[x, weight, bias])
}

/// `x Wᵀ + b` over the last dimension of `x`, recording a backward that computes the input,
/// weight and bias gradients directly (see [`can_fuse_linear`]).
///
/// The matmul runs first, on values that record nothing (candle's kernel); the op then adds the
/// bias into its own output as the composed path's broadcast add would, and stands in the graph
/// for the whole layer.
pub(crate) fn linear(x: &Tensor, weight: &Tensor, bias: &Tensor) -> Result<Tensor> {
    let x = x.contiguous()?;
    let (rows, in_features) = fold(&x);
    let product = x
        .detach()
        .reshape((rows, in_features))?
        .matmul(&weight.detach().t()?)?;
    let op = Linear {
        product: Mutex::new(Some(product)),
    };
    Ok(x.apply_op3(&weight.contiguous()?, &bias.contiguous()?, op)?)
}

/// The number of rows of `x` with its batch dimensions folded, and its last dimension.
fn fold(x: &Tensor) -> (usize, usize) {
    let in_features = x.dims().last().copied().unwrap_or(1).max(1);
    (x.elem_count() / in_features, in_features)
}

/// The candle op of [`linear`]: its arguments are the input, the weight and the bias.
struct Linear {
    /// `x Wᵀ`, `[rows, out]`, computed before the op and taken by its forward.
    product: Mutex<Option<Tensor>>,
}

impl candle_core::CustomOp3 for Linear {
    fn name(&self) -> &'static str {
        "linear-fused"
    }

    fn cpu_fwd(
        &self,
        _x: &CpuStorage,
        x_layout: &Layout,
        _w: &CpuStorage,
        _w_layout: &Layout,
        b: &CpuStorage,
        b_layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let name = self.name();
        let bias = f32_slice(b, b_layout, name)?;
        let product = self
            .product
            .lock()
            .map_err(|_| candle_core::Error::Msg(format!("{name}: poisoned")))?
            .take()
            .ok_or_else(|| candle_core::Error::Msg(format!("{name}: runs once")))?;
        let width = bias.len();
        let y = with_f32([&product], name, |inputs| {
            map_rows(inputs, width, |y, [p]| {
                for (y, p) in y.chunks_exact_mut(width).zip(p.chunks_exact(width)) {
                    for ((y, p), b) in y.iter_mut().zip(p).zip(bias) {
                        *y = p + b;
                    }
                }
            })
        })?;
        let mut dims = x_layout.shape().dims().to_vec();
        if let Some(last) = dims.last_mut() {
            *last = width;
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
            Some(g.matmul(&w.detach())?.reshape(x.shape())?)
        } else {
            None
        };
        let dw = if w.track_op() {
            Some(g.t()?.matmul(&x.detach().reshape((rows, in_features))?)?)
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
fn column_sums(values: &[f32], width: usize) -> Vec<f32> {
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
