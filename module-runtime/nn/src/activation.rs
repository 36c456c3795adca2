//! Activation functions as layers: `ReLU`, `GELU`, `SiLU`, `Sigmoid`, `Tanh`, `Softmax`,
//! `LogSoftmax`, and the [`Activation`] enum that holds any of them.
//!
//! Every layer here is elementwise or works along one dimension, so the output has the input's
//! shape. All are differentiable; the softmaxes take candle's fused kernel only when nothing needs a
//! gradient (see [`Softmax`]).
//!
//! None of these layers is zero-sized, on purpose: hooks may tell modules apart by address, and two
//! zero-sized fields of one struct can share an address. The layers without configuration hold a
//! [`Mode`] (PyTorch's `training` flag, which every `nn.Module` has), which gives them a real byte.

use candle_core::{DType, Tensor};

use crate::common::{
    config_layer, forward_by_value, layer_forward, layer_repr, resolve_dim, unit_layer,
};
use crate::error::Result;
use crate::fused_grad;
use crate::{Elementwise, Forward, Module};

unit_layer! {
    /// `max(x, 0)`: PyTorch's `nn.ReLU`. Any shape in, the same shape out.
    ///
    /// The gradient at exactly `0` is `1` here (candle's rule) where PyTorch uses `0`; it only matters
    /// for inputs that are exactly zero.
    ///
    /// Typed paths into it: [`ReLUPath`], from [`ReLU::path`] (`#[module(paths)]`).
    pub struct ReLU;
}

layer_forward!(ReLU, |_, x| Ok(x.relu()?));

/// How [`GELU`] computes its Gaussian CDF (PyTorch's `approximate` argument).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum GeluApproximation {
    /// The exact `x Φ(x) = x (1 + erf(x / √2)) / 2` (PyTorch's `approximate='none'`, the default).
    #[default]
    None,
    /// `x (1 + tanh(√(2/π) (x + 0.044715 x³))) / 2` (PyTorch's `approximate='tanh'`).
    Tanh,
}

/// The Gaussian error linear unit: PyTorch's `nn.GELU`. Any shape in, the same shape out.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::GELU;
/// let x = Tensor::new(&[-1f32, 0., 1.], &Device::Cpu)?;
/// let exact = GELU::new().call(&x)?.to_vec1::<f32>()?;
/// let tanh = GELU::tanh().call(&x)?.to_vec1::<f32>()?;
/// assert!((exact[2] - 0.8413).abs() < 1e-4);
/// assert!((tanh[2] - 0.8412).abs() < 1e-4);
/// # Ok::<(), module_runtime::Error>(())
/// ```
///
/// Typed paths into it: [`GELUPath`], from [`GELU::path`] (`#[module(paths)]`).
#[derive(Module, Clone, Debug, Default)]
#[module(crate = module_core)]
#[module(paths)]
#[module(extra_repr)]
pub struct GELU {
    /// Which formula to use.
    #[module(skip)]
    pub approximate: GeluApproximation,
}

impl GELU {
    /// The exact (erf) GELU.
    pub fn new() -> Self {
        Self::default()
    }

    /// The tanh approximation.
    pub fn tanh() -> Self {
        Self {
            approximate: GeluApproximation::Tanh,
        }
    }
}

impl Forward<&Tensor> for GELU {
    type Output = Tensor;

    /// The exact GELU of a float32 CPU tensor that needs no gradient runs a vectorized kernel (a
    /// rational approximation of `erf`, within 2e-6 of the exact GELU); everything else goes
    /// through candle's differentiable ops.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(match self.approximate {
            GeluApproximation::None
                if !x.track_op() && x.dtype() == DType::F32 && x.device().is_cpu() =>
            {
                x.contiguous()?
                    .apply_op1_no_bwd(&Vectorized(Elementwise::GeluErf))?
            }
            GeluApproximation::None if fused_grad::can_fuse_gelu_erf(x) => fused_grad::gelu_erf(x)?,
            GeluApproximation::None => x.gelu_erf()?,
            GeluApproximation::Tanh => x.gelu()?,
        })
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
        crate::fused::apply_in_place(&mut out, self.0);
        Ok((candle_core::CpuStorage::F32(out), layout.shape().clone()))
    }
}

unit_layer! {
    /// `x σ(x)`, also called swish: PyTorch's `nn.SiLU`. Any shape in, the same shape out.
    ///
    /// Typed paths into it: [`SiLUPath`], from [`SiLU::path`] (`#[module(paths)]`).
    pub struct SiLU;
}

impl Forward<&Tensor> for SiLU {
    type Output = Tensor;

