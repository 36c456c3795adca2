//! Fully connected layers: `Linear` and its lazy twin `LazyLinear`.

use candle_core::{DType, Device, Tensor, D};

use crate::common::{fit_param, forward_by_value, layer_forward, lazy_param, uniform_fan_in};
use crate::device::{check_device, check_input_device};
use crate::error::Result;
use crate::fused::{fusion_applies, ElementwiseActivation};
use crate::parametrize::Parametrizations;
use crate::peft::LoraLayer;
use crate::{Init, Module, ModuleExt, Param};
use module_core::py_bool;
use module_kernels::{activation_in_place, can_activate_in_place, Elementwise};

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
#[module(crate = module_core)]
#[module(paths)]
#[module(extra_repr)]
pub struct Linear {
    /// `[out_features, in_features]`.
    pub weight: Param,
    /// `[out_features]`, if the layer has a bias.
    pub bias: Option<Param>,
    /// LoRA adapters ([`get_peft_model`](crate::peft::get_peft_model)): their parameters are the
    /// layer's children (`lora_A.default.weight`, …); none until an adapter is added.
    #[module(flatten)]
    pub(crate) lora: Option<Box<LoraLayer>>,
    /// PEFT's `modules_to_save` copies of the layer (`modules_to_save.<adapter>.weight`, …),
    /// used instead of it while their adapter is active; none until an adapter asks for them.
    #[module(flatten)]
    pub(crate) modules_to_save: Option<Box<crate::peft::ModulesToSave>>,
    /// Parametrizations ([`parametrize`](crate::parametrize)): `parametrizations.weight.…`.
    #[module(flatten)]
    pub(crate) parametrizations: Option<Box<Parametrizations>>,
    /// A row-wise tensor-parallel shard's all-reduce of its output
    /// ([`shard_cols`](Linear::shard_cols)); none otherwise.
    #[module(skip)]
    pub(crate) reduce: Option<crate::tensor_parallel::OutputReduce>,
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
        Ok(Self::from_params(
            uniform(&[out_features, in_features])?,
            config.bias.then(|| uniform(&[out_features])).transpose()?,
        ))
    }

    /// A layer with the given weight `[out, in]` and optional bias `[out]`.
    pub fn from_tensors(weight: Tensor, bias: Option<Tensor>) -> Result<Self> {
        Ok(Self::from_params(
            Param::new(weight)?,
            bias.map(Param::new).transpose()?,
        ))
    }

    /// A layer over existing parameters: a weight `[out, in]` shared with another module (a
    /// language model's head tied to its embedding), a lazy one, or one built by hand.
    ///
    /// ```
    /// use module_runtime::prelude::*;
    /// use module_runtime::nn::Embedding;
    /// let embedding = Embedding::new(10, 4, &Device::Cpu)?;
    /// let head = Linear::from_params(embedding.weight.clone(), None);
    /// assert!(head.weight.same_as(&embedding.weight));
    /// # Ok::<(), module_runtime::Error>(())
    /// ```
    pub fn from_params(weight: Param, bias: Option<Param>) -> Self {
        Self {
            weight,
            bias,
            lora: None,
            modules_to_save: None,
            parametrizations: None,
            reduce: None,
        }
    }

    /// The layer's LoRA adapters, if it has any ([`get_peft_model`](crate::peft::get_peft_model)).
    pub fn lora(&self) -> Option<&LoraLayer> {
        self.lora.as_deref()
    }

    /// Size of each input sample.
    pub fn in_features(&self) -> usize {
        self.weight.shape().dims()[1]
    }

    /// Size of each output sample.
    pub fn out_features(&self) -> usize {
        self.weight.shape().dims()[0]
    }

    /// `activation(self(x))`, as `activation.call(&linear.call(x)?)` computes it — and during CPU
    /// float32 inference without a second output: the activation is applied in place in the
    /// layer's fresh output (the bias is already in it: the product is added onto it), instead of
    /// one more pass into a fresh tensor.
    ///
    /// The in-place pass runs when nothing records a gradient ([`no_grad`](module_core::no_grad) or
    /// frozen parameters), on float32 CPU tensors, with no hooks attached (hooks see each module's own
    /// output, so both are called as usual) and fusion not turned off
    /// ([`without_fusion`](crate::without_fusion)); its result is the two calls' (with fusion on:
    /// turning it off also moves the bias out of the product, a float32 rounding's difference).
    /// Otherwise, and for an activation that is not elementwise (an
    /// [`Activation`](crate::Activation) holding a softmax), this is the two calls.
    /// [`Sequential`](crate::Sequential) uses it for a `Linear` followed by an activation.
    ///
    /// ```
    /// use module_runtime::prelude::*;
    /// use module_runtime::nn::{Linear, GELU};
    /// let fc = Linear::new(4, 8, &Device::Cpu)?;
    /// let x = Tensor::randn(0f32, 1., (2, 3, 4), &Device::Cpu)?;
    /// let unfused = GELU::new().call(&fc.call(&x)?)?;
    /// let y = module_runtime::without_grad(|| fc.call_then(&x, &GELU::new()))?;
    /// assert_eq!(y.dims(), [2, 3, 8]);
    /// let diff = (y - unfused)?.abs()?.max_all()?.to_scalar::<f32>()?;
    /// assert!(diff < 1e-5); // the unfused path with a graph takes candle's exact GELU
    /// # Ok::<(), module_runtime::Error>(())
    /// ```
    pub fn call_then<A: ElementwiseActivation>(
        &self,
        x: &Tensor,
        activation: &A,
    ) -> Result<Tensor> {
        let Some(f) = activation.elementwise().filter(|_| fusion_applies()) else {
            return activation.call(&self.call(x)?);
        };
        if f == Elementwise::GeluErf {
            // A bfloat16 product recording a gradient (autocast): the product and the GELU as one
            // op, where the layer is its own plain product.
            match crate::fused::linear_gelu(self, x) {
                Ok(Some(y)) => return Ok(y),
                Ok(None) => {}
                Err(error) => return Err(crate::trace::forward_error(self, error)),
            }
        }
        // The layer's own output (in training the fused op that records its gradient), then
        // the activation in place over it when nothing records a gradient.
        let y = self.call(x)?;
        if can_activate_in_place(&y) {
            activation_in_place(&y, f)?;
            return Ok(y);
        }
        activation.call(&y)
    }
}

