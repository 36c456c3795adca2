//! Elementwise activation functions on float32 CPU tensors, vectorized: the exact GELU (a
//! rational `erf`), the SiLU (a vectorized `exp`), ReLU, the tanh GELU, the sigmoid and `tanh`,
//! each as the entry a layer calls ([`gelu_erf`], [`silu`]) and as the in-place pass over a
//! layer's fresh output that a fused `Linear` then activation runs ([`activation_in_place`]).

use candle_core::{CpuStorage, DType, Layout, Tensor};

use crate::cpu::{f32_slice_mut, is_plain_cpu_f32};
use crate::error::Result;
use crate::fused_grad;
use crate::pool::{block_len, par_map};

/// The exact GELU of `x` (`x Φ(x)`), as PyTorch's `F.gelu(x)`: on a float32 CPU tensor that
/// records no gradient, the vectorized pass (a rational `erf`, within 2e-6 of the exact GELU);
/// recording one, the fused op whose backward is one pass (fusion on); everywhere else candle's
/// `gelu_erf`. A half-precision CPU input that records a gradient (a bfloat16 activation under
/// autocast) is computed on the float32 op and rounded once, as PyTorch's CPU kernel computes a
/// bfloat16 GELU in float32.
pub fn gelu_erf(x: &Tensor) -> Result<Tensor> {
    if let Some(half) = crate::cpu::cpu_half_dtype(&[x]).filter(|_| x.track_op()) {
        // One op for bfloat16 with fusion on (the same bits as the two casts around the float32
        // op, with one graph node where they make three).
        if half == DType::BF16 && crate::fusion::is_fusion_enabled() {
            return fused_grad::gelu_erf_bf16(x);
        }
        return Ok(gelu_erf(&crate::cpu::widen(x)?)?.to_dtype(half)?);
    }
    Ok(
        if !x.track_op() && x.dtype() == DType::F32 && x.device().is_cpu() {
            x.contiguous()?
                .apply_op1_no_bwd(&Vectorized(Elementwise::GeluErf))?
        } else if fused_grad::can_fuse_gelu_erf(x) {
            fused_grad::gelu_erf(x)?
        } else {
            x.gelu_erf()?
        },
    )
}

/// The SiLU of `x` (`x σ(x)`): on a float32 CPU tensor that records no gradient, the vectorized
/// pass (its `exp` within 2 ulps, the SiLU within 3; candle's calls libm's `expf` per element);
/// everything else candle's differentiable `silu`.
pub fn silu(x: &Tensor) -> Result<Tensor> {
    Ok(
        if !x.track_op() && x.dtype() == DType::F32 && x.device().is_cpu() {
            x.contiguous()?
                .apply_op1_no_bwd(&Vectorized(Elementwise::Silu))?
        } else {
            x.silu()?
        },
    )
}

/// An elementwise activation function that a fused pass can apply, computed exactly as the
/// runtime's activation layer computes it during CPU float32 inference.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Elementwise {
    /// `ReLU`: `max(x, 0)`.
    Relu,
    /// The exact `GELU`, with its vectorized `erf`.
    GeluErf,
    /// The tanh-approximated `GELU`.
    GeluTanh,
    /// `SiLU`: `x / (1 + e⁻ˣ)`, with its vectorized `exp`.
    Silu,
    /// `Sigmoid`: `1 / (e⁻ˣ + 1)`.
    Sigmoid,
    /// `Tanh`.
    Tanh,
}

// The tanh GELU's constant, as candle writes it (`SQRT_TWO_OVER_PI_F32`), so the result is candle's
// bit for bit.
#[allow(clippy::excessive_precision)]
const SQRT_TWO_OVER_PI: f32 = 0.79788456080286535587989211986876373;

