//! [`ConvTranspose1d`]'s computation: the direct convolution it equals (candle's own 1-D
//! transposed convolution has no backward).

use candle_core::Tensor;

use super::conv2d_differentiable;
use super::transpose::ConvTranspose1d;
use crate::common::{add_channel_bias, forward_by_value, input_shape_error};
use crate::device::check_input_device;
use crate::error::Result;
use crate::Forward;

impl ConvTranspose1d {
    /// The transposed convolution of a `[N, C_in, L]` input.
    fn transposed(&self, x: &Tensor) -> Result<Tensor> {
        let c = &self.config;
        let w = self.weight_value()?;
        let (c_in, c_out_g, k) = w.dims3()?;
        let (n, x_c, l) = x.dims3()?;
        let reach = c.dilation * (k - 1);
        let l_out = ((l - 1) * c.stride + reach + c.output_padding + 1).checked_sub(2 * c.padding);
        if x_c != c_in || l == 0 || k == 0 || c.stride == 0 || c.dilation == 0 || l_out.is_none() {
            let expected = format!("[N, {c_in}, L] with an output length of at least 1");
            return Err(input_shape_error("ConvTranspose1d", expected, x));
        }
        // `stride - 1` zeros between the input's elements.
        let x = if c.stride > 1 {
            let zeros = Tensor::zeros((n, c_in, l, c.stride - 1), x.dtype(), x.device())?;
            Tensor::cat(&[&x.unsqueeze(3)?, &zeros], 3)?
                .reshape((n, c_in, l * c.stride))?
                .narrow(2, 0, (l - 1) * c.stride + 1)?
        } else {
            x.clone()
        };
        // `reach - padding` on the left, `output_padding` more on the right; cut where negative.
        let edge = |x: Tensor, extra: usize, left: bool| -> Result<Tensor> {
            let len = x.dim(2)?;
            let total = reach + extra;
            Ok(if total >= c.padding {
                let pad = total - c.padding;
                if left {
                    x.pad_with_zeros(2, pad, 0)?
                } else {
                    x.pad_with_zeros(2, 0, pad)?
                }
            } else {
                let cut = c.padding - total;
                x.narrow(2, if left { cut } else { 0 }, len - cut)?
            })
        };
        let x = edge(edge(x, 0, true)?, c.output_padding, false)?;
        // The kernel flipped along its length, `[C_in, C_out/g, k]` -> `[C_out, C_in/g, k]`.
        let reversed: Vec<u32> = (0..k as u32).rev().collect();
        let reversed = Tensor::from_vec(reversed, k, w.device())?;
        let g = c.groups;
        let w = w
            .index_select(&reversed, 2)?
            .reshape((g, c_in / g, c_out_g, k))?
            .transpose(1, 2)?
            .reshape((g * c_out_g, c_in / g, k))?
            .contiguous()?;
        // As a 2-D convolution of height 1, as `Conv1d` trains: candle 0.11's `conv1d` backward is
        // wrong for batches of more than one when the convolution has no padding (its
        // `conv_transpose1d` col2im path).
        let y = conv2d_differentiable(
            &x.unsqueeze(2)?,
            &w.unsqueeze(2)?,
            [0, 0],
            [1, 1],
            [1, c.dilation],
            g,
        )?;
        Ok(y.squeeze(2)?)
    }
}

impl Forward<&Tensor> for ConvTranspose1d {
    type Output = Tensor;

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        check_input_device("ConvTranspose1d.weight", &self.weight_value()?, x)?;
        let y = if x.rank() == 2 {
            self.transposed(&x.unsqueeze(0)?)?.squeeze(0)?
        } else if x.rank() == 3 {
            self.transposed(x)?
        } else {
            let expected = format!("[N, {}, L] or [C, L]", self.weight.shape().dims()[0]);
            return Err(input_shape_error("ConvTranspose1d", expected, x));
        };
        let channel = y.rank() - 2;
        let bias = self.bias_value()?;
        if channel == 0 {
            return Ok(match bias {
                Some(b) => y.broadcast_add(&b.unsqueeze(1)?)?,
                None => y,
            });
        }
        add_channel_bias(y, bias)
    }
}

forward_by_value!(ConvTranspose1d);
