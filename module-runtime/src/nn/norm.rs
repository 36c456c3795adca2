//! Normalization layers: `LayerNorm`, `RmsNorm`, `GroupNorm`, `BatchNorm1d`, `BatchNorm2d`, and
//! the lazy `LazyLayerNorm`, `LazyBatchNorm1d`, `LazyBatchNorm2d`.
//!
//! See the [`nn`](crate::nn) docs for when candle's fused kernels run.
//!
//! Half-precision inputs (`f16`, `bf16`) are normalized in `f32` and converted back, as PyTorch does.

use candle_core::{DType, Device, Tensor, D};

use crate::device::check_input_device;
use crate::error::{Error, Result};
use crate::lazy::{layer_buffer, layer_param};
use crate::nn::activation::forward_by_value;
use crate::{Buffer, Forward, Init, LazyShape, Mode, Module, Param};

fn no_gradient_needed(tensors: &[Option<&Tensor>]) -> bool {
    tensors.iter().flatten().all(|t| !t.track_op())
}

fn param_tensor(p: &Option<Param>) -> Option<Tensor> {
    p.as_ref().map(Param::tensor)
}

/// Half-precision inputs are normalized in `f32`.
fn compute_dtype(dtype: DType) -> DType {
    match dtype {
        DType::F16 | DType::BF16 => DType::F32,
        d => d,
    }
}

/// `(x - mean) / sqrt(var + eps)` along the last dimension, with the biased variance; composed of
/// differentiable ops.
fn standardize_last_dim(x: &Tensor, eps: f64) -> Result<Tensor> {
    let centered = x.broadcast_sub(&x.mean_keepdim(D::Minus1)?)?;
    let var = centered.sqr()?.mean_keepdim(D::Minus1)?;
    Ok(centered.broadcast_div(&(var + eps)?.sqrt()?)?)
}

fn shape_error(op: &str, expected: String, x: &Tensor) -> Error {
    candle_core::Error::Msg(format!(
        "{op}: expected an input of shape {expected}, got {:?}",
        x.dims()
    ))
    .into()
}

/// Checks that `x` ends with `normalized_shape` and folds those dimensions into one.
fn fold_trailing(x: &Tensor, normalized_shape: &[usize], op: &str) -> Result<Tensor> {
    let dims = x.dims();
    if dims.len() < normalized_shape.len() || !dims.ends_with(normalized_shape) {
        return Err(shape_error(op, format!("[…, {normalized_shape:?}]"), x));
    }
    if normalized_shape.len() == 1 {
        return Ok(x.clone());
    }
    let mut folded = dims[..dims.len() - normalized_shape.len()].to_vec();
    folded.push(normalized_shape.iter().product());
    Ok(x.reshape(folded)?)
}

fn flat(p: Option<Tensor>) -> Result<Option<Tensor>> {
    Ok(match p {
        Some(t) if t.rank() != 1 => Some(t.flatten_all()?),
        other => other,
    })
}

/// Normalizes over the last `normalized_shape.len()` dimensions: PyTorch's `nn.LayerNorm`.
///
/// `y = (x - mean) / sqrt(var + eps) * weight + bias`, with the biased variance. Parameters
/// `weight` (ones) and `bias` (zeros), each of shape `normalized_shape`, when the layer is
/// elementwise-affine. The input is `[…, *normalized_shape]`; the output has its shape.
///
/// Differentiable whenever a gradient is needed; see the [`nn`](crate::nn) docs for when candle's fused
/// kernel is used.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::LayerNorm;
/// let ln = LayerNorm::new(4, 1e-5, &Device::Cpu)?;
/// let y = ln.call(&Tensor::new(&[[1f32, 2., 3., 4.]], &Device::Cpu)?)?;
/// assert!(y.sum_all()?.to_scalar::<f32>()?.abs() < 1e-5);
/// assert_eq!(ln.named_parameters()[0].0, "weight");
/// # Ok::<(), module_runtime::Error>(())
/// ```
#[derive(Module, Clone, Debug)]
pub struct LayerNorm {
    /// `normalized_shape`, if the layer is elementwise-affine.
    pub weight: Option<Param>,
    /// `normalized_shape`, if the layer is elementwise-affine and has a bias.
    pub bias: Option<Param>,
    /// The trailing dimensions that are normalized.
    pub normalized_shape: Vec<usize>,
    /// Added to the variance.
    pub eps: f64,
}

