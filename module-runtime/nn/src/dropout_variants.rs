//! The other dropouts: `Dropout1d`, `Dropout2d`, `Dropout3d` (whole channels), `AlphaDropout` and
//! `FeatureAlphaDropout` (which keep a SELU network's mean and variance), PyTorch's `torch.nn`
//! classes of those names.
//!
//! As [`Dropout`](crate::Dropout), each is the identity in evaluation mode (see
//! [`Mode`]) and draws a fresh mask per call in training mode; the mask is a constant of the graph,
//! so the gradient is the kept elements' scale. The formulas are ATen's `_dropout_impl`.

use candle_core::{DType, Tensor};

use crate::common::{forward_by_value, input_shape_error, layer_forward, layer_repr};
use crate::dropout::dropout_repr;
use crate::error::Result;
use crate::{Forward, Mode, Module};

/// `-λα` of SELU: the value alpha dropout drops to, before its affine correction.
const SELU_SATURATION: f64 = 1.758_099_340_847_376_6;

/// # Panics
///
/// If `p` is not in `[0, 1]`, as PyTorch raises.
fn check_p(p: f64) {
    assert!(
        (0.0..=1.0).contains(&p),
        "dropout probability has to be between 0 and 1, but got {p}"
    );
}

/// A keep-mask of ones and zeros (kept with probability `1 - p`) of shape `dims`, in `x`'s dtype.
fn keep_mask(x: &Tensor, dims: &[usize], p: f64) -> Result<Tensor> {
    let draw = module_core::rand(0., 1., dims, DType::F32, x.device())?;
    Ok(draw.ge(p)?.to_dtype(x.dtype())?)
}

/// `x` with a mask of shape `dims` (broadcast over the rest) applied as ATen does: plain dropout
/// scales the kept values by `1 / (1 - p)`; alpha dropout keeps `a x + α a p` and sets the dropped
/// ones to `α a (p - 1)`, with `a = 1 / sqrt((α² p + 1)(1 - p))`.
fn drop(x: &Tensor, dims: &[usize], p: f64, alpha: bool) -> Result<Tensor> {
    if p == 0.0 {
        return Ok(x.clone());
    }
    if p == 1.0 {
        return Ok(x.zeros_like()?);
    }
    let keep = keep_mask(x, dims, p)?;
    if !alpha {
        return Ok(x.broadcast_mul(&keep.affine(1.0 / (1.0 - p), 0.0)?)?);
    }
    let a = 1.0 / ((SELU_SATURATION * SELU_SATURATION * p + 1.0) * (1.0 - p)).sqrt();
    let shift = keep.affine(SELU_SATURATION * a, SELU_SATURATION * a * (p - 1.0))?;
    Ok(x.broadcast_mul(&keep.affine(a, 0.0)?)?
        .broadcast_add(&shift)?)
}

/// The shape of a per-channel mask of `x`: its first `lead` dimensions, then ones.
fn channel_dims(x: &Tensor, lead: usize) -> Vec<usize> {
    x.dims()
        .iter()
        .enumerate()
        .map(|(i, &d)| if i < lead { d } else { 1 })
        .collect()
}

/// Zeroes whole channels during training, each with probability `p`, and scales the others by
/// `1 / (1 - p)`: PyTorch's `nn.Dropout1d(p=0.5)` ([`Dropout1d`] = `ChannelDropout<1>`),
/// `nn.Dropout2d` ([`Dropout2d`]) and `nn.Dropout3d` ([`Dropout3d`]). Identity in evaluation mode.
///
/// The input is `[N, C, *]` or `[C, *]` with `D` dimensions in `*`; another rank is an
/// [`Error::InputShape`](crate::Error::InputShape). As in PyTorch, a 3-D input to `Dropout2d` is
/// read as `[N, C, L]` (one mask per `(n, c)`), not as an unbatched image.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::Dropout2d;
/// let x = Tensor::ones((2, 8, 3, 3), DType::F32, &Device::Cpu)?;
/// let y = Dropout2d::new(0.5).call(&x)?; // each 3x3 channel all 0 or all 2
/// let sums = y.sum((2, 3))?.flatten_all()?.to_vec1::<f32>()?;
/// assert!(sums.iter().all(|&s| s == 0. || s == 18.));
/// # Ok::<(), module_runtime::Error>(())
/// ```
///
/// Typed paths into it: [`ChannelDropoutPath`], from [`ChannelDropout::path`]
/// (`#[module(paths)]`).
#[derive(Module, Clone, Debug)]
#[module(crate = module_core)]
#[module(paths)]
#[module(extra_repr)]
#[module(class_name = format!("Dropout{D}d"))]
pub struct ChannelDropout<const D: usize> {
    /// Probability of zeroing a channel, in `[0, 1]`.
    pub p: f64,
    /// Training or evaluation mode.
    pub mode: Mode,
}

