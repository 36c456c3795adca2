//! [`LazyConv`]: `LazyConv1d` and `LazyConv2d`, a [`Conv`] whose parameters are built at the first
//! input.

use candle_core::{Device, Tensor};

use super::{check_groups, Conv, ConvConfig, Spatial};
use crate::common::{fit_param, forward_by_value, input_shape_error, lazy_param, Size};
use crate::error::Result;
use crate::{Forward, Init, Module};

/// A [`Conv`] whose `in_channels` is dimension 1 of its first input: PyTorch's `nn.LazyConv1d`
/// ([`LazyConv1d`]) and `nn.LazyConv2d` ([`LazyConv2d`]).
///
/// It *is* a `Conv` whose parameters are unbuilt (it dereferences to it): same parameters, names,
/// init and computation, built once, at the first call, a [`build`](crate::LazyExt::build) dry run
/// or a checkpoint load. After that, an input with another number of channels is an
/// [`Error::LazyInput`](module_core::Error::LazyInput) naming the layer and both shapes.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::{ConvConfig, LazyConv2d};
/// let conv = LazyConv2d::with_config(6, 3, ConvConfig { padding: 1.into(), ..Default::default() }, &Device::Cpu)?;
/// let y = conv.call(&Tensor::zeros((1, 2, 5, 5), DType::F32, &Device::Cpu)?)?;
/// assert_eq!(y.dims(), [1, 6, 5, 5]);
/// assert_eq!(conv.in_channels(), Some(2));
/// # Ok::<(), module_runtime::Error>(())
/// ```
///
/// Typed paths into it: [`LazyConvPath`], from [`LazyConv::path`] (`#[module(paths)]`).
#[derive(Module, Clone, Debug)]
#[module(crate = module_core)]
#[module(paths)]
#[module(class_name = format!("LazyConv{D}d"))]
pub struct LazyConv<const D: usize> {
    #[module(flatten)]
    pub(crate) conv: Conv<D>,
}

/// A [`Conv1d`](super::Conv1d) whose `in_channels` comes from its first input: PyTorch's
/// `nn.LazyConv1d`. See [`LazyConv`].
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::LazyConv1d;
/// let conv = LazyConv1d::new(4, 3, &Device::Cpu)?;
/// let y = conv.call(&Tensor::zeros((2, 3, 9), DType::F32, &Device::Cpu)?)?;
/// assert_eq!(y.dims(), [2, 4, 7]);
/// assert_eq!(conv.weight.shape().dims(), [4, 3, 3]);
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub type LazyConv1d = LazyConv<1>;

/// A [`Conv2d`](super::Conv2d) whose `in_channels` comes from its first input: PyTorch's
/// `nn.LazyConv2d`. See [`LazyConv`].
pub type LazyConv2d = LazyConv<2>;

impl<const D: usize> LazyConv<D> {
    /// A float32 layer with PyTorch's defaults (stride 1, no padding, a bias).
    pub fn new(out_channels: usize, kernel_size: impl Size<D>, device: &Device) -> Result<Self> {
        Self::with_config(out_channels, kernel_size, ConvConfig::default(), device)
    }

    /// A layer built as `config` says. `groups` must divide `out_channels` now and
    /// `in_channels` at the build
    /// ([`Error::InvalidConfig`](crate::error::Error::InvalidConfig) otherwise).
    pub fn with_config(
        out_channels: usize,
        kernel_size: impl Size<D>,
        config: ConvConfig,
        device: &Device,
    ) -> Result<Self> {
        let names = Conv::<D>::names()?;
        check_groups(names.lazy, config.groups, out_channels, config.groups)?;
        Spatial::<D>::of(names.lazy, &config)?;
        let mut dims = vec![Some(out_channels), None];
        dims.extend(kernel_size.dims().map(Some));
        let lazy =
            |dims: &[Option<usize>]| lazy_param(dims, Init::UniformFanIn, config.dtype, device);
        let conv = Conv {
            weight: lazy(&dims)?,
            bias: config
                .bias
                .then(|| lazy(&[Some(out_channels)]))
                .transpose()?,
            config,
            lora: None,
            modules_to_save: None,
            parametrizations: None,
        };
        Ok(Self { conv })
    }

    /// Number of input channels, once built.
    pub fn in_channels(&self) -> Option<usize> {
        self.weight
            .is_built()
            .then(|| self.weight.shape().dims()[1] * self.config.groups)
    }

    /// Number of output channels.
    pub fn out_channels(&self) -> usize {
        match self.weight.lazy_shape() {
            Some(shape) => shape.dims()[0].unwrap_or_default(),
            None => self.weight.shape().dims()[0],
        }
    }
}

impl<const D: usize> std::ops::Deref for LazyConv<D> {
    type Target = Conv<D>;

    /// The `Conv` layer this is, built or not.
    fn deref(&self) -> &Conv<D> {
        &self.conv
    }
}

impl<const D: usize> Forward<&Tensor> for LazyConv<D> {
    type Output = Tensor;

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let layer = Conv::<D>::names()?.lazy;
        let (in_channels, groups) = (x.dim(1)?, self.config.groups);
        if in_channels % groups != 0 {
            let expected = format!("[N, C_in, …] with C_in a multiple of groups ({groups})");
            return Err(input_shape_error(layer, expected, x));
        }
        let kernel_area: usize = match self.weight.lazy_shape() {
            Some(shape) => shape.dims()[2..].iter().flatten().product(),
            None => self.weight.shape().dims()[2..].iter().product(),
        };
        let fan_in = in_channels / groups * kernel_area;
        let fit = |name, p, set| fit_param(layer, name, p, set, fan_in, x);
        fit("weight", &self.weight, Some((1, in_channels / groups)))?;
        if let Some(b) = &self.bias {
            fit("bias", b, None)?;
        }
        self.conv.forward(x)
    }
}

forward_by_value!(LazyConv1d, LazyConv2d);
