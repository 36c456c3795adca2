//! Convolutions: `Conv1d`, `Conv2d` (one type, [`Conv`], over one or two spatial dimensions),
//! `ConvTranspose1d`, `ConvTranspose2d` (one type, [`ConvTranspose`]), and the lazy twins
//! `LazyConv1d`, `LazyConv2d` (a `Conv` whose parameters are unbuilt).
//!
//! Weights use PyTorch's layouts, and both weight and bias start uniform on `±1/sqrt(fan_in)` (what
//! PyTorch's Kaiming-uniform init with `a = sqrt(5)` amounts to), where `fan_in` is the weight's
//! second dimension times the kernel's area. As in PyTorch, stride, padding and dilation are one
//! value for every spatial dimension or one per dimension ([`PerDim`]: `stride: (1, 2).into()`).
//! candle's convolutions take one value for all dimensions: when the values differ, `Conv2d` pads
//! explicitly, spaces the kernel's elements with zeros for the dilation beyond the common one, and
//! keeps every `stride / gcd(sH, sW)`-th row or column of a convolution with the common stride.
//!
//! # Gradients
//!
//! Two bugs in candle 0.11's convolution backward passes give wrong gradients: `Conv1D`'s hands the
//! CPU kernel a transposed (non-contiguous) kernel, which it misreads (a wrong weight gradient),
//! and `Conv2D`'s takes the input gradient's output padding from the height alone (a wrong shape
//! when a width's last elements fall outside every window). So when a gradient is needed, `Conv1d`
//! and `Conv2d` pad explicitly, crop the input to the elements the windows read (the rest has a
//! zero gradient) and run an unpadded 2-D convolution, which candle differentiates correctly;
//! otherwise they call candle's convolution directly.

use candle_core::{DType, Device, Tensor};

use crate::common::{
    add_channel_bias, add_channel_bias_to_fresh, batched, forward_by_value, lower_precision,
    uniform_fan_in, AutocastOp, PerDim, Size,
};
use crate::device::check_input_device;
use crate::error::{Error, Result};
use crate::{Forward, Module, Param};

mod conv3d;
mod differentiable;
mod lazy;
mod repr;
mod transpose;
mod transpose1d;

use differentiable::conv2d_differentiable;
pub use lazy::{LazyConv, LazyConv1d, LazyConv2d, LazyConvPath};
pub(crate) use repr::ConvRepr;
pub use transpose::{
    ConvTranspose, ConvTranspose1d, ConvTranspose2d, ConvTranspose2dPath, ConvTransposeConfig,
    ConvTransposePath,
};

/// How a [`Conv1d`], [`Conv2d`] or lazy convolution is built: PyTorch's keyword arguments, with
/// PyTorch's defaults (`ConvConfig::default()`).
///
/// `stride`, `padding` and `dilation` are PyTorch's "int or tuple": one value for every spatial
/// dimension (`2.into()`) or `(height, width)` for a `Conv2d` (`(1, 2).into()`). PyTorch's
/// `nn.Conv2d(8, 12, (3, 5), stride=(1, 2), padding=(1, 2))` is
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::{Conv2d, ConvConfig};
/// let cfg = ConvConfig { stride: (1, 2).into(), padding: (1, 2).into(), ..Default::default() };
/// let conv = Conv2d::with_config(8, 12, (3, 5), cfg, &Device::Cpu)?;
/// let y = conv.call(&Tensor::zeros((2, 8, 11, 13), DType::F32, &Device::Cpu)?)?;
/// assert_eq!(y.dims(), [2, 12, 11, 7]);
/// # Ok::<(), module_runtime::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConvConfig {
    /// Step between windows (default 1).
    pub stride: PerDim,
    /// Zeros added on both sides of each spatial dimension (default 0).
    pub padding: PerDim,
    /// Spacing between kernel elements (default 1).
    pub dilation: PerDim,
    /// Number of blocked connections from input to output channels; divides both channel counts
    /// (default 1).
    pub groups: usize,
    /// Whether the layer has a bias (default `true`).
    pub bias: bool,
    /// The parameters' floating-point dtype (default `F32`).
    pub dtype: DType,
}

impl Default for ConvConfig {
    fn default() -> Self {
        Self {
            stride: PerDim::All(1),
            padding: PerDim::All(0),
            dilation: PerDim::All(1),
            groups: 1,
            bias: true,
            dtype: DType::F32,
        }
    }
}

