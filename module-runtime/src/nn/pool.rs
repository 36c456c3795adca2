//! 2-D pooling.

use candle_core::{Tensor, D};

use crate::error::Result;
use crate::nn::activation::forward_by_value;
use crate::{Forward, Module};

/// Runs a 4-D pooling op on a `[N, C, H, W]` or `[C, H, W]` input.
fn pool(x: &Tensor, op: impl Fn(&Tensor) -> candle_core::Result<Tensor>) -> Result<Tensor> {
    match x.rank() {
        4 => Ok(op(x)?),
        3 => Ok(op(&x.unsqueeze(0)?)?.squeeze(0)?),
        _ => Err(candle_core::Error::Msg(format!(
            "pooling: expected an input [N, C, H, W] or [C, H, W], got {:?}",
            x.dims()
        ))
        .into()),
    }
}

/// `[N, C, H, W]` to `[N, C, H_out, W_out, kH * kW]`: the elements of every window, gathered with
/// `index_select`, whose backward pass adds each window's gradient back at its positions (windows
/// may overlap).
fn windows(x: &Tensor, kernel: (usize, usize), stride: (usize, usize)) -> Result<Tensor> {
    let (n, c, h, w) = x.dims4()?;
    let ((kh, kw), (sh, sw)) = (kernel, stride);
    if kh == 0 || kw == 0 || sh == 0 || sw == 0 || h < kh || w < kw {
        return Err(candle_core::Error::Msg(format!(
            "pooling: kernel {kernel:?} with stride {stride:?} does not fit an input {:?}",
            x.dims()
        ))
        .into());
    }
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

/// The maximum over `kernel_size` windows moved by `stride`: PyTorch's `nn.MaxPool2d` without
/// padding or dilation.
///
/// The input is `[N, C, H, W]` (or `[C, H, W]`); the output `[N, C, H_out, W_out]` with
/// `H_out = (H - kH) / sH + 1`.
///
/// As in PyTorch, the gradient of each window goes to one element, its first maximum. candle's own
/// max-pool backward scales the gradient by the share of maxima in the window (a quarter of the
/// right value for a 2×2 window) and rejects `stride != kernel_size`, so when the input tracks a
/// gradient the layer takes the max over gathered windows instead; otherwise it runs candle's
/// kernel.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::MaxPool2d;
/// let x = Tensor::arange(0f32, 16., &Device::Cpu)?.reshape((1, 1, 4, 4))?;
/// let y = MaxPool2d::new(2).call(&x)?;
/// assert_eq!(y.flatten_all()?.to_vec1::<f32>()?, [5., 7., 13., 15.]);
/// # Ok::<(), module_runtime::Error>(())
/// ```
#[derive(Module, Clone, Debug)]
pub struct MaxPool2d {
    /// Window size `(kH, kW)`.
    pub kernel_size: (usize, usize),
    /// Step `(sH, sW)` between windows.
    pub stride: (usize, usize),
}

impl MaxPool2d {
    /// Square windows of side `kernel_size`, stride equal to the window.
    pub fn new(kernel_size: usize) -> Self {
        Self::with_stride((kernel_size, kernel_size), (kernel_size, kernel_size))
    }

    /// Any window and stride.
    pub fn with_stride(kernel_size: (usize, usize), stride: (usize, usize)) -> Self {
        Self {
            kernel_size,
            stride,
        }
    }
}

impl Forward<&Tensor> for MaxPool2d {
    type Output = Tensor;

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if !x.track_op() {
            return pool(x, |x| {
                x.max_pool2d_with_stride(self.kernel_size, self.stride)
            });
        }
        pool(x, |x| {
            let windows =
                windows(x, self.kernel_size, self.stride).map_err(candle_core::Error::wrap)?;
            let first_max = windows.argmax_keepdim(D::Minus1)?;
            windows.gather(&first_max, D::Minus1)?.squeeze(D::Minus1)
        })
    }
}

/// The mean over `kernel_size` windows moved by `stride`: PyTorch's `nn.AvgPool2d` without padding.
///
/// The input is `[N, C, H, W]` (or `[C, H, W]`); the output `[N, C, H_out, W_out]` with
/// `H_out = (H - kH) / sH + 1`.
///
/// candle's average-pool backward rejects `stride != kernel_size`, so when the input tracks a
/// gradient with such a stride the layer averages gathered windows instead.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::AvgPool2d;
/// let x = Tensor::arange(0f32, 16., &Device::Cpu)?.reshape((1, 1, 4, 4))?;
/// let y = AvgPool2d::new(2).call(&x)?;
/// assert_eq!(y.flatten_all()?.to_vec1::<f32>()?, [2.5, 4.5, 10.5, 12.5]);
/// # Ok::<(), module_runtime::Error>(())
/// ```
#[derive(Module, Clone, Debug)]
pub struct AvgPool2d {
    /// Window size `(kH, kW)`.
    pub kernel_size: (usize, usize),
    /// Step `(sH, sW)` between windows.
    pub stride: (usize, usize),
}

impl AvgPool2d {
    /// Square windows of side `kernel_size`, stride equal to the window.
    pub fn new(kernel_size: usize) -> Self {
        Self::with_stride((kernel_size, kernel_size), (kernel_size, kernel_size))
    }

    /// Any window and stride.
    pub fn with_stride(kernel_size: (usize, usize), stride: (usize, usize)) -> Self {
        Self {
            kernel_size,
            stride,
        }
    }
}

impl Forward<&Tensor> for AvgPool2d {
    type Output = Tensor;

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if !x.track_op() || self.kernel_size == self.stride {
            return pool(x, |x| {
                x.avg_pool2d_with_stride(self.kernel_size, self.stride)
            });
        }
        pool(x, |x| {
            windows(x, self.kernel_size, self.stride)
                .map_err(candle_core::Error::wrap)?
                .mean(D::Minus1)
        })
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
        let max = MaxPool2d::with_stride((3, 3), (1, 1));
        let (y, g) = input_grad(&max, &x)?;
        let reference = x.max_pool2d_with_stride((3, 3), (1, 1))?;
        let diff = (&y - reference)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert_eq!(diff, 0.0);
        // One unit of gradient per window: 3 * 4 windows per channel.
        assert_eq!(g.sum_all()?.to_scalar::<f32>()?, (2 * 3 * 3 * 4) as f32);
        let avg = AvgPool2d::with_stride((3, 3), (1, 1));
        let (y, g) = input_grad(&avg, &x)?;
        let reference = x.avg_pool2d_with_stride((3, 3), (1, 1))?;
        let diff = (&y - reference)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-6);
        let total = g.sum_all()?.to_scalar::<f32>()?;
        assert!((total - (2 * 3 * 3 * 4) as f32).abs() < 1e-4);
        Ok(())
    }
}
