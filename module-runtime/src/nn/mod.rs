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

mod linear;

pub use linear::{LazyLinear, Linear};

// Attention, recurrent layers, containers and wrappers for candle-nn's own layers.
mod attention;
mod container;
mod native;
mod rnn;

pub use attention::{AttentionInput, MultiheadAttention, MultiheadAttentionConfig};
pub use container::{ModuleDict, ModuleList, Sequential, SequentialLayer};
pub use native::{Functional, Native, NativeLayer};
pub use rnn::{Gru, Lstm, RnnConfig};

// Embedding, normalization, dropout, convolution, pooling, activations and losses.
mod activation;
mod conv;
mod dropout;
mod embedding;
pub mod loss;
mod norm;
mod pool;

pub use activation::{
    Activation, GeluApproximation, LogSoftmax, ReLU, SiLU, Sigmoid, Softmax, Tanh, GELU,
};
pub use conv::{
    Conv1d, Conv2d, ConvConfig, ConvTranspose2d, ConvTransposeConfig, LazyConv1d, LazyConv2d,
};
pub use dropout::Dropout;
pub use embedding::Embedding;
pub use norm::{
    BatchNorm1d, BatchNorm2d, GroupNorm, LayerNorm, LazyBatchNorm1d, LazyBatchNorm2d,
    LazyLayerNorm, RmsNorm,
};
pub use pool::{AvgPool2d, MaxPool2d};
