//! Fully connected layers: `Linear` and its lazy twin `LazyLinear`.

use candle_core::{DType, Device, Tensor, D};

use crate::device::check_input_device;
use crate::error::Result;
use crate::nn::common::{
    add_bias_in_place, can_add_bias_in_place, fit_param, forward_by_value, lazy_param,
    uniform_fan_in,
};
use crate::{Forward, Init, Module, Param};

/// `y = x Wᵀ + b`: PyTorch's `nn.Linear`.
///
/// Parameters `weight` `[out_features, in_features]` and `bias` `[out_features]` (absent without a
/// bias), initialized as PyTorch does: uniform on `±1/sqrt(in_features)`.
/// The input is `[…, in_features]`, the output `[…, out_features]`.
///
/// ```
/// use module_runtime::prelude::*;
/// let fc = Linear::new(3, 2, &Device::Cpu)?;
/// let y = fc.call(&Tensor::zeros((4, 5, 3), DType::F32, &Device::Cpu)?)?;
/// assert_eq!(y.dims(), [4, 5, 2]);
/// # Ok::<(), module_runtime::Error>(())
/// ```
///
/// Typed paths into it: [`LinearPath`], from [`Linear::path`] (`#[module(paths)]`).
#[derive(Module, Clone, Debug)]
#[module(paths)]
pub struct Linear {
    /// `[out_features, in_features]`.
    pub weight: Param,
    /// `[out_features]`, if the layer has a bias.
    pub bias: Option<Param>,
}

/// How a [`Linear`] or [`LazyLinear`] is built: PyTorch's keyword arguments, with PyTorch's
/// defaults.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinearConfig {
    /// Whether the layer has a bias (default `true`).
    pub bias: bool,
    /// The parameters' floating-point dtype (default `F32`).
    pub dtype: DType,
}

impl Default for LinearConfig {
    fn default() -> Self {
        Self {
            bias: true,
            dtype: DType::F32,
        }
    }
}

impl Linear {
    /// A float32 layer with a bias, initialized like PyTorch.
    pub fn new(in_features: usize, out_features: usize, device: &Device) -> Result<Self> {
        Self::with_config(in_features, out_features, LinearConfig::default(), device)
    }

    /// A float32 layer without a bias: shorthand for `LinearConfig { bias: false, .. }`.
    pub fn no_bias(in_features: usize, out_features: usize, device: &Device) -> Result<Self> {
        let config = LinearConfig {
            bias: false,
            ..Default::default()
        };
        Self::with_config(in_features, out_features, config, device)
    }

    /// A layer built as `config` says, initialized like PyTorch.
    ///
    /// ```
    /// use module_runtime::prelude::*;
    /// use module_runtime::nn::{Linear, LinearConfig};
    /// let config = LinearConfig { bias: false, dtype: DType::F64 };
    /// let fc = Linear::with_config(3, 2, config, &Device::Cpu)?;
    /// assert!(fc.bias.is_none());
    /// assert_eq!(fc.weight.dtype(), DType::F64);
    /// # Ok::<(), module_runtime::Error>(())
    /// ```
    pub fn with_config(
        in_features: usize,
        out_features: usize,
        config: LinearConfig,
        device: &Device,
    ) -> Result<Self> {
        let uniform = |dims: &[usize]| uniform_fan_in(dims, in_features, config.dtype, device);
        Ok(Self {
            weight: uniform(&[out_features, in_features])?,
            bias: config.bias.then(|| uniform(&[out_features])).transpose()?,
        })
    }

    /// A layer with the given weight `[out, in]` and optional bias `[out]`.
    pub fn from_tensors(weight: Tensor, bias: Option<Tensor>) -> Result<Self> {
        Ok(Self {
            weight: Param::new(weight)?,
            bias: bias.map(Param::new).transpose()?,
        })
    }

    /// Size of each input sample.
    pub fn in_features(&self) -> usize {
        self.weight.shape().dims()[1]
    }

    /// Size of each output sample.
    pub fn out_features(&self) -> usize {
        self.weight.shape().dims()[0]
    }
}

impl Forward<&Tensor> for Linear {
    type Output = Tensor;

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        linear(
            x,
            &self.weight.value()?,
            self.bias.as_ref().map(Param::value).transpose()?,
        )
    }
}

/// `x Wᵀ + b`.
fn linear(x: &Tensor, w: &Tensor, bias: Option<Tensor>) -> Result<Tensor> {
    check_input_device("Linear.weight", w, x)?;
    // Fold the batch dimensions into one so a single 2-D matmul runs against Wᵀ, which candle
    // reads in place (no transpose copy).
    let y = match x.dims() {
        [_, _] => x.matmul(&w.t()?)?,
        dims => {
            let (batch, in_features) = dims.split_at(dims.len().saturating_sub(1));
            let rows = batch.iter().product::<usize>();
            let y = x.reshape((rows, in_features.iter().product::<usize>()))?;
            let y = y.matmul(&w.t()?)?;
            let mut out_dims = batch.to_vec();
            out_dims.push(w.dim(0)?);
            y.reshape(out_dims)?
        }
    };
    match bias {
        // Inference on the CPU: add the bias into the matmul's fresh output, in place, instead of
        // allocating (and page-faulting in) a second output of the same size.
        Some(b) if can_add_bias_in_place(&y, &b, y.rank().saturating_sub(1)) => {
            add_bias_in_place(&y, &b, y.rank() - 1)?;
            Ok(y)
        }
        Some(b) => Ok(y.broadcast_add(&b)?),
        None => Ok(y),
    }
}