impl LayerNorm {
    /// A float32 layer normalizing the last dimension of size `size`, with weight and bias.
    pub fn new(size: usize, eps: f64, device: &Device) -> Result<Self> {
        Self::with_options(&[size], eps, true, true, DType::F32, device)
    }

    /// A layer without parameters (PyTorch's `elementwise_affine=False`).
    pub fn no_affine(size: usize, eps: f64) -> Self {
        Self {
            weight: None,
            bias: None,
            normalized_shape: vec![size],
            eps,
        }
    }

    /// Any normalized shape; `elementwise_affine` and `bias` as in PyTorch.
    pub fn with_options(
        normalized_shape: &[usize],
        eps: f64,
        elementwise_affine: bool,
        bias: bool,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let (weight, bias) = if elementwise_affine {
            let weight = Param::new(Tensor::ones(normalized_shape, dtype, device)?)?;
            let bias = bias
                .then(|| Param::new(Tensor::zeros(normalized_shape, dtype, device)?))
                .transpose()?;
            (Some(weight), bias)
        } else {
            (None, None)
        };
        Ok(Self {
            weight,
            bias,
            normalized_shape: normalized_shape.to_vec(),
            eps,
        })
    }
}

impl Forward<&Tensor> for LayerNorm {
    type Output = Tensor;

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (weight, bias) = (param_tensor(&self.weight), param_tensor(&self.bias));
        layer_norm(x, &self.normalized_shape, weight, bias, self.eps)
    }
}

/// `LayerNorm`'s computation, for it and `LazyLayerNorm`.
fn layer_norm(
    x: &Tensor,
    normalized_shape: &[usize],
    weight: Option<Tensor>,
    bias: Option<Tensor>,
    eps: f64,
) -> Result<Tensor> {
    let folded = fold_trailing(x, normalized_shape, "LayerNorm")?;
    let weight = flat(weight)?;
    let bias = flat(bias)?;
    if let Some(w) = &weight {
        check_input_device("LayerNorm.weight", w, x)?;
    }
    let fused = match (&weight, &bias) {
        (Some(w), Some(b)) if no_gradient_needed(&[Some(x), Some(w), Some(b)]) => Some(
            candle_nn::ops::layer_norm(&folded.contiguous()?, w, b, eps as f32)?,
        ),
        _ => None,
    };
    let y = match fused {
        Some(y) => y,
        None => {
            let dtype = x.dtype();
            let normed = standardize_last_dim(&folded.to_dtype(compute_dtype(dtype))?, eps)?
                .to_dtype(dtype)?;
            let scaled = match &weight {
                Some(w) => normed.broadcast_mul(w)?,
                None => normed,
            };
            match &bias {
                Some(b) => scaled.broadcast_add(b)?,
                None => scaled,
            }
        }
    };
    Ok(y.reshape(x.shape())?)
}

/// A [`LayerNorm`] whose normalized shape is the last `num_dims` dimensions of its first input
/// (PyTorch has no lazy LayerNorm; this follows `LazyLinear`).
///
/// Same parameters, names, init and computation as `LayerNorm`: `weight` (ones) and `bias`
/// (zeros) of the normalized shape, built once, at the first call, a
/// [`build`](crate::LazyExt::build) dry run or a checkpoint load. After that, an input whose last
/// dimensions differ is an [`Error::LazyInput`](crate::Error::LazyInput) naming the layer and both
/// shapes. Without the affine parameters there is nothing to build, and any input is normalized
/// over its last `num_dims` dimensions.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::LazyLayerNorm;
/// let ln = LazyLayerNorm::new(1e-5, &Device::Cpu)?;
/// ln.call(&Tensor::ones((2, 5), DType::F32, &Device::Cpu)?)?;
/// assert_eq!(ln.normalized_shape(), Some(vec![5]));
/// # Ok::<(), module_runtime::Error>(())
/// ```
#[derive(Module, Clone, Debug)]
pub struct LazyLayerNorm {
    /// The normalized shape, if the layer is elementwise-affine; unbuilt until it is known.
    pub weight: Option<Param>,
    /// The normalized shape, if the layer is elementwise-affine and has a bias.
    pub bias: Option<Param>,
    /// How many trailing dimensions are normalized.
    pub num_dims: usize,
    /// Added to the variance.
    pub eps: f64,
}

