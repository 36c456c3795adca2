//! `GELU(x Wᵀ + b)` (the exact GELU) in bfloat16 as one op: the bfloat16 product
//! (`linear_bf16.rs`), rounded, then the bfloat16 GELU (`gelu_bf16.rs`), with one graph node where
//! the two ops make two — the product's output, as large as the feed-forward block's widest
//! activation, was a gradient candle sums into a zero-filled buffer every backward. The op keeps
//! the rounded product (the GELU's input) for its backward, as the two ops' graph kept it.
//!
//! The same values as the two ops, forward and backward: the GELU's gradient rounded to bfloat16,
//! then the product's backward from it (a zero gradient may keep the sign the two ops' sum into a
//! zero-filled buffer would make positive).

use std::sync::Mutex;

use candle_core::{CpuStorage, DType, Layout, Shape, Tensor};

use crate::bf16_gemm::{bf16_value, to_bf16_bits};
use crate::error::Result;
use crate::fused_grad::gelu_bf16::{gelu_grad_bf16, gelu_values};
use crate::fused_grad::linear_bf16::{backward, forward_values, to_storage};

/// `GELU(x Wᵀ + b)` for `x` `[…, in]`, `weight` `[out, in]` and `bias` `[out]` (zero where
/// `None`), bfloat16 or float32 CPU tensors, in bfloat16, recording the gradient of each operand
/// that records one (see the module's documentation).
pub(crate) fn linear_gelu_bf16(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
) -> Result<Tensor> {
    let bias = match bias {
        Some(b) => b.contiguous()?,
        None => Tensor::zeros(weight.dim(0)?, DType::F32, weight.device())?,
    };
    let op = LinearGeluBf16 {
        product: Mutex::new(Vec::new()),
    };
    Ok(x.contiguous()?.apply_op3(weight, &bias, op)?)
}

/// The candle op of [`linear_gelu_bf16`]: its arguments are the input, the weight and the bias;
/// it keeps the rounded product's bfloat16 bits from its forward for its backward.
struct LinearGeluBf16 {
    product: Mutex<Vec<u16>>,
}

impl candle_core::CustomOp3 for LinearGeluBf16 {
    fn name(&self) -> &'static str {
        "linear-gelu-bf16"
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
        let (y, shape) = forward_values([(x, x_layout), (w, w_layout), (b, b_layout)], name)?;
        let bits = to_bf16_bits(&y);
        let widened: Vec<f32> = bits.iter().map(|&b| bf16_value(b)).collect();
        let z = gelu_values(&widened);
        *self
            .product
            .lock()
            .map_err(|_| candle_core::Error::Msg(format!("{name}: a poisoned lock")))? = bits;
        Ok((to_storage(&z, DType::BF16), shape))
    }

    /// The GELU's gradient from the kept product, rounded to bfloat16, then the product's
    /// backward from it.
    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _out: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let name = self.name();
        let product = self
            .product
            .lock()
            .map_err(|_| candle_core::Error::Msg(format!("{name}: a poisoned lock")))?;
        let g: Vec<f32> = grad
            .contiguous()?
            .flatten_all()?
            .to_dtype(DType::F32)?
            .to_vec1()?;
        if g.len() != product.len() {
            return Err(candle_core::Error::Msg(format!(
                "{name}: a gradient of {} values for {} outputs",
                g.len(),
                product.len()
            )));
        }
        let y: Vec<f32> = product.iter().map(|&b| bf16_value(b)).collect();
        drop(product);
        let dy = Tensor::from_vec(gelu_grad_bf16(&y, &g), grad.shape(), grad.device())?;
        backward(x, w, b, &dy)
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Var};
    use half::bf16;

    use super::*;
    use crate::fused_grad::{gelu_erf_bf16, linear_bf16};

    fn bits(t: &Tensor) -> Vec<u16> {
        let t = t.to_dtype(DType::BF16).unwrap().flatten_all().unwrap();
        let v = t.to_vec1::<bf16>().unwrap();
        // Zeros compared by value: the two ops' zero-filled sums make a negative zero positive.
        v.iter()
            .map(|v| if v.to_f32() == 0.0 { 0 } else { v.to_bits() })
            .collect()
    }

    /// The one op against the bfloat16 product then the bfloat16 GELU: the same output and
    /// gradients (float32 parameters and a bfloat16 input, as autocast gives them), one node.
    #[test]
    fn equals_the_product_then_the_gelu() -> Result<()> {
        if !crate::kernel_choice().bf16_products {
            println!("not tested: the CPU lacks AVX512-BF16");
        }
        let dev = Device::Cpu;
        let x = Tensor::randn(0f32, 1., (3, 11, 40), &dev)?.to_dtype(DType::BF16)?;
        let x = Var::from_tensor(&x)?;
        let w = Var::randn(0f32, 0.2, (70, 40), &dev)?;
        let b = Var::randn(0f32, 0.5, 70, &dev)?;
        let (xt, wt, bt) = (x.as_tensor(), w.as_tensor(), b.as_tensor());
        let fused = linear_gelu_bf16(xt, wt, Some(bt))?;
        let nodes = fused.sorted_nodes().len();
        assert_eq!(nodes, 4, "the op and its three arguments");
        let two = gelu_erf_bf16(&linear_bf16(xt, wt, Some(bt))?)?;
        assert_eq!(fused.dtype(), DType::BF16);
        assert_eq!(bits(&fused), bits(&two));
        let g = Tensor::randn(0f32, 1., (3, 11, 70), &dev)?;
        let loss = |y: &Tensor| (y.to_dtype(DType::F32)? * &g)?.sum_all();
        let (gf, gt) = (loss(&fused)?.backward()?, loss(&two)?.backward()?);
        for v in [&x, &w, &b] {
            let (a, c) = (
                gf.get(v.as_tensor()).unwrap(),
                gt.get(v.as_tensor()).unwrap(),
            );
            assert_eq!(a.dtype(), v.dtype());
            assert_eq!(bits(a), bits(c), "{:?}", v.dims());
        }
        Ok(())
    }
}
