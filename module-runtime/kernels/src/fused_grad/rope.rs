//! Rotary position embeddings (the `rotate_half` convention of transformers' Llama) as one op
//! with a one-pass backward, its output written heads first.
//!
//! Composed, the rotation of a `[batch, seq, heads, head_dim]` projection is a chain of seven
//! nodes (two halves, a negation, a concatenation, two products with the tables and their sum)
//! that keeps four tensors of the input's size in the graph until the backward has run, and a
//! fifth when the heads are then copied before the positions for attention: for a
//! SmolLM-135M-shaped training step at batch 4 × 256, about 500 MB. The rotation is linear in
//! the input with constant tables, so its backward needs nothing but the tables (the rotation by
//! the opposite angles): this op keeps no tensor of its own in the graph, and writes its output
//! as the `[batch, heads, seq, head_dim]` buffer that attention reads, returned as its
//! `[batch, seq, heads, head_dim]` view.

use candle_core::{CpuStorage, DType, Layout, Shape, Tensor};

use crate::cpu::f32_slice;
use crate::error::{Error, Result};
use crate::fused_grad::{applies, with_f32};
use crate::pool::{block_len, par_map};

/// The rotary position embedding of `x` `[batch, seq, heads, head_dim]` with the angles' `cos`
/// and `sin` `[seq, head_dim / 2]` (or `[batch, seq, head_dim / 2]`, one table per row): each
/// head's halves `x₁`, `x₂` become `x₁ cos − x₂ sin` and `x₂ cos + x₁ sin` (transformers'
/// `apply_rotary_pos_emb` for one tensor, with `rotate_half`; candle-nn's `rope_thd`).
///
/// Where a gradient flows through `x` (float32 CPU tensors, fusion on, tables that record none)
/// this is one op that keeps nothing in the graph but its input and output, and whose backward
/// rotates the gradient back in one pass; its result is then the `[batch, seq, heads, head_dim]`
/// view of a contiguous `[batch, heads, seq, head_dim]` tensor, so `.transpose(1, 2)` gives
/// attention's layout without a copy. Where none flows, candle-nn's `rope_thd` kernel runs;
/// elsewhere (another dtype, fusion off, tables that record a gradient) the composed candle ops.
/// All three give the same bits.
///
/// A shape that does not fit (not rank 4, an odd `head_dim`, tables of another shape or dtype)
/// is an [`Error::InvalidConfig`] naming the shapes.
///
/// ```
/// use module_runtime::candle_core::{Device, Tensor, Var};
/// let x = Var::new(&[[[[1f32, 2., 3., 4.]]]], &Device::Cpu)?; // [1, 1, 1, 4]
/// let cos = Tensor::new(&[[0f32, 1.]], &Device::Cpu)?; // angles π/2 and 0
/// let sin = Tensor::new(&[[1f32, 0.]], &Device::Cpu)?;
/// let y = module_kernels::rotary_embedding(x.as_tensor(), &cos, &sin)?;
/// assert_eq!(y.flatten_all()?.to_vec1::<f32>()?, [-3., 2., 1., 4.]);
/// let grads = y.sum_all()?.backward()?;
/// assert_eq!(grads.get(&x).unwrap().flatten_all()?.to_vec1::<f32>()?, [1., 1., -1., 1.]);
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub fn rotary_embedding(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let tables = check(x, cos, sin)?;
    if x.track_op() && !cos.track_op() && !sin.track_op() && applies(&[x, cos, sin]) {
        let op = Rope {
            cos: cos.contiguous()?.detach(),
            sin: sin.contiguous()?.detach(),
            per_row: tables == Tables::PerRow,
        };
        return Ok(x.contiguous()?.apply_op1(op)?.transpose(1, 2)?);
    }
    if !(x.track_op() || cos.track_op() || sin.track_op()) {
        let (cos, sin) = (cos.contiguous()?, sin.contiguous()?);
        return Ok(candle_nn::rotary_emb::rope_thd(
            &x.contiguous()?,
            &cos,
            &sin,
        )?);
    }
    composed(x, cos, sin)
}

/// Which tables [`rotary_embedding`] was given.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Tables {
    /// `[seq, head_dim / 2]`, shared by the rows.
    Shared,
    /// `[batch, seq, head_dim / 2]`.
    PerRow,
}