/// A convolution's stride, padding and dilation along each of its `D` spatial dimensions.
#[derive(Clone, Copy, Debug)]
struct Spatial<const D: usize> {
    stride: [usize; D],
    padding: [usize; D],
    dilation: [usize; D],
}

impl<const D: usize> Spatial<D> {
    /// `config`'s values for a `D`-dimensional layer; [`Error::InvalidConfig`] for a `(h, w)` pair
    /// given to a 1-D layer, or a zero stride or dilation.
    fn of(layer: &'static str, config: &ConvConfig) -> Result<Self> {
        let dims = |name: &str, v: PerDim| {
            v.for_dims::<D>().ok_or_else(|| Error::InvalidConfig {
                layer,
                message: format!("{name} {v:?} does not fit a {D}-D convolution"),
            })
        };
        let spatial = Self {
            stride: dims("stride", config.stride)?,
            padding: dims("padding", config.padding)?,
            dilation: dims("dilation", config.dilation)?,
        };
        if spatial.stride.contains(&0) || spatial.dilation.contains(&0) {
            return Err(Error::InvalidConfig {
                layer,
                message: format!(
                    "stride {:?} and dilation {:?} must be positive",
                    config.stride, config.dilation
                ),
            });
        }
        Ok(spatial)
    }

    /// Whether every value is the same along every dimension (candle's convolution takes them).
    fn uniform(&self) -> bool {
        let same = |a: &[usize; D]| a.iter().all(|&v| v == a[0]);
        same(&self.stride) && same(&self.padding) && same(&self.dilation)
    }
}

/// [`Error::InvalidConfig`] unless `groups` divides both channel counts.
fn check_groups(
    layer: &'static str,
    in_channels: usize,
    out_channels: usize,
    groups: usize,
) -> Result<()> {
    if groups == 0 || !in_channels.is_multiple_of(groups) || !out_channels.is_multiple_of(groups) {
        return Err(Error::InvalidConfig {
            layer,
            message: format!(
                "groups ({groups}) must divide in_channels ({in_channels}) and out_channels \
                 ({out_channels})"
            ),
        });
    }
    Ok(())
}

/// A convolution's `weight` of shape `weight_dims` and its optional `bias` `[out_channels]`,
/// initialized as PyTorch does: uniform on `±1/sqrt(fan_in)`, with `fan_in` the weight's second
/// dimension times the kernel's area.
fn conv_params(
    weight_dims: &[usize],
    out_channels: usize,
    bias: bool,
    dtype: DType,
    device: &Device,
) -> Result<(Param, Option<Param>)> {
    let fan_in = weight_dims[1..].iter().product();
    let uniform = |dims: &[usize]| uniform_fan_in(dims, fan_in, dtype, device);
    let bias = bias.then(|| uniform(&[out_channels])).transpose()?;
    Ok((uniform(weight_dims)?, bias))
}

/// `Conv1d`'s computation.
fn conv1d(x: &Tensor, weight: &Tensor, bias: Option<Tensor>, c: &ConvConfig) -> Result<Tensor> {
    let sp = Spatial::<1>::of("Conv1d", c)?;
    let ([stride], [padding], [dilation]) = (sp.stride, sp.padding, sp.dilation);
    let y = if x.track_op() || weight.track_op() {
        // As a 2-D convolution of height 1 (see the module docs).
        conv2d_differentiable(
            &x.unsqueeze(2)?,
            &weight.unsqueeze(2)?,
            [0, padding],
            [stride, stride],
            [dilation, dilation],
            c.groups,
        )?
        .squeeze(2)?
    } else {
        // candle's CPU kernel misreads a non-contiguous kernel. Its output is fresh: the bias
        // can go in place.
        let y = x.conv1d(&weight.contiguous()?, padding, stride, dilation, c.groups)?;
        return add_channel_bias_to_fresh(y, bias);
    };
    add_channel_bias(y, bias)
}

/// `Conv2d`'s computation.
fn conv2d(x: &Tensor, weight: &Tensor, bias: Option<Tensor>, c: &ConvConfig) -> Result<Tensor> {
    let sp = Spatial::<2>::of("Conv2d", c)?;
    let y = if x.track_op() || weight.track_op() || !sp.uniform() {
        conv2d_differentiable(x, weight, sp.padding, sp.stride, sp.dilation, c.groups)?
    } else {
        // candle's kernel: a fresh output, so the bias can go in place.
        let y = x.conv2d(
            weight,
            sp.padding[0],
            sp.stride[0],
            sp.dilation[0],
            c.groups,
        )?;
        return add_channel_bias_to_fresh(y, bias);
    };
    add_channel_bias(y, bias)
}

