//! `nn.TransformerEncoderLayer` and `nn.TransformerEncoder`.

use candle_core::{Device, Tensor};

use super::TransformerActivation;
use super::{attention_block, feed_forward, residual_sum, resolve_mask, seq_len};
use super::{TransformerEncoder, TransformerLayerConfig};
use crate::error::Result;
use crate::{Dropout, Forward, LayerNorm, Linear, MultiheadAttention};
use crate::{Module, ModuleExt};

/// The arguments of a [`TransformerEncoderLayer`] or [`TransformerEncoder`] call: PyTorch's
/// `forward(src, src_mask=None, src_key_padding_mask=None, is_causal=False)`.
///
/// Masks follow [`MultiheadAttention`]: an integer mask marks blocked positions with a non-zero
/// value (PyTorch's boolean `True`), a floating-point mask is added to the attention scores.
#[derive(Clone, Debug)]
pub struct EncoderInput {
    /// `[B, S, E]` (batch first), `[S, B, E]`, or `[S, E]` unbatched.
    pub src: Tensor,
    /// `[S, S]` or `[B * nhead, S, S]`.
    pub src_mask: Option<Tensor>,
    /// `[B, S]` (`[S]` unbatched): the padded positions of each sequence.
    pub src_key_padding_mask: Option<Tensor>,
    /// Causal self-attention: with no `src_mask`, the layer masks every later position (PyTorch
    /// takes it as a hint that `src_mask` is causal and raises without one).
    pub is_causal: bool,
}

impl EncoderInput {
    /// `src` with no masks.
    pub fn new(src: &Tensor) -> Self {
        Self {
            src: src.clone(),
            src_mask: None,
            src_key_padding_mask: None,
            is_causal: false,
        }
    }

    input_setters!(masks { src_mask, src_key_padding_mask } flags { is_causal });

    /// The same masks over another `src`.
    fn with_src(&self, src: Tensor) -> Self {
        Self {
            src,
            ..self.clone()
        }
    }
}

input_tensors!(EncoderInput { src } masks { src_mask, src_key_padding_mask });

/// One Transformer encoder block, self-attention then a feed-forward block, each with a residual
/// connection and a layer norm: PyTorch's `nn.TransformerEncoderLayer(d_model, nhead, …)`.
///
/// Post-norm (PyTorch's default): `x = norm1(x + sa(x)); x = norm2(x + ff(x))`. Pre-norm
/// (`norm_first`): `x = x + sa(norm1(x)); x = x + ff(norm2(x))`, where
/// `sa(x) = dropout1(self_attn(x, x, x))` and `ff(x) = dropout2(linear2(dropout(activation(linear1(x)))))`.
///
/// Parameters, with PyTorch's names: `self_attn.in_proj_weight`, `self_attn.in_proj_bias`,
/// `self_attn.out_proj.{weight,bias}`, `linear1.{weight,bias}`, `linear2.{weight,bias}`,
/// `norm1.{weight,bias}`, `norm2.{weight,bias}` (no biases with `bias = false`), initialized as
/// PyTorch's layers are. A PyTorch checkpoint loads by name.
///
/// Call it with a tensor (no masks) or an [`EncoderInput`].
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::{EncoderInput, TransformerEncoderLayer, TransformerLayerConfig};
///
/// let dev = Device::Cpu;
/// let config = TransformerLayerConfig { dim_feedforward: 32, batch_first: true, ..Default::default() };
/// let layer = TransformerEncoderLayer::with_config(16, 4, config, &dev)?;
/// layer.eval();
/// let x = Tensor::randn(0f32, 1., (2, 5, 16), &dev)?;
/// let padded = Tensor::new(&[[0u8, 0, 0, 0, 0], [0, 0, 0, 1, 1]], &dev)?;
/// let y = layer.call(EncoderInput::new(&x).src_key_padding_mask(&padded))?;
/// assert_eq!(y.dims(), [2, 5, 16]);
/// assert_eq!(layer.named_parameters().len(), 12);
/// # Ok::<(), module_runtime::Error>(())
/// ```
///
/// Typed paths into it: [`TransformerEncoderLayerPath`], from [`TransformerEncoderLayer::path`].
#[derive(Module, Clone, Debug)]
#[module(crate = module_core)]
#[module(paths)]
#[module(extra_repr)]
pub struct TransformerEncoderLayer {
    /// The self-attention.
    pub self_attn: MultiheadAttention,
    /// `d_model → dim_feedforward`.
    pub linear1: Linear,
    /// Dropout inside the feed-forward block.
    pub dropout: Dropout,
    /// `dim_feedforward → d_model`.
    pub linear2: Linear,
    /// The norm of the attention block.
    pub norm1: LayerNorm,
    /// The norm of the feed-forward block.
    pub norm2: LayerNorm,
    /// Dropout after the attention.
    pub dropout1: Dropout,
    /// Dropout after the feed-forward block.
    pub dropout2: Dropout,
    /// The feed-forward activation.
    pub activation: TransformerActivation,
    norm_first: bool,
}

