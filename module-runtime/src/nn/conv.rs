//! Convolutions: `Conv1d`, `Conv2d`, `ConvTranspose2d`, and the lazy `LazyConv1d`, `LazyConv2d`.
//!
//! Weights use PyTorch's layouts, and both weight and bias start uniform on `±1/sqrt(fan_in)` (what
//! PyTorch's Kaiming-uniform init with `a = sqrt(5)` amounts to), where `fan_in` is the weight's
//! second dimension times the kernel's area. candle's convolutions take one stride, padding and
//! dilation for every spatial dimension, so these layers do too.
//!
//! # Gradients
//!
//! Two bugs in candle 0.11's convolution backward passes give wrong gradients: `Conv1D`'s backward
//! hands the CPU kernel a transposed (non-contiguous) kernel, which it misreads (wrong weight
//! gradient), and `Conv2D`'s backward takes the output padding of the input gradient from the height
//! alone, so a width whose last elements fall outside every window gets a gradient of the wrong
//! shape. When a gradient is needed (the input or the weight tracks one), `Conv1d` and `Conv2d`
//! therefore pad explicitly, crop the input to the elements the windows read (the rest has a zero
//! gradient), and run a 2-D convolution without padding, which candle differentiates correctly.
//! When nothing needs a gradient they call candle's convolution directly.

use candle_core::{DType, Device, Tensor};

use crate::device::check_input_device;
use crate::error::Result;
use crate::lazy::layer_param;
use crate::nn::activation::forward_by_value;
use crate::{Forward, Init, LazyShape, Module, Param};

/// Stride, padding, dilation and groups of a [`Conv1d`] or [`Conv2d`]; PyTorch's defaults are
/// `ConvConfig::default()`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConvConfig {
    /// Step between windows.
    pub stride: usize,
    /// Zeros added on both sides of each spatial dimension.
    pub padding: usize,
    /// Spacing between kernel elements.
    pub dilation: usize,
    /// Number of blocked connections from input to output channels; divides both channel counts.
    pub groups: usize,
}

impl Default for ConvConfig {
    fn default() -> Self {
        Self {
            stride: 1,
            padding: 0,
            dilation: 1,
            groups: 1,
        }
    }
}

/// Stride, padding, output padding, dilation and groups of a [`ConvTranspose2d`]; PyTorch's
/// defaults are `ConvTransposeConfig::default()`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConvTransposeConfig {
    /// Step between windows.
    pub stride: usize,
    /// `dilation * (kernel - 1) - padding` zeros are added on both sides of each input dimension.
    pub padding: usize,
    /// Extra size added to one side of each output dimension.
    pub output_padding: usize,
    /// Spacing between kernel elements.
    pub dilation: usize,
    /// Number of blocked connections from input to output channels; divides both channel counts.
    pub groups: usize,
}

impl Default for ConvTransposeConfig {
    fn default() -> Self {
        Self {
            stride: 1,
            padding: 0,
            output_padding: 0,
            dilation: 1,
            groups: 1,
        }
    }
}

fn check_groups(in_channels: usize, out_channels: usize, groups: usize) -> Result<()> {
    if groups == 0 || in_channels % groups != 0 || out_channels % groups != 0 {
        return Err(candle_core::Error::Msg(format!(
            "convolution: groups ({groups}) must divide in_channels ({in_channels}) and \
             out_channels ({out_channels})"
        ))
        .into());
    }
    Ok(())
}

/// PyTorch's default init: weight and bias uniform on `±1/sqrt(fan_in)`, with `fan_in` the
/// weight's second dimension times the kernel's area.
fn init(
    weight_shape: &[usize],
    bias_len: Option<usize>,
    dtype: DType,
    device: &Device,
) -> Result<(Param, Option<Param>)> {
    let fan_in: usize = weight_shape[1..].iter().product();
    let bound = 1.0 / (fan_in.max(1) as f64).sqrt();
    let uniform = |shape: &[usize]| -> Result<Param> {
        Param::new(Tensor::rand(-bound, bound, shape, device)?.to_dtype(dtype)?)
    };
    Ok((
        uniform(weight_shape)?,
        bias_len.map(|n| uniform(&[n])).transpose()?,
    ))
}

