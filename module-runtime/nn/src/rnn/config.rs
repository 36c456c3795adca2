//! [`RnnConfig`]: how a stack of recurrent layers is built, which the layer and its weights both
//! read.

use candle_core::DType;

/// How an [`Lstm`](super::Lstm) or a [`Gru`](super::Gru) is built: PyTorch's keyword arguments, with PyTorch's defaults.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RnnConfig {
    /// Number of stacked layers (default 1).
    pub num_layers: usize,
    /// Whether the layers have biases (default `true`).
    pub bias: bool,
    /// Whether inputs and outputs are `[batch, seq, feature]` (`true`) or `[seq, batch, feature]`
    /// (`false`, PyTorch's default).
    pub batch_first: bool,
    /// Dropout on the output of every layer but the last, in training mode only (default `0.0`).
    pub dropout: f64,
    /// The parameters' floating-point dtype (default `F32`).
    pub dtype: DType,
}

impl Default for RnnConfig {
    fn default() -> Self {
        Self {
            num_layers: 1,
            bias: true,
            batch_first: false,
            dropout: 0.0,
            dtype: DType::F32,
        }
    }
}
