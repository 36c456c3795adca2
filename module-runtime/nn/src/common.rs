//! What several layer families use: the by-value forward impls, PyTorch-style dimensions, bias
//! and per-channel helpers, the fan-in initialization, typed shape errors, and the helpers with
//! which a lazy layer builds its parameters from its first input.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Device, Layout, Shape, Tensor, D};

use crate::error::{Error, Result};
// The layer macros, where the layers' files have always found them.
pub(crate) use crate::layer_macros::{
    config_layer, default_new, forward_by_value, layer_forward, layer_repr, unit_layer,
};
use crate::{Buffer, Init, LazyShape, Param};

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
        Some(b) if can_add_bias_in_place(&y, &b, 1) => {
            add_bias_in_place(&y, &b, 1)?;
            Ok(y)
        }
        other => add_channel_bias(y, other),
    }
}

/// Whether `t` is what the runtime's in-place and fused CPU passes work on: float32, on the CPU,
/// contiguous, and recording no gradient.
pub(crate) fn is_plain_cpu_f32(t: &Tensor) -> bool {
    !t.track_op() && t.dtype() == DType::F32 && t.device().is_cpu() && t.is_contiguous()
}

/// Whether `b` can be added to `y` along dimension `dim` in place: both
/// [plain CPU float32](is_plain_cpu_f32), `b` one non-empty value per index of `dim`. The caller
/// guarantees that `y` is a kernel's fresh output that no one else holds.
pub(crate) fn can_add_bias_in_place(y: &Tensor, b: &Tensor, dim: usize) -> bool {
    is_plain_cpu_f32(y)
        && is_plain_cpu_f32(b)
        && b.rank() == 1
        && b.elem_count() > 0
        && y.dims().get(dim) == Some(&b.elem_count())
}

/// `y[.., j, ..] += b[j]` along dimension `dim`, in place (see [`can_add_bias_in_place`]).
pub(crate) fn add_bias_in_place(y: &Tensor, b: &Tensor, dim: usize) -> Result<()> {
    let inner = y.dims()[dim + 1..].iter().product();
    Ok(y.inplace_op2(b, &AddBiasInPlace { inner })?)
}

/// `y += b` over a contiguous float32 `y` viewed as `[outer, b.len(), inner]`.
struct AddBiasInPlace {
    inner: usize,
}

impl candle_core::InplaceOp2 for AddBiasInPlace {
    fn name(&self) -> &'static str {
        "add-bias-in-place"
    }

    fn cpu_fwd(
        &self,
        y: &mut candle_core::CpuStorage,
        y_layout: &candle_core::Layout,
        b: &candle_core::CpuStorage,
        b_layout: &candle_core::Layout,
    ) -> candle_core::Result<()> {
        let b = f32_slice(b, b_layout, self.name())?;
        let y = f32_slice_mut(y, y_layout, self.name())?;
        if self.inner == 0 || y.is_empty() {
            return Ok(());
        }
        for block in y.chunks_exact_mut(b.len() * self.inner) {
            for (run, c) in block.chunks_exact_mut(self.inner).zip(b) {
                for v in run {
                    *v += c;
                }
            }
        }
        Ok(())
    }
}

/// The contiguous float32 values of `storage` under `layout`, for the CPU op `op`.
pub(crate) fn f32_slice<'a>(
    storage: &'a CpuStorage,
    layout: &Layout,
    op: &'static str,
) -> candle_core::Result<&'a [f32]> {
    let CpuStorage::F32(data) = storage else {
        return Err(candle_core::Error::UnsupportedDTypeForOp(
            storage.dtype(),
            op,
        ));
    };
    match layout.contiguous_offsets() {
        Some((start, end)) => Ok(&data[start..end]),
        None => Err(candle_core::Error::RequiresContiguous { op }),
    }
}

/// [`f32_slice`], mutably.
pub(crate) fn f32_slice_mut<'a>(
    storage: &'a mut CpuStorage,
    layout: &Layout,
    op: &'static str,
) -> candle_core::Result<&'a mut [f32]> {
    let dtype = storage.dtype();
    let CpuStorage::F32(data) = storage else {
        return Err(candle_core::Error::UnsupportedDTypeForOp(dtype, op));
    };
    match layout.contiguous_offsets() {
        Some((start, end)) => Ok(&mut data[start..end]),
        None => Err(candle_core::Error::RequiresContiguous { op }),
    }
}

/// The dtype a normalization computes in: half-precision inputs are normalized in `f32`, as
/// PyTorch does.
pub(crate) fn compute_dtype(dtype: DType) -> DType {
    match dtype {
        DType::F16 | DType::BF16 => DType::F32,
        d => d,
    }
}

/// `(x - mean) / sqrt(var + eps)` along the last dimension, with the biased variance; composed of
/// differentiable ops.
pub(crate) fn standardize_last_dim(x: &Tensor, eps: f64) -> Result<Tensor> {
    let centered = x.broadcast_sub(&x.mean_keepdim(D::Minus1)?)?;
    let var = centered.sqr()?.mean_keepdim(D::Minus1)?;
    Ok(centered.broadcast_div(&(var + eps)?.sqrt()?)?)
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
/// that `input` fits the shape it was built with; [`Error::LazyInput`] naming the layer if not.
pub(crate) fn fit_param(
    layer: &'static str,
    name: &'static str,
    param: &Param,
    set: Option<(usize, usize)>,
    fan_in: usize,
    input: &Tensor,
) -> Result<Tensor> {
    let dims = fit_dims(param.lazy_shape(), param.shape(), set);
    layer_param(layer, name, param, &dims, fan_in, input)
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

#[cfg(test)]
mod tests {
    /// The in-place bias add gives `broadcast_add`'s values bit for bit, along any dimension.
    #[test]
    fn in_place_bias_add_matches_broadcast_add() -> Result<()> {
        let dev = Device::Cpu;
        let y = Tensor::randn(0f32, 1., (2, 3, 4, 5), &dev)?;
        for dim in 0..4 {
            let b = Tensor::randn(0f32, 1., y.dim(dim)?, &dev)?;
            let mut shape = vec![1; 4];
            shape[dim] = y.dim(dim)?;
            let expected = y.broadcast_add(&b.reshape(shape)?)?;
            let fresh = y.copy()?;
            assert!(can_add_bias_in_place(&fresh, &b, dim));
            add_bias_in_place(&fresh, &b, dim)?;
            assert_eq!(
                fresh.flatten_all()?.to_vec1::<f32>()?,
                expected.flatten_all()?.to_vec1::<f32>()?,
                "dim {dim}"
            );
        }
        // Not for a tensor that records a gradient, another dtype, or an empty bias.
        let var = candle_core::Var::from_tensor(&y)?;
        let b = Tensor::ones(3, DType::F32, &dev)?;
        assert!(!can_add_bias_in_place(var.as_tensor(), &b, 1));
        assert!(!can_add_bias_in_place(
            &y.to_dtype(DType::F64)?,
            &b.to_dtype(DType::F64)?,
            1
        ));
        let empty = Tensor::zeros((2, 0), DType::F32, &dev)?;
        assert!(!can_add_bias_in_place(
            &empty,
            &Tensor::zeros(0, DType::F32, &dev)?,
            1
        ));
        Ok(())
    }

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