impl LazyLayerNorm {
    /// A float32 layer normalizing the last dimension, with weight and bias.
    pub fn new(eps: f64, device: &Device) -> Result<Self> {
        Self::with_options(1, eps, true, true, DType::F32, device)
    }

    /// Normalizes the last `num_dims` dimensions; `elementwise_affine` and `bias` as in PyTorch.
    pub fn with_options(
        num_dims: usize,
        eps: f64,
        elementwise_affine: bool,
        bias: bool,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let lazy = |init| Param::lazy(LazyShape::new(vec![None; num_dims]), init, dtype, device);
        let weight = elementwise_affine.then(|| lazy(Init::Ones)).transpose()?;
        let bias = (elementwise_affine && bias)
            .then(|| lazy(Init::Zeros))
            .transpose()?;
        Ok(Self {
            weight,
            bias,
            num_dims,
            eps,
        })
    }

    /// The normalized shape, once built (always `None` without affine parameters).
    pub fn normalized_shape(&self) -> Option<Vec<usize>> {
        self.weight
            .as_ref()
            .filter(|w| w.is_built())
            .map(|w| w.shape().dims().to_vec())
    }
}

impl Forward<&Tensor> for LazyLayerNorm {
    type Output = Tensor;

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let dims = x.dims();
        if dims.len() < self.num_dims {
            return Err(shape_error(
                "LazyLayerNorm",
                format!("with at least {} dimensions", self.num_dims),
                x,
            ));
        }
        let normalized = &dims[dims.len() - self.num_dims..];
        let param = |name, p: &Option<Param>| {
            p.as_ref()
                .map(|p| layer_param("LazyLayerNorm", name, p, normalized, 0, x))
                .transpose()
        };
        let (weight, bias) = (param("weight", &self.weight)?, param("bias", &self.bias)?);
        layer_norm(x, normalized, weight, bias, self.eps)
    }
}

/// Root-mean-square normalization over the last dimensions: PyTorch's `nn.RMSNorm`.
///
/// `y = x / sqrt(mean(x²) + eps) * weight`. Parameter `weight` of shape `normalized_shape` (ones),
/// when elementwise-affine. PyTorch's default `eps=None` means the dtype's machine epsilon
/// ([`RmsNorm::DEFAULT_EPS_F32`] for float32). The input is `[…, *normalized_shape]`; the output has
/// its shape.
///
/// Differentiable whenever a gradient is needed; see the [`nn`](crate::nn) docs.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::RmsNorm;
/// let norm = RmsNorm::new(2, 1e-6, &Device::Cpu)?;
/// let y = norm.call(&Tensor::new(&[[3f32, 4.]], &Device::Cpu)?)?;
/// let expected = [3. / 12.5f32.sqrt(), 4. / 12.5f32.sqrt()];
/// let got = y.to_vec2::<f32>()?;
/// assert!((got[0][0] - expected[0]).abs() < 1e-5 && (got[0][1] - expected[1]).abs() < 1e-5);
/// # Ok::<(), module_runtime::Error>(())
/// ```
#[derive(Module, Clone, Debug)]
pub struct RmsNorm {
    /// `normalized_shape`, if the layer is elementwise-affine.
    pub weight: Option<Param>,
    /// The trailing dimensions that are normalized.
    pub normalized_shape: Vec<usize>,
    /// Added to the mean square.
    pub eps: f64,
}

impl RmsNorm {
    /// PyTorch's default `eps` for float32 inputs: `torch.finfo(torch.float32).eps`.
    pub const DEFAULT_EPS_F32: f64 = f32::EPSILON as f64;

    /// A float32 layer normalizing the last dimension of size `size`, with a weight.
    pub fn new(size: usize, eps: f64, device: &Device) -> Result<Self> {
        Self::with_options(&[size], eps, true, DType::F32, device)
    }

    /// Any normalized shape, with or without a weight.
    pub fn with_options(
        normalized_shape: &[usize],
        eps: f64,
        elementwise_affine: bool,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        Ok(Self {
            weight: elementwise_affine
                .then(|| Param::new(Tensor::ones(normalized_shape, dtype, device)?))
                .transpose()?,
            normalized_shape: normalized_shape.to_vec(),
            eps,
        })
    }
}

