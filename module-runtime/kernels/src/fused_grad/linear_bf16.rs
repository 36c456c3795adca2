//! `x Wᵀ + b` computed in bfloat16, as one op whose backward's two products are bfloat16 ones
//! too: what PyTorch's `linear` does on bfloat16 tensors (a bfloat16 model's, or under
//! `autocast(dtype=torch.bfloat16)`), on the AVX512-BF16 kernel (`bf16_gemm.rs`).
//!
//! The operands may be bfloat16 or float32 (autocast's float32 parameters and activations): each
//! is rounded to bfloat16 as it is read (the values of PyTorch's cast), the sums are float32, the
//! output is bfloat16, rounded once. The backward computes `dx = g W` and `dW = gᵀ x` on the same
//! kernel from the bfloat16 gradient and `db = Σ g` in float32, each rounded to bfloat16 (PyTorch's
//! bfloat16 `linear` backward), and hands each back in its operand's dtype (a float32 operand gets
//! the bfloat16 values widened, as the backward of PyTorch's cast gives them).
//!
//! Where the CPU lacks AVX512-BF16 (or a forced level is below `AVX512`) the same op computes the
//! products on the float32 kernels from the same bfloat16 values: the values agree within the
//! order of the float32 sums.

use std::borrow::Cow;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Layout, Shape, Storage, Tensor};

use crate::bf16_gemm::{bf16_product, to_bf16, to_bf16_bits};
use crate::error::Result;
use crate::fused_grad::linear::column_sums;
use crate::fused_grad::round::round_to_bf16_in_place;
use crate::matmul::Matrix;

/// `x Wᵀ + b` (`b` zero where `None`) for `x` `[…, in]`, `weight` `[out, in]` and `bias` `[out]`,
/// bfloat16 or float32 CPU tensors, in bfloat16 (see the module's documentation), recording the
/// gradient of each operand that records one.
pub(crate) fn linear_bf16(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let bias = match bias {
        Some(b) => b.contiguous()?,
        None => Tensor::zeros(weight.dim(0)?, DType::F32, weight.device())?,
    };
    Ok(x.contiguous()?.apply_op3(weight, &bias, LinearBf16)?)
}

/// Whether [`linear_bf16`] takes these operands: CPU tensors, each bfloat16 or float32.
pub(crate) fn bf16_operands(tensors: &[&Tensor]) -> bool {
    tensors
        .iter()
        .all(|t| t.device().is_cpu() && matches!(t.dtype(), DType::BF16 | DType::F32))
}

/// The bfloat16 bits of the values a layout reads from a CPU storage, from its first one on (as
/// far as its last one): in place for a bfloat16 storage, rounded for a float32 one.
fn bits<'a>(
    storage: &'a CpuStorage,
    layout: &Layout,
    op: &'static str,
) -> candle_core::Result<Cow<'a, [u16]>> {
    let span = match layout.shape().elem_count() {
        0 => 0,
        _ => {
            let dims = layout.shape().dims().iter().zip(layout.stride());
            1 + dims.map(|(d, s)| (d - 1) * s).sum::<usize>()
        }
    };
    let range = layout.start_offset()..layout.start_offset() + span;
    let short = || candle_core::Error::Msg(format!("{op}: a layout past its storage's end"));
    Ok(match storage {
        CpuStorage::BF16(v) => {
            let v = v.get(range).ok_or_else(short)?;
            Cow::Borrowed(half::slice::HalfFloatSliceExt::reinterpret_cast(v))
        }
        CpuStorage::F32(v) => Cow::Owned(to_bf16_bits(v.get(range).ok_or_else(short)?)),
        other => return Err(candle_core::Error::UnsupportedDTypeForOp(other.dtype(), op)),
    })
}

/// Float32 results each rounded once to bfloat16, as a bfloat16 storage, or (`dtype` float32)
/// widened back into a float32 one.
pub(super) fn to_storage(values: &[f32], dtype: DType) -> CpuStorage {
    match dtype {
        DType::F32 => CpuStorage::F32(
            to_bf16_bits(values)
                .iter()
                .map(|&b| f32::from_bits((b as u32) << 16))
                .collect(),
        ),
        _ => CpuStorage::BF16(to_bf16(values)),
    }
}

/// The candle op of [`linear_bf16`]: its arguments are the input, the weight and the bias.
struct LinearBf16;

impl candle_core::CustomOp3 for LinearBf16 {
    fn name(&self) -> &'static str {
        "linear-bf16"
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
        let (y, shape) =
            forward_values([(x, x_layout), (w, w_layout), (b, b_layout)], self.name())?;
        Ok((to_storage(&y, DType::BF16), shape))
    }

    /// `dx = g W`, `dW = gᵀ x` and `db = Σ g`, in bfloat16, each only for an argument that
    /// records a gradient.
    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _y: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        backward(x, w, b, grad)
    }
}

