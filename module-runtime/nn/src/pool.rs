//! 2-D pooling: `MaxPool2d` and `AvgPool2d`, one type, [`Pool2d`], with the reduction of each
//! window (max or mean) as its parameter, and PyTorch's options: `padding`, `dilation` (max only),
//! `ceil_mode`, `count_include_pad` and `divisor_override` (avg only), each per spatial dimension.
//!
//! # How it runs
//!
//! Without padding, dilation or an extra `ceil_mode` window, candle's kernels run (see [`Max`] and
//! [`Avg`] for when a gradient needs the gathered-window path instead). Otherwise the input is
//! padded explicitly (with `-inf` for max, which is never a window's maximum; with zeros for avg,
//! which add nothing to a sum) to exactly the extent the windows cover, including the overhang of a
//! `ceil_mode` window, and pooled without padding; an average is then rescaled by each window's
//! divisor, which follows PyTorch's CPU kernel (`aten/src/ATen/native/cpu/AvgPoolKernel.cpp`):
//! the window clipped to the padded input (`count_include_pad`, the default), only its real
//! elements (`count_include_pad = false`), or `divisor_override`.

use std::fmt::Debug;
use std::marker::PhantomData;

use candle_core::{Tensor, D};

use std::fmt::Write;

use crate::common::{forward_by_value, input_shape_error, PerDim, PyValue, Size};
use crate::error::{Error, Result};
use crate::{Forward, Module};
use module_core::{py_bool, ExtraRepr};

/// How a [`MaxPool2d`] or [`AvgPool2d`] is built: PyTorch's keyword arguments, with PyTorch's
/// defaults (`Pool2dConfig::default()`: stride = window, no padding or dilation, floor mode,
/// padding counted in averages).
///
/// `stride`, `padding` and `dilation` take one value or `(height, width)`, as PyTorch does:
/// `nn.AvgPool2d(3, stride=2, padding=(1, 0), ceil_mode=True)` is
///
/// ```
/// use module_runtime::nn::{AvgPool2d, Pool2dConfig};
/// let pool = AvgPool2d::with_config(3, Pool2dConfig {
///     stride: Some(2.into()),
///     padding: (1, 0).into(),
///     ceil_mode: true,
///     ..Default::default()
/// });
/// assert_eq!(pool.padding, (1, 0));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pool2dConfig {
    /// Step between windows; `None` (the default) is the window size.
    pub stride: Option<PerDim>,
    /// Implicit padding on both sides of each dimension (default 0); at most half the window, as
    /// PyTorch requires. Max pooling pads with `-inf`, average pooling with zeros.
    pub padding: PerDim,
    /// Spacing between the elements of a window (default 1). `MaxPool2d` only: PyTorch's
    /// `AvgPool2d` has no dilation, and an `AvgPool2d` with one is an
    /// [`Error::InvalidConfig`](module_core::Error::InvalidConfig).
    pub dilation: PerDim,
    /// Whether the output size rounds up (default `false`): a last, partial window is added when
    /// it starts inside the input or its left padding.
    pub ceil_mode: bool,
    /// `AvgPool2d` only: whether padding counts in a window's divisor (default `true`). When
    /// `false`, a window's sum is divided by the number of input elements it covers.
    pub count_include_pad: bool,
    /// `AvgPool2d` only: divide every window's sum by this instead (default `None`).
    pub divisor_override: Option<usize>,
}

impl Default for Pool2dConfig {
    fn default() -> Self {
        Self {
            stride: None,
            padding: PerDim::All(0),
            dilation: PerDim::All(1),
            ceil_mode: false,
            count_include_pad: true,
            divisor_override: None,
        }
    }
}

/// How a [`Pool2d`] reduces each window: [`Max`] or [`Avg`].
pub trait Reduction: Clone + Copy + Debug + Send + Sync + 'static {
    /// PyTorch's name for the layer (`"MaxPool2d"`).
    const LAYER: &'static str;
    /// PyTorch's name for the one-dimensional layer, [`Pool1d`](crate::Pool1d) (`"MaxPool1d"`).
    const LAYER_1D: &'static str;

    /// Whether the reduction is a mean (padding reads as zero, divisors apply, no dilation) rather
    /// than a maximum (padding reads as `-inf`).
    const AVERAGE: bool;

    /// candle's kernel over `[N, C, H, W]`.
    fn kernel(x: &Tensor, kernel: (usize, usize), stride: (usize, usize)) -> Result<Tensor>;

    /// Whether candle's kernel is differentiable correctly for this window and stride.
    fn kernel_differentiable(kernel: (usize, usize), stride: (usize, usize)) -> bool;

    /// The reduction over gathered windows `[N, C, H_out, W_out, kH * kW]`, along the last
    /// dimension.
    fn reduce(windows: &Tensor) -> Result<Tensor>;
}

