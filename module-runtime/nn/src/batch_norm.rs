//! Batch normalization: `BatchNorm1d`, `BatchNorm2d` (one type, [`BatchNorm`], over one or two
//! spatial dimensions) and their lazy twins `LazyBatchNorm1d`, `LazyBatchNorm2d` (a `BatchNorm`
//! whose parameters and running statistics are unbuilt).

use candle_core::{DType, Device, Tensor};

use crate::common::{fit_buffer, fit_param, forward_by_value, input_shape_error};
use crate::device::check_input_device;
use crate::error::Result;
use crate::norm_base::{
    blend_running_stats, mean_and_var, normalize, statistics, unbiased, NormState,
};
use crate::{Buffer, Forward, LazyShape, Mode, Module, Param};
use module_core::{py_bool, py_float, ExtraRepr};

/// How a batch norm is built: PyTorch's keyword arguments, with PyTorch's defaults.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BatchNormConfig {
    /// Added to the variance (default `1e-5`).
    pub eps: f64,
    /// Weight of the new batch in the running statistics (default `Some(0.1)`); `None` for a
    /// cumulative average over the batches seen.
    pub momentum: Option<f64>,
    /// Whether the layer has a per-channel `weight` and `bias` (default `true`).
    pub affine: bool,
    /// Whether the layer keeps running statistics, used in evaluation mode (default `true`);
    /// without them every call normalizes with the batch's statistics.
    pub track_running_stats: bool,
    /// The parameters' and running statistics' floating-point dtype (default `F32`).
    pub dtype: DType,
}

impl Default for BatchNormConfig {
    fn default() -> Self {
        Self {
            eps: 1e-5,
            momentum: Some(0.1),
            affine: true,
            track_running_stats: true,
            dtype: DType::F32,
        }
    }
}

/// Batch normalization over inputs with `D` spatial dimensions: PyTorch's `nn.BatchNorm1d`
/// ([`BatchNorm1d`] = `BatchNorm<1>`) and `nn.BatchNorm2d` ([`BatchNorm2d`] = `BatchNorm<2>`).
///
/// Parameters `weight` (ones) and `bias` (zeros), both `[C]`, when affine; buffers `running_mean`
/// (zeros) and `running_var` (ones), both `[C]`, and `num_batches_tracked` (an `i64` scalar) when
/// tracking running statistics — PyTorch's names, order and dtypes. The input is `[N, C]` or
/// `[N, C, L]` for `BatchNorm1d`, `[N, C, H, W]` for `BatchNorm2d`; the output has its shape.
/// As in PyTorch, a checkpoint without `num_batches_tracked` (saved before PyTorch 0.4.1) loads
/// strictly, keeping the layer's count (see [`Buffer::allow_missing`]).
///
/// In training mode (see [`Mode`]) the input is normalized with the batch mean and biased variance
/// over every dimension but the channels, and the running statistics are updated:
/// `r = (1 - momentum) r + momentum * batch_stat`, with the *unbiased* batch variance, and
/// `num_batches_tracked += 1`. In evaluation mode the running statistics are used and nothing
/// changes. Always composed of differentiable ops.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::BatchNorm2d;
/// let bn = BatchNorm2d::new(3, &Device::Cpu)?;
/// let x = Tensor::randn(0f32, 1., (2, 3, 4, 4), &Device::Cpu)?;
/// let y = bn.call(&x)?;
/// assert_eq!(y.dims(), x.dims());
/// assert_eq!(bn.num_batches_tracked.as_ref().unwrap().tensor()?.to_scalar::<i64>()?, 1);
/// bn.eval();
/// bn.call(&x)?; // eval: statistics unchanged
/// assert_eq!(bn.num_batches_tracked.as_ref().unwrap().tensor()?.to_scalar::<i64>()?, 1);
/// # Ok::<(), module_runtime::Error>(())
/// ```
///
/// Typed paths into it: [`BatchNormPath`], from [`BatchNorm::path`] (`#[module(paths)]`).
#[derive(Module, Clone, Debug)]
#[module(crate = module_core)]
#[module(paths)]
#[module(extra_repr)]
#[module(class_name = format!("BatchNorm{D}d"))]
pub struct BatchNorm<const D: usize> {
    /// `[C]`, if affine.
    pub weight: Option<Param>,
    /// `[C]`, if affine.
    pub bias: Option<Param>,
    /// `[C]`, if tracking running statistics.
    pub running_mean: Option<Buffer>,
    /// `[C]`, if tracking running statistics.
    pub running_var: Option<Buffer>,
    /// `i64` scalar, if tracking running statistics.
    pub num_batches_tracked: Option<Buffer>,
    /// Weight of the new batch in the running statistics; `None` for a cumulative average.
    pub momentum: Option<f64>,
    /// Added to the variance.
    pub eps: f64,
    /// Training or evaluation mode.
    pub mode: Mode,
}