layer_forward!(Linear, |layer, x| {
    if let Some(y) = crate::peft::saved_forward(&layer.modules_to_save, x) {
        return y;
    }
    let y = base_forward(layer, x)?;
    let y = match &layer.lora {
        // PEFT's `lora.Linear`: the base layer's output, plus the active adapter's.
        Some(lora) => lora.forward(layer, x, y)?,
        None => y,
    };
    match &layer.reduce {
        Some(reduce) => reduce.apply(y),
        None => Ok(y),
    }
});

/// The layer without its adapters: PEFT's `base_layer(x)`.
fn base_forward(layer: &Linear, x: &Tensor) -> Result<Tensor> {
    if layer.weight.is_quantized() {
        // A quantized weight (`quantize`): the kernels choose the quantized product or the float
        // one over the dequantized values.
        check_device("Linear.weight", &layer.weight.device(), x)?;
        check_in_features(layer.weight.shape().dims(), x)?;
        let bias = layer.bias_value()?;
        return module_kernels::quantized_linear(x, &layer.weight, bias.as_ref());
    }
    // The weight first: an unloaded layer's error names its weight.
    let weight = layer.weight_value()?;
    check_input_device("Linear.weight", &weight, x)?;
    check_in_features(weight.dims(), x)?;
    let bias = layer.bias_value()?;
    module_kernels::linear(x, &weight, bias.as_ref())
}

