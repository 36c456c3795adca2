//! Fully connected layers: `Linear` and its lazy twin `LazyLinear`.

use candle_core::{DType, Device, Tensor, D};

use crate::device::check_input_device;
use crate::error::Result;
use crate::lazy::layer_param;
use crate::{Forward, Init, LazyShape, Module, Param};

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
#[derive(Module, Clone, Debug)]
pub struct Linear {
    /// `[out_features, in_features]`.
    pub weight: Param,
    /// `[out_features]`, if the layer has a bias.
    pub bias: Option<Param>,
}

impl Linear {
    /// A float32 layer with a bias, initialized like PyTorch.
    pub fn new(in_features: usize, out_features: usize, device: &Device) -> Result<Self> {
        Self::with_options(in_features, out_features, true, DType::F32, device)
    }

    /// A float32 layer without a bias.
    pub fn no_bias(in_features: usize, out_features: usize, device: &Device) -> Result<Self> {
        Self::with_options(in_features, out_features, false, DType::F32, device)
    }

    /// A layer with or without a bias, of any floating-point dtype, initialized like PyTorch.
    pub fn with_options(
        in_features: usize,
        out_features: usize,
        bias: bool,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let bound = 1.0 / (in_features.max(1) as f64).sqrt();
        let uniform = |shape: &[usize]| -> Result<Param> {
            let t = Tensor::rand(-bound, bound, shape, device)?.to_dtype(dtype)?;
            Param::new(t)
        };
        Ok(Self {
            weight: uniform(&[out_features, in_features])?,
            bias: if bias {
                Some(uniform(&[out_features])?)
            } else {
                None
            },
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
            &self.weight.tensor(),
            self.bias.as_ref().map(Param::tensor),
        )
    }
}

/// `x Wᵀ + b`, for `Linear` and `LazyLinear`.
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
        Some(b) => Ok(y.broadcast_add(&b)?),
        None => Ok(y),
    }
}

/// A [`Linear`] layer whose `in_features` is the last dimension of its first input: PyTorch's
/// `nn.LazyLinear`.
///
/// Same parameters, names, init and computation as `Linear` (`weight` `[out_features,
/// in_features]`, `bias` `[out_features]`), built once, at the first call, a
/// [`build`](crate::LazyExt::build) dry run or a checkpoint load (which takes `in_features` from
/// the checkpoint). After that, an input with another last dimension is an
/// [`Error::LazyInput`](crate::Error::LazyInput) naming the layer and both shapes.
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
#[derive(Module, Clone, Debug)]
pub struct LazyLinear {
    /// `[out_features, in_features]`, unbuilt until `in_features` is known.
    pub weight: Param,
    /// `[out_features]`, if the layer has a bias; built with the weight.
    pub bias: Option<Param>,
    out_features: usize,
}

impl LazyLinear {
    /// A float32 layer with a bias.
    pub fn new(out_features: usize, device: &Device) -> Result<Self> {
        Self::with_options(out_features, true, DType::F32, device)
    }

    /// A float32 layer without a bias.
    pub fn no_bias(out_features: usize, device: &Device) -> Result<Self> {
        Self::with_options(out_features, false, DType::F32, device)
    }

    /// A layer with or without a bias, of any floating-point dtype.
    pub fn with_options(
        out_features: usize,
        bias: bool,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let lazy = |dims: &[Option<usize>]| {
            Param::lazy(
                LazyShape::new(dims.iter().copied()),
                Init::UniformFanIn,
                dtype,
                device,
            )
        };
        Ok(Self {
            weight: lazy(&[Some(out_features), None])?,
            bias: bias.then(|| lazy(&[Some(out_features)])).transpose()?,
            out_features,
        })
    }

    /// Size of each input sample, once built.
    pub fn in_features(&self) -> Option<usize> {
        self.weight
            .is_built()
            .then(|| self.weight.shape().dims()[1])
    }

    /// Size of each output sample.
    pub fn out_features(&self) -> usize {
        self.out_features
    }
}

impl Forward<&Tensor> for LazyLinear {
    type Output = Tensor;

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let in_features = x.dim(D::Minus1)?;
        let out_features = self.out_features;
        let param =
            |name, p, dims: &[usize]| layer_param("LazyLinear", name, p, dims, in_features, x);
        let w = param("weight", &self.weight, &[out_features, in_features])?;
        let b = self
            .bias
            .as_ref()
            .map(|b| param("bias", b, &[out_features]))
            .transpose()?;
        linear(x, &w, b)
    }
}

crate::nn::activation::forward_by_value!(Linear, LazyLinear);
