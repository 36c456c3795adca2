//! [`ConvTranspose`]: PyTorch's `nn.ConvTranspose1d` and `nn.ConvTranspose2d` (one type over one
//! or two spatial dimensions), its config, and the 2-D computation (the 1-D one is in
//! `transpose1d.rs`).

use candle_core::{DType, Device, Tensor};

use super::{check_groups, conv_params, ConvRepr};
use crate::common::{add_channel_bias, forward_by_value, layer_forward, lower_precision, Size};
use crate::device::check_input_device;
use crate::error::Result;
use crate::{Module, Param};
use module_core::autocast_policy::AutocastOp;
use module_core::ExtraRepr;

/// How a [`ConvTranspose`] is built: PyTorch's keyword arguments, with PyTorch's defaults
/// (`ConvTransposeConfig::default()`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConvTransposeConfig {
    /// Step between windows (default 1).
    pub stride: usize,
    /// `dilation * (kernel - 1) - padding` zeros are added on both sides of each input dimension
    /// (default 0).
    pub padding: usize,
    /// Extra size added to one side of each output dimension (default 0).
    pub output_padding: usize,
    /// Spacing between kernel elements (default 1).
    pub dilation: usize,
    /// Number of blocked connections from input to output channels; divides both channel counts
    /// (default 1).
    pub groups: usize,
    /// Whether the layer has a bias (default `true`).
    pub bias: bool,
    /// The parameters' floating-point dtype (default `F32`).
    pub dtype: DType,
}

impl Default for ConvTransposeConfig {
    fn default() -> Self {
        Self {
            stride: 1,
            padding: 0,
            output_padding: 0,
            dilation: 1,
            groups: 1,
            bias: true,
            dtype: DType::F32,
        }
    }
}

/// A transposed convolution over `D` spatial dimensions (the gradient of a convolution with
/// respect to its input): PyTorch's `nn.ConvTranspose1d` ([`ConvTranspose1d`] =
/// `ConvTranspose<1>`) and `nn.ConvTranspose2d` ([`ConvTranspose2d`] = `ConvTranspose<2>`).
/// PyTorch's base class is `_ConvTransposeNd`.
///
/// Parameters `weight` `[in_channels, out_channels / groups, *kernel]` (PyTorch's layout,
/// transposed relative to [`Conv`](super::Conv)) and `bias` `[out_channels]` (absent without a
/// bias), initialized like PyTorch. The input is `[N, C_in, *D]`; each output dimension is
/// `(L - 1) stride - 2 padding + dilation (k - 1) + output_padding + 1`.
///
/// Typed paths into it: [`ConvTransposePath`], from [`ConvTranspose::path`] (`#[module(paths)]`).
#[derive(Module, Clone, Debug)]
#[module(crate = module_core)]
#[module(paths)]
#[module(extra_repr)]
#[module(class_name = format!("ConvTranspose{D}d"))]
pub struct ConvTranspose<const D: usize> {
    /// `[in_channels, out_channels / groups, *kernel]`.
    pub weight: Param,
    /// `[out_channels]`, if the layer has a bias.
    pub bias: Option<Param>,
    /// Stride, padding, output padding, dilation, groups, bias and dtype.
    #[module(skip)]
    pub config: ConvTransposeConfig,
    /// Parametrizations ([`parametrize`](crate::parametrize)), flattened.
    #[module(flatten)]
    pub(crate) parametrizations: Option<Box<crate::parametrize::Parametrizations>>,
}

/// A 1-D transposed convolution: PyTorch's `nn.ConvTranspose1d` (the gradient of a `Conv1d`
/// with respect to its input; the upsampling layer of vocoders and 1-D decoders). See
/// [`ConvTranspose`].
///
/// Parameters `weight` `[in_channels, out_channels / groups, kernel_size]` and `bias`
/// `[out_channels]`. The input is `[N, C_in, L]` (or `[C_in, L]`); the output
/// `[N, C_out, L_out]` with `L_out = (L - 1) stride - 2 padding + dilation (kernel_size - 1) +
/// output_padding + 1`. It runs as the direct convolution it equals: the input with
/// `stride - 1` zeros between its elements, padded by `dilation (kernel_size - 1) - padding`
/// (and `output_padding` more on the right), convolved with the kernel flipped and its channel
/// axes swapped; every step is differentiable.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::{ConvTranspose1d, ConvTransposeConfig};
/// let cfg = ConvTransposeConfig { stride: 2, padding: 1, output_padding: 1, ..Default::default() };
/// let up = ConvTranspose1d::with_config(4, 2, 3, cfg, &Device::Cpu)?;
/// let y = up.call(&Tensor::zeros((1, 4, 8), DType::F32, &Device::Cpu)?)?;
/// assert_eq!(y.dims(), [1, 2, 16]);
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub type ConvTranspose1d = ConvTranspose<1>;

/// A 2-D transposed convolution: PyTorch's `nn.ConvTranspose2d`. See [`ConvTranspose`].
///
/// Parameters `weight` `[in_channels, out_channels / groups, kH, kW]` and `bias`
/// `[out_channels]`. The input is `[N, C_in, H, W]`; the output `[N, C_out, H_out, W_out]` with
/// `H_out = (H - 1) stride - 2 padding + dilation (kH - 1) + output_padding + 1`.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::{ConvTranspose2d, ConvTransposeConfig};
/// let cfg = ConvTransposeConfig { stride: 2, padding: 1, output_padding: 1, ..Default::default() };
/// let up = ConvTranspose2d::with_config(3, 2, 3, cfg, &Device::Cpu)?;
/// let y = up.call(&Tensor::zeros((1, 3, 4, 4), DType::F32, &Device::Cpu)?)?;
/// assert_eq!(y.dims(), [1, 2, 8, 8]);
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub type ConvTranspose2d = ConvTranspose<2>;