/// Batch normalization of `[N, C]` or `[N, C, L]` inputs: PyTorch's `nn.BatchNorm1d`.
///
/// See [`BatchNorm`].
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::{BatchNorm1d, BatchNormConfig};
/// let config = BatchNormConfig { momentum: None, affine: false, ..Default::default() };
/// let bn = BatchNorm1d::with_config(3, config, &Device::Cpu)?;
/// let x = Tensor::randn(0f32, 1., (8, 3), &Device::Cpu)?;
/// assert_eq!(bn.call(&x)?.dims(), [8, 3]);
/// assert_eq!(bn.named_buffers().len(), 3);
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub type BatchNorm1d = BatchNorm<1>;

/// Batch normalization of `[N, C, H, W]` inputs: PyTorch's `nn.BatchNorm2d`. See [`BatchNorm`].
pub type BatchNorm2d = BatchNorm<2>;

impl<const D: usize> BatchNorm<D> {
    /// A float32 layer over `num_features` channels with PyTorch's defaults: `eps = 1e-5`,
    /// `momentum = 0.1`, affine, tracking running statistics, in training mode.
    pub fn new(num_features: usize, device: &Device) -> Result<Self> {
        Self::with_config(num_features, BatchNormConfig::default(), device)
    }

    /// A layer over `num_features` channels built as `config` says, in training mode.
    pub fn with_config(
        num_features: usize,
        config: BatchNormConfig,
        device: &Device,
    ) -> Result<Self> {
        let (affine, track) = (config.affine, config.track_running_stats);
        let state = NormState::eager(num_features, affine, track, config.dtype, device)?;
        Ok(Self::from_state(&config, state))
    }

    /// The layer `config` asks for, over the parameters and statistics of `state`.
    fn from_state(config: &BatchNormConfig, state: NormState) -> Self {
        Self {
            weight: state.weight,
            bias: state.bias,
            running_mean: state.running_mean,
            running_var: state.running_var,
            num_batches_tracked: state.num_batches_tracked,
            momentum: config.momentum,
            eps: config.eps,
            mode: Mode::new(),
        }
    }

    /// PyTorch's names for the layer and its lazy twin, and the paths a device mismatch names.
    fn names() -> Names {
        let (layer, lazy, weight, running_mean) = match D {
            1 => (
                "BatchNorm1d",
                "LazyBatchNorm1d",
                "BatchNorm1d.weight",
                "BatchNorm1d.running_mean",
            ),
            2 => (
                "BatchNorm2d",
                "LazyBatchNorm2d",
                "BatchNorm2d.weight",
                "BatchNorm2d.running_mean",
            ),
            _ => (
                "BatchNorm",
                "LazyBatchNorm",
                "BatchNorm.weight",
                "BatchNorm.running_mean",
            ),
        };
        Names {
            layer,
            lazy,
            weight,
            running_mean,
        }
    }

    /// Fails unless `x` has the rank this layer takes (`[N, C]` or `[N, C, L]` with one spatial
    /// dimension, `[N, C, *D spatial]` otherwise) and, if given, `channels` channels.
    fn check_input(x: &Tensor, lazy: bool, channels: Option<usize>) -> Result<()> {
        let rank_fits = x.rank() == D + 2 || (D == 1 && x.rank() == 2);
        if rank_fits && channels.is_none_or(|c| x.dim(1).ok() == Some(c)) {
            return Ok(());
        }
        let c = channels.map_or("C".to_owned(), |c| c.to_string());
        let expected = match D {
            1 => format!("[N, {c}] or [N, {c}, L]"),
            2 => format!("[N, {c}, H, W]"),
            _ => format!("[N, {c}, …] with {D} spatial dimensions"),
        };
        let names = Self::names();
        let layer = if lazy { names.lazy } else { names.layer };
        Err(input_shape_error(layer, expected, x))
    }

    /// The number of channels of the parameters or statistics, if there are any (and they are
    /// built).
    fn channels(&self) -> Option<usize> {
        let weight = self.weight.as_ref().filter(|w| w.is_built());
        let mean = self.running_mean.as_ref().filter(|b| b.is_built());
        weight
            .map(Param::elem_count)
            .or_else(|| mean.map(|b| b.shape().elem_count()))
    }

