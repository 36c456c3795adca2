//! Group normalization: `GroupNorm`.

use candle_core::{DType, Device};

use crate::common::layer_repr;
use crate::common::{
    compute_dtype, forward_by_value, input_shape_error, layer_forward, standardize_last_dim,
};
use crate::device::check_input_device;
use crate::error::{Error, Result};
use crate::norm_base::channel_affine;
use crate::Init;
use crate::{Module, Param};
use module_core::{py_bool, py_float};

/// How a [`GroupNorm`] is built: PyTorch's keyword arguments, with PyTorch's defaults.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GroupNormConfig {
    /// Added to the variance (default `1e-5`).
    pub eps: f64,
    /// Whether the layer has a per-channel `weight` and `bias` (default `true`).
    pub affine: bool,
    /// The parameters' floating-point dtype (default `F32`).
    pub dtype: DType,
}

impl Default for GroupNormConfig {
    fn default() -> Self {
        Self {
            eps: 1e-5,
            affine: true,
            dtype: DType::F32,
        }
    }
}

/// Normalizes groups of channels: PyTorch's `nn.GroupNorm(num_groups, num_channels)`.
///
/// The `C` channels are split into `num_groups` groups; each sample's group is normalized with its
/// own mean and biased variance, then scaled and shifted per channel. Parameters `weight` (ones) and
/// `bias` (zeros), both `[C]`, when affine. The input is `[N, C, *]`; the output has its shape.
/// Always composed of differentiable ops.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::GroupNorm;
/// let gn = GroupNorm::new(2, 4, &Device::Cpu)?;
/// let y = gn.call(&Tensor::randn(0f32, 1., (3, 4, 5), &Device::Cpu)?)?;
/// assert_eq!(y.dims(), [3, 4, 5]);
/// assert!(GroupNorm::new(3, 4, &Device::Cpu).is_err()); // 3 groups do not divide 4 channels
/// # Ok::<(), module_runtime::Error>(())
/// ```
///
/// Typed paths into it: [`GroupNormPath`], from [`GroupNorm::path`] (`#[module(paths)]`).
#[derive(Module, Clone, Debug)]
#[module(crate = module_core)]
#[module(paths)]
#[module(extra_repr)]
pub struct GroupNorm {
    /// `[num_channels]`, if affine.
    pub weight: Option<Param>,
    /// `[num_channels]`, if affine.
    pub bias: Option<Param>,
    /// Number of groups; divides `num_channels`.
    pub num_groups: usize,
    /// Number of channels `C`.
    pub num_channels: usize,
    /// Added to the variance.
    pub eps: f64,
}

impl GroupNorm {
    /// A float32 layer with PyTorch's defaults (`eps = 1e-5`, affine).
    pub fn new(num_groups: usize, num_channels: usize, device: &Device) -> Result<Self> {
        Self::with_config(num_groups, num_channels, GroupNormConfig::default(), device)
    }

    /// A layer built as `config` says. `num_groups` must divide `num_channels`
    /// ([`Error::InvalidConfig`] otherwise).
    pub fn with_config(
        num_groups: usize,
        num_channels: usize,
        config: GroupNormConfig,
        device: &Device,
    ) -> Result<Self> {
        if num_groups == 0 || !num_channels.is_multiple_of(num_groups) {
            return Err(Error::InvalidConfig {
                layer: "GroupNorm",
                message: format!(
                    "num_channels ({num_channels}) must be divisible by num_groups ({num_groups})"
                ),
            });
        }
        let param = |init: Init| -> Result<Option<Param>> {
            config
                .affine
                .then(|| Param::init(num_channels, init, 0, config.dtype, device))
                .transpose()
        };
        Ok(Self {
            weight: param(Init::Ones)?,
            bias: param(Init::Zeros)?,
            num_groups,
            num_channels,
            eps: config.eps,
        })
    }
}

layer_forward!(GroupNorm, |layer, x| {
    let dims = x.dims();
    if dims.len() < 2 || dims[1] != layer.num_channels {
        let expected = format!("[N, {}, *]", layer.num_channels);
        return Err(input_shape_error("GroupNorm", expected, x));
    }
    if let Some(w) = &layer.weight {
        check_input_device("GroupNorm.weight", &w.tensor()?, x)?;
    }
    // A float32 op under CUDA autocast; the input's dtype under CPU autocast.
    let [x] = module_core::autocast_policy::autocast_cast(
        module_core::autocast_policy::AutocastOp::GroupNorm,
        [x],
    )?;
    let dtype = x.dtype();
    let grouped = x
        .to_dtype(compute_dtype(dtype))?
        .reshape((dims[0], layer.num_groups, ()))?;
    let y = standardize_last_dim(&grouped, layer.eps)?
        .to_dtype(dtype)?
        .reshape(dims)?;
    channel_affine(y, &layer.weight, &layer.bias)
});

layer_repr!(GroupNorm, |layer| {
    let affine = py_bool(layer.weight.is_some());
    let eps = py_float(layer.eps);
    let (groups, channels) = (layer.num_groups, layer.num_channels);
    format!("{groups}, {channels}, eps={eps}, affine={affine}, bias={affine}")
});

forward_by_value!(GroupNorm);