/// A convolution over `D` spatial dimensions: PyTorch's `nn.Conv1d` ([`Conv1d`] = `Conv<1>`) and
/// `nn.Conv2d` ([`Conv2d`] = `Conv<2>`).
///
/// Parameters `weight` `[out_channels, in_channels / groups, *kernel_size]` and `bias`
/// `[out_channels]` (absent without a bias). The input is `[N, C_in, *spatial]` (or unbatched,
/// `[C_in, *spatial]`); the output
/// `[N, C_out, *spatial_out]` with, along each spatial dimension (each with its own stride,
/// padding and dilation, see [`ConvConfig`]),
/// `out = (in + 2 padding - dilation (kernel - 1) - 1) / stride + 1`.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::{Conv2d, ConvConfig};
/// let cfg = ConvConfig { stride: 2.into(), padding: 1.into(), groups: 2, ..Default::default() };
/// let conv = Conv2d::with_config(4, 6, 3, cfg, &Device::Cpu)?;
/// assert_eq!(conv.weight.shape().dims(), [6, 2, 3, 3]);
/// let y = conv.call(&Tensor::zeros((1, 4, 7, 7), DType::F32, &Device::Cpu)?)?;
/// assert_eq!(y.dims(), [1, 6, 4, 4]);
/// # Ok::<(), module_runtime::Error>(())
/// ```
///
/// Typed paths into it: [`ConvPath`], from [`Conv::path`] (`#[module(paths)]`).
#[derive(Module, Clone, Debug)]
#[module(crate = module_core)]
#[module(paths)]
#[module(extra_repr)]
#[module(class_name = format!("Conv{D}d"))]
pub struct Conv<const D: usize> {
    /// `[out_channels, in_channels / groups, *kernel_size]`.
    pub weight: Param,
    /// `[out_channels]`, if the layer has a bias.
    pub bias: Option<Param>,
    /// Stride, padding, dilation, groups, bias and dtype.
    #[module(skip)]
    pub config: ConvConfig,
    /// LoRA adapters ([`get_peft_model`](crate::peft::get_peft_model)):
    /// `lora_A.<name>.weight`, …, the layer's children; none until an adapter is added.
    #[module(flatten)]
    pub(crate) lora: Option<Box<crate::peft::LoraLayer>>,
    /// PEFT's `modules_to_save` copies of the layer (`modules_to_save.<adapter>.weight`, …),
    /// used instead of it while their adapter is active; none until an adapter asks for them.
    #[module(flatten)]
    pub(crate) modules_to_save: Option<Box<crate::peft::ModulesToSave>>,
    /// Parametrizations ([`parametrize`](crate::parametrize)), flattened.
    #[module(flatten)]
    pub(crate) parametrizations: Option<Box<crate::parametrize::Parametrizations>>,
}

/// A 1-D convolution: PyTorch's `nn.Conv1d`. See [`Conv`].
///
/// The input is `[N, C_in, L]` (or `[C_in, L]`); the output `[N, C_out, L_out]` with
/// `L_out = (L + 2 padding - dilation (kernel_size - 1) - 1) / stride + 1`.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::{Conv1d, ConvConfig};
/// let cfg = ConvConfig { stride: 2.into(), padding: 1.into(), ..Default::default() };
/// let conv = Conv1d::with_config(3, 4, 3, cfg, &Device::Cpu)?;
/// let y = conv.call(&Tensor::zeros((2, 3, 9), DType::F32, &Device::Cpu)?)?;
/// assert_eq!(y.dims(), [2, 4, 5]);
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub type Conv1d = Conv<1>;

/// A 2-D convolution: PyTorch's `nn.Conv2d`. See [`Conv`].
///
/// `kernel_size` is `k` for a square kernel or `(kH, kW)`.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::Conv2d;
/// let conv = Conv2d::new(3, 8, (3, 5), &Device::Cpu)?;
/// assert_eq!(conv.weight.shape().dims(), [8, 3, 3, 5]);
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub type Conv2d = Conv<2>;

