//! Instance normalization: `InstanceNorm1d`, `InstanceNorm2d` (one type, [`InstanceNorm`], over
//! one or two spatial dimensions), and `LocalResponseNorm`.

use candle_core::{DType, Device, Tensor};

use crate::common::{batched, input_shape_error};
use crate::error::Result;
use crate::norm_base::{
    blend_running_stats, mean_and_var, normalize, statistics, unbiased, NormState,
};
use crate::{Buffer, Forward, Mode, Module, Param};
use module_core::{py_bool, py_float, ExtraRepr};

/// How an instance norm is built: PyTorch's keyword arguments, with PyTorch's defaults (which
/// differ from batch norm's: no affine parameters, no running statistics).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct InstanceNormConfig {
    /// Added to the variance (default `1e-5`).
    pub eps: f64,
    /// Weight of the new statistics in the running ones (default `0.1`).
    pub momentum: f64,
    /// Whether the layer has a per-channel `weight` and `bias` (default `false`).
    pub affine: bool,
    /// Whether the layer keeps running statistics, used in evaluation mode (default `false`).
    pub track_running_stats: bool,
    /// The parameters' and statistics' dtype (default `F32`).
    pub dtype: DType,
}

impl Default for InstanceNormConfig {
    fn default() -> Self {
        Self {
            eps: 1e-5,
            momentum: 0.1,
            affine: false,
            track_running_stats: false,
            dtype: DType::F32,
        }
    }
}

/// Instance normalization over `D` spatial dimensions: PyTorch's `nn.InstanceNorm1d`
/// ([`InstanceNorm1d`]) and `nn.InstanceNorm2d` ([`InstanceNorm2d`]).
///
/// Each sample's channel is normalized over its spatial dimensions with their mean and biased
/// variance. The input is `[N, C, *D]` or unbatched `[C, *D]`; the output has its shape.
/// Parameters `weight` (ones) and `bias` (zeros), `[C]`, when affine; buffers `running_mean`,
/// `running_var` and `num_batches_tracked` when tracking running statistics — PyTorch's names.
/// With running statistics, evaluation mode normalizes with them; training mode (and a layer
/// without them) with each instance's statistics, updating the running ones with their mean over
/// the batch (`r = (1 - momentum) r + momentum * stat`, the variance unbiased). As in PyTorch,
/// `num_batches_tracked` is kept for checkpoints but not counted. Without affine parameters or
/// running statistics any number of channels is taken (PyTorch warns); otherwise it must be
/// `num_features`. Composed of differentiable ops.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::{InstanceNorm2d, InstanceNormConfig};
/// let config = InstanceNormConfig { affine: true, ..Default::default() };
/// let norm = InstanceNorm2d::with_config(3, config, &Device::Cpu)?;
/// let x = Tensor::randn(0f32, 1., (2, 3, 4, 4), &Device::Cpu)?;
/// let y = norm.call(&x)?;
/// let mean = y.mean_keepdim((2, 3))?.abs()?.max_all()?.to_scalar::<f32>()?;
/// assert!(mean < 1e-5);
/// # Ok::<(), module_runtime::Error>(())
/// ```
#[derive(Module, Clone, Debug)]
#[module(crate = module_core)]
#[module(extra_repr)]
#[module(class_name = format!("InstanceNorm{D}d"))]
pub struct InstanceNorm<const D: usize> {
    /// `[C]`, if affine.
    pub weight: Option<Param>,
    /// `[C]`, if affine.
    pub bias: Option<Param>,
    /// `[C]`, if tracking running statistics.
    pub running_mean: Option<Buffer>,
    /// `[C]`, if tracking running statistics.
    pub running_var: Option<Buffer>,
    /// `i64` scalar, if tracking running statistics (never counted, as in PyTorch).
    pub num_batches_tracked: Option<Buffer>,
    /// The number of channels.
    pub num_features: usize,
    /// Added to the variance.
    pub eps: f64,
    /// Weight of the new statistics in the running ones.
    pub momentum: f64,
    /// Training or evaluation mode.
    pub mode: Mode,
}

