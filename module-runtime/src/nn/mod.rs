//! Layers, written with `#[derive(Module)]`, with PyTorch's parameter names, layouts and default
//! initialization.

mod linear;

pub use linear::Linear;

// Attention, recurrent layers, containers and wrappers for candle-nn's own layers.
mod attention;
mod rnn;

pub use attention::{AttentionInput, MultiheadAttention, MultiheadAttentionConfig};
pub use rnn::{Gru, Lstm, RnnConfig};