/// A 3-D convolution: PyTorch's `nn.Conv3d`. See [`Conv`].
///
/// The input is `[N, C_in, D, H, W]` (or `[C_in, D, H, W]`). candle has no 3-D convolution: it
/// runs as one 2-D convolution per kernel depth, over the input's depth slices that kernel row
/// reads folded into the batch, summed; every step is differentiable. Stride, padding and
/// dilation are one value for all three dimensions (`PerDim::All`); `kernel_size` is `k` or
/// `[kD, kH, kW]`.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::{Conv3d, ConvConfig};
/// let cfg = ConvConfig { padding: 1.into(), ..Default::default() };
/// let conv = Conv3d::with_config(2, 4, 3, cfg, &Device::Cpu)?;
/// assert_eq!(conv.weight.shape().dims(), [4, 2, 3, 3, 3]);
/// let y = conv.call(&Tensor::zeros((1, 2, 5, 6, 7), DType::F32, &Device::Cpu)?)?;
/// assert_eq!(y.dims(), [1, 4, 5, 6, 7]);
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub type Conv3d = Conv<3>;

impl<const D: usize> Conv<D> {
    /// A float32 layer with PyTorch's defaults (stride 1, no padding, a bias), initialized like
    /// PyTorch.
    pub fn new(
        in_channels: usize,
        out_channels: usize,
        kernel_size: impl Size<D>,
        device: &Device,
    ) -> Result<Self> {
        Self::with_config(
            in_channels,
            out_channels,
            kernel_size,
            ConvConfig::default(),
            device,
        )
    }

    /// A layer built as `config` says, initialized like PyTorch. `groups` must divide both channel
    /// counts, stride and dilation must be positive, and a `(h, w)` pair fits only a `Conv2d`
    /// ([`Error::InvalidConfig`] otherwise).
    pub fn with_config(
        in_channels: usize,
        out_channels: usize,
        kernel_size: impl Size<D>,
        config: ConvConfig,
        device: &Device,
    ) -> Result<Self> {
        let names = Self::names()?;
        check_groups(names.layer, in_channels, out_channels, config.groups)?;
        Spatial::<D>::of(names.layer, &config)?;
        let mut dims = vec![out_channels, in_channels / config.groups];
        dims.extend(kernel_size.dims());
        let (weight, bias) = conv_params(&dims, out_channels, config.bias, config.dtype, device)?;
        Ok(Self {
            weight,
            bias,
            config,
            lora: None,
            modules_to_save: None,
            parametrizations: None,
        })
    }

    /// The layer's LoRA adapters, if it has any ([`get_peft_model`](crate::peft::get_peft_model)).
    pub fn lora(&self) -> Option<&crate::peft::LoraLayer> {
        self.lora.as_deref()
    }

    /// PyTorch's names for the layer and its lazy twin, and the path a device mismatch names;
    /// [`Error::InvalidConfig`] for a convolution candle does not run.
    fn names() -> Result<Names> {
        let (layer, lazy, weight) = match D {
            1 => ("Conv1d", "LazyConv1d", "Conv1d.weight"),
            2 => ("Conv2d", "LazyConv2d", "Conv2d.weight"),
            3 => ("Conv3d", "LazyConv3d", "Conv3d.weight"),
            _ => {
                return Err(Error::InvalidConfig {
                    layer: "Conv",
                    message: format!("{D}-D convolutions are not supported, only 1-D, 2-D and 3-D"),
                })
            }
        };
        Ok(Names {
            layer,
            lazy,
            weight,
        })
    }
}

/// What [`Conv::names`] gives.
struct Names {
    layer: &'static str,
    lazy: &'static str,
    weight: &'static str,
}

impl<const D: usize> Forward<&Tensor> for Conv<D> {
    type Output = Tensor;

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if let Some(y) = crate::peft::saved_forward(&self.modules_to_save, x) {
            return y;
        }
        let y = self.base_forward(x)?;
        match &self.lora {
            // PEFT's `lora.Conv2d`: the base layer's output, plus the active adapter's.
            Some(lora) => lora.forward_conv(self, x, y),
            None => Ok(y),
        }
    }
}

impl<const D: usize> Conv<D> {
    /// The layer without its adapters: PEFT's `base_layer(x)`.
    pub(crate) fn base_forward(&self, x: &Tensor) -> Result<Tensor> {
        let weight = self.weight_value()?;
        check_input_device(Self::names()?.weight, &weight, x)?;
        check_input::<D>(Self::names()?.layer, &weight, &self.config, x)?;
        let bias = self.bias_value()?;
        lower_precision(AutocastOp::Conv, x, &weight, bias, |x, weight, bias| {
            // An unbatched input (`[C, L]`, `[C, H, W]`) as a batch of one, as PyTorch takes it.
            let (xb, unbatched) = batched(x, D + 1, 0)?;
            let y = match D {
                1 => conv1d(&xb, weight, bias, &self.config)?,
                2 => conv2d(&xb, weight, bias, &self.config)?,
                _ => return conv3d::conv3d(x, weight, bias, &self.config),
            };
            Ok(if unbatched { y.squeeze(0)? } else { y })
        })
    }
}