/// PyTorch's `nn.InstanceNorm1d`: `[N, C, L]` or `[C, L]`. See [`InstanceNorm`].
pub type InstanceNorm1d = InstanceNorm<1>;
/// PyTorch's `nn.InstanceNorm2d`: `[N, C, H, W]` or `[C, H, W]`. See [`InstanceNorm`].
pub type InstanceNorm2d = InstanceNorm<2>;

impl<const D: usize> InstanceNorm<D> {
    /// A layer over `num_features` channels with PyTorch's defaults: no affine parameters, no
    /// running statistics, `eps = 1e-5`.
    pub fn new(num_features: usize, device: &Device) -> Result<Self> {
        Self::with_config(num_features, InstanceNormConfig::default(), device)
    }

    /// A layer over `num_features` channels built as `config` says, in training mode.
    pub fn with_config(
        num_features: usize,
        config: InstanceNormConfig,
        device: &Device,
    ) -> Result<Self> {
        let (affine, track) = (config.affine, config.track_running_stats);
        let state = NormState::eager(num_features, affine, track, config.dtype, device)?;
        Ok(Self {
            weight: state.weight,
            bias: state.bias,
            running_mean: state.running_mean,
            running_var: state.running_var,
            num_batches_tracked: state.num_batches_tracked,
            num_features,
            eps: config.eps,
            momentum: config.momentum,
            mode: Mode::new(),
        })
    }

    fn layer() -> &'static str {
        if D == 1 {
            "InstanceNorm1d"
        } else {
            "InstanceNorm2d"
        }
    }

    /// `[N, C, *D]` (an unbatched input as a batch of one), or the error naming what it takes.
    fn batched(&self, x: &Tensor) -> Result<Tensor> {
        let rank = x.rank();
        let strict = self.weight.is_some() || self.running_mean.is_some();
        let channel_dim = if rank == D + 1 { 0 } else { 1 };
        let fits = (rank == D + 1 || rank == D + 2)
            && x.dims()[rank - D..].iter().product::<usize>() > 1
            && (!strict || x.dim(channel_dim)? == self.num_features);
        if !fits {
            let c = if strict {
                self.num_features.to_string()
            } else {
                "C".to_owned()
            };
            let spatial = if D == 1 { "L" } else { "H, W" };
            let expected =
                format!("[N, {c}, {spatial}] or [{c}, {spatial}], more than one spatial value");
            return Err(input_shape_error(Self::layer(), expected, x));
        }
        Ok(batched(x, D + 1, 0)?.0)
    }
}

impl<const D: usize> Forward<&Tensor> for InstanceNorm<D> {
    type Output = Tensor;

    fn forward(&self, input: &Tensor) -> Result<Tensor> {
        let x = self.batched(input)?;
        let training = self.mode.is_training();
        let running = (&self.running_mean, &self.running_var);
        let (mean, var) = statistics(training, running, &x, || {
            let (mean, var) = mean_and_var(&x, &(2..x.rank()).collect::<Vec<_>>())?;
            if training {
                let n = x.elem_count() / x.dims()[..2].iter().product::<usize>();
                self.update_running_stats(&mean, &var, n)?;
            }
            Ok((mean, var))
        })?;
        let y = normalize(&x, (&mean, &var), self.eps, &self.weight, &self.bias)?;
        Ok(if input.rank() == D + 1 {
            y.squeeze(0)?
        } else {
            y
        })
    }
}

