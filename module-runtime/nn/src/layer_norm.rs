//! Normalization over the last dimensions: `LayerNorm`, its lazy twin `LazyLayerNorm`, and
//! `RmsNorm`.
//!
//! See the [`nn`](crate) docs for when candle's fused kernels run. Half-precision inputs (`f16`,
//! `bf16`) are normalized in `f32` and converted back, as PyTorch does.

use candle_core::{DType, Device, Shape, Tensor};

use crate::common::layer_repr;
use crate::common::{
    forward_by_value, input_shape_error, layer_forward, layer_param, lazy_param, param_tensor,
};
use crate::device::check_input_device;
use crate::error::Result;
use crate::fused::fusion_applies;
use crate::{Init, Module, ModuleExt, Param};
use module_core::{py_bool, py_float, py_tuple};
use module_kernels::{can_fuse_residual_norm, residual_layer_norm};

/// How a [`LayerNorm`] or [`LazyLayerNorm`] is built: PyTorch's keyword arguments, with PyTorch's
/// defaults.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LayerNormConfig {
    /// Added to the variance (default `1e-5`).
    pub eps: f64,
    /// Whether the layer has a `weight` (and a `bias`, see below) (default `true`).
    pub elementwise_affine: bool,
    /// Whether an elementwise-affine layer has a `bias` (default `true`).
    pub bias: bool,
    /// The parameters' floating-point dtype (default `F32`).
    pub dtype: DType,
}

impl Default for LayerNormConfig {
    fn default() -> Self {
        Self {
            eps: 1e-5,
            elementwise_affine: true,
            bias: true,
            dtype: DType::F32,
        }
    }
}

impl LayerNormConfig {
    /// The `weight` (ones) and `bias` (zeros) this configuration asks for, each made by `make`
    /// from its init.
    fn params(
        &self,
        make: impl Fn(Init) -> Result<Param>,
    ) -> Result<(Option<Param>, Option<Param>)> {
        if !self.elementwise_affine {
            return Ok((None, None));
        }
        let bias = self.bias.then(|| make(Init::Zeros)).transpose()?;
        Ok((Some(make(Init::Ones)?), bias))
    }
}

/// Normalizes over the last `normalized_shape.len()` dimensions: PyTorch's `nn.LayerNorm`.
///
/// `y = (x - mean) / sqrt(var + eps) * weight + bias`, with the biased variance. Parameters
/// `weight` (ones) and `bias` (zeros), each of shape `normalized_shape`, when the layer is
/// elementwise-affine. The input is `[…, *normalized_shape]`; the output has its shape.
///
/// Differentiable whenever a gradient is needed; see the [`nn`](crate) docs for when candle's fused
/// kernel is used.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::LayerNorm;
/// let ln = LayerNorm::new(4, &Device::Cpu)?;
/// let y = ln.call(&Tensor::new(&[[1f32, 2., 3., 4.]], &Device::Cpu)?)?;
/// assert!(y.sum_all()?.to_scalar::<f32>()?.abs() < 1e-5);
/// assert_eq!(ln.named_parameters()[0].0, "weight");
/// # Ok::<(), module_runtime::Error>(())
/// ```
///
/// Typed paths into it: [`LayerNormPath`], from [`LayerNorm::path`] (`#[module(paths)]`).
#[derive(Module, Clone, Debug)]
#[module(crate = module_core)]
#[module(paths)]
#[module(extra_repr)]
pub struct LayerNorm {
    /// `normalized_shape`, if the layer is elementwise-affine.
    pub weight: Option<Param>,
    /// `normalized_shape`, if the layer is elementwise-affine and has a bias.
    pub bias: Option<Param>,
    /// The trailing dimensions that are normalized.
    pub normalized_shape: Vec<usize>,
    /// Added to the variance.
    pub eps: f64,
    /// PEFT's `modules_to_save` copies of the layer (`modules_to_save.<adapter>.weight`, …),
    /// used instead of it while their adapter is active; none until an adapter asks for them.
    #[module(flatten)]
    pub(crate) modules_to_save: Option<Box<crate::peft::ModulesToSave>>,
}

impl LayerNorm {
    /// A float32 layer with PyTorch's defaults (`eps = 1e-5`, weight and bias) normalizing the
    /// trailing dimensions `normalized_shape` (`8`, or `(2, 3)` for the last two).
    pub fn new(normalized_shape: impl Into<Shape>, device: &Device) -> Result<Self> {
        Self::with_config(normalized_shape, LayerNormConfig::default(), device)
    }

