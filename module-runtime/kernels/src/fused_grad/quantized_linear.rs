//! `x Wᵀ` for a quantized `W` with the gradient of `x` recorded (QLoRA's frozen base): the weight
//! is dequantized for the forward's product and again for the backward's, and neither float copy
//! outlives its product.
//!
//! Through a float product, the dequantized weight would be an argument of the product's node and
//! stay in the graph until the backward has run: a float copy of every quantized weight of the
//! model held for the whole step (on the SmolLM-135M-shaped model, the size of the float model),
//! which QLoRA is meant not to keep. Here the node holds the quantized parameter itself.
//!
//! A large weight is dequantized a block of its rows at a time ([`CHUNK_VALUES`] values at most),
//! each block multiplied and dropped before the next: the product's transient float weight is
//! that block, not the whole matrix (a tied `lm_head` over a 49152-word vocabulary would
//! otherwise be a 108 MiB float copy in the forward and again in the backward, as large as the
//! logits themselves).

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Layout, Shape, Storage, Tensor};

use crate::cpu::f32_slice;
use crate::error::Result;
use crate::fusion::is_fusion_enabled;
use crate::matmul::{matmul_candle, product, Matrix};
use crate::Param;

/// Whether [`quantized_product`] takes `x` against the quantized `weight`: fusion on, a float32
/// CPU `x` that records a gradient (under gradient mode), a quantized float32 CPU weight whose
/// width is `x`'s last dimension.
pub(crate) fn can_fuse_quantized_product(x: &Tensor, weight: &Param) -> bool {
    is_fusion_enabled()
        && weight.is_quantized()
        && x.track_op()
        && module_core::is_grad_enabled()
        && x.dtype() == DType::F32
        && x.device().is_cpu()
        && weight.dtype() == DType::F32
        && weight.device().is_cpu()
        && weight
            .shape()
            .dims2()
            .is_ok_and(|(_, k)| x.dims().last() == Some(&k))
}

/// `x Wᵀ` `[rows, out]` for `x` `[rows, in]` (contiguous float32 rows) and the quantized weight
/// `[out, in]`, recording the gradient of `x` (`g W`, the weight dequantized again); the weight
/// records none (a quantized parameter is frozen).
pub(crate) fn quantized_product(x: &Tensor, weight: &Param) -> Result<Tensor> {
    let in_features = weight.shape().dims2().map_or(1, |(_, k)| k.max(1));
    quantized_product_in_chunks(x, weight, (CHUNK_VALUES / in_features).max(1))
}

/// The most float32 values of a quantized weight [`quantized_product`] dequantizes at once
/// (8 MiB): a weight of more is multiplied a block of whole rows at a time.
const CHUNK_VALUES: usize = 1 << 21;

/// [`quantized_product`] dequantizing at most `chunk_rows` rows of the weight at a time.
fn quantized_product_in_chunks(x: &Tensor, weight: &Param, chunk_rows: usize) -> Result<Tensor> {
    Ok(x.apply_op1(QuantizedProduct {
        weight: weight.clone(),
        chunk_rows,
    })?)
}

/// The candle op of [`quantized_product`]: the quantized parameter, dequantized when needed.
struct QuantizedProduct {
    weight: Param,
    /// The rows of the weight dequantized at once.
    chunk_rows: usize,
}

impl QuantizedProduct {
    /// The weight's values in float32, a fresh tensor `[out, in]`.
    fn dequantized(&self) -> candle_core::Result<Tensor> {
        self.weight
            .own_tensor()
            .map_err(candle_core::Error::wrap)?
            .to_dtype(DType::F32)
    }

    /// The weight's rows in blocks of at most `chunk_rows`: each block's first row and its
    /// float32 values `[rows, in]`, made when the iterator reaches it. One block, the whole
    /// weight, when it is no larger (or when the parameter holds no quantized rows to read: a
    /// functional call's substitute).
    fn row_blocks(
        &self,
    ) -> candle_core::Result<impl Iterator<Item = candle_core::Result<(usize, Tensor)>> + '_> {
        let (n, _) = self.weight.shape().dims2()?;
        let whole = n <= self.chunk_rows || !self.weight.is_quantized();
        let step = if whole { n.max(1) } else { self.chunk_rows };
        Ok((0..n).step_by(step).map(move |start| {
            if whole {
                return Ok((0, self.dequantized()?));
            }
            let rows: Vec<usize> = (start..(start + step).min(n)).collect();
            let block = match self.weight.quantized_rows(&rows) {
                Ok(Some(q)) => q.dequantize(&candle_core::Device::Cpu)?,
                Ok(None) => self.dequantized()?.narrow(0, start, rows.len())?,
                Err(e) => return Err(candle_core::Error::wrap(e)),
            };
            Ok((start, block))
        }))
    }
}

