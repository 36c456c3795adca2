//! Layers, written with `#[derive(Module)]`, with PyTorch's parameter names, layouts and default
//! initialization.
//!
//! # Gradients and candle's fused kernels
//!
//! candle-nn's fused `layer_norm` and `rms_norm` kernels are fast but record no gradient (candle
//! issues #2168, #3011): a model trained through them silently stops learning below the norm. The
//! rule here is: **the fused kernel runs only when nothing needs a gradient**, that is when neither
//! the input nor any parameter tracks one (`Tensor::track_op()` is false for all of them: the input
//! is a plain tensor and the parameters are frozen, for instance after `model.freeze("**")` for
//! inference). Otherwise the layer is composed of differentiable candle ops, which match PyTorch
//! forward and backward. Both paths compute the same values.
//!
//! The runtime's own fused inference passes follow the same rule, and run on float32 CPU tensors
//! with no hooks attached: [`Linear::call_then`] (bias and activation in one pass; [`Sequential`]
//! uses it for a `Linear` followed by an activation) and [`LayerNorm::call_residual`] (residual sum
//! and norm in one pass). [`without_fusion`] turns them off on a thread.
//!
//! When a gradient *is* recorded, on float32 CPU tensors, [`Linear`] (with a bias), [`LayerNorm`]
//! (over one dimension, with weight and bias), the exact [`GELU`], [`Softmax`] over the last
//! dimension and [`Dropout`] run as single candle ops whose backward computes the input and
//! parameter gradients directly, in one pass over rows, instead of candle's backward through a
//! chain of composed ops. They match the composed path within float32 rounding (both are held to
//! PyTorch's gradients in the tests); [`without_fusion`] turns them off as well.

//! # Layout and constructors
//!
//! One file per layer family, as in candle-nn. Every layer is built the same way:
//! `Layer::new(<required sizes>, device)` with PyTorch's defaults, or
//! `Layer::with_config(<required sizes>, LayerConfig { .. }, device)`, where the config's fields
//! are PyTorch's keyword arguments (and `dtype`) and its `Default` is PyTorch's defaults.
//!
//! A family that PyTorch spells once per spatial rank or per cell is one generic type here, with
//! PyTorch's names as aliases: [`BatchNorm1d`] is `BatchNorm<1>`, [`Conv2d`] is `Conv<2>`,
//! [`MaxPool2d`] is `Pool2d<Max>`, [`Lstm`] is `RnnBase<LstmGates>`, [`LstmCell`] is
//! `RnnCellBase<LstmGates>` (PyTorch's base classes are `RNNBase` and `RNNCellBase`). Summaries,
//! `Debug` and type errors show PyTorch's class name (`BatchNorm1d`, `Conv2d`, `MaxPool2d`, `LSTM`,
//! `GRUCell`, …), not the generic one; [`Module::type_name`](crate::Module::type_name) is still the
//! Rust name. A lazy layer is its eager twin with unbuilt parameters, which it
//! dereferences to: [`LazyLinear`] holds a [`Linear`], [`LazyConv2d`] a `Conv2d`.

mod common;
mod fused;
mod fused_grad;

pub use common::{PerDim, Size};
pub use fused::{is_fusion_enabled, without_fusion, Elementwise, ElementwiseActivation};

mod linear;

pub use linear::{LazyLinear, LazyLinearPath, Linear, LinearConfig, LinearPath};

// Attention, recurrent layers, containers and wrappers for candle-nn's own layers.
mod attention;
mod container;
mod native;
mod rnn;

pub use attention::{
    AttentionInput, MultiheadAttention, MultiheadAttentionConfig, MultiheadAttentionPath,
    OwnedAttentionInput,
};
pub use container::{ModuleDict, ModuleList, Sequential, SequentialLayer};
pub use native::{Functional, Native, NativeLayer};
pub use rnn::{
    Gates, Gru, GruCell, GruGates, Lstm, LstmCell, LstmGates, RnnBase, RnnBasePath, RnnCellBase,
    RnnCellBasePath, RnnCellConfig, RnnConfig,
};

// Embedding, normalization, dropout, convolution, pooling, activations and losses.
mod activation;
mod batch_norm;
mod conv;
mod dropout;
mod embedding;
mod group_norm;
mod layer_norm;
pub mod loss;
mod pool;

pub use activation::{
    Activation, ActivationPath, GELUPath, GeluApproximation, LogSoftmax, LogSoftmaxPath, ReLU,
    ReLUPath, SiLU, SiLUPath, Sigmoid, SigmoidPath, Softmax, SoftmaxPath, Tanh, TanhPath, GELU,
};
pub use batch_norm::{
    BatchNorm, BatchNorm1d, BatchNorm2d, BatchNormConfig, BatchNormPath, LazyBatchNorm,
    LazyBatchNorm1d, LazyBatchNorm2d, LazyBatchNormPath,
};
pub use conv::{
    Conv, Conv1d, Conv2d, ConvConfig, ConvPath, ConvTranspose2d, ConvTranspose2dPath,
    ConvTransposeConfig, LazyConv, LazyConv1d, LazyConv2d, LazyConvPath,
};
pub use dropout::{Dropout, DropoutPath};
pub use embedding::{Embedding, EmbeddingConfig, EmbeddingPath};
pub use group_norm::{GroupNorm, GroupNormConfig, GroupNormPath};
pub use layer_norm::{
    LayerNorm, LayerNormConfig, LayerNormPath, LazyLayerNorm, LazyLayerNormPath, RmsNorm,
    RmsNormConfig, RmsNormPath,
};
pub use pool::{Avg, AvgPool2d, Max, MaxPool2d, Pool2d, Pool2dConfig, Pool2dPath, Reduction};

/// The Rust names (`std::any::type_name`) of the runtime's generic layers, and the PyTorch class
/// each instantiation is, for [`short_type_name`](crate::short_type_name) (summaries, `Debug`,
/// type errors). Also `RmsNorm`, which PyTorch spells `RMSNorm`.
pub(crate) fn pytorch_names() -> [(&'static str, &'static str); 15] {
    use std::any::type_name;
    [
        (type_name::<BatchNorm1d>(), "BatchNorm1d"),
        (type_name::<BatchNorm2d>(), "BatchNorm2d"),
        (type_name::<LazyBatchNorm1d>(), "LazyBatchNorm1d"),
        (type_name::<LazyBatchNorm2d>(), "LazyBatchNorm2d"),
        (type_name::<Conv1d>(), "Conv1d"),
        (type_name::<Conv2d>(), "Conv2d"),
        (type_name::<LazyConv1d>(), "LazyConv1d"),
        (type_name::<LazyConv2d>(), "LazyConv2d"),
        (type_name::<MaxPool2d>(), "MaxPool2d"),
        (type_name::<AvgPool2d>(), "AvgPool2d"),
        (type_name::<Lstm>(), "LSTM"),
        (type_name::<Gru>(), "GRU"),
        (type_name::<LstmCell>(), "LSTMCell"),
        (type_name::<GruCell>(), "GRUCell"),
        (type_name::<RmsNorm>(), "RMSNorm"),
    ]
}
