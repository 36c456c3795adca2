//! 2-D pooling: `MaxPool2d` and `AvgPool2d`, one type, [`Pool2d`], with the reduction of each
//! window (max or mean) as its parameter.

use std::fmt::Debug;
use std::marker::PhantomData;

use candle_core::{Tensor, D};

use crate::error::{Error, Result};
use crate::nn::common::{forward_by_value, input_shape_error, Size};
use crate::{Forward, Module};

/// How a [`MaxPool2d`] or [`AvgPool2d`] is built: PyTorch's keyword arguments this layer supports,
/// with PyTorch's defaults (no padding, dilation or `ceil_mode`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Pool2dConfig {
    /// Step `(sH, sW)` between windows; `None` (the default) is the window size.
    pub stride: Option<(usize, usize)>,
}

/// How a [`Pool2d`] reduces each window: [`Max`] or [`Avg`].
pub trait Reduction: Clone + Copy + Debug + Send + Sync + 'static {
    /// PyTorch's name for the layer (`"MaxPool2d"`).
    const LAYER: &'static str;

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
/// gradient with such a stride the layer averages gathered windows instead.
#[derive(Clone, Copy, Debug)]
pub struct Avg;

impl Reduction for Max {
    const LAYER: &'static str = "MaxPool2d";

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
/// `Pool2d<Avg>`), without padding or dilation.
///
/// The input is `[N, C, H, W]` (or `[C, H, W]`); the output `[N, C, H_out, W_out]` with
/// `H_out = (H - kH) / sH + 1`. When nothing needs a gradient candle's kernel runs; see [`Max`] and
/// [`Avg`] for the gradients.
#[derive(Module, Clone, Debug)]
pub struct Pool2d<R> {
    /// Window size `(kH, kW)`.
    pub kernel_size: (usize, usize),
    /// Step `(sH, sW)` between windows.
    pub stride: (usize, usize),
    #[module(skip)]
    reduction: PhantomData<R>,
}

/// The maximum over windows: PyTorch's `nn.MaxPool2d`. See [`Pool2d`] and [`Max`].
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::MaxPool2d;
/// let x = Tensor::arange(0f32, 16., &Device::Cpu)?.reshape((1, 1, 4, 4))?;
/// let y = MaxPool2d::new(2).call(&x)?;
/// assert_eq!(y.flatten_all()?.to_vec1::<f32>()?, [5., 7., 13., 15.]);
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
/// let overlapping = AvgPool2d::with_config(3, Pool2dConfig { stride: Some((1, 1)) });
/// assert_eq!(overlapping.call(&x)?.dims(), [1, 1, 2, 2]);
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub type AvgPool2d = Pool2d<Avg>;

impl<R: Reduction> Pool2d<R> {
    /// Windows of `kernel_size` (`k` or `(kH, kW)`), moved by their own size (PyTorch's default).
    pub fn new(kernel_size: impl Size<2>) -> Self {
        Self::with_config(kernel_size, Pool2dConfig::default())
    }

    /// Windows of `kernel_size`, moved as `config` says.
    pub fn with_config(kernel_size: impl Size<2>, config: Pool2dConfig) -> Self {
        let [kh, kw] = kernel_size.dims();
        Self {
            kernel_size: (kh, kw),
            stride: config.stride.unwrap_or((kh, kw)),
            reduction: PhantomData,
        }
    }

    /// The pooling of a `[N, C, H, W]` input.
    fn pool(&self, x: &Tensor) -> Result<Tensor> {
        let (kernel, stride) = (self.kernel_size, self.stride);
        if !x.track_op() || R::kernel_differentiable(kernel, stride) {
            return R::kernel(x, kernel, stride);
        }
        R::reduce(&windows(x, kernel, stride)?)
    }
}

impl<R: Reduction> Forward<&Tensor> for Pool2d<R> {
    type Output = Tensor;

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let ((kh, kw), (sh, sw)) = (self.kernel_size, self.stride);
        if kh == 0 || kw == 0 || sh == 0 || sw == 0 {
            return Err(Error::InvalidConfig {
                layer: R::LAYER,
                message: format!(
                    "kernel_size {:?} and stride {:?} must be positive",
                    self.kernel_size, self.stride
                ),
            });
        }
        let rank = x.rank();
        let fits = |h: usize, w: usize| h >= kh && w >= kw;
        let expected = || format!("[N, C, H, W] or [C, H, W] with H >= {kh} and W >= {kw}");
        match x.dims() {
            &[.., h, w] if (rank == 3 || rank == 4) && fits(h, w) => {}
            _ => return Err(input_shape_error(R::LAYER, expected(), x)),
        }
        if rank == 3 {
            return Ok(self.pool(&x.unsqueeze(0)?)?.squeeze(0)?);
        }
        self.pool(x)
    }
}

/// `[N, C, H, W]` to `[N, C, H_out, W_out, kH * kW]`: the elements of every window, gathered with
/// `index_select`, whose backward pass adds each window's gradient back at its positions (windows
/// may overlap). The window fits the input.
fn windows(x: &Tensor, kernel: (usize, usize), stride: (usize, usize)) -> Result<Tensor> {
    let (n, c, h, w) = x.dims4()?;
    let ((kh, kw), (sh, sw)) = (kernel, stride);
    let (ho, wo) = ((h - kh) / sh + 1, (w - kw) / sw + 1);
    let mut index = Vec::with_capacity(ho * wo * kh * kw);
    for i in 0..ho {
        for j in 0..wo {
            for a in 0..kh {
                for b in 0..kw {
                    index.push(((i * sh + a) * w + j * sw + b) as u32);
                }
            }
        }
    }
    let index = Tensor::from_vec(index, ho * wo * kh * kw, x.device())?;
    Ok(x.reshape((n, c, h * w))?
        .index_select(&index, 2)?
        .reshape((n, c, ho, wo, kh * kw))?)
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
            stride: Some((1, 1)),
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