/// The input's last dimension against the weight's `in_features` (`weight` is `[out, in]`): a
/// mismatch says which dimension, both sizes and the two fixes, instead of candle's product
/// error with the transposed weight's shape.
pub(crate) fn check_in_features(weight: &[usize], x: &Tensor) -> Result<()> {
    let (&[out_features, in_features], Some(&got)) = (weight, x.dims().last()) else {
        return Ok(());
    };
    if got == in_features {
        return Ok(());
    }
    Err(crate::Error::InvalidInput {
        layer: "Linear",
        message: format!(
            "expected in_features = {in_features}, got {got} (last dimension of the input \
             {:?}): give it inputs of shape [.., {in_features}], or make the layer \
             `Linear::new({got}, {out_features}, ..)`",
            x.dims()
        ),
    })
}

/// A [`Linear`] layer whose `in_features` is the last dimension of its first input: PyTorch's
/// `nn.LazyLinear`.
///
/// It *is* a `Linear` whose parameters are unbuilt (it dereferences to it): same parameters,
/// names, init and computation (`weight` `[out_features, in_features]`, `bias`
/// `[out_features]`), built once, at the first call, a [`build`](crate::LazyExt::build) dry run
/// or a checkpoint load (which takes `in_features` from the checkpoint). After that, an input with
/// another last dimension is an [`Error::LazyInput`](module_core::Error::LazyInput) naming the layer and
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
#[module(crate = module_core)]
#[module(paths)]
pub struct LazyLinear {
    #[module(flatten)]
    pub(crate) linear: Linear,
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
        let linear = Linear::from_params(
            lazy(&[Some(out_features), None])?,
            config
                .bias
                .then(|| lazy(&[Some(out_features)]))
                .transpose()?,
        );
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

    /// [`Linear::call_then`] for the lazy layer: builds it for `x` if needed, then applies it and
    /// `activation`, fused during CPU float32 inference.
    pub fn call_then<A: ElementwiseActivation>(
        &self,
        x: &Tensor,
        activation: &A,
    ) -> Result<Tensor> {
        if !fusion_applies() {
            return activation.call(&self.call(x)?);
        }
        self.fit(x)
            .map_err(|error| crate::trace::forward_error(self, error))?;
        self.linear.call_then(x, activation)
    }

    /// Builds the parameters for `x`, or checks that `x` fits them.
    fn fit(&self, x: &Tensor) -> Result<()> {
        let in_features = x.dim(D::Minus1)?;
        let fit = |name, p, set| fit_param("LazyLinear", name, p, set, in_features, x);
        fit("weight", &self.weight, Some((1, in_features)))?;
        if let Some(b) = &self.bias {
            fit("bias", b, None)?;
        }
        Ok(())
    }
}

impl std::ops::Deref for LazyLinear {
    type Target = Linear;

    /// The `Linear` layer this is, built or not.
    fn deref(&self) -> &Linear {
        &self.linear
    }
}

layer_forward!(LazyLinear, |layer, x| {
    layer.fit(x)?;
    layer.linear.forward(x)
});

impl module_core::ExtraRepr for Linear {
    /// `in_features=…, out_features=…, bias=…`; with adapters, PEFT's `lora.Linear` body: the
    /// layer as `(base_layer)`, then the adapters' dictionaries.
    fn extra_repr(&self) -> String {
        let own = linear_repr(self);
        if let Some(saved) = &self.modules_to_save {
            return saved.wrapped_repr(&format!("Linear({own})"));
        }
        match &self.lora {
            None => own,
            Some(lora) => lora.wrapped_repr(&format!("Linear({own})")),
        }
    }

    /// The adapters' children are printed by `extra_repr`, in PEFT's order.
    fn child_repr(&self, child: &str) -> module_core::ChildRepr {
        crate::peft::adapter_child_repr(child)
    }