impl Elementwise {
    /// `f(x)` in float32: the same formula, operation for operation, as the layer's CPU float32
    /// inference path (candle's scalar kernels, or the runtime's vectorized exact GELU and
    /// SiLU), so a fused pass gives the unfused pass's bits.
    ///
    /// ```
    /// use module_runtime::nn::Elementwise;
    /// assert_eq!(Elementwise::Relu.apply_f32(-2.0), 0.0);
    /// assert_eq!(Elementwise::Sigmoid.apply_f32(0.0), 0.5);
    /// ```
    #[inline(always)]
    pub fn apply_f32(self, x: f32) -> f32 {
        match self {
            Self::Relu => x.max(0.0),
            Self::GeluErf => gelu_erf_vectorized(x),
            Self::GeluTanh => {
                0.5 * x * (1.0 + f32::tanh(SQRT_TWO_OVER_PI * x * (1.0 + 0.044715 * x * x)))
            }
            Self::Silu => crate::vector_exp::silu_vectorized(x),
            Self::Sigmoid => ((-x).exp() + 1.0).recip(),
            Self::Tanh => x.tanh(),
        }
    }
}

/// `x Φ(x) = x (1 + erf(x / √2)) / 2` on float32, written so the compiler vectorizes it.
///
/// candle's `gelu_erf` calls the scalar `erf` of `libm` element by element, which profiles of
/// BERT inference on the CPU put at a tenth of the forward pass. This uses a rational minimax
/// approximation of `erf` on `[-4, 4]` (the form and coefficients of Eigen's
/// `generic_fast_erf_float`), and ±1 beyond ±3.9, where float32 rounds `erf` to ±1: multiplies,
/// adds, one division, a clamp and a select, eight lanes at a time. Its absolute error is below 4e-7 for `erf` and
/// below 2e-6 for the GELU (a few float32 ulps at |x| ≈ 6, where the GELU is ≈ 6); see the tests.
#[inline(always)]
pub(crate) fn gelu_erf_vectorized(x: f32) -> f32 {
    let z = (x * std::f32::consts::FRAC_1_SQRT_2).clamp(-4.0, 4.0);
    let z2 = z * z;
    // Numerator: z times an odd polynomial's coefficients in z², highest degree first.
    let mut p = -2.726_142_3e-10_f32;
    for c in [
        2.770_681_4e-8,
        -2.101_024e-6,
        -5.692_506_4e-5,
        -7.349_906_3e-4,
        -2.954_6e-3,
        -1.609_603_3e-2,
    ] {
        p = p * z2 + c;
    }
    let mut q = -1.456_607_2e-5_f32;
    for c in [-2.133_740_6e-4, -1.682_827e-3, -7.373_329e-3, -1.426_474e-2] {
        q = q * z2 + c;
    }
    // Beyond 3.9, erf rounds to ±1 in float32: exact there, so the GELU of a large negative input
    // is exactly 0 and of a large positive one exactly x, as in PyTorch.
    let erf = if z.abs() >= 3.9 {
        z.signum()
    } else {
        z * p / q
    };
    0.5 * x * (1.0 + erf)
}

/// The forward-only candle op running an [`Elementwise`] function over a contiguous float32
/// tensor: the exact GELU with [`gelu_erf_vectorized`], the SiLU with its vectorized `exp`.
struct Vectorized(Elementwise);

impl candle_core::CustomOp1 for Vectorized {
    fn name(&self) -> &'static str {
        "elementwise-vectorized"
    }

    fn cpu_fwd(
        &self,
        storage: &candle_core::CpuStorage,
        layout: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
        let candle_core::CpuStorage::F32(data) = storage else {
            return Err(candle_core::Error::UnsupportedDTypeForOp(
                candle_core::backend::BackendStorage::dtype(storage),
                self.name(),
            ));
        };
        let Some((start, end)) = layout.contiguous_offsets() else {
            return Err(candle_core::Error::RequiresContiguous { op: self.name() });
        };
        let mut out = data[start..end].to_vec();
        apply_in_place(&mut out, self.0);
        Ok((candle_core::CpuStorage::F32(out), layout.shape().clone()))
    }
}

/// Whether [`activation_in_place`] can run on a layer's fresh output `y`: nothing records a
/// gradient, float32 on the CPU, contiguous. The caller guarantees that no one else holds `y`.
pub fn can_activate_in_place(y: &Tensor) -> bool {
    y.rank() > 0 && is_plain_cpu_f32(y)
}