/// The maximum of each window (PyTorch's `nn.MaxPool2d`).
///
/// As in PyTorch, the gradient of each window goes to one element, its first maximum. candle's own
/// max-pool backward scales the gradient by the share of maxima in the window (a quarter of the
/// right value for a 2×2 window) and rejects `stride != kernel_size`, so when the input tracks a
/// gradient the layer takes the max over gathered windows instead.
#[derive(Clone, Copy, Debug)]
pub struct Max;

/// The mean of each window (PyTorch's `nn.AvgPool2d`).
///
/// candle's average-pool backward rejects `stride != kernel_size`, so when the input tracks a
/// gradient with such a stride the layer averages gathered windows instead. With
/// `stride == kernel_size` candle's backward is used, on the input cut to the elements the windows
/// read (its nearest-neighbour upsampling of the gradient is wrong otherwise).
#[derive(Clone, Copy, Debug)]
pub struct Avg;

impl Reduction for Max {
    const LAYER: &'static str = "MaxPool2d";
    const LAYER_1D: &'static str = "MaxPool1d";
    const AVERAGE: bool = false;

    fn kernel(x: &Tensor, kernel: (usize, usize), stride: (usize, usize)) -> Result<Tensor> {
        Ok(x.max_pool2d_with_stride(kernel, stride)?)
    }

    fn kernel_differentiable(_: (usize, usize), _: (usize, usize)) -> bool {
        false
    }

    fn reduce(windows: &Tensor) -> Result<Tensor> {
        let first_max = windows.argmax_keepdim(D::Minus1)?;
        Ok(windows.gather(&first_max, D::Minus1)?.squeeze(D::Minus1)?)
    }
}

impl Reduction for Avg {
    const LAYER: &'static str = "AvgPool2d";
    const LAYER_1D: &'static str = "AvgPool1d";
    const AVERAGE: bool = true;

    fn kernel(x: &Tensor, kernel: (usize, usize), stride: (usize, usize)) -> Result<Tensor> {
        Ok(x.avg_pool2d_with_stride(kernel, stride)?)
    }

    fn kernel_differentiable(kernel: (usize, usize), stride: (usize, usize)) -> bool {
        kernel == stride
    }

    fn reduce(windows: &Tensor) -> Result<Tensor> {
        Ok(windows.mean(D::Minus1)?)
    }
}

/// A reduction `R` ([`Max`] or [`Avg`]) over `kernel_size` windows moved by `stride`: PyTorch's
/// `nn.MaxPool2d` ([`MaxPool2d`] = `Pool2d<Max>`) and `nn.AvgPool2d` ([`AvgPool2d`] =
/// `Pool2d<Avg>`), with PyTorch's options (see [`Pool2dConfig`]).
///
/// The input is `[N, C, H, W]` (or `[C, H, W]`); the output `[N, C, H_out, W_out]` with PyTorch's
/// `H_out = (H + 2 padding - dilation (kH - 1) - 1) / sH + 1`, the division rounding up in
/// `ceil_mode`, where a last window that would start in the right padding is dropped. When nothing
/// needs a gradient and no option is involved candle's kernel runs; see [`Max`] and [`Avg`] for the
/// gradients. With padding or an extra `ceil_mode` window, the input is padded explicitly (`-inf`
/// for max, zeros for avg) to exactly the extent the windows cover, and an average is rescaled by
/// each window's divisor as PyTorch's CPU kernel computes it (see [`Pool2dConfig`]).
///
/// Typed paths into it: [`Pool2dPath`], from [`Pool2d::path`] (`#[module(paths)]`).
#[derive(Module, Clone, Debug)]
#[module(crate = module_core)]
#[module(paths)]
#[module(extra_repr)]
#[module(bound = "R: Reduction", class_name = R::LAYER)]
pub struct Pool2d<R> {
    /// Window size `(kH, kW)`.
    pub kernel_size: (usize, usize),
    /// Step `(sH, sW)` between windows.
    pub stride: (usize, usize),
    /// Implicit padding `(pH, pW)` on both sides.
    #[module(skip)]
    pub padding: (usize, usize),
    /// Spacing `(dH, dW)` between window elements (`MaxPool2d` only).
    #[module(skip)]
    pub dilation: (usize, usize),
    /// Whether the output size rounds up.
    #[module(skip)]
    pub ceil_mode: bool,
    /// Whether padding counts in an average's divisor (`AvgPool2d` only).
    #[module(skip)]
    pub count_include_pad: bool,
    /// The divisor of every average, if set (`AvgPool2d` only).
    #[module(skip)]
    pub divisor_override: Option<usize>,
    #[module(skip)]
    reduction: PhantomData<R>,
}

