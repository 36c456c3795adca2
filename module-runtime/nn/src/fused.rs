//! Which layers the fused inference passes may stand in for: the activation after a `Linear`
//! applied in place in the layer's output ([`Linear::call_then`](crate::Linear::call_then)), and
//! the residual sum and norm in one pass
//! ([`LayerNorm::call_residual`](crate::LayerNorm::call_residual)). The passes themselves are
//! `module-kernels`' ([`activation_in_place`], [`residual_layer_norm`]); this file holds the
//! layers' side: the activation layers a pass can apply ([`ElementwiseActivation`]) and the rule
//! that no hook is attached (hooks must see each module's own output).
//!
//! They run only during CPU float32 inference ([`no_grad`](crate::no_grad) or frozen parameters,
//! so nothing records a gradient) and with fusion enabled
//! ([`without_fusion`](crate::without_fusion) turns it off, to compare or to measure). Everywhere
//! else the layers take their unfused path, which the fused one matches within float32 rounding.
//!
//! [`activation_in_place`]: module_kernels::activation_in_place
//! [`residual_layer_norm`]: module_kernels::residual_layer_norm

use candle_core::Tensor;
use module_kernels::{is_fusion_enabled, Elementwise};

use crate::{Forward, Module};

/// Whether a fused pass may replace a layer's calls now: fusion is on and no hook is attached.
pub(crate) fn fusion_applies() -> bool {
    is_fusion_enabled() && !crate::hooks::dispatch::active()
}

mod sealed {
    /// Keeps [`ElementwiseActivation`](super::ElementwiseActivation) to the runtime's activations,
    /// whose forward the fused pass is known to reproduce.
    pub trait Sealed {}
}

/// An activation layer that [`Linear::call_then`](crate::Linear::call_then) can apply in place in
/// the layer's output: [`ReLU`](crate::ReLU), [`GELU`](crate::GELU) (exact or tanh),
/// [`SiLU`](crate::SiLU), [`Sigmoid`](crate::Sigmoid), [`Tanh`](crate::Tanh), and
/// [`Activation`](crate::Activation) holding one of those (holding a softmax, it runs unfused).
pub trait ElementwiseActivation:
    sealed::Sealed + Module + for<'a> Forward<&'a Tensor, Output = Tensor>
{
    /// The layer's function, if it is elementwise.
    fn elementwise(&self) -> Option<Elementwise>;
}

macro_rules! elementwise_activation {
    ($($ty:ty => |$s:ident| $f:expr),* $(,)?) => {$(
        impl sealed::Sealed for $ty {}

        impl ElementwiseActivation for $ty {
            fn elementwise(&self) -> Option<Elementwise> {
                let $s = self;
                $f
            }
        }
    )*};
}

use crate::{Activation, GeluApproximation, ReLU, SiLU, Sigmoid, Tanh, GELU};

elementwise_activation! {
    ReLU => |_s| Some(Elementwise::Relu),
    GELU => |s| Some(match s.approximate {
        GeluApproximation::None => Elementwise::GeluErf,
        GeluApproximation::Tanh => Elementwise::GeluTanh,
    }),
    SiLU => |_s| Some(Elementwise::Silu),
    Sigmoid => |_s| Some(Elementwise::Sigmoid),
    Tanh => |_s| Some(Elementwise::Tanh),
    Activation => |s| match s {
        Activation::Relu(m) => m.elementwise(),
        Activation::Gelu(m) => m.elementwise(),
        Activation::Silu(m) => m.elementwise(),
        Activation::Sigmoid(m) => m.elementwise(),
        Activation::Tanh(m) => m.elementwise(),
        Activation::Softmax(_) | Activation::LogSoftmax(_) => None,
    },
}

/// `module_kernels::linear_gelu` over `layer`'s parameters (for `Linear::call_then` with a
/// `GELU`), where the layer computes nothing but its product: no adapter, saved copy, output
/// reduction or quantized weight. `None` where it or the kernel does not apply.
pub(crate) fn linear_gelu(
    layer: &crate::Linear,
    x: &Tensor,
) -> crate::error::Result<Option<Tensor>> {
    if layer.lora.is_some()
        || layer.modules_to_save.is_some()
        || layer.reduce.is_some()
        || layer.weight.is_quantized()
    {
        return Ok(None);
    }
    let weight = layer.weight_value()?;
    crate::device::check_input_device("Linear.weight", &weight, x)?;
    crate::linear::check_in_features(weight.dims(), x)?;
    let bias = layer.bias_value()?;
    module_kernels::linear_gelu(x, &weight, bias.as_ref())
}