    /// A layer built as `config` says.
    ///
    /// ```
    /// use module_runtime::prelude::*;
    /// use module_runtime::nn::{LayerNorm, LayerNormConfig};
    /// let config = LayerNormConfig { eps: 1e-12, elementwise_affine: false, ..Default::default() };
    /// let ln = LayerNorm::with_config((2, 3), config, &Device::Cpu)?;
    /// assert_eq!(ln.num_parameters(), 0);
    /// assert_eq!(ln.call(&Tensor::ones((4, 2, 3), DType::F32, &Device::Cpu)?)?.dims(), [4, 2, 3]);
    /// # Ok::<(), module_runtime::Error>(())
    /// ```
    pub fn with_config(
        normalized_shape: impl Into<Shape>,
        config: LayerNormConfig,
        device: &Device,
    ) -> Result<Self> {
        let shape: Shape = normalized_shape.into();
        let (weight, bias) =
            config.params(|init| Param::init(shape.clone(), init, 0, config.dtype, device))?;
        Ok(Self {
            weight,
            bias,
            normalized_shape: shape.dims().to_vec(),
            eps: config.eps,
            modules_to_save: None,
        })
    }

    /// `self(x + residual)`, as `layer_norm.call(&(x + residual)?)` computes it — and during CPU
    /// float32 inference in one pass and one fresh output, for a norm over one trailing dimension:
    /// each row's sum is normalized where it is written, instead of the sum being a tensor of its
    /// own that the norm reads back. This is the "add & norm" after a transformer's attention and
    /// feed-forward blocks.
    ///
    /// The fused pass runs when nothing records a gradient ([`no_grad`](module_core::no_grad) or frozen
    /// parameters), on contiguous float32 CPU tensors of one shape, with no hooks attached and
    /// fusion not turned off ([`without_fusion`](crate::without_fusion)); it agrees with the
    /// unfused path within float32 rounding (it takes the variance as the mean of squared
    /// deviations, as PyTorch does, where candle's kernel takes `E[x²] - E[x]²`). Otherwise this is
    /// the sum and the call.
    ///
    /// ```
    /// use module_runtime::prelude::*;
    /// use module_runtime::nn::LayerNorm;
    /// let ln = LayerNorm::new(8, &Device::Cpu)?;
    /// let x = Tensor::randn(0f32, 1., (2, 3, 8), &Device::Cpu)?;
    /// let residual = Tensor::randn(0f32, 1., (2, 3, 8), &Device::Cpu)?;
    /// let y = module_runtime::without_grad(|| ln.call_residual(&x, &residual))?;
    /// let unfused = ln.call(&(&x + &residual)?)?;
    /// assert!((y - unfused)?.abs()?.max_all()?.to_scalar::<f32>()? < 1e-5);
    /// # Ok::<(), module_runtime::Error>(())
    /// ```
    pub fn call_residual(&self, x: &Tensor, residual: &Tensor) -> Result<Tensor> {
        // A `modules_to_save` copy in use computes with its own parameters: the call.
        let own = self.modules_to_save.is_none();
        if own && self.normalized_shape.len() == 1 && fusion_applies() {
            let fused = || -> Result<Option<Tensor>> {
                let (weight, bias) = (param_tensor(&self.weight)?, param_tensor(&self.bias)?);
                let (weight, bias) = (weight.as_ref(), bias.as_ref());
                if !can_fuse_residual_norm(x, residual, weight, bias) {
                    return Ok(None);
                }
                Ok(Some(residual_layer_norm(
                    x, residual, weight, bias, self.eps,
                )?))
            };
            match fused() {
                Ok(Some(y)) => return Ok(y),
                Ok(None) => {}
                Err(error) => return Err(crate::trace::forward_error(self, error)),
            }
        }
        // PyTorch's `+` promotes (a bfloat16 block output under autocast, a float32 stream): one
        // op for that pair when a gradient is recorded.
        self.call(&module_kernels::add_promoted(x, residual)?)
    }
}

layer_forward!(LayerNorm, |layer, x| {
    if let Some(y) = crate::peft::saved_forward(&layer.modules_to_save, x) {
        return y;
    }
    let (weight, bias) = (param_tensor(&layer.weight)?, param_tensor(&layer.bias)?);
    layer_norm(x, &layer.normalized_shape, weight, bias, layer.eps)
});

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
    let y = module_kernels::layer_norm(&folded, weight.as_ref(), bias.as_ref(), eps)?;
    // Unfolded only where folded: candle's reshape to the same shape is still a graph node (one
    // more zero-filled gradient buffer and sum in the backward).
    if y.shape() == x.shape() {
        return Ok(y);
    }
    Ok(y.reshape(x.shape())?)
}

/// Checks that `x` ends with `normalized_shape` and folds those dimensions into one.
fn fold_trailing(x: &Tensor, normalized_shape: &[usize], layer: &'static str) -> Result<Tensor> {
    let dims = x.dims();
    if !dims.ends_with(normalized_shape) {
        let trailing: Vec<String> = normalized_shape.iter().map(usize::to_string).collect();
        return Err(input_shape_error(
            layer,
            format!("[…, {}]", trailing.join(", ")),
            x,
        ));
    }
    if normalized_shape.len() == 1 {
        return Ok(x.clone());
    }
    let mut folded = dims[..dims.len() - normalized_shape.len()].to_vec();
    folded.push(normalized_shape.iter().product());
    Ok(x.reshape(folded)?)
}

