//! Layers, written with `#[derive(Module)]`, with PyTorch's parameter names, layouts and default
//! initialization.

mod linear;

pub use linear::Linear;

// Attention, recurrent layers, containers and wrappers for candle-nn's own layers.
mod attention;
mod container;
mod native;
mod rnn;

pub use attention::{AttentionInput, MultiheadAttention, MultiheadAttentionConfig};
pub use container::{ModuleDict, ModuleList, Sequential, SequentialLayer};
pub use native::{Functional, Native, NativeLayer};
pub use rnn::{Gru, Lstm, RnnConfig};