impl Forward<&Tensor> for RmsNorm {
    type Output = Tensor;

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let folded = fold_trailing(x, &self.normalized_shape, "RmsNorm")?;
        let weight = flat(param_tensor(&self.weight))?;
        if let Some(w) = &weight {
            check_input_device("RmsNorm.weight", w, x)?;
        }
        let y = match &weight {
            Some(w) if no_gradient_needed(&[Some(x), Some(w)]) => {
                candle_nn::ops::rms_norm(&folded.contiguous()?, w, self.eps as f32)?
            }
            _ => {
                let dtype = x.dtype();
                let xc = folded.to_dtype(compute_dtype(dtype))?;
                let ms = xc.sqr()?.mean_keepdim(D::Minus1)?;
                let normed = xc
                    .broadcast_div(&(ms + self.eps)?.sqrt()?)?
                    .to_dtype(dtype)?;
                match &weight {
                    Some(w) => normed.broadcast_mul(w)?,
                    None => normed,
                }
            }
        };
        Ok(y.reshape(x.shape())?)
    }
}

/// Shape `[1, C, 1, …]` for a per-channel tensor `[C]` applied to an input of rank `rank`.
fn per_channel(t: &Tensor, rank: usize) -> Result<Tensor> {
    let mut dims = vec![1; rank];
    dims[1] = t.elem_count();
    Ok(t.reshape(dims)?)
}

/// Normalizes groups of channels: PyTorch's `nn.GroupNorm(num_groups, num_channels)`.
///
/// The `C` channels are split into `num_groups` groups; each sample's group is normalized with its
/// own mean and biased variance, then scaled and shifted per channel. Parameters `weight` (ones) and
/// `bias` (zeros), both `[C]`, when affine. The input is `[N, C, *]`; the output has its shape.
/// Always composed of differentiable ops.
#[derive(Module, Clone, Debug)]
pub struct GroupNorm {
    /// `[num_channels]`, if affine.
    pub weight: Option<Param>,
    /// `[num_channels]`, if affine.
    pub bias: Option<Param>,
    /// Number of groups; divides `num_channels`.
    pub num_groups: usize,
    /// Number of channels `C`.
    pub num_channels: usize,
    /// Added to the variance.
    pub eps: f64,
}

impl GroupNorm {
    /// A float32 affine layer with `eps = 1e-5`, PyTorch's defaults.
    pub fn new(num_groups: usize, num_channels: usize, device: &Device) -> Result<Self> {
        Self::with_options(num_groups, num_channels, 1e-5, true, DType::F32, device)
    }

    /// Any `eps`, with or without the affine parameters.
    pub fn with_options(
        num_groups: usize,
        num_channels: usize,
        eps: f64,
        affine: bool,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        if num_groups == 0 || num_channels % num_groups != 0 {
            return Err(candle_core::Error::Msg(format!(
                "GroupNorm: num_channels ({num_channels}) must be divisible by num_groups ({num_groups})"
            ))
            .into());
        }
        let (weight, bias) = if affine {
            (
                Some(Param::new(Tensor::ones(num_channels, dtype, device)?)?),
                Some(Param::new(Tensor::zeros(num_channels, dtype, device)?)?),
            )
        } else {
            (None, None)
        };
        Ok(Self {
            weight,
            bias,
            num_groups,
            num_channels,
            eps,
        })
    }
}

impl Forward<&Tensor> for GroupNorm {
    type Output = Tensor;

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let dims = x.dims();
        if dims.len() < 2 || dims[1] != self.num_channels {
            return Err(shape_error(
                "GroupNorm",
                format!("[N, {}, *]", self.num_channels),
                x,
            ));
        }
        if let Some(w) = &self.weight {
            check_input_device("GroupNorm.weight", &w.tensor(), x)?;
        }
        let dtype = x.dtype();
        let grouped = x
            .to_dtype(compute_dtype(dtype))?
            .reshape((dims[0], self.num_groups, ()))?;
        let mut y = standardize_last_dim(&grouped, self.eps)?
            .to_dtype(dtype)?
            .reshape(dims)?;
        if let Some(w) = &self.weight {
            y = y.broadcast_mul(&per_channel(&w.tensor(), dims.len())?)?;
        }
        if let Some(b) = &self.bias {
            y = y.broadcast_add(&per_channel(&b.tensor(), dims.len())?)?;
        }
        Ok(y)
    }
}

