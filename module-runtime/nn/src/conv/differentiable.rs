//! The 2-D convolution every differentiated `Conv1d`/`Conv2d` runs (see [the module docs](super)):
//! explicit padding, the input cropped to what the windows read, dilations and strides that differ
//! between dimensions built from candle's uniform ones.

use candle_core::Tensor;

use crate::error::Result;

/// A 2-D convolution that candle differentiates correctly (see the module docs), with a stride,
/// padding and dilation per dimension: explicit zero padding, the input cropped to the extent the
/// windows read, no implicit padding. Unequal dilations space the kernel's elements with zeros
/// beyond their common divisor; unequal strides run candle's convolution with their common divisor
/// and keep every `stride / gcd`-th output row or column.
pub(super) fn conv2d_differentiable(
    x: &Tensor,
    weight: &Tensor,
    padding: [usize; 2],
    stride: [usize; 2],
    dilation: [usize; 2],
    groups: usize,
) -> Result<Tensor> {
    let x = x.pad_with_zeros(2, padding[0], padding[0])?;
    let x = x.pad_with_zeros(3, padding[1], padding[1])?;
    let d = gcd(dilation[0], dilation[1]);
    let weight = space_kernel(weight, 2, dilation[0] / d)?;
    let weight = space_kernel(&weight, 3, dilation[1] / d)?;
    let s = gcd(stride[0], stride[1]);
    let (_, _, h, w) = x.dims4()?;
    let (_, _, kh, kw) = weight.dims4()?;
    let read = |size: usize, kernel: usize, stride: usize| {
        let span = d * (kernel - 1) + 1;
        if size < span {
            size // too small: candle reports the error
        } else {
            (size - span) / stride * stride + span
        }
    };
    let x = x
        .narrow(2, 0, read(h, kh, stride[0]))?
        .narrow(3, 0, read(w, kw, stride[1]))?;
    let y = x.conv2d(&weight, 0, s, d, groups)?;
    let y = every_nth(&y, 2, stride[0] / s)?;
    every_nth(&y, 3, stride[1] / s)
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// `kernel` with `factor - 1` zeros between consecutive elements along `dim` (a dilation by
/// `factor`), built from differentiable ops.
fn space_kernel(kernel: &Tensor, dim: usize, factor: usize) -> Result<Tensor> {
    if factor == 1 {
        return Ok(kernel.clone());
    }
    let k = kernel.dim(dim)?;
    let mut dims = kernel.dims().to_vec();
    dims[dim] = k * factor;
    let spaced = kernel
        .unsqueeze(dim + 1)?
        .pad_with_zeros(dim + 1, 0, factor - 1)?
        .reshape(dims)?;
    Ok(spaced.narrow(dim, 0, (k - 1) * factor + 1)?)
}

/// Every `n`-th element of `x` along `dim`, from the first (differentiable: `index_select`).
fn every_nth(x: &Tensor, dim: usize, n: usize) -> Result<Tensor> {
    if n == 1 {
        return Ok(x.clone());
    }
    let size = x.dim(dim)?;
    let index: Vec<u32> = (0..size).step_by(n).map(|i| i as u32).collect();
    let len = index.len();
    let index = Tensor::from_vec(index, len, x.device())?;
    Ok(x.index_select(&index, dim)?)
}