/// The maximum over windows: PyTorch's `nn.MaxPool2d`. See [`Pool2d`] and [`Max`].
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::{MaxPool2d, Pool2dConfig};
/// let x = Tensor::arange(0f32, 16., &Device::Cpu)?.reshape((1, 1, 4, 4))?;
/// let y = MaxPool2d::new(2).call(&x)?;
/// assert_eq!(y.flatten_all()?.to_vec1::<f32>()?, [5., 7., 13., 15.]);
/// // nn.MaxPool2d(3, stride=1, padding=1): same size out.
/// let same = MaxPool2d::with_config(3, Pool2dConfig {
///     stride: Some(1.into()),
///     padding: 1.into(),
///     ..Default::default()
/// });
/// assert_eq!(same.call(&x)?.dims(), [1, 1, 4, 4]);
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub type MaxPool2d = Pool2d<Max>;

/// The mean over windows: PyTorch's `nn.AvgPool2d`. See [`Pool2d`] and [`Avg`].
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::{AvgPool2d, Pool2dConfig};
/// let x = Tensor::arange(0f32, 16., &Device::Cpu)?.reshape((1, 1, 4, 4))?;
/// let y = AvgPool2d::new(2).call(&x)?;
/// assert_eq!(y.flatten_all()?.to_vec1::<f32>()?, [2.5, 4.5, 10.5, 12.5]);
/// let overlapping = AvgPool2d::with_config(3, Pool2dConfig { stride: Some(1.into()), ..Default::default() });
/// assert_eq!(overlapping.call(&x)?.dims(), [1, 1, 2, 2]);
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub type AvgPool2d = Pool2d<Avg>;

impl<R: Reduction> Pool2d<R> {
    /// Windows of `kernel_size` (`k` or `(kH, kW)`), moved by their own size (PyTorch's default).
    pub fn new(kernel_size: impl Size<2>) -> Self {
        Self::with_config(kernel_size, Pool2dConfig::default())
    }

    /// Windows of `kernel_size`, moved, padded and counted as `config` says. The options are
    /// checked when the layer runs (a typed error then, as PyTorch raises at the call).
    pub fn with_config(kernel_size: impl Size<2>, config: Pool2dConfig) -> Self {
        let [kh, kw] = kernel_size.dims();
        Self {
            kernel_size: (kh, kw),
            stride: config.stride.map_or((kh, kw), PerDim::hw),
            padding: config.padding.hw(),
            dilation: config.dilation.hw(),
            ceil_mode: config.ceil_mode,
            count_include_pad: config.count_include_pad,
            divisor_override: config.divisor_override,
            reduction: PhantomData,
        }
    }

    /// The options along the height (`0`) or the width (`1`).
    fn axis(&self, dim: usize, size: usize) -> Axis {
        let pick = |(h, w): (usize, usize)| if dim == 0 { h } else { w };
        Axis {
            size,
            kernel: pick(self.kernel_size),
            stride: pick(self.stride),
            padding: pick(self.padding),
            dilation: pick(self.dilation),
            ceil_mode: self.ceil_mode,
        }
    }