/// What BatchNorm1d and BatchNorm2d share: the computation, given the layer's state.
struct BatchNormState<'a> {
    weight: &'a Option<Param>,
    bias: &'a Option<Param>,
    running_mean: &'a Option<Buffer>,
    running_var: &'a Option<Buffer>,
    num_batches_tracked: &'a Option<Buffer>,
    momentum: Option<f64>,
    eps: f64,
    training: bool,
}

impl BatchNormState<'_> {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let rank = x.rank();
        let reduce: Vec<usize> = (0..rank).filter(|&d| d != 1).collect();
        let use_batch_stats = self.training || self.running_mean.is_none();
        let (mean, var) = if use_batch_stats {
            let n = x.elem_count() / x.dim(1)?;
            if n <= 1 {
                return Err(candle_core::Error::Msg(format!(
                    "BatchNorm: expected more than 1 value per channel when training, got input {:?}",
                    x.dims()
                ))
                .into());
            }
            let mean = x.mean_keepdim(reduce.as_slice())?;
            let var = x
                .broadcast_sub(&mean)?
                .sqr()?
                .mean_keepdim(reduce.as_slice())?;
            if self.training {
                self.update_running_stats(&mean, &var, n)?;
            }
            (mean, var)
        } else {
            let stat = |b: &Option<Buffer>| -> Result<Tensor> {
                let t = b.as_ref().map(Buffer::tensor).ok_or_else(|| {
                    candle_core::Error::Msg("BatchNorm: missing running statistics".into())
                })?;
                per_channel(&t.to_dtype(x.dtype())?, rank)
            };
            (stat(self.running_mean)?, stat(self.running_var)?)
        };
        let mut y = x
            .broadcast_sub(&mean)?
            .broadcast_div(&(var + self.eps)?.sqrt()?)?;
        if let Some(w) = self.weight {
            y = y.broadcast_mul(&per_channel(&w.tensor(), rank)?)?;
        }
        if let Some(b) = self.bias {
            y = y.broadcast_add(&per_channel(&b.tensor(), rank)?)?;
        }
        Ok(y)
    }

    /// `r = (1 - momentum) r + momentum * batch_stat`, with the unbiased batch variance; without a
    /// momentum, the cumulative average over `num_batches_tracked` batches.
    fn update_running_stats(&self, mean: &Tensor, var: &Tensor, n: usize) -> Result<()> {
        let (Some(rm), Some(rv)) = (self.running_mean, self.running_var) else {
            return Ok(());
        };
        let mut batches = None;
        if let Some(nbt) = self.num_batches_tracked {
            let t = nbt.tensor();
            let next = t.broadcast_add(&t.ones_like()?)?;
            nbt.set(&next)?;
            batches = Some(next);
        }
        let factor = match (self.momentum, batches) {
            (Some(m), _) => m,
            (None, Some(b)) => 1.0 / b.to_dtype(DType::F64)?.to_scalar::<f64>()?,
            (None, None) => 0.0,
        };
        let unbiased = (var.detach() * (n as f64 / (n - 1) as f64))?;
        for (buffer, stat) in [(rm, mean.detach()), (rv, unbiased)] {
            let old = buffer.tensor();
            let stat = stat.flatten_all()?.to_dtype(old.dtype())?;
            buffer.set(&((old * (1.0 - factor))? + (stat * factor)?)?)?;
        }
        Ok(())
    }
}