    /// The SiLU of a float32 CPU tensor that needs no gradient runs a vectorized kernel (its
    /// `exp` within 2 ulps, the SiLU within 3; candle's calls libm's `expf` per element);
    /// everything else goes through candle's differentiable `silu`.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(
            if !x.track_op() && x.dtype() == DType::F32 && x.device().is_cpu() {
                x.contiguous()?
                    .apply_op1_no_bwd(&Vectorized(Elementwise::Silu))?
            } else {
                x.silu()?
            },
        )
    }
}

unit_layer! {
    /// `1 / (1 + e⁻ˣ)`: PyTorch's `nn.Sigmoid`. Any shape in, the same shape out.
    ///
    /// Typed paths into it: [`SigmoidPath`], from [`Sigmoid::path`] (`#[module(paths)]`).
    pub struct Sigmoid;
}

layer_forward!(Sigmoid, |_, x| {
    // candle-nn's sigmoid is a custom op with a backward pass.
    Ok(candle_nn::ops::sigmoid(x)?)
});

unit_layer! {
    /// The hyperbolic tangent: PyTorch's `nn.Tanh`. Any shape in, the same shape out.
    ///
    /// Typed paths into it: [`TanhPath`], from [`Tanh::path`] (`#[module(paths)]`).
    pub struct Tanh;
}

layer_forward!(Tanh, |_, x| Ok(x.tanh()?));

/// `softmax(x)` along `dim`, differentiable unless nothing needs a gradient.
///
/// The fused kernel (`candle_nn::ops::softmax_last_dim`) records no gradient (candle #3011), so it
/// is used only when the input tracks no gradient (`!x.track_op()`) and `dim` is the last one.
pub(crate) fn softmax(x: &Tensor, dim: usize) -> Result<Tensor> {
    if dim + 1 == x.rank() && !x.track_op() {
        return Ok(candle_nn::ops::softmax_last_dim(&x.contiguous()?)?);
    }
    if dim + 1 == x.rank() && fused_grad::can_fuse_softmax_last_dim(x) {
        return fused_grad::softmax_last_dim(x);
    }
    let shifted = x.broadcast_sub(&x.max_keepdim(dim)?.detach())?;
    let exp = shifted.exp()?;
    Ok(exp.broadcast_div(&exp.sum_keepdim(dim)?)?)
}

/// `log(softmax(x))` along `dim`, computed stably (`x - max - log Σ exp(x - max)`).
pub(crate) fn log_softmax(x: &Tensor, dim: usize) -> Result<Tensor> {
    // The max only shifts the values for stability; it cancels out of the result, so it needs
    // no gradient.
    let shifted = x.broadcast_sub(&x.max_keepdim(dim)?.detach())?;
    let log_sum = shifted.exp()?.sum_keepdim(dim)?.log()?;
    Ok(shifted.broadcast_sub(&log_sum)?)
}

config_layer! {
    /// `exp(xᵢ) / Σⱼ exp(xⱼ)` along `dim`: PyTorch's `nn.Softmax(dim)`. Any shape in, the same shape
    /// out; negative `dim` counts from the end.
    ///
    /// Differentiable. The fused candle kernel, which records no gradient (candle #3011), is used only
    /// when the input tracks no gradient and `dim` is the last dimension.
    ///
    /// ```
    /// use module_runtime::prelude::*;
    /// use module_runtime::nn::Softmax;
    /// let p = Softmax::new(-1).call(&Tensor::new(&[[1f32, 1.], [0., 0.]], &Device::Cpu)?)?;
    /// assert_eq!(p.to_vec2::<f32>()?, [[0.5, 0.5], [0.5, 0.5]]);
    /// # Ok::<(), module_runtime::Error>(())
    /// ```
    ///
    /// Typed paths into it: [`SoftmaxPath`], from [`Softmax::path`] (`#[module(paths)]`).
    #[module(extra_repr)]
    pub struct Softmax {
        /// The dimension the probabilities sum to one along (negative counts from the end).
        pub dim: isize,
    }
    /// Softmax along `dim`.
    new
}

layer_forward!(Softmax, |layer, x| softmax(
    x,
    resolve_dim(x, layer.dim, "softmax")?
));

layer_repr!(Softmax: dim);

config_layer! {
    /// `log(softmax(x))` along `dim`, computed stably: PyTorch's `nn.LogSoftmax(dim)`. Any shape in,
    /// the same shape out; negative `dim` counts from the end.
    ///
    /// Typed paths into it: [`LogSoftmaxPath`], from [`LogSoftmax::path`] (`#[module(paths)]`).
    #[module(extra_repr)]
    pub struct LogSoftmax {
        /// The dimension to normalize along (negative counts from the end).
        pub dim: isize,
    }
    /// Log-softmax along `dim`.
    new
}

layer_forward!(LogSoftmax, |layer, x| log_softmax(
    x,
    resolve_dim(x, layer.dim, "log_softmax")?
));

