//! `x Wᵀ` for a quantized `W` with the gradient of `x` recorded (QLoRA's frozen base): the weight
//! is dequantized for the forward's product and again for the backward's, and neither float copy
//! outlives its product.
//!
//! Through a float product, the dequantized weight would be an argument of the product's node and
//! stay in the graph until the backward has run: a float copy of every quantized weight of the
//! model held for the whole step (on the SmolLM-135M-shaped model, the size of the float model),
//! which QLoRA is meant not to keep. Here the node holds the quantized parameter itself.

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
    Ok(x.apply_op1(QuantizedProduct {
        weight: weight.clone(),
    })?)
}

/// The candle op of [`quantized_product`]: the quantized parameter, dequantized when needed.
struct QuantizedProduct {
    weight: Param,
}

impl QuantizedProduct {
    /// The weight's values in float32, a fresh tensor `[out, in]`.
    fn dequantized(&self) -> candle_core::Result<Tensor> {
        self.weight
            .own_tensor()
            .map_err(candle_core::Error::wrap)?
            .to_dtype(DType::F32)
    }
}

impl candle_core::CustomOp1 for QuantizedProduct {
    fn name(&self) -> &'static str {
        "quantized-product-grad"
    }

    fn cpu_fwd(&self, x: &CpuStorage, layout: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (m, k) = layout.shape().dims2()?;
        let w = self.dequantized()?.contiguous()?;
        let (n, k2) = w.dims2()?;
        if k != k2 {
            return Err(candle_core::Error::ShapeMismatchBinaryOp {
                lhs: layout.shape().clone(),
                rhs: w.shape().clone(),
                op: self.name(),
            });
        }
        let (storage, w_layout) = w.storage_and_layout();
        let Storage::Cpu(w_storage) = &*storage else {
            return Err(candle_core::Error::Msg(format!(
                "{}: a CPU weight expected",
                self.name()
            )));
        };
        let w_values = f32_slice(w_storage, w_layout, self.name())?;
        // Wᵀ read in place: the `[in, out]` view of the row-major `[out, in]` values.
        let x_values = match x {
            CpuStorage::F32(values) => values.as_slice(),
            other => {
                return Err(candle_core::Error::UnsupportedDTypeForOp(
                    other.dtype(),
                    self.name(),
                ))
            }
        };
        let y = product(
            Matrix::new(x_values, layout),
            Matrix::transposed(w_values, k),
            (m, n, k),
            None,
        )?;
        Ok((CpuStorage::F32(y), Shape::from((m, n))))
    }

    /// `dx = g W`, the weight dequantized for this product only.
    fn bwd(&self, _x: &Tensor, _y: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(matmul_candle(grad, &self.dequantized()?)?))
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
}