/// `y = f(y)` in place, in one pass split over the threads (see [`can_activate_in_place`]).
pub fn activation_in_place(y: &Tensor, f: Elementwise) -> Result<()> {
    Ok(y.inplace_op1(&ActivationInPlace(f))?)
}

/// `y = f(y)` over a contiguous float32 `y`.
struct ActivationInPlace(Elementwise);

impl ActivationInPlace {
    fn run(&self, y: &mut [f32]) {
        apply_in_place(y, self.0);
    }
}

/// `y = f(y)` in place: in blocks over the threads of [`par_map`] (one block, on the calling
/// thread, below its threshold), each block in a loop built for the CPU's widest vectors
/// ([`map_in_place`](crate::vector_exp::map_in_place)). The layers' own inference passes
/// (the exact GELU and the SiLU: [`gelu_erf`], [`silu`]) run this too, so fused and unfused passes
/// give the same bits.
pub(crate) fn apply_in_place(y: &mut [f32], f: Elementwise) {
    // One monomorphized loop per function, so each inlines (and ReLU, the exact GELU and the
    // SiLU vectorize) instead of dispatching per element.
    match f {
        Elementwise::Relu => apply(y, |v| Elementwise::Relu.apply_f32(v)),
        Elementwise::GeluErf => apply(y, |v| Elementwise::GeluErf.apply_f32(v)),
        Elementwise::GeluTanh => apply(y, |v| Elementwise::GeluTanh.apply_f32(v)),
        Elementwise::Silu => apply(y, |v| Elementwise::Silu.apply_f32(v)),
        Elementwise::Sigmoid => apply(y, |v| Elementwise::Sigmoid.apply_f32(v)),
        Elementwise::Tanh => apply(y, |v| Elementwise::Tanh.apply_f32(v)),
    }
}

fn apply(y: &mut [f32], f: impl Fn(f32) -> f32 + Sync + Copy) {
    let block = block_len(y.len(), 1);
    let level = crate::kernel_choice().elementwise;
    par_map(y.chunks_mut(block).collect(), |block: &mut [f32]| {
        crate::vector_exp::map_in_place(level, block, f)
    });
}

impl candle_core::InplaceOp1 for ActivationInPlace {
    fn name(&self) -> &'static str {
        "activation-in-place"
    }

    fn cpu_fwd(&self, y: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let name = candle_core::InplaceOp1::name(self);
        self.run(f32_slice_mut(y, layout, name)?);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `erf` in f64: its Maclaurin series up to |x| = 3 (where cancellation stays below 1e-12), the
    /// asymptotic series of `erfc` beyond (its truncation error there is below 1e-8).
    fn erf_reference(x: f64) -> f64 {
        if x.abs() > 3.0 {
            let z2 = x * x;
            let mut term = 1.0;
            let mut sum = 1.0;
            for n in 1..6 {
                term *= -((2 * n - 1) as f64) / (2.0 * z2);
                sum += term;
            }
            let erfc = (-z2).exp() / (x.abs() * std::f64::consts::PI.sqrt()) * sum;
            return x.signum() * (1.0 - erfc);
        }
        let mut term = x;
        let mut sum = x;
        for n in 1..100 {
            term *= -x * x / n as f64;
            sum += term / (2 * n + 1) as f64;
        }
        sum * 2.0 / std::f64::consts::PI.sqrt()
    }

    #[test]
    fn vectorized_gelu_matches_the_exact_gelu() {
        let mut worst = 0f64;
        for i in -8000..=8000 {
            let x = i as f64 * 1e-3;
            let exact = 0.5 * x * (1.0 + erf_reference(x / std::f64::consts::SQRT_2));
            let fast = f64::from(gelu_erf_vectorized(x as f32));
            worst = worst.max((exact - fast).abs());
        }
        assert!(worst < 2e-6, "largest error {worst:e}");
        assert_eq!(gelu_erf_vectorized(-100.0), 0.0);
        assert_eq!(gelu_erf_vectorized(100.0), 100.0);
    }
}