macro_rules! batch_norm {
    ($name:ident, $torch:literal, $input:literal, $ranks:expr, $example:literal) => {
        #[doc = concat!("Batch normalization: PyTorch's `nn.", $torch, "`.")]
        ///
        /// Parameters `weight` (ones) and `bias` (zeros), both `[C]`, when affine; buffers
        /// `running_mean` (zeros) and `running_var` (ones), both `[C]`, and `num_batches_tracked`
        /// (an `i64` scalar) when tracking running statistics — PyTorch's names, order and dtypes.
        #[doc = concat!("The input is ", $input, "; the output has its shape.")]
        ///
        /// In training mode (see [`Mode`]) the input is normalized with the batch mean and biased
        /// variance over every dimension but the channels, and the running statistics are updated:
        /// `r = (1 - momentum) r + momentum * batch_stat`, with the *unbiased* batch variance, and
        /// `num_batches_tracked += 1`. In evaluation mode the running statistics are used and nothing
        /// changes. Always composed of differentiable ops.
        ///
        /// ```
        /// use module_runtime::prelude::*;
        #[doc = concat!("use module_runtime::nn::", stringify!($name), ";")]
        #[doc = concat!("let bn = ", stringify!($name), "::new(3, &Device::Cpu)?;")]
        #[doc = $example]
        /// let y = bn.call(&x)?;
        /// assert_eq!(y.dims(), x.dims());
        /// assert_eq!(bn.num_batches_tracked.as_ref().unwrap().tensor().to_scalar::<i64>()?, 1);
        /// bn.eval();
        /// bn.call(&x)?; // eval: statistics unchanged
        /// assert_eq!(bn.num_batches_tracked.as_ref().unwrap().tensor().to_scalar::<i64>()?, 1);
        /// # Ok::<(), module_runtime::Error>(())
        /// ```
        #[derive(Module, Clone, Debug)]
        pub struct $name {
            /// `[C]`, if affine.
            pub weight: Option<Param>,
            /// `[C]`, if affine.
            pub bias: Option<Param>,
            /// `[C]`, if tracking running statistics.
            pub running_mean: Option<Buffer>,
            /// `[C]`, if tracking running statistics.
            pub running_var: Option<Buffer>,
            /// `i64` scalar, if tracking running statistics.
            pub num_batches_tracked: Option<Buffer>,
            /// Weight of the new batch in the running statistics; `None` for a cumulative average.
            pub momentum: Option<f64>,
            /// Added to the variance.
            pub eps: f64,
            /// Training or evaluation mode.
            pub mode: Mode,
        }

        impl $name {
            /// A float32 layer over `num_features` channels with PyTorch's defaults: `eps = 1e-5`,
            /// `momentum = 0.1`, affine, tracking running statistics, in training mode.
            pub fn new(num_features: usize, device: &Device) -> Result<Self> {
                Self::with_options(
                    num_features,
                    1e-5,
                    Some(0.1),
                    true,
                    true,
                    DType::F32,
                    device,
                )
            }

            /// Every PyTorch option: `eps`, `momentum`, `affine`, `track_running_stats`.
            pub fn with_options(
                num_features: usize,
                eps: f64,
                momentum: Option<f64>,
                affine: bool,
                track_running_stats: bool,
                dtype: DType,
                device: &Device,
            ) -> Result<Self> {
                let param = |value: f64| -> Result<Option<Param>> {
                    affine
                        .then(|| Param::new((Tensor::ones(num_features, dtype, device)? * value)?))
                        .transpose()
                };
                let buffer = |t: candle_core::Result<Tensor>| -> Result<Option<Buffer>> {
                    Ok(if track_running_stats {
                        Some(Buffer::new(t?))
                    } else {
                        None
                    })
                };
                Ok(Self {
                    weight: param(1.0)?,
                    bias: param(0.0)?,
                    running_mean: buffer(Tensor::zeros(num_features, dtype, device))?,
                    running_var: buffer(Tensor::ones(num_features, dtype, device))?,
                    num_batches_tracked: buffer(Tensor::new(0i64, device))?,
                    momentum,
                    eps,
                    mode: Mode::new(),
                })
            }
        }

        impl Forward<&Tensor> for $name {
            type Output = Tensor;

            fn forward(&self, x: &Tensor) -> Result<Tensor> {
                let channels = self
                    .weight
                    .as_ref()
                    .map(Param::elem_count)
                    .or_else(|| self.running_mean.as_ref().map(|b| b.shape().elem_count()));
                if !$ranks.contains(&x.rank()) || channels.is_some_and(|c| x.dim(1).ok() != Some(c))
                {
                    return Err(shape_error(stringify!($name), $input.to_string(), x));
                }
                if let Some(w) = &self.weight {
                    check_input_device(concat!(stringify!($name), ".weight"), &w.tensor(), x)?;
                } else if let Some(mean) = &self.running_mean {
                    check_input_device(
                        concat!(stringify!($name), ".running_mean"),
                        &mean.tensor(),
                        x,
                    )?;
                }
                BatchNormState {
                    weight: &self.weight,
                    bias: &self.bias,
                    running_mean: &self.running_mean,
                    running_var: &self.running_var,
                    num_batches_tracked: &self.num_batches_tracked,
                    momentum: self.momentum,
                    eps: self.eps,
                    training: self.mode.is_training(),
                }
                .forward(x)
            }
        }
    };
}