    /// [`Error::InvalidConfig`] for options PyTorch rejects.
    fn check_config(&self) -> Result<()> {
        let ((kh, kw), (sh, sw), (ph, pw)) = (self.kernel_size, self.stride, self.padding);
        let (dh, dw) = self.dilation;
        let invalid = |message: String| {
            Err(Error::InvalidConfig {
                layer: R::LAYER,
                message,
            })
        };
        if kh == 0 || kw == 0 || sh == 0 || sw == 0 || dh == 0 || dw == 0 {
            return invalid(format!(
                "kernel_size {:?}, stride {:?} and dilation {:?} must be positive",
                self.kernel_size, self.stride, self.dilation
            ));
        }
        // PyTorch's `pool2d_shape_check` (aten/src/ATen/native/Pool.h): "pad should be smaller
        // than or equal to half of kernel size".
        if ph > kh / 2 || pw > kw / 2 {
            return invalid(format!(
                "padding {:?} must be at most half of kernel_size {:?}",
                self.padding, self.kernel_size
            ));
        }
        if R::AVERAGE && self.dilation != (1, 1) {
            return invalid(format!(
                "PyTorch's AvgPool2d has no dilation, got {:?}",
                self.dilation
            ));
        }
        if R::AVERAGE && self.divisor_override == Some(0) {
            return invalid("divisor_override must not be zero".to_owned());
        }
        Ok(())
    }

    /// The pooling of a `[N, C, H, W]` input along `ah` (the height) and `aw` (the width), whose
    /// output sizes are at least 1.
    fn pool(&self, x: &Tensor, ah: &Axis, aw: &Axis) -> Result<Tensor> {
        let (kernel, stride) = (self.kernel_size, self.stride);
        if ah.is_plain() && aw.is_plain() && self.divisor_override.is_none() {
            if !x.track_op() {
                return R::kernel(x, kernel, stride);
            }
            if R::kernel_differentiable(kernel, stride) {
                // candle's backward spreads the gradient by nearest-neighbour upsampling to the
                // input's size, which is right only when the windows tile the input exactly: the
                // elements no window reads are cut off first (their gradient is zero).
                let x = ah.pad(x, 2, 0.0)?;
                return R::kernel(&aw.pad(&x, 3, 0.0)?, kernel, stride);
            }
            return R::reduce(&windows(x, kernel, stride, (1, 1))?);
        }
        // Padded explicitly to exactly the extent the windows cover.
        let pad = if R::AVERAGE { 0.0 } else { f64::NEG_INFINITY };
        let x = ah.pad(x, 2, pad)?;
        let x = aw.pad(&x, 3, pad)?;
        let fast =
            self.dilation == (1, 1) && (!x.track_op() || R::kernel_differentiable(kernel, stride));
        if !R::AVERAGE {
            if fast {
                return R::kernel(&x, kernel, stride);
            }
            return R::reduce(&windows(&x, kernel, stride, self.dilation)?);
        }
        // The mean over the whole window (padding included), rescaled by the window's divisor.
        let mean = if fast {
            R::kernel(&x, kernel, stride)?
        } else {
            R::reduce(&windows(&x, kernel, stride, (1, 1))?)?
        };
        let area = (kernel.0 * kernel.1) as f64;
        let divisors = |a: &Axis| a.divisors(self.count_include_pad);
        let (dh, dw) = (divisors(ah), divisors(aw));
        let scale: Vec<f64> = match self.divisor_override {
            Some(d) => vec![area / d as f64; dh.len() * dw.len()],
            None => dh
                .iter()
                .flat_map(|h| dw.iter().map(move |w| area / (h * w).max(1) as f64))
                .collect(),
        };
        if scale.iter().all(|&s| s == 1.0) {
            return Ok(mean);
        }
        let scale =
            Tensor::from_vec(scale, (dh.len(), dw.len()), x.device())?.to_dtype(x.dtype())?;
        Ok(mean.broadcast_mul(&scale)?)
    }
}

/// One spatial dimension of a pooling: the input size and the options along it.
struct Axis {
    size: usize,
    kernel: usize,
    stride: usize,
    padding: usize,
    dilation: usize,
    ceil_mode: bool,
}

impl Axis {
    /// PyTorch's output size, `None` when it is below 1 (the input is too small).
    ///
    /// PyTorch's `pooling_output_shape_pad_lr` (aten/src/ATen/native/Pool.h):
    /// `out = div_rtn(in + pad_l + pad_r - dilation * (kernel - 1) - 1 + (ceil_mode ? stride - 1
    /// : 0), stride) + 1`, then in `ceil_mode`, "ensure that the last pooling starts inside the
    /// image": `if ((out - 1) * stride >= in + pad_l) --out`.
    fn output_size(&self) -> Option<usize> {
        let (size, p, s) = (self.size as i64, self.padding as i64, self.stride as i64);
        let span = (self.dilation * (self.kernel - 1)) as i64 + 1;
        let num = size + 2 * p - span + if self.ceil_mode { s - 1 } else { 0 };
        let mut out = num.div_euclid(s) + 1;
        if self.ceil_mode && (out - 1) * s >= size + p {
            out -= 1;
        }
        (out >= 1).then_some(out as usize)
    }