/// The float32 sums `x Wᵀ + b` of the op's forward (before their rounding), from the input, the
/// weight and the bias storages, and the output's shape.
pub(super) fn forward_values(
    [(x, x_layout), (w, w_layout), (b, b_layout)]: [(&CpuStorage, &Layout); 3],
    name: &'static str,
) -> candle_core::Result<(Vec<f32>, Shape)> {
    let mismatch = |rhs: &Layout| candle_core::Error::ShapeMismatchBinaryOp {
        lhs: x_layout.shape().clone(),
        rhs: rhs.shape().clone(),
        op: name,
    };
    let (out_features, in_features) = w_layout.shape().dims2()?;
    let x_dims = x_layout.shape().dims();
    if x_dims.last() != Some(&in_features) || !x_layout.is_contiguous() {
        return Err(mismatch(w_layout));
    }
    if b_layout.shape().dims() != [out_features] {
        return Err(mismatch(b_layout));
    }
    let rows = x_layout.shape().elem_count() / in_features.max(1);
    let (xv, wv, bv) = (
        bits(x, x_layout, name)?,
        bits(w, w_layout, name)?,
        bits(b, b_layout, name)?,
    );
    let stride = b_layout.stride()[0];
    let bias: Vec<f32> = (0..out_features)
        .map(|j| f32::from_bits((bv[j * stride] as u32) << 16))
        .collect();
    let w_strides = w_layout.stride();
    // `Wᵀ`: `[in, out]`, read in place.
    let wt = Matrix {
        values: &wv[..],
        row_stride: w_strides[1],
        col_stride: w_strides[0],
    };
    let y = bf16_product(
        Matrix::rows(&xv[..], in_features),
        wt,
        (rows, out_features, in_features),
        Some(&bias),
    )?;
    let mut dims = x_dims.to_vec();
    if let Some(last) = dims.last_mut() {
        *last = out_features;
    }
    Ok((y, Shape::from(dims)))
}

/// The op's backward for the output's gradient `grad`: `dx = g W`, `dW = gᵀ x` and `db = Σ g`,
/// in bfloat16, each only for an argument that records a gradient.
pub(super) fn backward(
    x: &Tensor,
    w: &Tensor,
    b: &Tensor,
    grad: &Tensor,
) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
    let (out_features, in_features) = w.dims2()?;
    let rows = x.elem_count() / in_features.max(1);
    let g = grad.contiguous()?.reshape((rows, out_features))?;
    let dx = match x.track_op() {
        true => Some(matmul_bf16(&g, &w.detach(), x.dtype())?.reshape(x.shape())?),
        false => None,
    };
    let dw = match w.track_op() {
        true => {
            let x2 = x.detach().reshape((rows, in_features))?;
            Some(matmul_bf16(&g.t()?, &x2, w.dtype())?)
        }
        false => None,
    };
    let db = match b.track_op() {
        true => {
            let sums = bf16_column_sums(&g, out_features, "linear-bf16")?;
            let sums = Tensor::from_vec(sums, out_features, b.device())?;
            Some(sums.to_dtype(DType::BF16)?.to_dtype(b.dtype())?)
        }
        false => None,
    };
    Ok((dx, dw, db))
}

/// The float32 sums of the columns of the contiguous bfloat16 (or float32) CPU matrix `g`, rows
/// `width` long: widened in one vectorized pass, summed on the pool.
fn bf16_column_sums(g: &Tensor, width: usize, op: &'static str) -> candle_core::Result<Vec<f32>> {
    let (storage, layout) = g.storage_and_layout();
    let Storage::Cpu(cpu) = &*storage else {
        return Err(candle_core::Error::Msg(format!(
            "{op}: expects CPU tensors"
        )));
    };
    let widened: Vec<f32> = bits(cpu, layout, op)?
        .iter()
        .map(|&b| f32::from_bits((b as u32) << 16))
        .collect();
    Ok(column_sums(&widened, width))
}

/// `a b` for bfloat16 or float32 CPU matrices (any strides), in bfloat16, the result in `dtype`
/// (float32 or bfloat16; bfloat16 values either way): the backward's products. Records no
/// gradient.
fn matmul_bf16(a: &Tensor, b: &Tensor, dtype: DType) -> candle_core::Result<Tensor> {
    a.apply_op2_no_bwd(b, &MatMulBf16(dtype))
}

/// The candle op of [`matmul_bf16`]: the dtype of its output (bfloat16 values either way).
struct MatMulBf16(DType);