impl TransformerEncoderLayer {
    /// A float32 layer with PyTorch's defaults (`dim_feedforward = 2048`, dropout 0.1, ReLU,
    /// post-norm, `[seq, batch, feature]` inputs).
    pub fn new(d_model: usize, nhead: usize, device: &Device) -> Result<Self> {
        Self::with_config(d_model, nhead, TransformerLayerConfig::default(), device)
    }

    /// A layer built as `config` says. `d_model` must be divisible by `nhead`, the dropout in
    /// `[0, 1]` ([`Error::InvalidConfig`](crate::Error::InvalidConfig) otherwise).
    pub fn with_config(
        d_model: usize,
        nhead: usize,
        config: TransformerLayerConfig,
        device: &Device,
    ) -> Result<Self> {
        config.check("TransformerEncoderLayer")?;
        let self_attn = config.attention(d_model, nhead, device)?;
        let (linear1, dropout, linear2) = config.feed_forward(d_model, device)?;
        Ok(Self {
            self_attn,
            linear1,
            dropout,
            linear2,
            norm1: config.norm(d_model, device)?,
            norm2: config.norm(d_model, device)?,
            dropout1: Dropout::new(config.dropout),
            dropout2: Dropout::new(config.dropout),
            activation: config.activation,
            norm_first: config.norm_first,
        })
    }

    /// Whether the layer is pre-norm.
    pub fn norm_first(&self) -> bool {
        self.norm_first
    }

    /// Whether inputs are `[batch, seq, feature]`.
    pub fn batch_first(&self) -> bool {
        self.self_attn.batch_first()
    }

    /// `dropout1(self_attn(x, x, x))` with the call's masks.
    fn sa_block(&self, x: &Tensor, mask: Option<&Tensor>, pad: Option<&Tensor>) -> Result<Tensor> {
        attention_block(&self.self_attn, &self.dropout1, x, x, (mask, pad))
    }

    /// `dropout2(linear2(dropout(activation(linear1(x)))))`.
    fn ff_block(&self, x: &Tensor) -> Result<Tensor> {
        let linears = [&self.linear1, &self.linear2];
        feed_forward(
            linears,
            &self.activation,
            [&self.dropout, &self.dropout2],
            x,
        )
    }
}

impl Forward<EncoderInput> for TransformerEncoderLayer {
    type Output = Tensor;

    fn forward(&self, input: EncoderInput) -> Result<Tensor> {
        let x = &input.src;
        let len = seq_len(x, self.batch_first())?;
        let mask = resolve_mask(
            input.src_mask.as_ref(),
            input.is_causal,
            len,
            len,
            x.device(),
        )?;
        let padding = input.src_key_padding_mask.as_ref();
        if self.norm_first {
            let x = residual_sum(
                x,
                &self.sa_block(&self.norm1.call(x)?, mask.as_ref(), padding)?,
            )?;
            residual_sum(&x, &self.ff_block(&self.norm2.call(&x)?)?)
        } else {
            let x = self
                .norm1
                .call_residual(x, &self.sa_block(x, mask.as_ref(), padding)?)?;
            self.norm2.call_residual(&x, &self.ff_block(&x)?)
        }
    }
}

forward_unmasked!(TransformerEncoderLayer, EncoderInput);

impl Forward<EncoderInput> for TransformerEncoder {
    type Output = Tensor;

    fn forward(&self, input: EncoderInput) -> Result<Tensor> {
        let mut input = input;
        // The causal mask is made once for every layer.
        if let (true, None, Some(first)) = (input.is_causal, &input.src_mask, self.layers.first()) {
            let len = seq_len(&input.src, first.batch_first())?;
            input.src_mask = resolve_mask(None, true, len, len, input.src.device())?;
        }
        let mut x = input.src.clone();
        for layer in &self.layers {
            x = layer.call(input.with_src(x))?;
        }
        self.final_norm(x)
    }
}

forward_unmasked!(TransformerEncoder, EncoderInput);