    fn span(&self) -> usize {
        self.dilation * (self.kernel - 1) + 1
    }

    /// Whether candle's kernel computes this dimension as it is: no padding or dilation, and as
    /// many windows as candle's floor rule gives.
    fn is_plain(&self) -> bool {
        self.padding == 0
            && self.dilation == 1
            && self.size >= self.kernel
            && Some((self.size - self.kernel) / self.stride + 1) == self.output_size()
    }

    /// `x` padded along `dim` with `value`: `padding` before, and after whatever makes the extent
    /// exactly what the windows cover (the right padding, a `ceil_mode` overhang, or less: the
    /// elements no window reads are cut off).
    fn pad(&self, x: &Tensor, dim: usize, value: f64) -> Result<Tensor> {
        let out = self.output_size().unwrap_or(1);
        let extent = (out - 1) * self.stride + self.span();
        let before = self.padding;
        let after = extent.saturating_sub(before + self.size);
        let x = pad_with(x, dim, before, after, value)?;
        Ok(x.narrow(dim, 0, extent)?)
    }

    /// Each window's divisor along this dimension, as PyTorch's CPU average pooling computes it
    /// (`aten/src/ATen/native/cpu/AvgPoolKernel.cpp`): the window `[start, start + kernel)`,
    /// `start = i * stride - padding`, clipped to the padded input `[-padding, size + padding)`
    /// (`pool_size`, used with `count_include_pad`), or to the input `[0, size)` (without).
    fn divisors(&self, count_include_pad: bool) -> Vec<usize> {
        let out = self.output_size().unwrap_or(1);
        let (size, p) = (self.size as i64, self.padding as i64);
        (0..out as i64)
            .map(|i| {
                let start = i * self.stride as i64 - p;
                let end = (start + self.kernel as i64).min(size + p);
                let (start, end) = if count_include_pad {
                    (start, end)
                } else {
                    (start.max(0), end.min(size))
                };
                (end - start).max(0) as usize
            })
            .collect()
    }
}

/// `x` with `before` and `after` elements of `value` added along `dim` (differentiable).
fn pad_with(x: &Tensor, dim: usize, before: usize, after: usize, value: f64) -> Result<Tensor> {
    if before == 0 && after == 0 {
        return Ok(x.clone());
    }
    if value == 0.0 {
        return Ok(x.pad_with_zeros(dim, before, after)?);
    }
    let block = |n: usize| -> Result<Tensor> {
        let mut dims = x.dims().to_vec();
        dims[dim] = n;
        Ok(Tensor::full(value, dims, x.device())?.to_dtype(x.dtype())?)
    };
    let mut parts = Vec::with_capacity(3);
    if before > 0 {
        parts.push(block(before)?);
    }
    parts.push(x.clone());
    if after > 0 {
        parts.push(block(after)?);
    }
    Ok(Tensor::cat(&parts, dim)?)
}

impl<R: Reduction> Forward<&Tensor> for Pool2d<R> {
    type Output = Tensor;

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.check_config()?;
        let rank = x.rank();
        let expected = || {
            format!(
                "[N, C, H, W] or [C, H, W] large enough for kernel_size {:?} (dilation {:?}, \
                 padding {:?}) to give an output of at least 1x1",
                self.kernel_size, self.dilation, self.padding
            )
        };
        let (ah, aw) = match x.dims() {
            &[.., h, w] if rank == 3 || rank == 4 => (self.axis(0, h), self.axis(1, w)),
            _ => return Err(input_shape_error(R::LAYER, expected(), x)),
        };
        if ah.output_size().is_none() || aw.output_size().is_none() {
            return Err(input_shape_error(R::LAYER, expected(), x));
        }
        if rank == 3 {
            return Ok(self.pool(&x.unsqueeze(0)?, &ah, &aw)?.squeeze(0)?);
        }
        self.pool(x, &ah, &aw)
    }
}