    /// The computation, once `x` is known to fit.
    fn normalize(&self, x: &Tensor) -> Result<Tensor> {
        let training = self.mode.is_training();
        let running = (&self.running_mean, &self.running_var);
        let (mean, var) = statistics(training, running, x, || self.batch_statistics(x, training))?;
        normalize(x, (&mean, &var), self.eps, &self.weight, &self.bias)
    }

    /// The batch's per-channel mean and biased variance, `[1, C, 1, …]`; in training, the running
    /// statistics are updated with them.
    fn batch_statistics(&self, x: &Tensor, training: bool) -> Result<(Tensor, Tensor)> {
        let reduce: Vec<usize> = (0..x.rank()).filter(|&d| d != 1).collect();
        let n = x.elem_count() / x.dim(1)?;
        if n <= 1 {
            let expected = "more than 1 value per channel when training";
            return Err(input_shape_error(Self::names().layer, expected, x));
        }
        let (mean, var) = mean_and_var(x, &reduce)?;
        if training {
            self.update_running_stats(&mean, &var, n)?;
        }
        Ok((mean, var))
    }

    /// `r = (1 - momentum) r + momentum * batch_stat`, with the unbiased batch variance; without a
    /// momentum, the cumulative average over `num_batches_tracked` batches.
    fn update_running_stats(&self, mean: &Tensor, var: &Tensor, n: usize) -> Result<()> {
        let (Some(rm), Some(rv)) = (&self.running_mean, &self.running_var) else {
            return Ok(());
        };
        let mut batches = None;
        if let Some(nbt) = &self.num_batches_tracked {
            let t = nbt.tensor()?;
            let next = t.broadcast_add(&t.ones_like()?)?;
            nbt.set(&next)?;
            batches = Some(next);
        }
        let factor = match (self.momentum, batches) {
            (Some(m), _) => m,
            (None, Some(b)) => 1.0 / b.to_dtype(DType::F64)?.to_scalar::<f64>()?,
            (None, None) => 0.0,
        };
        blend_running_stats(
            (rm, rv),
            &mean.detach().flatten_all()?,
            &unbiased(var, n)?.flatten_all()?,
            factor,
        )
    }
}

/// What [`BatchNorm::names`] gives.
struct Names {
    layer: &'static str,
    lazy: &'static str,
    weight: &'static str,
    running_mean: &'static str,
}

impl<const D: usize> Forward<&Tensor> for BatchNorm<D> {
    type Output = Tensor;

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Self::check_input(x, false, self.channels())?;
        let names = Self::names();
        if let Some(w) = &self.weight {
            check_input_device(names.weight, &w.tensor()?, x)?;
        } else if let Some(mean) = &self.running_mean {
            check_input_device(names.running_mean, &mean.tensor()?, x)?;
        }
        self.normalize(x)
    }
}

/// A [`BatchNorm`] whose number of channels is dimension 1 of its first input: PyTorch's
/// `nn.LazyBatchNorm1d` ([`LazyBatchNorm1d`]) and `nn.LazyBatchNorm2d` ([`LazyBatchNorm2d`]).
///
/// It *is* a `BatchNorm` whose parameters and running statistics are unbuilt (it dereferences to
/// it): same parameters, buffers, names, init and computation. `weight`, `bias`, `running_mean`
/// and `running_var` are built once, at the first call, a [`build`](crate::LazyExt::build) dry
/// run or a checkpoint load (`num_batches_tracked`, a scalar, exists from the start). After that,
/// an input with another number of channels is an [`Error::LazyInput`](module_core::Error::LazyInput)
/// naming the layer and both shapes.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::LazyBatchNorm2d;
/// let bn = LazyBatchNorm2d::new(&Device::Cpu)?;
/// bn.call(&Tensor::randn(0f32, 1., (2, 3, 4, 4), &Device::Cpu)?)?;
/// assert_eq!(bn.running_mean.as_ref().unwrap().shape().dims(), [3]);
/// assert_eq!(bn.num_features(), Some(3));
/// # Ok::<(), module_runtime::Error>(())
/// ```
///
/// Typed paths into it: [`LazyBatchNormPath`], from [`LazyBatchNorm::path`] (`#[module(paths)]`).
#[derive(Module, Clone, Debug)]
#[module(crate = module_core)]
#[module(paths)]
#[module(class_name = format!("LazyBatchNorm{D}d"))]
pub struct LazyBatchNorm<const D: usize> {
    #[module(flatten)]
    norm: BatchNorm<D>,
}