/// Typed paths into a [`ConvTranspose2d`] (see [`ConvTransposePath`]).
pub type ConvTranspose2dPath<R, K> = ConvTransposePath<R, K, 2>;

impl<const D: usize> ConvTranspose<D> {
    /// A float32 layer with PyTorch's defaults (stride 1, no padding, a bias), initialized like
    /// PyTorch; `kernel_size` is `k` for every spatial dimension or one per dimension (`(kH, kW)`).
    pub fn new(
        in_channels: usize,
        out_channels: usize,
        kernel_size: impl Size<D>,
        device: &Device,
    ) -> Result<Self> {
        let config = ConvTransposeConfig::default();
        Self::with_config(in_channels, out_channels, kernel_size, config, device)
    }

    /// A layer built as `config` says, initialized like PyTorch. `groups` must divide both channel
    /// counts ([`Error::InvalidConfig`](crate::error::Error::InvalidConfig) otherwise).
    pub fn with_config(
        in_channels: usize,
        out_channels: usize,
        kernel_size: impl Size<D>,
        config: ConvTransposeConfig,
        device: &Device,
    ) -> Result<Self> {
        check_groups(Self::layer(), in_channels, out_channels, config.groups)?;
        let mut dims = vec![in_channels, out_channels / config.groups];
        dims.extend(kernel_size.dims());
        let (weight, bias) = conv_params(&dims, out_channels, config.bias, config.dtype, device)?;
        Ok(Self {
            weight,
            bias,
            config,
            parametrizations: None,
        })
    }

    /// PyTorch's name for the layer.
    fn layer() -> &'static str {
        match D {
            1 => "ConvTranspose1d",
            2 => "ConvTranspose2d",
            _ => "ConvTranspose",
        }
    }
}

layer_forward!(ConvTranspose2d, |layer, x| {
    let c = &layer.config;
    let weight = layer.weight_value()?;
    check_input_device("ConvTranspose2d.weight", &weight, x)?;
    let run = |x: &Tensor, w: &Tensor| {
        x.conv_transpose2d(w, c.padding, c.output_padding, c.stride, c.dilation)
    };
    // Under autocast a lower-precision op (PyTorch's `conv_transpose2d`).
    let bias = layer.bias_value()?;
    lower_precision(
        AutocastOp::ConvTranspose,
        x,
        &weight,
        bias,
        |x, weight, bias| {
            // candle's transposed convolution has no groups: run each group on its slice of the
            // input channels and of the weight, and stack the outputs along the channels.
            let y = if c.groups == 1 {
                run(x, weight)?
            } else {
                let xs = x.chunk(c.groups, 1)?;
                let ws = weight.chunk(c.groups, 0)?;
                let ys = xs
                    .iter()
                    .zip(&ws)
                    .map(|(x, w)| run(x, w))
                    .collect::<candle_core::Result<Vec<_>>>()?;
                Tensor::cat(&ys, 1)?
            };
            add_channel_bias(y, bias)
        },
    )
});

/// PyTorch's text: `ConvTranspose2d(3, 8, kernel_size=(3, 3), stride=(2, 2), padding=(1, 1),
/// output_padding=(1, 1), bias=False)`.
impl<const D: usize> ExtraRepr for ConvTranspose<D> {
    fn extra_repr(&self) -> String {
        let dims = self.weight.shape().dims().to_vec();
        let c = &self.config;
        ConvRepr {
            channels: (dims[0], dims[1] * c.groups),
            kernel_size: &dims[2..],
            stride: vec![c.stride; D],
            padding: vec![c.padding; D],
            dilation: vec![c.dilation; D],
            output_padding: vec![c.output_padding; D],
            groups: c.groups,
            bias: self.bias.is_some(),
        }
        .text()
    }

    /// PyTorch's `ParametrizedConvTranspose2d` once a tensor is parametrized.
    fn class_repr(&self) -> Option<String> {
        let class = <Self as Module>::type_class_name;
        (self.parametrizations.as_ref()).map(|_| format!("Parametrized{}", class()))
    }
}

forward_by_value!(ConvTranspose2d);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Forward;

    /// A grouped transposed convolution equals the per-group convolutions, stacked.
    #[test]
    fn conv_transpose_groups_split_channels() -> Result<()> {
        let dev = Device::Cpu;
        let cfg = ConvTransposeConfig {
            groups: 2,
            stride: 2,
            bias: false,
            ..Default::default()
        };
        let grouped = ConvTranspose2d::with_config(4, 6, 3, cfg, &dev)?;
        assert_eq!(grouped.weight.shape().dims(), [4, 3, 3, 3]);
        let x = Tensor::randn(0f32, 1., (1, 4, 5, 5), &dev)?;
        let y = grouped.forward(&x)?;
        let w = grouped.weight.tensor()?;
        let first = x
            .narrow(1, 0, 2)?
            .conv_transpose2d(&w.narrow(0, 0, 2)?, 0, 0, 2, 1)?;
        let diff = (y.narrow(1, 0, 3)? - first)?.abs()?.max_all()?;
        assert!(diff.to_scalar::<f32>()? < 1e-6);
        Ok(())
    }
}