impl<const D: usize> InstanceNorm<D> {
    /// The running statistics moved towards the batch's mean of the instances' statistics
    /// (`mean`, `var` are `[N, C, 1, …]`; `n` values per instance).
    fn update_running_stats(&self, mean: &Tensor, var: &Tensor, n: usize) -> Result<()> {
        let (Some(rm), Some(rv)) = (&self.running_mean, &self.running_var) else {
            return Ok(());
        };
        // The instances' statistics `[N, C, 1, …]`, averaged over the batch.
        let over_batch = |t: &Tensor| t.flatten_from(1)?.mean(0);
        blend_running_stats(
            (rm, rv),
            &over_batch(&mean.detach())?,
            &over_batch(&unbiased(var, n)?)?,
            self.momentum,
        )
    }
}

/// PyTorch's `nn.LocalResponseNorm(size, alpha, beta, k)`: each channel divided by
/// `(k + alpha / size · Σ x²)^beta`, the sum over the `size` channels around it (from
/// `c - size / 2` to `c + (size - 1) / 2`, zeros beyond the edges). The input is `[N, C, …]` with
/// at least one more dimension. No parameters; composed of differentiable ops.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::LocalResponseNorm;
/// let lrn = LocalResponseNorm::new(2);
/// let x = Tensor::new(&[[[1f32], [2.], [3.]]], &Device::Cpu)?; // [1, 3, 1]
/// let y = lrn.call(&x)?;
/// // Channel 1: window {0, 1}, 2 / (1 + 1e-4 / 2 · (1 + 4))^0.75.
/// let want = 2.0 / (1.0 + 1e-4 / 2.0 * 5.0f32).powf(0.75);
/// assert!((y.flatten_all()?.to_vec1::<f32>()?[1] - want).abs() < 1e-6);
/// # Ok::<(), module_runtime::Error>(())
/// ```
#[derive(Module, Clone, Debug)]
#[module(crate = module_core)]
#[module(extra_repr)]
pub struct LocalResponseNorm {
    /// The number of neighbouring channels summed over.
    pub size: usize,
    /// The multiplicative factor (default `1e-4`).
    pub alpha: f64,
    /// The exponent (default `0.75`).
    pub beta: f64,
    /// The additive factor (default `1.0`).
    pub k: f64,
}

impl LocalResponseNorm {
    /// Over `size` channels, with PyTorch's defaults `alpha = 1e-4`, `beta = 0.75`, `k = 1`.
    pub fn new(size: usize) -> Self {
        Self::with_params(size, 1e-4, 0.75, 1.0)
    }

    /// Over `size` channels with the given `alpha`, `beta` and `k`.
    pub fn with_params(size: usize, alpha: f64, beta: f64, k: f64) -> Self {
        Self {
            size,
            alpha,
            beta,
            k,
        }
    }
}

impl Forward<&Tensor> for LocalResponseNorm {
    type Output = Tensor;

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if x.rank() < 3 || self.size == 0 {
            let expected = format!("[N, C, …] with at least 3 dimensions (size {})", self.size);
            return Err(input_shape_error("LocalResponseNorm", expected, x));
        }
        let c = x.dim(1)?;
        let squares = x
            .sqr()?
            .pad_with_zeros(1, self.size / 2, (self.size - 1) / 2)?;
        let mut sum = squares.narrow(1, 0, c)?;
        for t in 1..self.size {
            sum = (sum + squares.narrow(1, t, c)?)?;
        }
        let div = ((sum * (self.alpha / self.size as f64))? + self.k)?.powf(self.beta)?;
        Ok((x / div)?)
    }
}

impl<const D: usize> ExtraRepr for InstanceNorm<D> {
    fn extra_repr(&self) -> String {
        let affine = py_bool(self.weight.is_some());
        format!(
            "{}, eps={}, momentum={}, affine={affine}, bias={affine}, track_running_stats={}",
            self.num_features,
            py_float(self.eps),
            py_float(self.momentum),
            py_bool(self.running_mean.is_some())
        )
    }
}

impl ExtraRepr for LocalResponseNorm {
    fn extra_repr(&self) -> String {
        format!(
            "{}, alpha={}, beta={}, k={}",
            self.size,
            py_float(self.alpha),
            py_float(self.beta),
            py_float(self.k)
        )
    }
}