    fn class_repr(&self) -> Option<String> {
        let parametrized = self.parametrizations.as_ref().map(|_| "ParametrizedLinear");
        let saved = self
            .modules_to_save
            .as_ref()
            .map(|_| "ModulesToSaveWrapper");
        let lora = self.lora.as_ref().map(|_| "lora.Linear");
        (saved.or(lora).or(parametrized)).map(str::to_owned)
    }
}

/// `Linear`'s own `extra_repr`.
fn linear_repr(layer: &Linear) -> String {
    let dims = layer.weight.shape().dims().to_vec();
    // A quantized weight says its kind, as PyTorch's `DynamicQuantizedLinear` says its dtype.
    let quantized = match layer.weight.quantized_dtype() {
        Some(kind) => format!(", quantized={kind:?}"),
        None => String::new(),
    };
    format!(
        "in_features={}, out_features={}, bias={}{quantized}",
        dims.get(1).copied().unwrap_or(0),
        dims.first().copied().unwrap_or(0),
        py_bool(layer.bias.is_some())
    )
}

forward_by_value!(Linear, LazyLinear);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Forward;

    /// The in-place bias add of inference gives what the differentiable path gives, bit for bit.
    #[test]
    fn in_place_bias_matches_broadcast_add() -> Result<()> {
        let dev = Device::Cpu;
        let x = Tensor::randn(0f32, 1., (2, 5, 7), &dev)?;
        let fc = Linear::new(7, 4, &dev)?;
        let plain = module_kernels::linear(&x, &fc.weight.tensor()?.detach(), None)?
            .broadcast_add(&fc.bias.as_ref().unwrap().tensor()?.detach())?;
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

    use crate::{
        without_fusion, Activation, Elementwise, ElementwiseActivation, ReLU, Sequential, SiLU,
        Sigmoid, Tanh, GELU,
    };

    fn values(t: &Tensor) -> Vec<f32> {
        t.flatten_all().unwrap().to_vec1().unwrap()
    }

    /// `call_then` under `no_grad` against the two calls with fusion off, bit for bit, with and
    /// without a bias, for 2-D and 3-D inputs.
    fn check_call_then<A: ElementwiseActivation + std::fmt::Debug>(act: &A) -> Result<()> {
        let dev = Device::Cpu;
        // The last size makes an output of 81,920 values, which the fused pass splits over the
        // thread pool; the others stay on the calling thread.
        for (rows, out) in [(5, 6), (160, 256)] {
            let x = Tensor::randn(0f32, 3., (2, rows, 7), &dev)?;
            let fcs = [Linear::new(7, out, &dev)?, Linear::no_bias(7, out, &dev)?];
            for (fc, x) in fcs
                .iter()
                .flat_map(|fc| [(fc, x.clone()), (fc, x.reshape((2 * rows, 7)).unwrap())])
            {
                let _inference = crate::no_grad();
                let fused = fc.call_then(&x, act)?;
                let unfused = without_fusion(|| act.call(&fc.call(&x)?))?;
                assert_eq!(fused.dims(), unfused.dims());
                assert_eq!(values(&fused), values(&unfused), "{act:?}");
            }
        }
        Ok(())
    }

    #[test]
    fn call_then_matches_the_unfused_calls_bit_for_bit() -> Result<()> {
        check_call_then(&ReLU::new())?;
        check_call_then(&GELU::new())?;
        check_call_then(&GELU::tanh())?;
        check_call_then(&SiLU::new())?;
        check_call_then(&Sigmoid::new())?;
        check_call_then(&Tanh::new())?;
        for act in [
            Activation::relu(),
            Activation::gelu(),
            Activation::gelu_tanh(),
            Activation::silu(),
            Activation::sigmoid(),
            Activation::tanh(),
            Activation::softmax(-1),
        ] {
            check_call_then(&act)?;
        }
        Ok(())
    }

    /// In training `call_then` is the two calls: the same output and the same input, weight and
    /// bias gradients (the layer's fused op records them; nothing is applied in place).
    #[test]
    fn call_then_in_training_records_the_two_calls_gradients() -> Result<()> {
        let dev = Device::Cpu;
        let fc = Linear::new(7, 24, &dev)?;
        let x = candle_core::Var::randn(0f32, 1., (3, 5, 7), &dev)?;
        let x = x.as_tensor();
        let grads = |y: Tensor| -> Result<Vec<Vec<f32>>> {
            let g = (y.sqr()?.sum_all()?).backward()?;
            let w = fc.weight.tensor()?;
            let b = fc.bias.as_ref().unwrap().tensor()?;
            Ok([x, &w, &b]
                .iter()
                .map(|t| values(g.get(t).expect("a gradient")))
                .collect())
        };
        let fused = fc.call_then(x, &GELU::new())?;
        assert!(fused.track_op());
        let two = GELU::new().call(&fc.call(x)?)?;
        assert_eq!(values(&fused), values(&two));
        assert_eq!(grads(fused)?, grads(two)?);
        Ok(())
    }

    /// The fused pass's scalar functions are the layers' CPU float32 inference path, bit for bit,
    /// over a range that covers each function's saturation.
    #[test]
    fn elementwise_functions_match_the_layers() -> Result<()> {
        let x = Tensor::arange(-2000f32, 2000., &Device::Cpu)?.affine(0.01, 0.003)?;
        let cases: [(Elementwise, Activation); 6] = [
            (Elementwise::Relu, Activation::relu()),
            (Elementwise::GeluErf, Activation::gelu()),
            (Elementwise::GeluTanh, Activation::gelu_tanh()),
            (Elementwise::Silu, Activation::silu()),
            (Elementwise::Sigmoid, Activation::sigmoid()),
            (Elementwise::Tanh, Activation::tanh()),
        ];
        for (f, layer) in cases {
            assert_eq!(layer.elementwise(), Some(f));
            let expected = values(&layer.forward(&x)?);
            let got: Vec<f32> = values(&x).into_iter().map(|v| f.apply_f32(v)).collect();
            assert_eq!(got, expected, "{f:?}");
        }
        assert_eq!(Activation::softmax(-1).elementwise(), None);
        Ok(())
    }

    /// With a graph, or with hooks attached, `call_then` is the two calls: gradients flow, and
    /// hooks see both modules.
    #[test]
    fn call_then_records_gradients_and_runs_hooks() -> Result<()> {
        let dev = Device::Cpu;
        let fc = Linear::new(3, 4, &dev)?;
        let x = Tensor::randn(0f32, 1., (5, 3), &dev)?;
        let y = fc.call_then(&x, &GELU::tanh())?;
        let grads = y.sum_all()?.backward()?;
        assert!(grads.get(&fc.weight.tensor()?).is_some());
        let mlp = Sequential::new()
            .add(Linear::new(3, 4, &dev)?)
            .add(ReLU::new());
        let (y, captured) = crate::without_grad(|| mlp.capture(&["*"], |m| m.call(&x)))?;
        assert_eq!(captured.paths().collect::<Vec<_>>(), ["0", "1"]);
        assert_eq!(values(captured.get("1").unwrap()), values(&y));
        Ok(())
    }

    /// `Sequential` fuses a `Linear` (or `LazyLinear`) followed by an activation, with the unfused
    /// result's bits, and runs everything else as before.
    #[test]
    fn sequential_fuses_linear_then_activation() -> Result<()> {
        let dev = Device::Cpu;
        let mlp = Sequential::new()
            .add(Linear::new(6, 16, &dev)?)
            .add(GELU::new())
            .add(LazyLinear::new(8, &dev)?)
            .add(Activation::silu())
            .add(Linear::new(8, 3, &dev)?);
        let x = Tensor::randn(0f32, 1., (4, 6), &dev)?;
        let _inference = crate::no_grad();
        let fused = mlp.call(&x)?;
        let unfused = without_fusion(|| mlp.call(&x))?;
        assert_eq!(fused.dims(), [4, 3]);
        assert_eq!(values(&fused), values(&unfused));
        Ok(())
    }
}