batch_norm!(
    BatchNorm1d,
    "BatchNorm1d",
    "`[N, C]` or `[N, C, L]`",
    [2, 3],
    "let x = Tensor::randn(0f32, 1., (8, 3), &Device::Cpu)?;"
);
batch_norm!(
    BatchNorm2d,
    "BatchNorm2d",
    "`[N, C, H, W]`",
    [4],
    "let x = Tensor::randn(0f32, 1., (2, 3, 4, 4), &Device::Cpu)?;"
);

macro_rules! lazy_batch_norm {
    ($name:ident, $eager:ident, $torch:literal, $input:literal, $ranks:expr, $example:literal) => {
        #[doc = concat!("A [`", stringify!($eager), "`] whose number of channels is dimension 1 of its first input: PyTorch's `nn.", $torch, "`.")]
        ///
        /// Same parameters, buffers, names, init and computation as the eager layer; `weight`,
        /// `bias`, `running_mean` and `running_var` are built once, at the first call, a
        /// [`build`](crate::LazyExt::build) dry run or a checkpoint load. After that, an input
        /// with another number of channels is an [`Error::LazyInput`](crate::Error::LazyInput)
        /// naming the layer and both shapes.
        #[doc = concat!("The input is ", $input, "; the output has its shape.")]
        ///
        /// ```
        /// use module_runtime::prelude::*;
        #[doc = concat!("use module_runtime::nn::", stringify!($name), ";")]
        #[doc = concat!("let bn = ", stringify!($name), "::new(&Device::Cpu)?;")]
        #[doc = $example]
        /// bn.call(&x)?;
        /// assert_eq!(bn.running_mean.as_ref().unwrap().shape().dims(), [3]);
        /// # Ok::<(), module_runtime::Error>(())
        /// ```
        #[derive(Module, Clone, Debug)]
        pub struct $name {
            /// `[C]`, if affine.
            pub weight: Option<Param>,
            /// `[C]`, if affine.
            pub bias: Option<Param>,
            /// `[C]`, if tracking running statistics.
            pub running_mean: Option<Buffer>,
            /// `[C]`, if tracking running statistics.
            pub running_var: Option<Buffer>,
            /// `i64` scalar, if tracking running statistics (its shape is known: built at once).
            pub num_batches_tracked: Option<Buffer>,
            /// Weight of the new batch in the running statistics; `None` for a cumulative average.
            pub momentum: Option<f64>,
            /// Added to the variance.
            pub eps: f64,
            /// Training or evaluation mode.
            pub mode: Mode,
        }

        impl $name {
            /// A float32 layer with PyTorch's defaults: `eps = 1e-5`, `momentum = 0.1`, affine,
            /// tracking running statistics, in training mode.
            pub fn new(device: &Device) -> Result<Self> {
                Self::with_options(1e-5, Some(0.1), true, true, DType::F32, device)
            }

            /// Every PyTorch option: `eps`, `momentum`, `affine`, `track_running_stats`.
            pub fn with_options(
                eps: f64,
                momentum: Option<f64>,
                affine: bool,
                track_running_stats: bool,
                dtype: DType,
                device: &Device,
            ) -> Result<Self> {
                let channels = || LazyShape::new([None]);
                let param = |init| {
                    affine
                        .then(|| Param::lazy(channels(), init, dtype, device))
                        .transpose()
                };
                let buffer = |init| {
                    track_running_stats
                        .then(|| Buffer::lazy(channels(), init, dtype, device))
                        .transpose()
                };
                Ok(Self {
                    weight: param(Init::Ones)?,
                    bias: param(Init::Zeros)?,
                    running_mean: buffer(Init::Zeros)?,
                    running_var: buffer(Init::Ones)?,
                    num_batches_tracked: track_running_stats
                        .then(|| Tensor::new(0i64, device).map(Buffer::new))
                        .transpose()?,
                    momentum,
                    eps,
                    mode: Mode::new(),
                })
            }

            /// Number of channels, once built (`None` with neither affine parameters nor running
            /// statistics: there is nothing to build).
            pub fn num_features(&self) -> Option<usize> {
                let weight = self.weight.as_ref().filter(|w| w.is_built());
                let mean = self.running_mean.as_ref().filter(|b| b.is_built());
                weight
                    .map(Param::elem_count)
                    .or_else(|| mean.map(|b| b.shape().elem_count()))
            }
        }

        impl Forward<&Tensor> for $name {
            type Output = Tensor;

            fn forward(&self, x: &Tensor) -> Result<Tensor> {
                if !$ranks.contains(&x.rank()) {
                    return Err(shape_error(stringify!($name), $input.to_string(), x));
                }
                let c = [x.dim(1)?];
                let layer = stringify!($name);
                for (name, p) in [("weight", &self.weight), ("bias", &self.bias)] {
                    if let Some(p) = p {
                        layer_param(layer, name, p, &c, 0, x)?;
                    }
                }
                for (name, b) in [("running_mean", &self.running_mean), ("running_var", &self.running_var)] {
                    if let Some(b) = b {
                        layer_buffer(layer, name, b, &c, x)?;
                    }
                }
                BatchNormState {
                    weight: &self.weight,
                    bias: &self.bias,
                    running_mean: &self.running_mean,
                    running_var: &self.running_var,
                    num_batches_tracked: &self.num_batches_tracked,
                    momentum: self.momentum,
                    eps: self.eps,
                    training: self.mode.is_training(),
                }
                .forward(x)
            }
        }
    };
}