/// A 2-D convolution that candle differentiates correctly (see the module docs): explicit zero
/// padding `(pad_h, pad_w)`, the input cropped to the extent the windows read, no implicit padding.
fn conv2d_differentiable(
    x: &Tensor,
    weight: &Tensor,
    padding: (usize, usize),
    stride: usize,
    dilation: usize,
    groups: usize,
) -> Result<Tensor> {
    let x = x.pad_with_zeros(2, padding.0, padding.0)?;
    let x = x.pad_with_zeros(3, padding.1, padding.1)?;
    let read = |size: usize, kernel: usize| {
        let span = dilation * (kernel - 1) + 1;
        if size < span {
            size // too small: candle reports the error
        } else {
            (size - span) / stride * stride + span
        }
    };
    let (_, _, h, w) = x.dims4()?;
    let (_, _, kh, kw) = weight.dims4()?;
    let x = x.narrow(2, 0, read(h, kh))?.narrow(3, 0, read(w, kw))?;
    Ok(x.conv2d(weight, 0, stride, dilation, groups)?)
}

fn add_bias(y: Tensor, bias: Option<Tensor>) -> Result<Tensor> {
    match bias {
        Some(b) => {
            let mut dims = vec![1; y.rank()];
            dims[1] = b.elem_count();
            Ok(y.broadcast_add(&b.reshape(dims)?)?)
        }
        None => Ok(y),
    }
}

/// `Conv1d`'s computation, for it and `LazyConv1d`.
fn conv1d(x: &Tensor, weight: &Tensor, bias: Option<Tensor>, c: &ConvConfig) -> Result<Tensor> {
    check_input_device("Conv1d.weight", weight, x)?;
    let y = if x.track_op() || weight.track_op() {
        // As a 2-D convolution of height 1 (see the module docs).
        conv2d_differentiable(
            &x.unsqueeze(2)?,
            &weight.unsqueeze(2)?,
            (0, c.padding),
            c.stride,
            c.dilation,
            c.groups,
        )?
        .squeeze(2)?
    } else {
        // candle's CPU kernel misreads a non-contiguous kernel.
        x.conv1d(
            &weight.contiguous()?,
            c.padding,
            c.stride,
            c.dilation,
            c.groups,
        )?
    };
    add_bias(y, bias)
}

/// `Conv2d`'s computation, for it and `LazyConv2d`.
fn conv2d(x: &Tensor, weight: &Tensor, bias: Option<Tensor>, c: &ConvConfig) -> Result<Tensor> {
    check_input_device("Conv2d.weight", weight, x)?;
    let y = if x.track_op() || weight.track_op() {
        conv2d_differentiable(
            x,
            weight,
            (c.padding, c.padding),
            c.stride,
            c.dilation,
            c.groups,
        )?
    } else {
        x.conv2d(weight, c.padding, c.stride, c.dilation, c.groups)?
    };
    add_bias(y, bias)
}

/// A 1-D convolution: PyTorch's `nn.Conv1d`.
///
/// Parameters `weight` `[out_channels, in_channels / groups, kernel_size]` and `bias`
/// `[out_channels]` (absent without a bias). The input is `[N, C_in, L]`; the output
/// `[N, C_out, L_out]` with `L_out = (L + 2 padding - dilation (kernel_size - 1) - 1) / stride + 1`.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::{Conv1d, ConvConfig};
/// let cfg = ConvConfig { stride: 2, padding: 1, ..Default::default() };
/// let conv = Conv1d::new(3, 4, 3, cfg, &Device::Cpu)?;
/// let y = conv.call(&Tensor::zeros((2, 3, 9), DType::F32, &Device::Cpu)?)?;
/// assert_eq!(y.dims(), [2, 4, 5]);
/// # Ok::<(), module_runtime::Error>(())
/// ```
#[derive(Module, Clone, Debug)]
pub struct Conv1d {
    /// `[out_channels, in_channels / groups, kernel_size]`.
    pub weight: Param,
    /// `[out_channels]`, if the layer has a bias.
    pub bias: Option<Param>,
    /// Stride, padding, dilation and groups.
    #[module(skip)]
    pub config: ConvConfig,
}

