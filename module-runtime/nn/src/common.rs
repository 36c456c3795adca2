//! What several layer families use: the by-value forward impls, PyTorch-style dimensions, bias
//! and per-channel helpers, the fan-in initialization, typed shape errors, and the helpers with
//! which a lazy layer builds its parameters from its first input.

use candle_core::{DType, Device, Shape, Tensor};

use crate::error::{Error, Result};
// The layer macros, where the layers' files have always found them.
pub(crate) use crate::layer_macros::{
    config_layer, default_new, forward_by_value, layer_forward, layer_repr, unit_layer,
};
// The normalizations' composed step, which the kernels' `layer_norm` takes too.
use crate::{Buffer, Init, LazyShape, Param};
pub(crate) use module_core::autocast_policy::AutocastOp;
pub(crate) use module_kernels::{compute_dtype, standardize_last_dim};

/// A size over `N` spatial dimensions, given as one number for all of them (`3`), as an array
/// (`[3, 5]`), or for two dimensions as `(height, width)`: PyTorch's "int or tuple" arguments
/// (`kernel_size` of [`Conv2d`](crate::Conv2d), [`MaxPool2d`](crate::MaxPool2d), …).
pub trait Size<const N: usize> {
    /// The size along each dimension.
    fn dims(self) -> [usize; N];
}

impl<const N: usize> Size<N> for usize {
    fn dims(self) -> [usize; N] {
        [self; N]
    }
}

impl<const N: usize> Size<N> for [usize; N] {
    fn dims(self) -> [usize; N] {
        self
    }
}

impl Size<2> for (usize, usize) {
    fn dims(self) -> [usize; 2] {
        [self.0, self.1]
    }
}

/// A configuration value given for all spatial dimensions at once or per dimension: PyTorch's
/// "int or tuple" `stride`, `padding` and `dilation` (`stride=2`, `padding=(1, 2)`).
///
/// Write it as PyTorch does and convert with `.into()`: `2.into()` is [`PerDim::All`]`(2)`,
/// `(1, 2).into()` (or `[1, 2].into()`) is [`PerDim::HW`]`(1, 2)`.
///
/// ```
/// use module_runtime::nn::{PerDim, Pool2dConfig};
/// let cfg = Pool2dConfig { stride: Some((1, 2).into()), padding: 1.into(), ..Default::default() };
/// assert_eq!(cfg.stride, Some(PerDim::HW(1, 2)));
/// assert_eq!(cfg.padding.hw(), (1, 1));
/// assert_eq!(PerDim::All(3).for_dims::<1>(), Some([3]));
/// assert_eq!(PerDim::HW(1, 2).for_dims::<1>(), None);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PerDim {
    /// The same value along every spatial dimension (PyTorch's int).
    All(usize),
    /// `(height, width)`: one value per dimension of a 2-D layer (PyTorch's tuple).
    HW(usize, usize),
}

impl PerDim {
    /// The value along the height and along the width.
    pub fn hw(self) -> (usize, usize) {
        match self {
            PerDim::All(v) => (v, v),
            PerDim::HW(h, w) => (h, w),
        }
    }

    /// The value along each of `N` dimensions; `None` for [`PerDim::HW`] unless `N` is 2.
    pub fn for_dims<const N: usize>(self) -> Option<[usize; N]> {
        match self {
            PerDim::All(v) => Some([v; N]),
            PerDim::HW(h, w) => <[usize; N]>::try_from(&[h, w][..]).ok(),
        }
    }
}

impl From<usize> for PerDim {
    fn from(v: usize) -> Self {
        PerDim::All(v)
    }
}

impl From<(usize, usize)> for PerDim {
    fn from((h, w): (usize, usize)) -> Self {
        PerDim::HW(h, w)
    }
}

impl From<[usize; 2]> for PerDim {
    fn from([h, w]: [usize; 2]) -> Self {
        PerDim::HW(h, w)
    }
}

impl Size<2> for PerDim {
    fn dims(self) -> [usize; 2] {
        let (h, w) = self.hw();
        [h, w]
    }
}

/// Resolves a PyTorch-style dimension (negative counts from the end) against a tensor's rank.
pub(crate) fn resolve_dim(x: &Tensor, dim: isize, op: &'static str) -> Result<usize> {
    let rank = x.rank() as isize;
    let resolved = if dim < 0 { rank + dim } else { dim };
    if (0..rank).contains(&resolved) {
        Ok(resolved as usize)
    } else {
        Err(candle_core::Error::DimOutOfRange {
            shape: x.shape().clone(),
            dim: dim as i32,
            op,
        }
        .into())
    }
}

/// [`Error::InputShape`]: `layer` takes inputs of shape `expected`, not `x`'s.
pub(crate) fn input_shape_error(
    layer: &'static str,
    expected: impl Into<String>,
    x: &Tensor,
) -> Error {
    Error::InputShape {
        layer,
        expected: expected.into(),
        got: x.shape().clone(),
    }
}

