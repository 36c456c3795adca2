//! `Conv3d`'s computation: candle has no 3-D convolution, so it runs as 2-D ones.

use candle_core::Tensor;

use super::{conv2d_differentiable, ConvConfig, Spatial};
use crate::common::{add_channel_bias, batched, input_shape_error};
use crate::error::Result;

/// `Conv3d`'s computation: for each kernel depth `kd`, the input's depth slices that row of the
/// kernel reads (`i stride + kd dilation` for each output depth `i`), folded into the batch and
/// convolved in 2-D with that row; the sum over `kd`.
pub(super) fn conv3d(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<Tensor>,
    c: &ConvConfig,
) -> Result<Tensor> {
    let sp = Spatial::<3>::of("Conv3d", c)?;
    let (x, unbatched) = batched(x, 4, 0)?;
    let (Ok((n, ch, depth, h, w)), Ok((c_out, _, kd, _, _))) = (x.dims5(), weight.dims5()) else {
        return Err(input_shape_error(
            "Conv3d",
            "[N, C, D, H, W] or [C, D, H, W]",
            &x,
        ));
    };
    let [sd, sh, sw] = sp.stride;
    let [pd, ph, pw] = sp.padding;
    let [dd, dh, dw] = sp.dilation;
    let padded = depth + 2 * pd;
    let reach = dd * (kd - 1) + 1;
    if padded < reach {
        let expected = format!("[N, C, D, H, W] with D + 2 padding >= {reach}");
        return Err(input_shape_error("Conv3d", expected, &x));
    }
    let d_out = (padded - reach) / sd + 1;
    // candle's `index_select` reads contiguous tensors only (a bias-free `Conv3d`'s own output
    // is a permuted view).
    let x = x.pad_with_zeros(2, pd, pd)?.contiguous()?;
    let mut sum: Option<Tensor> = None;
    for k in 0..kd {
        let index: Vec<u32> = (0..d_out).map(|i| (i * sd + k * dd) as u32).collect();
        let index = Tensor::from_vec(index, d_out, x.device())?;
        let slices = x
            .index_select(&index, 2)?
            .permute((0, 2, 1, 3, 4))?
            .reshape((n * d_out, ch, h, w))?;
        let row = weight.narrow(2, k, 1)?.squeeze(2)?;
        let y = conv2d_differentiable(&slices, &row, [ph, pw], [sh, sw], [dh, dw], c.groups)?;
        sum = Some(match sum {
            Some(s) => (s + y)?,
            None => y,
        });
    }
    let y = sum.expect("a kernel has at least one depth row");
    let (_, _, ho, wo) = y.dims4()?;
    let y = y
        .reshape((n, d_out, c_out, ho, wo))?
        .permute((0, 2, 1, 3, 4))?;
    let y = add_channel_bias(y, bias)?;
    Ok(if unbatched { y.squeeze(0)? } else { y })
}