/// The input's rank, channels and spatial size against the layer's (`weight` is
/// `[out, in / groups, k…]`): a mismatch names both and the fix, where candle would report its
/// own operation (or, for an input smaller than the kernel, overflow).
fn check_input<const D: usize>(
    layer: &'static str,
    weight: &Tensor,
    config: &ConvConfig,
    x: &Tensor,
) -> Result<()> {
    let in_channels = weight.dim(1)? * config.groups;
    let out_channels = weight.dim(0)?;
    let dims = x.dims();
    let fail = |what: String| Error::InvalidInput {
        layer,
        message: format!(
            "expected an input of shape [N, {in_channels}, …] or [{in_channels}, …] ({D} spatial \
             dimensions), got {dims:?}: {what}"
        ),
    };
    if dims.len() != D + 2 && dims.len() != D + 1 {
        return Err(fail(format!("it has {} dimensions", dims.len())));
    }
    let c = dims.len() - D - 1;
    if dims[c] != in_channels {
        return Err(fail(format!(
            "in_channels = {in_channels}, got {} channels (dimension {c}): give it {in_channels} \
             channels, or make the layer with in_channels = {} (`{layer}::new({}, {out_channels}, ..)`)",
            dims[c], dims[c], dims[c]
        )));
    }
    let sp = Spatial::<D>::of(layer, config)?;
    for i in 0..D {
        let span = sp.dilation[i] * (weight.dim(2 + i)? - 1) + 1;
        let padded = dims[c + 1 + i] + 2 * sp.padding[i];
        if padded < span {
            return Err(fail(format!(
                "spatial dimension {i} is {} ({padded} padded), smaller than the kernel's span \
                 {span}: give it a larger input, or more padding",
                dims[c + 1 + i]
            )));
        }
    }
    Ok(())
}

forward_by_value!(Conv1d, Conv2d, Conv3d);

#[cfg(test)]
mod tests {
    use super::*;

    use crate::ModuleExt;

    /// Inference (candle's kernels, the bias added in place) agrees with the differentiable path.
    #[test]
    fn inference_matches_the_differentiable_path() -> Result<()> {
        let dev = Device::Cpu;
        let x1 = Tensor::randn(0f32, 1., (2, 3, 9), &dev)?;
        let c1 = Conv1d::new(3, 4, 3, &dev)?;
        let x2 = Tensor::randn(0f32, 1., (2, 3, 6, 7), &dev)?;
        let c2 = Conv2d::new(3, 4, 3, &dev)?;
        let pairs = [
            (c1.call(&x1)?, crate::without_grad(|| c1.call(&x1))?),
            (c2.call(&x2)?, crate::without_grad(|| c2.call(&x2))?),
        ];
        for (tracked, fast) in pairs {
            assert!(tracked.track_op() && !fast.track_op());
            let diff = (tracked - fast)?.abs()?.flatten_all()?.max(0)?;
            assert!(diff.to_scalar::<f32>()? < 1e-5);
        }
        Ok(())
    }

    #[test]
    fn groups_must_divide_the_channels() {
        let cfg = ConvConfig {
            groups: 2,
            ..Default::default()
        };
        let err = Conv2d::with_config(3, 4, 3, cfg, &Device::Cpu).unwrap_err();
        assert!(
            matches!(
                err,
                Error::InvalidConfig {
                    layer: "Conv2d",
                    ..
                }
            ),
            "{err}"
        );
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
            g.get(&w.tensor()?).unwrap().clone(),
        ))
    }

    /// A width whose last column no window reads (8 = 2*3 + 2, stride 2, kernel 3) gets a gradient
    /// of the input's shape, with a zero there; candle's own Conv2D backward fails on this.
    #[test]
    fn conv2d_gradient_with_unread_columns() -> Result<()> {
        let dev = Device::Cpu;
        let cfg = ConvConfig {
            stride: 2.into(),
            ..Default::default()
        };
        let conv = Conv2d::with_config(2, 3, 3, cfg, &dev)?;
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
        let conv = Conv2d::new(2, 3, 3, &Device::Cpu)?;
        let bound = 1.0 / 18f32.sqrt();
        let max = conv.weight.tensor()?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(max <= bound);
        Ok(())
    }
}