/// The value of an optional parameter (a bias, an affine weight).
pub(crate) fn param_tensor(p: &Option<Param>) -> Result<Option<Tensor>> {
    p.as_ref().map(Param::tensor).transpose()
}

/// `x` with a batch of one inserted as dimension `batch_dim` when it has `unbatched_rank`
/// dimensions (PyTorch's layers take inputs with and without the batch), and whether it did: the
/// caller squeezes its output back.
pub(crate) fn batched(
    x: &Tensor,
    unbatched_rank: usize,
    batch_dim: usize,
) -> Result<(Tensor, bool)> {
    let unbatched = x.rank() == unbatched_rank;
    let x = if unbatched {
        x.unsqueeze(batch_dim)?
    } else {
        x.clone()
    };
    Ok((x, unbatched))
}

/// `t` `[C]` reshaped to `[1, C, 1, …]`, to broadcast over an input `[N, C, *]` of rank `rank`.
pub(crate) fn per_channel(t: &Tensor, rank: usize) -> Result<Tensor> {
    let mut dims = vec![1; rank];
    dims[1] = t.elem_count();
    Ok(t.reshape(dims)?)
}

/// `y + bias` with the bias `[C]` added to every position of channel dimension 1 of `y`.
pub(crate) fn add_channel_bias(y: Tensor, bias: Option<Tensor>) -> Result<Tensor> {
    match bias {
        Some(b) => Ok(y.broadcast_add(&per_channel(&b, y.rank())?)?),
        None => Ok(y),
    }
}

/// [`add_channel_bias`] for the fresh output of a convolution kernel, which nothing else holds: in
/// place during CPU float32 inference (no second output allocated), else as `add_channel_bias`.
pub(crate) fn add_channel_bias_to_fresh(y: Tensor, bias: Option<Tensor>) -> Result<Tensor> {
    match bias {
        Some(b) => Ok(module_kernels::add_bias(y, &b, 1)?),
        None => Ok(y),
    }
}

/// A parameter of shape `dims` drawn as PyTorch initializes `Linear`, convolution and recurrent
/// weights and biases: uniform on `±1/sqrt(fan_in)` ([`Init::UniformFanIn`]).
pub(crate) fn uniform_fan_in(
    dims: &[usize],
    fan_in: usize,
    dtype: DType,
    device: &Device,
) -> Result<Param> {
    Param::init(dims.to_vec(), Init::UniformFanIn, fan_in, dtype, device)
}

/// An unbuilt parameter of a lazy layer: `None` dimensions come from the first input.
pub(crate) fn lazy_param(
    dims: &[Option<usize>],
    init: Init,
    dtype: DType,
    device: &Device,
) -> Result<Param> {
    Param::lazy(LazyShape::new(dims.iter().copied()), init, dtype, device)
}

/// The shape a lazy layer's parameter or buffer takes for an input that sets its dimension
/// `set.0` to `set.1` (if any): the other dimensions are those known at construction while it is
/// unbuilt (`lazy`), or those it was built with (`built`).
fn fit_dims(lazy: Option<LazyShape>, built: Shape, set: Option<(usize, usize)>) -> Vec<usize> {
    let mut dims = match (lazy, set) {
        (Some(lazy), Some((_, size))) => lazy.dims().iter().map(|d| d.unwrap_or(size)).collect(),
        (Some(lazy), None) => lazy.dims().iter().map(|d| d.unwrap_or(0)).collect(),
        (None, _) => built.dims().to_vec(),
    };
    if let Some((dim, size)) = set {
        dims[dim] = size;
    }
    dims
}

/// Builds a lazy layer's `param` for `input` (dimension `set.0` of its shape is `set.1`), or checks
/// that `input` fits the shape it was built with; [`Error::LazyInput`] naming the layer if not. A
/// parametrized tensor's stand-in is checked by its shape (the computed tensor's).
pub(crate) fn fit_param(
    layer: &'static str,
    name: &'static str,
    param: &Param,
    set: Option<(usize, usize)>,
    fan_in: usize,
    input: &Tensor,
) -> Result<()> {
    let dims = fit_dims(param.lazy_shape(), param.shape(), set);
    if param.is_parametrized() {
        return check_fit(layer, name, param.shape().dims(), &dims, input);
    }
    layer_param(layer, name, param, &dims, fan_in, input).map(drop)
}

/// Like [`fit_param`], for a buffer (running statistics).
pub(crate) fn fit_buffer(
    layer: &'static str,
    name: &'static str,
    buffer: &Buffer,
    set: (usize, usize),
    input: &Tensor,
) -> Result<Tensor> {
    let dims = fit_dims(buffer.lazy_shape(), buffer.shape(), Some(set));
    layer_buffer(layer, name, buffer, &dims, input)
}

/// Builds `param` with `dims` for a lazy layer, or checks that the input still fits the shape it
/// was built with (by an earlier call or a checkpoint), naming the layer and both shapes if not.
pub(crate) fn layer_param(
    layer: &'static str,
    name: &'static str,
    param: &Param,
    dims: &[usize],
    fan_in: usize,
    input: &Tensor,
) -> Result<Tensor> {
    let t = if param.is_built() {
        param.tensor()?
    } else {
        param.materialize(dims, fan_in)?
    };
    check_fit(layer, name, t.dims(), dims, input)?;
    Ok(t)
}