/// Channel dropout of `[N, C, L]` or `[C, L]`: PyTorch's `nn.Dropout1d(p)`. See [`ChannelDropout`].
pub type Dropout1d = ChannelDropout<1>;
/// Channel dropout of `[N, C, H, W]` (or `[N, C, L]`): PyTorch's `nn.Dropout2d(p)`. See
/// [`ChannelDropout`].
pub type Dropout2d = ChannelDropout<2>;
/// Channel dropout of `[N, C, D, H, W]` or `[C, D, H, W]`: PyTorch's `nn.Dropout3d(p)`. See
/// [`ChannelDropout`].
pub type Dropout3d = ChannelDropout<3>;

impl<const D: usize> ChannelDropout<D> {
    /// Channel dropout with probability `p`, in training mode.
    ///
    /// # Panics
    ///
    /// If `p` is not in `[0, 1]`, as PyTorch raises.
    pub fn new(p: f64) -> Self {
        check_p(p);
        Self {
            p,
            mode: Mode::new(),
        }
    }
}

impl<const D: usize> Forward<&Tensor> for ChannelDropout<D> {
    type Output = Tensor;

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let rank = x.rank();
        // Batched inputs (and Dropout2d's 3-D inputs, as PyTorch reads them) have a mask per
        // (sample, channel); unbatched ones a mask per channel.
        let lead = match rank {
            r if r == D + 2 => 2,
            3 if D == 2 => 2,
            r if r == D + 1 => 1,
            _ => {
                let layer = ["Dropout1d", "Dropout2d", "Dropout3d"][D.clamp(1, 3) - 1];
                let expected = format!("[N, C, *] or [C, *] with {D} dimensions in *");
                return Err(input_shape_error(layer, expected, x));
            }
        };
        if !self.mode.is_training() {
            return Ok(x.clone());
        }
        drop(x, &channel_dims(x, lead), self.p, false)
    }
}

impl<const D: usize> Forward<Tensor> for ChannelDropout<D> {
    type Output = Tensor;

    fn forward(&self, x: Tensor) -> Result<Tensor> {
        self.forward(&x)
    }
}

impl<const D: usize> candle_core::Module for ChannelDropout<D> {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        Ok(Forward::forward(self, x)?)
    }
}

/// Alpha dropout, for self-normalizing (SELU) networks: during training each element is dropped
/// with probability `p` to SELU's saturation value, and the result is rescaled and shifted so a
/// standard-normal input keeps mean 0 and variance 1. PyTorch's `nn.AlphaDropout(p=0.5)`.
/// Identity in evaluation mode; any shape.
///
/// Typed paths into it: [`AlphaDropoutPath`], from [`AlphaDropout::path`] (`#[module(paths)]`).
#[derive(Module, Clone, Debug)]
#[module(crate = module_core)]
#[module(paths)]
#[module(extra_repr)]
pub struct AlphaDropout {
    /// Probability of dropping an element, in `[0, 1]`.
    pub p: f64,
    /// Training or evaluation mode.
    pub mode: Mode,
}

impl AlphaDropout {
    /// Alpha dropout with probability `p`, in training mode.
    ///
    /// # Panics
    ///
    /// If `p` is not in `[0, 1]`, as PyTorch raises.
    pub fn new(p: f64) -> Self {
        check_p(p);
        Self {
            p,
            mode: Mode::new(),
        }
    }
}

layer_forward!(AlphaDropout, |layer, x| {
    if !layer.mode.is_training() {
        return Ok(x.clone());
    }
    drop(x, x.dims(), layer.p, true)
});

/// [`AlphaDropout`] of whole channels: one draw per `(sample, channel)` of `[N, C, *]`. PyTorch's
/// `nn.FeatureAlphaDropout(p=0.5)`. Identity in evaluation mode; inputs of rank 2 or more.
///
/// Typed paths into it: [`FeatureAlphaDropoutPath`], from [`FeatureAlphaDropout::path`]
/// (`#[module(paths)]`).
#[derive(Module, Clone, Debug)]
#[module(crate = module_core)]
#[module(paths)]
#[module(extra_repr)]
pub struct FeatureAlphaDropout {
    /// Probability of dropping a channel, in `[0, 1]`.
    pub p: f64,
    /// Training or evaluation mode.
    pub mode: Mode,
}

impl FeatureAlphaDropout {
    /// Feature alpha dropout with probability `p`, in training mode.
    ///
    /// # Panics
    ///
    /// If `p` is not in `[0, 1]`, as PyTorch raises.
    pub fn new(p: f64) -> Self {
        check_p(p);
        Self {
            p,
            mode: Mode::new(),
        }
    }
}

layer_forward!(FeatureAlphaDropout, |layer, x| {
    if x.rank() < 2 {
        return Err(input_shape_error("FeatureAlphaDropout", "[N, C, *]", x));
    }
    if !layer.mode.is_training() {
        return Ok(x.clone());
    }
    drop(x, &channel_dims(x, 2), layer.p, true)
});

forward_by_value!(AlphaDropout, FeatureAlphaDropout);

impl<const D: usize> module_core::ExtraRepr for ChannelDropout<D> {
    fn extra_repr(&self) -> String {
        dropout_repr(self.p)
    }
}

layer_repr!(AlphaDropout, |layer| dropout_repr(layer.p));
layer_repr!(FeatureAlphaDropout, |layer| dropout_repr(layer.p));