impl Conv1d {
    /// A float32 layer with a bias, initialized like PyTorch.
    pub fn new(
        in_channels: usize,
        out_channels: usize,
        kernel_size: usize,
        config: ConvConfig,
        device: &Device,
    ) -> Result<Self> {
        Self::with_options(
            in_channels,
            out_channels,
            kernel_size,
            config,
            true,
            DType::F32,
            device,
        )
    }

    /// With or without a bias, of any floating-point dtype, initialized like PyTorch.
    pub fn with_options(
        in_channels: usize,
        out_channels: usize,
        kernel_size: usize,
        config: ConvConfig,
        bias: bool,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        check_groups(in_channels, out_channels, config.groups)?;
        let shape = [out_channels, in_channels / config.groups, kernel_size];
        let (weight, bias) = init(&shape, bias.then_some(out_channels), dtype, device)?;
        Ok(Self {
            weight,
            bias,
            config,
        })
    }
}

impl Forward<&Tensor> for Conv1d {
    type Output = Tensor;

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let bias = self.bias.as_ref().map(Param::tensor);
        conv1d(x, &self.weight.tensor(), bias, &self.config)
    }
}

/// A 2-D convolution: PyTorch's `nn.Conv2d`.
///
/// Parameters `weight` `[out_channels, in_channels / groups, kH, kW]` and `bias` `[out_channels]`
/// (absent without a bias). The input is `[N, C_in, H, W]`; the output `[N, C_out, H_out, W_out]`
/// with `H_out = (H + 2 padding - dilation (kH - 1) - 1) / stride + 1`.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::{Conv2d, ConvConfig};
/// let cfg = ConvConfig { stride: 2, padding: 1, groups: 2, ..Default::default() };
/// let conv = Conv2d::new(4, 6, 3, cfg, &Device::Cpu)?;
/// assert_eq!(conv.weight.shape().dims(), [6, 2, 3, 3]);
/// let y = conv.call(&Tensor::zeros((1, 4, 7, 7), DType::F32, &Device::Cpu)?)?;
/// assert_eq!(y.dims(), [1, 6, 4, 4]);
/// # Ok::<(), module_runtime::Error>(())
/// ```
#[derive(Module, Clone, Debug)]
pub struct Conv2d {
    /// `[out_channels, in_channels / groups, kH, kW]`.
    pub weight: Param,
    /// `[out_channels]`, if the layer has a bias.
    pub bias: Option<Param>,
    /// Stride, padding, dilation and groups.
    #[module(skip)]
    pub config: ConvConfig,
}

impl Conv2d {
    /// A float32 layer with a square kernel and a bias, initialized like PyTorch.
    pub fn new(
        in_channels: usize,
        out_channels: usize,
        kernel_size: usize,
        config: ConvConfig,
        device: &Device,
    ) -> Result<Self> {
        Self::with_options(
            in_channels,
            out_channels,
            (kernel_size, kernel_size),
            config,
            true,
            DType::F32,
            device,
        )
    }

    /// Any kernel `(kH, kW)`, with or without a bias, of any floating-point dtype.
    pub fn with_options(
        in_channels: usize,
        out_channels: usize,
        kernel_size: (usize, usize),
        config: ConvConfig,
        bias: bool,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        check_groups(in_channels, out_channels, config.groups)?;
        let shape = [
            out_channels,
            in_channels / config.groups,
            kernel_size.0,
            kernel_size.1,
        ];
        let (weight, bias) = init(&shape, bias.then_some(out_channels), dtype, device)?;
        Ok(Self {
            weight,
            bias,
            config,
        })
    }
}

impl Forward<&Tensor> for Conv2d {
    type Output = Tensor;

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let bias = self.bias.as_ref().map(Param::tensor);
        conv2d(x, &self.weight.tensor(), bias, &self.config)
    }
}