/// A [`BatchNorm1d`] whose number of channels comes from its first input: PyTorch's
/// `nn.LazyBatchNorm1d`. See [`LazyBatchNorm`].
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::LazyBatchNorm1d;
/// let bn = LazyBatchNorm1d::new(&Device::Cpu)?;
/// bn.call(&Tensor::randn(0f32, 1., (8, 3), &Device::Cpu)?)?;
/// assert_eq!(bn.weight.as_ref().unwrap().shape().dims(), [3]);
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub type LazyBatchNorm1d = LazyBatchNorm<1>;

/// A [`BatchNorm2d`] whose number of channels comes from its first input: PyTorch's
/// `nn.LazyBatchNorm2d`. See [`LazyBatchNorm`].
pub type LazyBatchNorm2d = LazyBatchNorm<2>;

impl<const D: usize> LazyBatchNorm<D> {
    /// A float32 layer with PyTorch's defaults: `eps = 1e-5`, `momentum = 0.1`, affine, tracking
    /// running statistics, in training mode.
    pub fn new(device: &Device) -> Result<Self> {
        Self::with_config(BatchNormConfig::default(), device)
    }

    /// A layer built as `config` says, in training mode.
    pub fn with_config(config: BatchNormConfig, device: &Device) -> Result<Self> {
        let channels = || LazyShape::new([None]);
        let state = NormState::new(
            config.affine,
            config.track_running_stats,
            device,
            |init| Param::lazy(channels(), init, config.dtype, device),
            |init| Buffer::lazy(channels(), init, config.dtype, device),
        )?;
        let norm = BatchNorm::from_state(&config, state);
        Ok(Self { norm })
    }

    /// Number of channels, once built (`None` with neither affine parameters nor running
    /// statistics: there is nothing to build).
    pub fn num_features(&self) -> Option<usize> {
        self.norm.channels()
    }
}

impl<const D: usize> std::ops::Deref for LazyBatchNorm<D> {
    type Target = BatchNorm<D>;

    /// The `BatchNorm` layer this is, built or not.
    fn deref(&self) -> &BatchNorm<D> {
        &self.norm
    }
}

impl<const D: usize> std::ops::DerefMut for LazyBatchNorm<D> {
    /// The `BatchNorm` layer this is, writable (its `momentum`, as PyTorch's `module.momentum`).
    fn deref_mut(&mut self) -> &mut BatchNorm<D> {
        &mut self.norm
    }
}

impl<const D: usize> Forward<&Tensor> for LazyBatchNorm<D> {
    type Output = Tensor;

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        BatchNorm::<D>::check_input(x, true, None)?;
        let layer = BatchNorm::<D>::names().lazy;
        let channels = (0, x.dim(1)?);
        for (name, p) in [("weight", &self.weight), ("bias", &self.bias)] {
            if let Some(p) = p {
                fit_param(layer, name, p, Some(channels), 0, x)?;
            }
        }
        let stats = [
            ("running_mean", &self.running_mean),
            ("running_var", &self.running_var),
        ];
        for (name, b) in stats {
            if let Some(b) = b {
                fit_buffer(layer, name, b, channels, x)?;
            }
        }
        self.norm.forward(x)
    }
}

impl<const D: usize> ExtraRepr for BatchNorm<D> {
    fn extra_repr(&self) -> String {
        let features = (self.weight.as_ref().map(Param::shape))
            .or(self.running_mean.as_ref().map(Buffer::shape))
            .map_or(0, |s| s.elem_count());
        let momentum = self.momentum.map_or("None".into(), py_float);
        let affine = py_bool(self.weight.is_some());
        let track = py_bool(self.running_mean.is_some());
        let eps = py_float(self.eps);
        format!(
            "{features}, eps={eps}, momentum={momentum}, affine={affine}, bias={affine}, \
             track_running_stats={track}"
        )
    }
}

forward_by_value!(BatchNorm1d, BatchNorm2d, LazyBatchNorm1d, LazyBatchNorm2d);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_norm_rejects_wrong_shapes() -> Result<()> {
        let dev = Device::Cpu;
        let bn = BatchNorm2d::new(3, &dev)?;
        let err = bn
            .forward(&Tensor::zeros((2, 3), DType::F32, &dev)?)
            .unwrap_err();
        assert!(err.to_string().contains("[N, 3, H, W]"), "{err}");
        assert!(bn
            .forward(&Tensor::zeros((2, 4, 2, 2), DType::F32, &dev)?)
            .is_err());
        let single = Tensor::zeros((1, 3, 1, 1), DType::F32, &dev)?;
        assert!(matches!(
            bn.forward(&single),
            Err(crate::Error::InputShape {
                layer: "BatchNorm2d",
                ..
            })
        ));
        Ok(())
    }
}
