//! A float32 tensor rounded to bfloat16 or float16 precision, kept in float32: what autocast's
//! cast to the half dtype followed by the float32 kernels' widening computes, as one op (one pass
//! over the pool each way, where the two casts are two single-threaded passes each way).
//!
//! Its backward rounds the gradient the same way, as the two casts' backward do (the gradient
//! reaching the half-precision copy is rounded to it, then widened back).

use candle_core::{CpuStorage, DType, Layout, Shape, Tensor};
use half::f16;

use crate::bf16_gemm::bf16_bits;
use crate::cpu::f32_slice;
use crate::error::Result;
use crate::fused_grad::{map_rows, with_f32};

/// `x` (float32, on the CPU) with each value rounded to `half` (`BF16` or `F16`, to nearest
/// even, as candle's and PyTorch's casts round), in float32: the values of
/// `x.to_dtype(half)?.to_dtype(F32)?`, recording a backward that rounds the gradient the same way.
pub(crate) fn round_to(x: &Tensor, half: DType) -> Result<Tensor> {
    Ok(x.contiguous()?.apply_op1(RoundTo(half))?)
}

/// The candle op of [`round_to`].
struct RoundTo(DType);

impl RoundTo {
    fn round(&self, values: &[f32]) -> Vec<f32> {
        if self.0 == DType::BF16 {
            map_rows([values], 1, |out, [x]| {
                for (y, &x) in out.iter_mut().zip(x) {
                    *y = f32::from_bits(u32::from(bf16_bits(x)) << 16);
                }
            })
        } else {
            map_rows([values], 1, |out, [x]| {
                for (y, &x) in out.iter_mut().zip(x) {
                    *y = f16::from_f32(x).to_f32();
                }
            })
        }
    }
}

impl candle_core::CustomOp1 for RoundTo {
    fn name(&self) -> &'static str {
        "round-to-half"
    }

    fn cpu_fwd(&self, x: &CpuStorage, layout: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = f32_slice(x, layout, self.name())?;
        Ok((CpuStorage::F32(self.round(x)), layout.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, _: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let grad = grad.contiguous()?;
        let dx = with_f32([&grad], self.name(), |[g]| self.round(g))?;
        Ok(Some(Tensor::from_vec(dx, x.shape(), x.device())?))
    }
}

/// Each value rounded to bfloat16 precision in place (to nearest even, NaNs kept NaN), still
/// float32: the values of [`to_bf16_bits`](crate::bf16_gemm::to_bf16_bits) widened, without a second buffer. Compiled for AVX-512
/// where the CPU has it.
pub(crate) fn round_to_bf16_in_place(values: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if crate::kernel_choice().elementwise >= crate::CpuCapability::Avx512 {
        // SAFETY: the CPU has AVX-512 F and BW (`kernel_choice` said so).
        unsafe { round_in_place_avx512(values) };
        return;
    }
    round_in_place(values);
}

/// [`round_in_place`] compiled for AVX-512 (the loop vectorizes 16 values at a time).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
unsafe fn round_in_place_avx512(values: &mut [f32]) {
    round_in_place(values);
}

/// `values[i]` rounded to bfloat16 precision, in float32.
#[inline(always)]
fn round_in_place(values: &mut [f32]) {
    for v in values.iter_mut() {
        *v = f32::from_bits(u32::from(bf16_bits(*v)) << 16);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};
    use half::bf16;

    /// The rounding is `half`'s, bit for bit, on every 2^-16th of the bit patterns and on the
    /// edges (zeros, subnormals, ties, the largest finite values, infinities, NaNs).
    #[test]
    fn the_rounding_is_halfs() {
        let edges = [
            0u32,
            0x8000_0000,
            1,
            0x0000_8000,
            0x0001_8000,
            0x3F80_8000,
            0x3F81_8000,
            0x3F80_7FFF,
            0x7F7F_FFFF,
            0xFF7F_FFFF,
            0x7F7F_7FFF,
            0x7F80_0000,
            0xFF80_0000,
            0x7F80_0001,
            0x7FC0_0000,
            0xFFFF_FFFF,
            0x7FBF_FFFF,
        ];
        let sampled = (0..=u32::MAX / 65_521).map(|i| i.wrapping_mul(65_521) ^ (i >> 3));
        let values: Vec<f32> = edges
            .into_iter()
            .chain(sampled)
            .map(f32::from_bits)
            .collect();
        let rounded = RoundTo(DType::BF16).round(&values);
        let mut in_place = values.clone();
        round_to_bf16_in_place(&mut in_place);
        for ((x, y), z) in values.iter().zip(rounded).zip(in_place) {
            let want = bf16::from_f32(*x).to_f32().to_bits();
            assert_eq!(y.to_bits(), want, "{:#010x}", x.to_bits());
            assert_eq!(z.to_bits(), want, "in place: {:#010x}", x.to_bits());
        }
    }

    #[test]
    fn equals_the_two_casts_both_ways() -> Result<()> {
        let x = Var::randn(0f32, 10.0, (37, 5), &Device::Cpu)?;
        let g = Tensor::randn(0f32, 10.0, (37, 5), &Device::Cpu)?;
        for half in [DType::BF16, DType::F16] {
            let ours = round_to(x.as_tensor(), half)?;
            let casts = x.to_dtype(half)?.to_dtype(DType::F32)?;
            let diff = |a: &Tensor, b: &Tensor| -> Result<f32> {
                Ok((a - b)?.abs()?.max_all()?.to_scalar::<f32>()?)
            };
            assert_eq!(diff(&ours, &casts)?, 0.0);
            let ga = (ours * &g)?.sum_all()?.backward()?;
            let gb = (casts * &g)?.sum_all()?.backward()?;
            assert_eq!(diff(ga.get(&x).unwrap(), gb.get(&x).unwrap())?, 0.0);
        }
        Ok(())
    }
}