/// A 2-D transposed convolution (the gradient of a convolution with respect to its input):
/// PyTorch's `nn.ConvTranspose2d`.
///
/// Parameters `weight` `[in_channels, out_channels / groups, kH, kW]` (PyTorch's layout, transposed
/// relative to `Conv2d`) and `bias` `[out_channels]` (absent without a bias). The input is
/// `[N, C_in, H, W]`; the output `[N, C_out, H_out, W_out]` with
/// `H_out = (H - 1) stride - 2 padding + dilation (kH - 1) + output_padding + 1`.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::{ConvTranspose2d, ConvTransposeConfig};
/// let cfg = ConvTransposeConfig { stride: 2, padding: 1, output_padding: 1, ..Default::default() };
/// let up = ConvTranspose2d::new(3, 2, 3, cfg, &Device::Cpu)?;
/// let y = up.call(&Tensor::zeros((1, 3, 4, 4), DType::F32, &Device::Cpu)?)?;
/// assert_eq!(y.dims(), [1, 2, 8, 8]);
/// # Ok::<(), module_runtime::Error>(())
/// ```
#[derive(Module, Clone, Debug)]
pub struct ConvTranspose2d {
    /// `[in_channels, out_channels / groups, kH, kW]`.
    pub weight: Param,
    /// `[out_channels]`, if the layer has a bias.
    pub bias: Option<Param>,
    /// Stride, padding, output padding, dilation and groups.
    #[module(skip)]
    pub config: ConvTransposeConfig,
}

impl ConvTranspose2d {
    /// A float32 layer with a square kernel and a bias, initialized like PyTorch.
    pub fn new(
        in_channels: usize,
        out_channels: usize,
        kernel_size: usize,
        config: ConvTransposeConfig,
        device: &Device,
    ) -> Result<Self> {
        Self::with_options(
            in_channels,
            out_channels,
            (kernel_size, kernel_size),
            config,
            true,
            DType::F32,
            device,
        )
    }

    /// Any kernel `(kH, kW)`, with or without a bias, of any floating-point dtype.
    pub fn with_options(
        in_channels: usize,
        out_channels: usize,
        kernel_size: (usize, usize),
        config: ConvTransposeConfig,
        bias: bool,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        check_groups(in_channels, out_channels, config.groups)?;
        let shape = [
            in_channels,
            out_channels / config.groups,
            kernel_size.0,
            kernel_size.1,
        ];
        let (weight, bias) = init(&shape, bias.then_some(out_channels), dtype, device)?;
        Ok(Self {
            weight,
            bias,
            config,
        })
    }
}

impl Forward<&Tensor> for ConvTranspose2d {
    type Output = Tensor;

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let c = &self.config;
        let weight = self.weight.tensor();
        check_input_device("ConvTranspose2d.weight", &weight, x)?;
        let run = |x: &Tensor, w: &Tensor| {
            x.conv_transpose2d(w, c.padding, c.output_padding, c.stride, c.dilation)
        };
        // candle's transposed convolution has no groups: run each group on its slice of the input
        // channels and of the weight, and stack the outputs along the channels.
        let y = if c.groups == 1 {
            run(x, &weight)?
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
        add_bias(y, self.bias.as_ref().map(Param::tensor))
    }
}

/// The parameters of a lazy convolution with kernel `kernel`: unbuilt, with the input channels
/// (the weight's second dimension) unknown.
fn lazy_conv_params(
    out_channels: usize,
    kernel: &[usize],
    config: &ConvConfig,
    bias: bool,
    dtype: DType,
    device: &Device,
) -> Result<(Param, Option<Param>)> {
    // Only `out_channels` can be checked now; `in_channels` is checked at the build.
    check_groups(config.groups, out_channels, config.groups)?;
    let weight_shape = [Some(out_channels), None]
        .into_iter()
        .chain(kernel.iter().map(|&k| Some(k)));
    let weight = Param::lazy(
        LazyShape::new(weight_shape),
        Init::UniformFanIn,
        dtype,
        device,
    )?;
    let bias = bias
        .then(|| {
            let shape = LazyShape::new([Some(out_channels)]);
            Param::lazy(shape, Init::UniformFanIn, dtype, device)
        })
        .transpose()?;
    Ok((weight, bias))
}

/// Builds a lazy convolution's parameters for input `x` (channels in dimension 1), or checks that
/// `x` fits them; returns the weight and bias to compute with.
fn lazy_conv_tensors(
    layer: &'static str,
    weight: &Param,
    bias: &Option<Param>,
    out_channels: usize,
    kernel: &[usize],
    groups: usize,
    x: &Tensor,
) -> Result<(Tensor, Option<Tensor>)> {
    let in_channels = x.dim(1)?;
    check_groups(in_channels, out_channels, groups)?;
    let mut dims = vec![out_channels, in_channels / groups];
    dims.extend_from_slice(kernel);
    let fan_in = dims[1..].iter().product();
    let w = layer_param(layer, "weight", weight, &dims, fan_in, x)?;
    let b = bias
        .as_ref()
        .map(|b| layer_param(layer, "bias", b, &[out_channels], fan_in, x))
        .transpose()?;
    Ok((w, b))
}