impl candle_core::CustomOp2 for MatMulBf16 {
    fn name(&self) -> &'static str {
        "matmul-bf16"
    }

    fn cpu_fwd(
        &self,
        a: &CpuStorage,
        a_layout: &Layout,
        b: &CpuStorage,
        b_layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let name = self.name();
        let (m, k) = a_layout.shape().dims2()?;
        let (k2, n) = b_layout.shape().dims2()?;
        if k != k2 {
            return Err(candle_core::Error::ShapeMismatchBinaryOp {
                lhs: a_layout.shape().clone(),
                rhs: b_layout.shape().clone(),
                op: name,
            });
        }
        let (av, bv) = (bits(a, a_layout, name)?, bits(b, b_layout, name)?);
        let matrix = |values, layout: &Layout| Matrix {
            values,
            row_stride: layout.stride()[0],
            col_stride: layout.stride()[1],
        };
        let y = bf16_product(
            matrix(&av[..], a_layout),
            matrix(&bv[..], b_layout),
            (m, n, k),
            None,
        )?;
        let storage = match self.0 {
            // A float32 gradient of bfloat16 values (a float32 parameter's): rounded in place.
            DType::F32 => {
                let mut y = y;
                round_to_bf16_in_place(&mut y);
                CpuStorage::F32(y)
            }
            dtype => to_storage(&y, dtype),
        };
        Ok((storage, Shape::from((m, n))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    use crate::{kernel_choice, with_cpu_capability, CpuCapability};

    /// `t` rounded to bfloat16, in float32, recording the gradient.
    fn round(t: &Tensor) -> Tensor {
        t.to_dtype(DType::BF16)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
    }

    /// The largest difference relative to the largest value of `want`.
    fn rel_diff(got: &Tensor, want: &Tensor) -> f32 {
        let got = got.to_dtype(DType::F32).unwrap();
        let scale = want
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        crate::cpu::max_diff(&got, want) / scale.max(1e-30)
    }

    /// Output and the three gradients against the composed float32 ops on the rounded operands
    /// (the bfloat16 values PyTorch multiplies), for float32 and bfloat16 operands, a batch of
    /// rows and odd sizes, on every implementation (the float32 kernels under a forced AVX2).
    #[test]
    fn values_and_gradients_match_the_rounded_float32_ops() -> Result<()> {
        if !kernel_choice().bf16_products {
            println!(
                "AVX512-BF16 kernel not tested: {} lacks it",
                kernel_choice().cpu
            );
        }
        let dev = Device::Cpu;
        for (batch, rows, inf, outf) in [(1, 1, 7, 3), (2, 13, 33, 50), (4, 25, 130, 97)] {
            let x = Var::randn(0f32, 1., (batch, rows, inf), &dev)?;
            let w = Var::randn(0f32, 0.3, (outf, inf), &dev)?;
            let b = Var::randn(0f32, 1., outf, &dev)?;
            let g = Tensor::randn(0f32, 1., (batch, rows, outf), &dev)?;
            let want = round(
                &round(x.as_tensor())
                    .broadcast_matmul(&round(w.as_tensor()).t()?)?
                    .broadcast_add(&round(b.as_tensor()))?,
            );
            let want_grads = (&want * &g)?.sum_all()?.backward()?;
            for level in [CpuCapability::Avx512, CpuCapability::Avx2] {
                for dtype in [DType::F32, DType::BF16] {
                    let (xs, ws, bs) = (x.to_dtype(dtype)?, w.to_dtype(dtype)?, b.to_dtype(dtype)?);
                    let y = with_cpu_capability(level, || linear_bf16(&xs, &ws, Some(&bs)))?;
                    assert_eq!(y.dtype(), DType::BF16);
                    assert!(rel_diff(&y, &want) < 1e-2, "{level} {dtype:?}");
                    let loss = (y.to_dtype(DType::F32)? * &g)?.sum_all()?;
                    let grads = with_cpu_capability(level, || loss.backward())?;
                    // Through the casts for bfloat16 operands: the gradients reach the `Var`s.
                    for v in [&x, &w, &b] {
                        let got = grads.get(v).unwrap();
                        let d = rel_diff(got, want_grads.get(v).unwrap());
                        assert!(d < 2e-2, "{level} {dtype:?} {:?}: {d}", v.dims());
                    }
                }
            }
        }
        Ok(())
    }

    #[test]
    fn mismatched_shapes_are_errors() -> Result<()> {
        let dev = Device::Cpu;
        let x = Tensor::zeros((2, 5), DType::BF16, &dev)?;
        let w = Tensor::zeros((3, 4), DType::BF16, &dev)?;
        assert!(linear_bf16(&x, &w, None).is_err());
        let w = Tensor::zeros((3, 5), DType::BF16, &dev)?;
        let b = Tensor::zeros(4, DType::BF16, &dev)?;
        assert!(linear_bf16(&x, &w, Some(&b)).is_err());
        assert_eq!(linear_bf16(&x, &w, None)?.dims(), [2, 3]);
        let x = Tensor::zeros((2, 5), DType::F64, &dev)?;
        assert!(linear_bf16(&x, &w, None).is_err());
        Ok(())
    }
}