/// A [`Linear`] layer whose `in_features` is the last dimension of its first input: PyTorch's
/// `nn.LazyLinear`.
///
/// It *is* a `Linear` whose parameters are unbuilt (it dereferences to it): same parameters,
/// names, init and computation (`weight` `[out_features, in_features]`, `bias`
/// `[out_features]`), built once, at the first call, a [`build`](crate::LazyExt::build) dry run
/// or a checkpoint load (which takes `in_features` from the checkpoint). After that, an input with
/// another last dimension is an [`Error::LazyInput`](crate::Error::LazyInput) naming the layer and
/// both shapes.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::LazyLinear;
/// let fc = LazyLinear::new(2, &Device::Cpu)?;
/// assert_eq!(fc.in_features(), None);
/// let y = fc.call(&Tensor::zeros((4, 3), DType::F32, &Device::Cpu)?)?;
/// assert_eq!((y.dims(), fc.in_features()), (&[4, 2][..], Some(3)));
/// assert!(fc.call(&Tensor::zeros((4, 5), DType::F32, &Device::Cpu)?).is_err());
/// # Ok::<(), module_runtime::Error>(())
/// ```
///
/// Typed paths into it: [`LazyLinearPath`], from [`LazyLinear::path`] (`#[module(paths)]`).
#[derive(Module, Clone, Debug)]
#[module(paths)]
pub struct LazyLinear {
    #[module(flatten)]
    linear: Linear,
}

impl LazyLinear {
    /// A float32 layer with a bias.
    pub fn new(out_features: usize, device: &Device) -> Result<Self> {
        Self::with_config(out_features, LinearConfig::default(), device)
    }

    /// A layer built as `config` says.
    pub fn with_config(out_features: usize, config: LinearConfig, device: &Device) -> Result<Self> {
        let lazy =
            |dims: &[Option<usize>]| lazy_param(dims, Init::UniformFanIn, config.dtype, device);
        let linear = Linear {
            weight: lazy(&[Some(out_features), None])?,
            bias: config
                .bias
                .then(|| lazy(&[Some(out_features)]))
                .transpose()?,
        };
        Ok(Self { linear })
    }

    /// Size of each input sample, once built.
    pub fn in_features(&self) -> Option<usize> {
        self.weight.is_built().then(|| self.linear.in_features())
    }

    /// Size of each output sample.
    pub fn out_features(&self) -> usize {
        match self.weight.lazy_shape() {
            Some(shape) => shape.dims()[0].unwrap_or_default(),
            None => self.linear.out_features(),
        }
    }
}

impl std::ops::Deref for LazyLinear {
    type Target = Linear;

    /// The `Linear` layer this is, built or not.
    fn deref(&self) -> &Linear {
        &self.linear
    }
}

impl Forward<&Tensor> for LazyLinear {
    type Output = Tensor;

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let in_features = x.dim(D::Minus1)?;
        let fit = |name, p, set| fit_param("LazyLinear", name, p, set, in_features, x);
        fit("weight", &self.weight, Some((1, in_features)))?;
        if let Some(b) = &self.bias {
            fit("bias", b, None)?;
        }
        self.linear.forward(x)
    }
}

forward_by_value!(Linear, LazyLinear);

#[cfg(test)]
mod tests {
    use super::*;

    /// The in-place bias add of inference gives what the differentiable path gives, bit for bit.
    #[test]
    fn in_place_bias_matches_broadcast_add() -> Result<()> {
        let dev = Device::Cpu;
        let x = Tensor::randn(0f32, 1., (2, 5, 7), &dev)?;
        let fc = Linear::new(7, 4, &dev)?;
        let plain = linear(&x, &fc.weight.tensor().detach(), None)?
            .broadcast_add(&fc.bias.as_ref().unwrap().tensor().detach())?;
        let fast = crate::without_grad(|| fc.forward(&x))?;
        assert_eq!(fast.to_vec3::<f32>()?, plain.to_vec3::<f32>()?);
        // With a graph, the same values through the differentiable path.
        let tracked = fc.forward(&x)?;
        assert!(tracked.track_op());
        assert_eq!(tracked.to_vec3::<f32>()?, plain.to_vec3::<f32>()?);
        // No output features: nothing to add, no panic.
        let empty = Linear::new(7, 0, &dev)?;
        assert_eq!(crate::without_grad(|| empty.forward(&x))?.dims(), [2, 5, 0]);
        Ok(())
    }
}