macro_rules! lazy_conv {
    (
        $name:ident, $eager:ident, $torch:literal, $kernel:ty, $kernel_dims:expr, $input:literal,
        $example:literal
    ) => {
        #[doc = concat!("A [`", stringify!($eager), "`] whose `in_channels` is dimension 1 of its first input: PyTorch's `nn.", $torch, "`.")]
        ///
        /// Same parameters, names, init and computation as the eager layer, built once, at the
        /// first call, a [`build`](crate::LazyExt::build) dry run or a checkpoint load. After that,
        /// an input with another number of channels is an
        /// [`Error::LazyInput`](crate::Error::LazyInput) naming the layer and both shapes.
        #[doc = concat!("The input is ", $input, ".")]
        ///
        /// ```
        /// use module_runtime::prelude::*;
        #[doc = concat!("use module_runtime::nn::{", stringify!($name), ", ConvConfig};")]
        #[doc = $example]
        /// # Ok::<(), module_runtime::Error>(())
        /// ```
        #[derive(Module, Clone, Debug)]
        pub struct $name {
            #[doc = concat!("As `", stringify!($eager), "`'s, unbuilt until `in_channels` is known.")]
            pub weight: Param,
            /// `[out_channels]`, if the layer has a bias; built with the weight.
            pub bias: Option<Param>,
            /// Stride, padding, dilation and groups.
            #[module(skip)]
            pub config: ConvConfig,
            out_channels: usize,
            kernel_size: $kernel,
        }

        impl $name {
            /// Any kernel, with or without a bias, of any floating-point dtype.
            pub fn with_options(
                out_channels: usize,
                kernel_size: $kernel,
                config: ConvConfig,
                bias: bool,
                dtype: DType,
                device: &Device,
            ) -> Result<Self> {
                let kernel: &dyn Fn($kernel) -> Vec<usize> = &$kernel_dims;
                let (weight, bias) =
                    lazy_conv_params(out_channels, &kernel(kernel_size), &config, bias, dtype, device)?;
                Ok(Self {
                    weight,
                    bias,
                    config,
                    out_channels,
                    kernel_size,
                })
            }

            /// Number of input channels, once built.
            pub fn in_channels(&self) -> Option<usize> {
                self.weight
                    .is_built()
                    .then(|| self.weight.shape().dims()[1] * self.config.groups)
            }

            /// Number of output channels.
            pub fn out_channels(&self) -> usize {
                self.out_channels
            }
        }

        impl Forward<&Tensor> for $name {
            type Output = Tensor;

            fn forward(&self, x: &Tensor) -> Result<Tensor> {
                let kernel: &dyn Fn($kernel) -> Vec<usize> = &$kernel_dims;
                let (w, b) = lazy_conv_tensors(
                    stringify!($name),
                    &self.weight,
                    &self.bias,
                    self.out_channels,
                    &kernel(self.kernel_size),
                    self.config.groups,
                    x,
                )?;
                lazy_conv!(@run $name, x, &w, b, &self.config)
            }
        }
    };
    (@run LazyConv1d, $x:expr, $w:expr, $b:expr, $c:expr) => { conv1d($x, $w, $b, $c) };
    (@run LazyConv2d, $x:expr, $w:expr, $b:expr, $c:expr) => { conv2d($x, $w, $b, $c) };
}

lazy_conv!(
    LazyConv1d,
    Conv1d,
    "LazyConv1d",
    usize,
    |k: usize| vec![k],
    "`[N, C_in, L]`",
    "let conv = LazyConv1d::new(4, 3, ConvConfig::default(), &Device::Cpu)?;
let y = conv.call(&Tensor::zeros((2, 3, 9), DType::F32, &Device::Cpu)?)?;
assert_eq!(y.dims(), [2, 4, 7]);
assert_eq!(conv.weight.shape().dims(), [4, 3, 3]);"
);
lazy_conv!(
    LazyConv2d,
    Conv2d,
    "LazyConv2d",
    (usize, usize),
    |(kh, kw): (usize, usize)| vec![kh, kw],
    "`[N, C_in, H, W]`",
    "let conv = LazyConv2d::new(6, 3, ConvConfig { padding: 1, ..Default::default() }, &Device::Cpu)?;
let y = conv.call(&Tensor::zeros((1, 2, 5, 5), DType::F32, &Device::Cpu)?)?;
assert_eq!(y.dims(), [1, 6, 5, 5]);
assert_eq!(conv.in_channels(), Some(2));"
);

