//! The exact GELU as one op with a one-pass backward.
//!
//! candle's `gelu_erf` backward is eleven tensor ops, among them a scalar `erf` per element; here
//! the derivative `Φ(x) + x φ(x)` is one pass that reads the input, the forward's output and the
//! incoming gradient.

use candle_core::{CpuStorage, Layout, Shape, Tensor};

use crate::cpu::f32_slice;
use crate::elementwise::gelu_erf_vectorized;
use crate::error::Result;
use crate::fused_grad::{applies, map_rows, with_f32};

/// `1 / √(2π)`, the standard normal density at 0.
const INV_SQRT_TWO_PI: f32 = 0.398_942_3;

/// Whether [`gelu_erf`] can replace candle's `gelu_erf` for `x`.
pub(crate) fn can_fuse_gelu_erf(x: &Tensor) -> bool {
    applies(&[x])
}

/// The exact GELU `x Φ(x)` of `x`, with the vectorized `erf` of the inference kernel
/// ([`gelu_erf_vectorized`], within 2e-6 of the exact GELU), recording a one-pass backward.
pub(crate) fn gelu_erf(x: &Tensor) -> Result<Tensor> {
    Ok(x.contiguous()?.apply_op1(GeluErf)?)
}

/// The candle op of [`gelu_erf`].
struct GeluErf;

impl candle_core::CustomOp1 for GeluErf {
    fn name(&self) -> &'static str {
        "gelu-erf-fused"
    }

    fn cpu_fwd(&self, x: &CpuStorage, layout: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = f32_slice(x, layout, self.name())?;
        let y = map_rows([x], 1, |y, [x]| {
            for (y, &x) in y.iter_mut().zip(x) {
                *y = gelu_erf_vectorized(x);
            }
        });
        Ok((CpuStorage::F32(y), layout.shape().clone()))
    }

    /// `dx = g (Φ(x) + x φ(x))`, where `Φ(x) = GELU(x) / x` is read from the forward's output (the
    /// same `erf` as the forward, and none computed again) and `Φ(0) = ½`.
    fn bwd(&self, x: &Tensor, y: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let name = self.name();
        let grad = grad.contiguous()?;
        let dx = with_f32([x, y, &grad], name, |inputs| {
            map_rows(inputs, 1, |dx, [x, y, g]| {
                for (((dx, &x), &y), &g) in dx.iter_mut().zip(x).zip(y).zip(g) {
                    *dx = gelu_erf_grad(x, y, g);
                }
            })
        })?;
        Ok(Some(Tensor::from_vec(dx, x.shape(), x.device())?))
    }
}

/// `g (Φ(x) + x φ(x))`, the gradient through the exact GELU at `x` of `g`, with `Φ(x)` read from
/// the forward's float32 value `y = GELU(x)` (`Φ(0) = ½`).
#[inline(always)]
pub(super) fn gelu_erf_grad(x: f32, y: f32, g: f32) -> f32 {
    let cdf = if x == 0.0 { 0.5 } else { y / x };
    let pdf = INV_SQRT_TWO_PI * (-0.5 * x * x).exp();
    g * (cdf + x * pdf)
}