lazy_batch_norm!(
    LazyBatchNorm1d,
    BatchNorm1d,
    "LazyBatchNorm1d",
    "`[N, C]` or `[N, C, L]`",
    [2, 3],
    "let x = Tensor::randn(0f32, 1., (8, 3), &Device::Cpu)?;"
);
lazy_batch_norm!(
    LazyBatchNorm2d,
    BatchNorm2d,
    "LazyBatchNorm2d",
    "`[N, C, H, W]`",
    [4],
    "let x = Tensor::randn(0f32, 1., (2, 3, 4, 4), &Device::Cpu)?;"
);

forward_by_value!(
    LayerNorm,
    RmsNorm,
    GroupNorm,
    BatchNorm1d,
    BatchNorm2d,
    LazyLayerNorm,
    LazyBatchNorm1d,
    LazyBatchNorm2d
);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ModuleExt;

    fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        (a - b)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    }

    /// With frozen parameters and a plain input nothing needs a gradient: the fused kernel runs, and
    /// it agrees with the differentiable path.
    #[test]
    fn fused_and_composed_paths_agree() -> Result<()> {
        let dev = Device::Cpu;
        let x = (Tensor::randn(0f32, 2., (3, 5, 16), &dev)? + 0.5)?;
        let ln = LayerNorm::new(16, 1e-5, &dev)?;
        ln.weight
            .as_ref()
            .unwrap()
            .set(&Tensor::randn(1f32, 0.5, 16, &dev)?)?;
        ln.bias
            .as_ref()
            .unwrap()
            .set(&Tensor::randn(0f32, 0.5, 16, &dev)?)?;
        let rms = RmsNorm::new(16, 1e-6, &dev)?;
        rms.weight
            .as_ref()
            .unwrap()
            .set(&Tensor::randn(1f32, 0.5, 16, &dev)?)?;
        let composed = (ln.forward(&x)?, rms.forward(&x)?);
        ln.freeze("**")?;
        rms.freeze("**")?;
        let fused = (ln.forward(&x)?, rms.forward(&x)?);
        assert!(max_diff(&composed.0, &fused.0) < 1e-5);
        assert!(max_diff(&composed.1, &fused.1) < 1e-5);
        Ok(())
    }

    #[test]
    fn layer_norm_over_two_trailing_dims() -> Result<()> {
        let dev = Device::Cpu;
        let ln = LayerNorm::with_options(&[2, 3], 1e-5, true, true, DType::F32, &dev)?;
        let x = Tensor::randn(0f32, 1., (4, 2, 3), &dev)?;
        let y = ln.forward(&x)?;
        let flat = LayerNorm::no_affine(6, 1e-5).forward(&x.reshape((4, 6))?)?;
        assert!(max_diff(&y.reshape((4, 6))?, &flat) < 1e-6);
        Ok(())
    }

    #[test]
    fn batch_norm_rejects_wrong_shapes() -> Result<()> {
        let dev = Device::Cpu;
        let bn = BatchNorm2d::new(3, &dev)?;
        assert!(bn
            .forward(&Tensor::zeros((2, 3), DType::F32, &dev)?)
            .is_err());
        assert!(bn
            .forward(&Tensor::zeros((2, 4, 2, 2), DType::F32, &dev)?)
            .is_err());
        let single = Tensor::zeros((1, 3, 1, 1), DType::F32, &dev)?;
        assert!(bn.forward(&single).is_err());
        Ok(())
    }
}