impl candle_core::CustomOp1 for QuantizedProduct {
    fn name(&self) -> &'static str {
        "quantized-product-grad"
    }

    fn cpu_fwd(&self, x: &CpuStorage, layout: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (m, k) = layout.shape().dims2()?;
        let (n, k2) = self.weight.shape().dims2()?;
        if k != k2 {
            return Err(candle_core::Error::ShapeMismatchBinaryOp {
                lhs: layout.shape().clone(),
                rhs: self.weight.shape(),
                op: self.name(),
            });
        }
        let x_values = match x {
            CpuStorage::F32(values) => values.as_slice(),
            other => {
                return Err(candle_core::Error::UnsupportedDTypeForOp(
                    other.dtype(),
                    self.name(),
                ))
            }
        };
        // One block: its product is the output. Several: each block's columns copied into place.
        let mut y = Vec::new();
        for block in self.row_blocks()? {
            let (start, w) = block?;
            let w = w.contiguous()?;
            let rows = w.dim(0)?;
            let (storage, w_layout) = w.storage_and_layout();
            let Storage::Cpu(w_storage) = &*storage else {
                return Err(candle_core::Error::Msg(format!(
                    "{}: a CPU weight expected",
                    self.name()
                )));
            };
            let w_values = f32_slice(w_storage, w_layout, self.name())?;
            // Wᵀ read in place: the `[in, rows]` view of the row-major `[rows, in]` values.
            let part = product(
                Matrix::new(x_values, layout),
                Matrix::transposed(w_values, k),
                (m, rows, k),
                None,
            )?;
            if rows == n {
                y = part;
                break;
            }
            if y.is_empty() {
                y = vec![0f32; m * n];
            }
            for (out, part) in y.chunks_exact_mut(n).zip(part.chunks_exact(rows)) {
                out[start..start + rows].copy_from_slice(part);
            }
        }
        Ok((CpuStorage::F32(y), Shape::from((m, n))))
    }

    /// `dx = g W`, the weight dequantized for this product only.
    /// By blocks of the weight's rows, the sum of each block's `g[:, block] W[block]`.
    fn bwd(&self, _x: &Tensor, _y: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let mut dx: Option<Tensor> = None;
        for block in self.row_blocks()? {
            let (start, w) = block?;
            let part = matmul_candle(&grad.narrow(1, start, w.dim(0)?)?, &w)?;
            dx = Some(match dx {
                None => part,
                Some(sum) => (sum + part)?,
            });
        }
        Ok(dx)
    }
}

#[cfg(test)]
mod tests {
    use candle_core::quantized::GgmlDType;
    use candle_core::{Device, Var};

    use super::*;
    use crate::fusion::without_fusion;

    /// Through a quantized weight, the product that keeps no float copy gives the bits of the
    /// float product over the dequantized weight (fusion off), forward and backward, and its node
    /// holds no float weight.
    #[test]
    fn quantized_product_matches_the_dequantized_float_product() -> crate::error::Result<()> {
        let dev = Device::Cpu;
        let weight = Param::new(Tensor::randn(0f32, 1., (96, 64), &dev)?)?;
        weight.quantize(GgmlDType::Q8_0)?;
        let bias = Tensor::randn(0f32, 1., 96, &dev)?;
        let x = Var::randn(0f32, 1., (3, 40, 64), &dev)?;
        let upstream = Tensor::randn(0f32, 1., (3, 40, 96), &dev)?;
        let run = || -> crate::error::Result<(Vec<f32>, Vec<f32>)> {
            let y = crate::quantized_linear(x.as_tensor(), &weight, Some(&bias))?;
            let grads = (&y * &upstream)?.sum_all()?.backward()?;
            let dx = grads.get(&x).expect("x's gradient");
            Ok((
                y.flatten_all()?.to_vec1::<f32>()?,
                dx.flatten_all()?.to_vec1::<f32>()?,
            ))
        };
        assert!(can_fuse_quantized_product(x.as_tensor(), &weight));
        assert_eq!(run()?, without_fusion(run)?);
        Ok(())
    }

    /// A weight dequantized by blocks of its rows (here 40, 40 and 16 of 96) gives the product
    /// over the whole dequantized weight: the forward to the bit (each output is the same dot
    /// product), the input's gradient within float32 rounding (summed block by block).
    #[test]
    fn a_weight_dequantized_by_blocks_of_rows_gives_the_whole_product() -> crate::error::Result<()>
    {
        let dev = Device::Cpu;
        for kind in [GgmlDType::Q8_0, GgmlDType::Q4_0] {
            let weight = Param::new(Tensor::randn(0f32, 1., (96, 64), &dev)?)?;
            weight.quantize(kind)?;
            let x = Var::randn(0f32, 1., (50, 64), &dev)?;
            let upstream = Tensor::randn(0f32, 1., (50, 96), &dev)?;
            let run = |chunk_rows| -> crate::error::Result<(Vec<f32>, Vec<f32>)> {
                let y = quantized_product_in_chunks(x.as_tensor(), &weight, chunk_rows)?;
                let grads = (&y * &upstream)?.sum_all()?.backward()?;
                let dx = grads.get(&x).expect("x's gradient");
                Ok((
                    y.flatten_all()?.to_vec1::<f32>()?,
                    dx.flatten_all()?.to_vec1::<f32>()?,
                ))
            };
            let op = QuantizedProduct {
                weight: weight.clone(),
                chunk_rows: 40,
            };
            let blocks = (op.row_blocks()?)
                .map(|b| b.map(|(start, w)| (start, w.dims().to_vec())))
                .collect::<candle_core::Result<Vec<_>>>()?;
            assert_eq!(
                blocks,
                [(0, vec![40, 64]), (40, vec![40, 64]), (80, vec![16, 64])]
            );
            let (y, dx) = run(40)?;
            let (whole_y, whole_dx) = run(96)?;
            assert_eq!(y, whole_y, "{kind:?}");
            for (a, b) in dx.iter().zip(&whole_dx) {
                assert!(
                    (a - b).abs() <= 1e-5 * b.abs().max(1.),
                    "{kind:?}: {a} against {b}"
                );
            }
            assert_ne!(dx, vec![0f32; dx.len()]);
        }
        Ok(())
    }
}
