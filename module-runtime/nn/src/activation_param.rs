//! Activations with a parameter or a dimension: `PReLU` (a learned negative slope), `GLU`,
//! `Softmin` and `Softmax2d`, PyTorch's `torch.nn` layers of those names.

use candle_core::{DType, Device, Tensor};

use crate::common::{
    config_layer, forward_by_value, input_shape_error, layer_forward, layer_repr, resolve_dim,
    unit_layer,
};
use crate::device::check_input_device;
use crate::error::Result;
use crate::{Module, Param};
use module_kernels::softmax;

/// How a [`PReLU`] is built: PyTorch's keyword arguments, with PyTorch's defaults.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PReLUConfig {
    /// The initial slope of every negative input (PyTorch's default 0.25).
    pub init: f64,
    /// The parameter's floating-point dtype (default `F32`).
    pub dtype: DType,
}

impl Default for PReLUConfig {
    fn default() -> Self {
        Self {
            init: 0.25,
            dtype: DType::F32,
        }
    }
}

/// `x` where `x > 0`, `weight · x` elsewhere, with a learned slope: PyTorch's
/// `nn.PReLU(num_parameters=1, init=0.25)`.
///
/// Parameter `weight` `[num_parameters]`, filled with `init`. With one parameter the slope is
/// shared by every element; with `num_parameters = C` the input must have `C` channels in
/// dimension 1 (`[N, C, *]`; dimension 0 of a 1-D input), one slope each, and another size is an
/// [`Error::InputShape`](crate::Error::InputShape).
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::PReLU;
/// let prelu = PReLU::new(1, &Device::Cpu)?;
/// let y = prelu.call(&Tensor::new(&[-4f32, 2.], &Device::Cpu)?)?;
/// assert_eq!(y.to_vec1::<f32>()?, [-1., 2.]);
/// assert_eq!(prelu.named_parameters()[0].0, "weight");
/// # Ok::<(), module_runtime::Error>(())
/// ```
///
/// Typed paths into it: [`PReLUPath`], from [`PReLU::path`] (`#[module(paths)]`).
#[derive(Module, Clone, Debug)]
#[module(crate = module_core)]
#[module(paths)]
#[module(extra_repr)]
pub struct PReLU {
    /// `[num_parameters]`: the slopes of negative inputs.
    pub weight: Param,
}

impl PReLU {
    /// `num_parameters` float32 slopes of 0.25 (PyTorch's default `init`).
    pub fn new(num_parameters: usize, device: &Device) -> Result<Self> {
        Self::with_config(num_parameters, PReLUConfig::default(), device)
    }

    /// `num_parameters` slopes built as `config` says.
    pub fn with_config(
        num_parameters: usize,
        config: PReLUConfig,
        device: &Device,
    ) -> Result<Self> {
        let weight = Tensor::full(config.init, num_parameters, device)?.to_dtype(config.dtype)?;
        Ok(Self {
            weight: Param::new(weight)?,
        })
    }

    /// How many slopes it has (1, or one per channel).
    pub fn num_parameters(&self) -> usize {
        self.weight.shape().elem_count()
    }
}

layer_forward!(PReLU, |layer, x| {
    let w = layer.weight.tensor()?;
    check_input_device("PReLU.weight", &w, x)?;
    let n = w.elem_count();
    let mut dims = vec![1; x.rank()];
    if n != 1 {
        let channel = usize::from(x.rank() > 1);
        if x.dims().get(channel) != Some(&n) {
            let expected = format!("[N, {n}, *] or [{n}] (PReLU with num_parameters={n})");
            return Err(input_shape_error("PReLU", expected, x));
        }
        dims[channel] = n;
    }
    // Under autocast a lower-precision op (PyTorch's `prelu`).
    let op = module_core::autocast_policy::AutocastOp::Prelu;
    let [x, w] = module_core::autocast_policy::autocast_cast(op, [x, &w])?;
    let negative = x.broadcast_mul(&w.reshape(dims)?)?;
    Ok(x.gt(0f64)?.where_cond(&x, &negative)?)
});

config_layer! {
    /// The gated linear unit: the input is split in halves `a`, `b` along `dim`, and the output is
    /// `a · σ(b)`. PyTorch's `nn.GLU(dim=-1)`. The size along `dim` must be even (else an
    /// [`Error::InputShape`](crate::Error::InputShape)); the output has half of it.
    ///
    /// ```
    /// use module_runtime::prelude::*;
    /// use module_runtime::nn::GLU;
    /// let y = GLU::new().call(&Tensor::new(&[[2f32, 0.]], &Device::Cpu)?)?;
    /// assert_eq!(y.to_vec2::<f32>()?, [[1.]]); // 2 · σ(0)
    /// # Ok::<(), module_runtime::Error>(())
    /// ```
    ///
    /// Typed paths into it: [`GLUPath`], from [`GLU::path`] (`#[module(paths)]`).
    #[module(extra_repr)]
    pub struct GLU {
        /// The dimension split in halves (negative counts from the end; PyTorch's default -1).
        pub dim: isize = -1,
    }
    /// Split along `dim`.
    with_dim
}

layer_forward!(GLU, |layer, x| {
    let dim = resolve_dim(x, layer.dim, "glu")?;
    let size = x.dim(dim)?;
    if size % 2 != 0 {
        let expected = format!("an even size along dimension {}", layer.dim);
        return Err(input_shape_error("GLU", expected, x));
    }
    let half = size / 2;
    let gate = candle_nn::ops::sigmoid(&x.narrow(dim, half, half)?)?;
    Ok((x.narrow(dim, 0, half)? * gate)?)
});

layer_repr!(GLU: dim);

config_layer! {
    /// `softmax(-x)` along `dim`: PyTorch's `nn.Softmin(dim)`. Any shape in, the same shape out.
    ///
    /// PyTorch's `dim=None` (a deprecated guess of the dimension from the rank) has no equivalent: the
    /// dimension is required.
    ///
    /// Typed paths into it: [`SoftminPath`], from [`Softmin::path`] (`#[module(paths)]`).
    #[module(extra_repr)]
    pub struct Softmin {
        /// The dimension the output sums to one along (negative counts from the end).
        pub dim: isize,
    }
    /// Softmin along `dim`.
    new
}

layer_repr!(Softmin: dim);

layer_forward!(Softmin, |layer, x| softmax(
    &x.neg()?,
    resolve_dim(x, layer.dim, "softmin")?
));

unit_layer! {
    /// Softmax over the channels of every position: PyTorch's `nn.Softmax2d`. The input is
    /// `[N, C, H, W]` or `[C, H, W]` (another rank is an
    /// [`Error::InputShape`](crate::Error::InputShape)); the output has its shape.
    ///
    /// Typed paths into it: [`Softmax2dPath`], from [`Softmax2d::path`] (`#[module(paths)]`).
    pub struct Softmax2d;
}

layer_forward!(Softmax2d, |_, x| {
    if !matches!(x.rank(), 3 | 4) {
        return Err(input_shape_error(
            "Softmax2d",
            "[N, C, H, W] or [C, H, W]",
            x,
        ));
    }
    softmax(x, x.rank() - 3)
});

layer_repr!(PReLU, |layer| format!(
    "num_parameters={}",
    layer.weight.shape().elem_count()
));

forward_by_value!(PReLU, GLU, Softmin, Softmax2d);