layer_repr!(LogSoftmax: dim);

/// Any of this module's activations, chosen at run time (from a config file, say).
///
/// Each variant holds its layer, and the enum is transparent: in a model's tree it *is* that layer,
/// at the field's path.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::Activation;
/// let act = Activation::relu();
/// let y = act.call(&Tensor::new(&[-1f32, 2.], &Device::Cpu)?)?;
/// assert_eq!(y.to_vec1::<f32>()?, [0., 2.]);
/// # Ok::<(), module_runtime::Error>(())
/// ```
///
/// Typed paths into it: [`ActivationPath`], from [`Activation::path`] (`#[module(paths)]`).
#[derive(Module, Clone, Debug)]
#[module(crate = module_core)]
#[module(paths)]
pub enum Activation {
    /// [`ReLU`].
    Relu(ReLU),
    /// [`GELU`], exact or tanh-approximated.
    Gelu(GELU),
    /// [`SiLU`].
    Silu(SiLU),
    /// [`Sigmoid`].
    Sigmoid(Sigmoid),
    /// [`Tanh`].
    Tanh(Tanh),
    /// [`Softmax`].
    Softmax(Softmax),
    /// [`LogSoftmax`].
    LogSoftmax(LogSoftmax),
}

impl Activation {
    /// `ReLU`.
    pub fn relu() -> Self {
        Self::Relu(ReLU::new())
    }

    /// Exact (erf) `GELU`.
    pub fn gelu() -> Self {
        Self::Gelu(GELU::new())
    }

    /// Tanh-approximated `GELU`.
    pub fn gelu_tanh() -> Self {
        Self::Gelu(GELU::tanh())
    }

    /// `SiLU`.
    pub fn silu() -> Self {
        Self::Silu(SiLU::new())
    }

    /// `Sigmoid`.
    pub fn sigmoid() -> Self {
        Self::Sigmoid(Sigmoid::new())
    }

    /// `Tanh`.
    pub fn tanh() -> Self {
        Self::Tanh(Tanh::new())
    }

    /// `Softmax` along `dim`.
    pub fn softmax(dim: isize) -> Self {
        Self::Softmax(Softmax::new(dim))
    }

    /// `LogSoftmax` along `dim`.
    pub fn log_softmax(dim: isize) -> Self {
        Self::LogSoftmax(LogSoftmax::new(dim))
    }
}

layer_forward!(Activation, |layer, x| {
    match layer {
        Self::Relu(m) => m.forward(x),
        Self::Gelu(m) => m.forward(x),
        Self::Silu(m) => m.forward(x),
        Self::Sigmoid(m) => m.forward(x),
        Self::Tanh(m) => m.forward(x),
        Self::Softmax(m) => m.forward(x),
        Self::LogSoftmax(m) => m.forward(x),
    }
});

layer_repr!(GELU, |layer| match layer.approximate {
    GeluApproximation::None => "approximate='none'".into(),
    GeluApproximation::Tanh => "approximate='tanh'".into(),
});

forward_by_value!(ReLU, GELU, SiLU, Sigmoid, Tanh, Softmax, LogSoftmax, Activation);

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

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

    #[test]
    fn gelu_fast_path_and_differentiable_path_agree() -> Result<()> {
        let x = Tensor::arange(-60f32, 60., &Device::Cpu)?.affine(0.1, 0.)?;
        let fast = GELU::new().forward(&x)?;
        let tracked = Var::from_tensor(&x)?;
        let slow = GELU::new().forward(tracked.as_tensor())?;
        let diff = (fast - slow)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 2e-6, "{diff}");
        Ok(())
    }

    #[test]
    fn layers_are_not_zero_sized() {
        assert_ne!(std::mem::size_of::<ReLU>(), 0);
        assert_ne!(std::mem::size_of::<GELU>(), 0);
        assert_ne!(std::mem::size_of::<SiLU>(), 0);
        assert_ne!(std::mem::size_of::<Sigmoid>(), 0);
        assert_ne!(std::mem::size_of::<Tanh>(), 0);
        assert_ne!(std::mem::size_of::<Softmax>(), 0);
        assert_ne!(std::mem::size_of::<LogSoftmax>(), 0);
    }

    #[test]
    fn softmax_fused_and_composed_agree_and_composed_has_a_gradient() -> Result<()> {
        let x = Var::new(&[[1f32, -2., 0.5], [3., 0., -1.]], &Device::Cpu)?;
        let fused = Softmax::new(-1).forward(&x.as_tensor().detach())?;
        let composed = Softmax::new(-1).forward(x.as_tensor())?;
        let diff = (fused - &composed)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-6);
        let grads = composed.sqr()?.sum_all()?.backward()?;
        assert!(grads.get(x.as_tensor()).is_some());
        Ok(())
    }
}