/// A parameter of the normalized shape, as a vector over the folded dimension.
fn flat(p: Option<Tensor>) -> Result<Option<Tensor>> {
    Ok(match p {
        Some(t) if t.rank() != 1 => Some(t.flatten_all()?),
        other => other,
    })
}

/// A [`LayerNorm`] whose normalized shape is the last `num_dims` dimensions of its first input
/// (PyTorch has no lazy LayerNorm; this follows `LazyLinear`).
///
/// Same parameters, names, init and computation as `LayerNorm`: `weight` (ones) and `bias`
/// (zeros) of the normalized shape, built once, at the first call, a
/// [`build`](crate::LazyExt::build) dry run or a checkpoint load. After that, an input whose last
/// dimensions differ is an [`Error::LazyInput`](module_core::Error::LazyInput) naming the layer and both
/// shapes. Without the affine parameters there is nothing to build, and any input is normalized
/// over its last `num_dims` dimensions. (Unlike the other lazy layers it is not a `LayerNorm` with
/// unbuilt parameters: a `LayerNorm` knows its normalized shape, which this layer learns from each
/// input when it has no parameters to remember it.)
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::LazyLayerNorm;
/// let ln = LazyLayerNorm::new(1, &Device::Cpu)?;
/// ln.call(&Tensor::ones((2, 5), DType::F32, &Device::Cpu)?)?;
/// assert_eq!(ln.normalized_shape(), Some(vec![5]));
/// # Ok::<(), module_runtime::Error>(())
/// ```
///
/// Typed paths into it: [`LazyLayerNormPath`], from [`LazyLayerNorm::path`] (`#[module(paths)]`).
#[derive(Module, Clone, Debug)]
#[module(crate = module_core)]
#[module(paths)]
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
    /// A float32 layer with PyTorch's defaults (`eps = 1e-5`, weight and bias) normalizing the
    /// last `num_dims` dimensions.
    pub fn new(num_dims: usize, device: &Device) -> Result<Self> {
        Self::with_config(num_dims, LayerNormConfig::default(), device)
    }

    /// A layer built as `config` says, normalizing the last `num_dims` dimensions.
    pub fn with_config(num_dims: usize, config: LayerNormConfig, device: &Device) -> Result<Self> {
        let (weight, bias) =
            config.params(|init| lazy_param(&vec![None; num_dims], init, config.dtype, device))?;
        Ok(Self {
            weight,
            bias,
            num_dims,
            eps: config.eps,
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

layer_forward!(LazyLayerNorm, |layer, x| {
    let dims = x.dims();
    if dims.len() < layer.num_dims {
        let expected = format!("with at least {} dimensions", layer.num_dims);
        return Err(input_shape_error("LazyLayerNorm", expected, x));
    }
    let normalized = &dims[dims.len() - layer.num_dims..];
    let param = |name, p: &Option<Param>| {
        p.as_ref()
            .map(|p| layer_param("LazyLayerNorm", name, p, normalized, 0, x))
            .transpose()
    };
    let (weight, bias) = (param("weight", &layer.weight)?, param("bias", &layer.bias)?);
    layer_norm(x, normalized, weight, bias, layer.eps)
});

/// How an [`RmsNorm`] is built: PyTorch's keyword arguments, with PyTorch's defaults.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RmsNormConfig {
    /// Added to the mean square; `None` (the default) is the machine epsilon of the input's dtype
    /// (`torch.finfo(x.dtype).eps`).
    pub eps: Option<f64>,
    /// Whether the layer has a `weight` (default `true`).
    pub elementwise_affine: bool,
    /// The weight's floating-point dtype (default `F32`).
    pub dtype: DType,
}

impl Default for RmsNormConfig {
    fn default() -> Self {
        Self {
            eps: None,
            elementwise_affine: true,
            dtype: DType::F32,
        }
    }
}

/// Root-mean-square normalization over the last dimensions: PyTorch's `nn.RMSNorm`.
///
/// `y = x / sqrt(mean(x²) + eps) * weight`. Parameter `weight` of shape `normalized_shape` (ones),
/// when elementwise-affine. PyTorch's default `eps=None` means the input dtype's machine epsilon
/// ([`RmsNorm::DEFAULT_EPS_F32`] for float32). The input is `[…, *normalized_shape]`; the output has
/// its shape.
///
/// Differentiable whenever a gradient is needed; see the [`nn`](crate) docs.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::{RmsNorm, RmsNormConfig};
/// let config = RmsNormConfig { eps: Some(1e-6), ..Default::default() };
/// let norm = RmsNorm::with_config(2, config, &Device::Cpu)?;
/// let y = norm.call(&Tensor::new(&[[3f32, 4.]], &Device::Cpu)?)?;
/// let expected = [3. / 12.5f32.sqrt(), 4. / 12.5f32.sqrt()];
/// let got = y.to_vec2::<f32>()?;
/// assert!((got[0][0] - expected[0]).abs() < 1e-5 && (got[0][1] - expected[1]).abs() < 1e-5);
/// # Ok::<(), module_runtime::Error>(())
/// ```
///
/// Typed paths into it: [`RmsNormPath`], from [`RmsNorm::path`] (`#[module(paths)]`).
#[derive(Module, Clone, Debug)]
#[module(crate = module_core)]
#[module(paths)]
#[module(extra_repr)]
#[module(class_name = "RMSNorm")]
pub struct RmsNorm {
    /// `normalized_shape`, if the layer is elementwise-affine.
    pub weight: Option<Param>,
    /// The trailing dimensions that are normalized.
    pub normalized_shape: Vec<usize>,
    /// Added to the mean square; `None` for the input dtype's machine epsilon.
    pub eps: Option<f64>,
}

impl RmsNorm {
    /// PyTorch's default `eps` for float32 inputs: `torch.finfo(torch.float32).eps`.
    pub const DEFAULT_EPS_F32: f64 = f32::EPSILON as f64;

    /// A float32 layer with PyTorch's defaults (machine-epsilon `eps`, a weight) normalizing the
    /// trailing dimensions `normalized_shape`.
    pub fn new(normalized_shape: impl Into<Shape>, device: &Device) -> Result<Self> {
        Self::with_config(normalized_shape, RmsNormConfig::default(), device)
    }

    /// A layer built as `config` says.
    pub fn with_config(
        normalized_shape: impl Into<Shape>,
        config: RmsNormConfig,
        device: &Device,
    ) -> Result<Self> {
        let shape: Shape = normalized_shape.into();
        Ok(Self {
            weight: config
                .elementwise_affine
                .then(|| Param::init(shape.clone(), Init::Ones, 0, config.dtype, device))
                .transpose()?,
            normalized_shape: shape.dims().to_vec(),
            eps: config.eps,
        })
    }

    /// The `eps` used for inputs of `dtype`.
    fn eps_for(&self, dtype: DType) -> f64 {
        self.eps.unwrap_or(match dtype {
            // `torch.finfo(dtype).eps`: 2^-10 and 2^-7.
            DType::F16 => 0.0009765625,
            DType::BF16 => 0.0078125,
            DType::F64 => f64::EPSILON,
            _ => Self::DEFAULT_EPS_F32,
        })
    }
}

layer_forward!(RmsNorm, |layer, x| {
    let folded = fold_trailing(x, &layer.normalized_shape, "RmsNorm")?;
    let weight = flat(param_tensor(&layer.weight)?)?;
    if let Some(w) = &weight {
        check_input_device("RmsNorm.weight", w, x)?;
    }
    let eps = layer.eps_for(x.dtype());
    let y = module_kernels::rms_norm(&folded, weight.as_ref(), eps)?;
    if y.shape() == x.shape() {
        return Ok(y); // no reshape node where nothing was folded (see `layer_norm`)
    }
    Ok(y.reshape(x.shape())?)
});

impl module_core::ExtraRepr for LayerNorm {
    /// PyTorch's settings; with `modules_to_save` copies, PEFT's `ModulesToSaveWrapper` body.
    fn extra_repr(&self) -> String {
        let shape = py_tuple(&self.normalized_shape);
        let affine = py_bool(self.weight.is_some());
        let bias = py_bool(self.bias.is_some());
        let eps = py_float(self.eps);
        let own = format!("{shape}, eps={eps}, elementwise_affine={affine}, bias={bias}");
        match &self.modules_to_save {
            Some(saved) => saved.wrapped_repr(&format!("LayerNorm({own})")),
            None => own,
        }
    }

    fn child_repr(&self, child: &str) -> module_core::ChildRepr {
        crate::peft::adapter_child_repr(child)
    }

    fn class_repr(&self) -> Option<String> {
        (self.modules_to_save.as_ref()).map(|_| "ModulesToSaveWrapper".to_owned())
    }
}

layer_repr!(RmsNorm, |layer| {
    let shape = py_tuple(&layer.normalized_shape);
    let eps = layer.eps.map_or_else(|| "None".to_owned(), py_float);
    let affine = py_bool(layer.weight.is_some());
    format!("{shape}, eps={eps}, elementwise_affine={affine}")
});

forward_by_value!(LayerNorm, LazyLayerNorm, RmsNorm);

#[cfg(test)]
#[path = "layer_norm_tests.rs"]
mod tests;