/// Like [`layer_param`], for a buffer (running statistics).
pub(crate) fn layer_buffer(
    layer: &'static str,
    name: &'static str,
    buffer: &Buffer,
    dims: &[usize],
    input: &Tensor,
) -> Result<Tensor> {
    let t = if buffer.is_built() {
        buffer.tensor()?
    } else {
        buffer.materialize(dims)?
    };
    check_fit(layer, name, t.dims(), dims, input)?;
    Ok(t)
}

fn check_fit(
    layer: &'static str,
    name: &'static str,
    built: &[usize],
    needed: &[usize],
    input: &Tensor,
) -> Result<()> {
    if built == needed {
        return Ok(());
    }
    Err(Error::LazyInput {
        layer,
        name,
        input: input.shape().clone(),
        needed: Shape::from(needed.to_vec()),
        built: Shape::from(built.to_vec()),
    })
}

/// A configuration value as Python prints it in a layer's `extra_repr`.
pub(crate) trait PyValue {
    /// Python's `repr` of the value.
    fn py(&self) -> String;
}

impl PyValue for f64 {
    fn py(&self) -> String {
        module_core::py_float(*self)
    }
}

impl PyValue for isize {
    fn py(&self) -> String {
        self.to_string()
    }
}

impl PyValue for usize {
    fn py(&self) -> String {
        self.to_string()
    }
}

/// A `(height, width)` pair as PyTorch shows an "int or tuple" argument: one number when the
/// sides are equal (what PyTorch shows when it was given one), `(1, 2)` otherwise.
impl PyValue for (usize, usize) {
    fn py(&self) -> String {
        match self {
            (a, b) if a == b => a.to_string(),
            (a, b) => format!("({a}, {b})"),
        }
    }
}

/// As it was given: `2` for [`PerDim::All`], `(1, 2)` for [`PerDim::HW`].
impl PyValue for PerDim {
    fn py(&self) -> String {
        match *self {
            PerDim::All(v) => v.to_string(),
            PerDim::HW(h, w) => format!("({h}, {w})"),
        }
    }
}

impl PyValue for bool {
    fn py(&self) -> String {
        module_core::py_bool(*self).to_owned()
    }
}

/// The largest absolute difference between two tensors of one shape: what the crate's unit tests
/// compare paths with.
#[cfg(test)]
pub(crate) fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

/// `f(x, weight, bias)` for a lower-precision op under [`autocast`](module_core::autocast) (a
/// convolution): the three cast as PyTorch's lists say, and a half-precision CPU computation
/// widened to float32 from the rounded values and rounded once at the end (float32 accumulation,
/// as PyTorch's CPU kernels; candle's own half-precision CPU convolutions accumulate in half
/// precision). Outside autocast, `f` on the tensors as given.
pub(crate) fn lower_precision(
    op: module_core::autocast_policy::AutocastOp,
    x: &Tensor,
    weight: &Tensor,
    bias: Option<Tensor>,
    f: impl FnOnce(&Tensor, &Tensor, Option<Tensor>) -> Result<Tensor>,
) -> Result<Tensor> {
    use module_core::autocast_policy::{autocast_cast, autocast_cast_opt};
    let [x, weight] = autocast_cast(op, [x, weight])?;
    let bias = autocast_cast_opt(op, bias.as_ref())?;
    let half = |d: DType| matches!(d, DType::BF16 | DType::F16);
    if x.device().is_cpu() && half(x.dtype()) && x.dtype() == weight.dtype() {
        let widened = |t: &Tensor| t.to_dtype(DType::F32);
        let bias = bias.as_ref().map(widened).transpose()?;
        let y = f(&widened(&x)?, &widened(&weight)?, bias)?;
        return Ok(y.to_dtype(x.dtype())?);
    }
    f(&x, &weight, bias)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolve_dim_counts_negative_dims_from_the_end() -> Result<()> {
        let x = Tensor::zeros((2, 3), DType::F32, &Device::Cpu)?;
        assert_eq!(resolve_dim(&x, -1, "t")?, 1);
        assert_eq!(resolve_dim(&x, 0, "t")?, 0);
        assert!(resolve_dim(&x, 2, "t").is_err());
        assert!(resolve_dim(&x, -3, "t").is_err());
        Ok(())
    }

    #[test]
    fn fit_dims_fills_the_input_dimension() {
        let lazy = LazyShape::new([Some(4), None, Some(3)]);
        assert_eq!(
            fit_dims(Some(lazy), Shape::from(0), Some((1, 2))),
            [4, 2, 3]
        );
        let built = Shape::from((4, 5, 3));
        assert_eq!(fit_dims(None, built.clone(), Some((1, 2))), [4, 2, 3]);
        assert_eq!(fit_dims(None, built, None), [4, 5, 3]);
    }
}
