//! Layers, written with `#[derive(Module)]`, with PyTorch's parameter names, layouts and default
//! initialization.

mod linear;

pub use linear::Linear;

// Embedding, normalization, dropout, convolution, pooling, activations and losses.
mod activation;
pub mod loss;

pub use activation::{
    Activation, GeluApproximation, LogSoftmax, ReLU, SiLU, Sigmoid, Softmax, Tanh, GELU,
};