/// `[N, C, H, W]` to `[N, C, H_out, W_out, kH * kW]`: the elements of every window (spaced by
/// `dilation`), gathered with `index_select`, whose backward pass adds each window's gradient back
/// at its positions (windows may overlap). The input's extent is exactly what the windows cover,
/// or more.
fn windows(
    x: &Tensor,
    kernel: (usize, usize),
    stride: (usize, usize),
    dilation: (usize, usize),
) -> Result<Tensor> {
    let (n, c, h, w) = x.dims4()?;
    let ((kh, kw), (sh, sw), (dh, dw)) = (kernel, stride, dilation);
    let (span_h, span_w) = (dh * (kh - 1) + 1, dw * (kw - 1) + 1);
    let (ho, wo) = ((h - span_h) / sh + 1, (w - span_w) / sw + 1);
    let mut index = Vec::with_capacity(ho * wo * kh * kw);
    for i in 0..ho {
        for j in 0..wo {
            for a in 0..kh {
                for b in 0..kw {
                    index.push(((i * sh + a * dh) * w + j * sw + b * dw) as u32);
                }
            }
        }
    }
    let index = Tensor::from_vec(index, ho * wo * kh * kw, x.device())?;
    Ok(x.reshape((n, c, h * w))?
        .index_select(&index, 2)?
        .reshape((n, c, ho, wo, kh * kw))?)
}

impl<R: Reduction> ExtraRepr for Pool2d<R> {
    fn extra_repr(&self) -> String {
        // PyTorch shows what it was given; a pair with equal sides is shown as one number.
        let (kernel, stride, padding) =
            (self.kernel_size.py(), self.stride.py(), self.padding.py());
        let mut s = format!("kernel_size={kernel}, stride={stride}, padding={padding}");
        if !R::AVERAGE {
            let ceil = py_bool(self.ceil_mode);
            let _ = write!(s, ", dilation={}, ceil_mode={ceil}", self.dilation.py());
        }
        s
    }
}

forward_by_value!(MaxPool2d, AvgPool2d);

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    fn input_grad(
        layer: &impl for<'a> Forward<&'a Tensor, Output = Tensor>,
        x: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let x = Var::from_tensor(x)?;
        let y = layer.forward(x.as_tensor())?;
        let g = y.sum_all()?.backward()?;
        Ok((y, g.get(x.as_tensor()).unwrap().clone()))
    }

    /// Overlapping windows (kernel 3, stride 1): forward equals candle's kernel, and each window's
    /// gradient lands on one element (max) or is spread evenly (avg).
    #[test]
    fn overlapping_windows_are_differentiable() -> Result<()> {
        let dev = Device::Cpu;
        let x = Tensor::randn(0f32, 1., (2, 3, 5, 6), &dev)?;
        let overlapping = Pool2dConfig {
            stride: Some((1, 1).into()),
            ..Default::default()
        };
        let max = MaxPool2d::with_config(3, overlapping);
        let (y, g) = input_grad(&max, &x)?;
        let reference = x.max_pool2d_with_stride((3, 3), (1, 1))?;
        let diff = (&y - reference)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert_eq!(diff, 0.0);
        // One unit of gradient per window: 3 * 4 windows per channel.
        assert_eq!(g.sum_all()?.to_scalar::<f32>()?, (2 * 3 * 3 * 4) as f32);
        let avg = AvgPool2d::with_config(3, overlapping);
        let (y, g) = input_grad(&avg, &x)?;
        let reference = x.avg_pool2d_with_stride((3, 3), (1, 1))?;
        let diff = (&y - reference)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-6);
        let total = g.sum_all()?.to_scalar::<f32>()?;
        assert!((total - (2 * 3 * 3 * 4) as f32).abs() < 1e-4);
        Ok(())
    }

    #[test]
    fn bad_inputs_and_windows_are_typed_errors() -> Result<()> {
        let x = Tensor::zeros((1, 1, 2, 2), candle_core::DType::F32, &Device::Cpu)?;
        let kind = |result: Result<Tensor>| match result {
            Err(Error::InputShape { layer, .. }) => format!("{layer}: shape"),
            Err(Error::InvalidConfig { layer, .. }) => format!("{layer}: config"),
            other => format!("{other:?}"),
        };
        assert_eq!(kind(MaxPool2d::new(3).forward(&x)), "MaxPool2d: shape");
        assert_eq!(kind(AvgPool2d::new(0).forward(&x)), "AvgPool2d: config");
        let flat = x.flatten_all()?;
        assert_eq!(kind(MaxPool2d::new(2).forward(&flat)), "MaxPool2d: shape");
        Ok(())
    }
}