impl LazyConv1d {
    /// A float32 layer with a bias.
    pub fn new(
        out_channels: usize,
        kernel_size: usize,
        config: ConvConfig,
        device: &Device,
    ) -> Result<Self> {
        Self::with_options(out_channels, kernel_size, config, true, DType::F32, device)
    }
}

impl LazyConv2d {
    /// A float32 layer with a square kernel and a bias.
    pub fn new(
        out_channels: usize,
        kernel_size: usize,
        config: ConvConfig,
        device: &Device,
    ) -> Result<Self> {
        let kernel = (kernel_size, kernel_size);
        Self::with_options(out_channels, kernel, config, true, DType::F32, device)
    }
}

forward_by_value!(Conv1d, Conv2d, ConvTranspose2d, LazyConv1d, LazyConv2d);

#[cfg(test)]
mod tests {
    use super::*;

    /// A grouped transposed convolution equals the per-group convolutions, stacked.
    #[test]
    fn conv_transpose_groups_split_channels() -> Result<()> {
        let dev = Device::Cpu;
        let cfg = ConvTransposeConfig {
            groups: 2,
            stride: 2,
            ..Default::default()
        };
        let grouped = ConvTranspose2d::with_options(4, 6, (3, 3), cfg, false, DType::F32, &dev)?;
        assert_eq!(grouped.weight.shape().dims(), [4, 3, 3, 3]);
        let x = Tensor::randn(0f32, 1., (1, 4, 5, 5), &dev)?;
        let y = grouped.forward(&x)?;
        let w = grouped.weight.tensor();
        let first = x
            .narrow(1, 0, 2)?
            .conv_transpose2d(&w.narrow(0, 0, 2)?, 0, 0, 2, 1)?;
        let diff = (y.narrow(1, 0, 3)? - first)?.abs()?.max_all()?;
        assert!(diff.to_scalar::<f32>()? < 1e-6);
        Ok(())
    }

    fn grads(
        layer: &impl for<'a> Forward<&'a Tensor, Output = Tensor>,
        x: &Tensor,
        w: &Param,
    ) -> Result<(Tensor, Tensor)> {
        let x = candle_core::Var::from_tensor(x)?;
        let y = layer.forward(x.as_tensor())?;
        let up = Tensor::randn(0f32, 1., y.shape(), y.device())?;
        let g = (y * up)?.sum_all()?.backward()?;
        Ok((
            g.get(x.as_tensor()).unwrap().clone(),
            g.get(&w.tensor()).unwrap().clone(),
        ))
    }

    /// A width whose last column no window reads (8 = 2*3 + 2, stride 2, kernel 3) gets a gradient
    /// of the input's shape, with a zero there; candle's own Conv2D backward fails on this.
    #[test]
    fn conv2d_gradient_with_unread_columns() -> Result<()> {
        let dev = Device::Cpu;
        let cfg = ConvConfig {
            stride: 2,
            ..Default::default()
        };
        let conv = Conv2d::new(2, 3, 3, cfg, &dev)?;
        let x = Tensor::randn(0f32, 1., (1, 2, 7, 8), &dev)?;
        let (gx, gw) = grads(&conv, &x, &conv.weight)?;
        assert_eq!(gx.dims(), [1, 2, 7, 8]);
        assert_eq!(gw.dims(), [3, 2, 3, 3]);
        let last = gx.narrow(3, 7, 1)?.abs()?.sum_all()?.to_scalar::<f32>()?;
        assert_eq!(last, 0.0);
        Ok(())
    }

    #[test]
    fn init_bound_follows_fan_in() -> Result<()> {
        let conv = Conv2d::new(2, 3, 3, ConvConfig::default(), &Device::Cpu)?;
        let bound = 1.0 / 18f32.sqrt();
        let max = conv.weight.tensor().abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(max <= bound);
        Ok(())
    }
}