fn check(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tables> {
    let bad = |message: String| Error::InvalidConfig {
        layer: "rotary_embedding",
        message,
    };
    let (b, s, _, d) = x.dims4().map_err(|_| {
        bad(format!(
            "x must be [batch, seq, heads, head_dim], got {:?}",
            x.dims()
        ))
    })?;
    if d % 2 != 0 {
        return Err(bad(format!(
            "head_dim must be even, got x of shape {:?}",
            x.dims()
        )));
    }
    if cos.dims() != sin.dims() || cos.dtype() != x.dtype() || sin.dtype() != x.dtype() {
        return Err(bad(format!(
            "cos {:?} ({:?}) and sin {:?} ({:?}) must have one shape and the dtype of x {:?} ({:?})",
            cos.dims(),
            cos.dtype(),
            sin.dims(),
            sin.dtype(),
            x.dims(),
            x.dtype()
        )));
    }
    if cos.dims() == [s, d / 2] {
        Ok(Tables::Shared)
    } else if cos.dims() == [b, s, d / 2] {
        Ok(Tables::PerRow)
    } else {
        Err(bad(format!(
            "cos and sin must be [seq, head_dim / 2] = [{s}, {}] or [batch, seq, head_dim / 2] \
             for x of shape {:?}, got {:?}",
            d / 2,
            x.dims(),
            cos.dims()
        )))
    }
}

/// The rotation in candle's differentiable ops (the path where the fused op does not apply).
fn composed(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let half = x.dim(3)? / 2;
    // `[…, seq, 1, head_dim]`: one table for every head.
    let table = |t: &Tensor| -> Result<Tensor> {
        let full = Tensor::cat(&[t, t], t.rank() - 1)?;
        Ok(full.unsqueeze(full.rank() - 1)?)
    };
    let rotated = Tensor::cat(
        &[&x.narrow(3, half, half)?.neg()?, &x.narrow(3, 0, half)?],
        3,
    )?;
    Ok((x.broadcast_mul(&table(cos)?)? + rotated.broadcast_mul(&table(sin)?)?)?)
}

/// The candle op of [`rotary_embedding`]: the tables (detached, contiguous), and whether there
/// is one per row of the batch.
struct Rope {
    cos: Tensor,
    sin: Tensor,
    per_row: bool,
}

impl Rope {
    /// Rotates the rows of `src` into `dst`, both of `[batch, seq, heads, head_dim]` values in
    /// their own order: `src_heads_first` (and not `dst`) when the source is the forward's
    /// output layout. `sign` is 1 for the forward rotation, −1 for its inverse (the backward).
    #[allow(clippy::too_many_arguments)]
    fn rotate(
        &self,
        src: &[f32],
        dims: [usize; 4],
        src_heads_first: bool,
        inverse: bool,
        cos: &[f32],
        sin: &[f32],
    ) -> Vec<f32> {
        let [b, s, h, d] = dims;
        let half = d / 2;
        let mut dst = vec![0f32; b * s * h * d];
        let block = block_len(dst.len(), d);
        let jobs: Vec<_> = dst.chunks_mut(block).enumerate().collect();
        par_map(jobs, |(i, out)| {
            let first = i * block / d;
            for (r, out) in out.chunks_exact_mut(d).enumerate() {
                let row = first + r;
                // The destination row's (batch, seq, head), in the destination's order.
                let (bi, si, hi) = if src_heads_first {
                    (row / (s * h), row / h % s, row % h)
                } else {
                    (row / (h * s), row % s, row / s % h)
                };
                let src_row = if src_heads_first {
                    ((bi * h + hi) * s + si) * d
                } else {
                    ((bi * s + si) * h + hi) * d
                };
                let x = &src[src_row..src_row + d];
                let t = if self.per_row { bi * s + si } else { si } * half;
                let (c, sn) = (&cos[t..t + half], &sin[t..t + half]);
                let (o1, o2) = out.split_at_mut(half);
                let (x1, x2) = x.split_at(half);
                for j in 0..half {
                    if inverse {
                        // The gradient: `dx₁ = g₁ cos + g₂ sin`, `dx₂ = g₂ cos − g₁ sin`.
                        o1[j] = x1[j] * c[j] + x2[j] * sn[j];
                        o2[j] = x2[j] * c[j] - x1[j] * sn[j];
                    } else {
                        o1[j] = x1[j] * c[j] - x2[j] * sn[j];
                        o2[j] = x2[j] * c[j] + x1[j] * sn[j];
                    }
                }
            }
        });
        dst
    }
}

impl candle_core::CustomOp1 for Rope {
    fn name(&self) -> &'static str {
        "rotary-embedding-fused"
    }

    /// `[batch, seq, heads, head_dim]` in, the rotation out as `[batch, heads, seq, head_dim]`.
    fn cpu_fwd(&self, x: &CpuStorage, layout: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = f32_slice(x, layout, self.name())?;
        let (b, s, h, d) = layout.shape().dims4()?;
        let y = with_f32([&self.cos, &self.sin], self.name(), |[cos, sin]| {
            // Written in the destination's (heads-first) order, read from the input's.
            self.rotate(x, [b, s, h, d], false, false, cos, sin)
        })?;
        Ok((CpuStorage::F32(y), Shape::from((b, h, s, d))))
    }

    /// The gradient rotated back by the opposite angles, into the input's layout.
    fn bwd(&self, x: &Tensor, _y: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let (b, s, h, d) = x.dims4()?;
        let grad = grad.to_dtype(DType::F32)?.contiguous()?;
        let dx = with_f32(
            [&grad, &self.cos, &self.sin],
            self.name(),
            |[g, cos, sin]| self.rotate(g, [b, s, h, d], true, true, cos, sin),
        )?;
        Ok(Some(Tensor::from_vec(dx, x.shape(), x.device())?))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Var};

    use super::*;
    use crate::fusion::without_fusion;

    /// Fused, composed and candle-nn's kernel: the same bits forward, and the fused and composed
    /// gradients the same bits too, for shared and per-row tables, with the output's heads-first
    /// buffer read through its view.
    #[test]
    fn fused_rotary_embedding_matches_composed_bit_for_bit() -> crate::error::Result<()> {
        let dev = Device::Cpu;
        let x = Var::randn(0f32, 1., (2, 5, 3, 8), &dev)?;
        for per_row in [false, true] {
            let table: &[usize] = if per_row { &[2, 5, 4] } else { &[5, 4] };
            let angles = Tensor::randn(0f32, 3., table, &dev)?;
            let (cos, sin) = (angles.cos()?, angles.sin()?);
            let upstream = Tensor::randn(0f32, 1., (2, 5, 3, 8), &dev)?;
            let run = || -> crate::error::Result<(Vec<f32>, Vec<f32>)> {
                let y = rotary_embedding(x.as_tensor(), &cos, &sin)?;
                let grads = (&y * &upstream)?.sum_all()?.backward()?;
                let dx = grads.get(&x).expect("x's gradient");
                Ok((y.flatten_all()?.to_vec1()?, dx.flatten_all()?.to_vec1()?))
            };
            let fused = run()?;
            assert_eq!(fused, without_fusion(run)?);
            let kernel = rotary_embedding(&x.as_tensor().detach(), &cos, &sin)?;
            assert_eq!(fused.0, kernel.flatten_all()?.to_vec1::<f32>()?);
            // Heads first in memory: attention's layout is a free transpose.
            let y = rotary_embedding(x.as_tensor(), &cos, &sin)?;
            assert!(y.transpose(1, 2)?.is_contiguous());
        }
        Ok(())
    }

    /// Shapes that do not fit are typed errors naming them.
    #[test]
    fn rotary_embedding_refuses_shapes_that_do_not_fit() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let x = Tensor::zeros((1, 4, 2, 6), DType::F32, &dev)?;
        let table = Tensor::zeros((4, 3), DType::F32, &dev)?;
        let wrong = Tensor::zeros((5, 3), DType::F32, &dev)?;
        let odd = Tensor::zeros((1, 4, 2, 5), DType::F32, &dev)?;
        for (x, cos, sin) in [
            (&x, &wrong, &wrong),
            (&x, &table, &wrong),
            (&odd, &table, &table),
        ] {
            let err = rotary_embedding(x, cos, sin).expect_err("a shape that does not fit");
            assert!(matches!(
                err,
                Error::InvalidConfig {
                    layer: "rotary_embedding",
                    ..
                }
            ));
            assert!(
                err.to_string().contains(&format!("{:?}", x.dims())),
                "{err}"
            );
        }
        Ok(())
    }
}
