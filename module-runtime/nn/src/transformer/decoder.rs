//! `nn.TransformerDecoderLayer` and `nn.TransformerDecoder`.

use candle_core::{Device, Tensor};

use super::TransformerLayerConfig;
use super::{attention_block, feed_forward, residual_sum, resolve_mask, seq_len};
use super::{TransformerActivation, TransformerDecoder};
use crate::error::Result;
use crate::{Dropout, Forward, LayerNorm, Linear, MultiheadAttention};
use crate::{Module, ModuleExt};

/// The arguments of a [`TransformerDecoderLayer`] or [`TransformerDecoder`] call: PyTorch's
/// `forward(tgt, memory, tgt_mask=None, memory_mask=None, tgt_key_padding_mask=None,
/// memory_key_padding_mask=None, tgt_is_causal=False, memory_is_causal=False)`.
///
/// Masks follow [`MultiheadAttention`]: an integer mask marks blocked positions with a non-zero
/// value (PyTorch's boolean `True`), a floating-point mask is added to the attention scores.
#[derive(Clone, Debug)]
pub struct DecoderInput {
    /// `[B, T, E]` (batch first), `[T, B, E]`, or `[T, E]` unbatched.
    pub tgt: Tensor,
    /// The encoder's output, `[B, S, E]` laid out like `tgt`.
    pub memory: Tensor,
    /// `[T, T]` or `[B * nhead, T, T]`, for the self-attention.
    pub tgt_mask: Option<Tensor>,
    /// `[T, S]` or `[B * nhead, T, S]`, for the attention over `memory`.
    pub memory_mask: Option<Tensor>,
    /// `[B, T]`: the padded positions of `tgt`.
    pub tgt_key_padding_mask: Option<Tensor>,
    /// `[B, S]`: the padded positions of `memory`.
    pub memory_key_padding_mask: Option<Tensor>,
    /// Causal self-attention: with no `tgt_mask`, every later target position is masked.
    pub tgt_is_causal: bool,
    /// Causal attention over `memory`: with no `memory_mask`, key positions after the query's are
    /// masked.
    pub memory_is_causal: bool,
}

impl DecoderInput {
    /// `tgt` attending to `memory`, with no masks.
    pub fn new(tgt: &Tensor, memory: &Tensor) -> Self {
        Self {
            tgt: tgt.clone(),
            memory: memory.clone(),
            tgt_mask: None,
            memory_mask: None,
            tgt_key_padding_mask: None,
            memory_key_padding_mask: None,
            tgt_is_causal: false,
            memory_is_causal: false,
        }
    }

    input_setters!(masks {
        tgt_mask, memory_mask, tgt_key_padding_mask, memory_key_padding_mask
    } flags { tgt_is_causal, memory_is_causal });

    /// The causal masks made once (for the layers of a stack), given the layout.
    fn resolved(mut self, batch_first: bool) -> Result<Self> {
        let (t, s) = (
            seq_len(&self.tgt, batch_first)?,
            seq_len(&self.memory, batch_first)?,
        );
        let device = self.tgt.device().clone();
        let tgt_mask = resolve_mask(self.tgt_mask.as_ref(), self.tgt_is_causal, t, t, &device)?;
        let memory = self.memory_mask.as_ref();
        self.memory_mask = resolve_mask(memory, self.memory_is_causal, t, s, &device)?;
        self.tgt_mask = tgt_mask;
        Ok(self)
    }
}

input_tensors!(DecoderInput { tgt, memory } masks {
    tgt_mask, memory_mask, tgt_key_padding_mask, memory_key_padding_mask
});

/// One Transformer decoder block: self-attention over the target, attention over the encoder's
/// output (`memory`), then a feed-forward block, each with a residual connection and a layer norm:
/// PyTorch's `nn.TransformerDecoderLayer(d_model, nhead, …)`.
///
/// Post-norm (default): `x = norm1(x + sa(x)); x = norm2(x + mha(x, memory)); x = norm3(x + ff(x))`;
/// pre-norm (`norm_first`): `x = x + sa(norm1(x)); x = x + mha(norm2(x), memory); x = x + ff(norm3(x))`.
///
/// Parameters, with PyTorch's names: `self_attn.*`, `multihead_attn.*` (each `in_proj_weight`,
/// `in_proj_bias`, `out_proj.{weight,bias}`), `linear1.*`, `linear2.*`, `norm1.*`, `norm2.*`,
/// `norm3.*`.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::{DecoderInput, TransformerDecoderLayer, TransformerLayerConfig};
///
/// let dev = Device::Cpu;
/// let config = TransformerLayerConfig { dim_feedforward: 32, ..Default::default() };
/// let layer = TransformerDecoderLayer::with_config(16, 4, config, &dev)?;
/// let tgt = Tensor::randn(0f32, 1., (4, 2, 16), &dev)?; // [T, B, E]
/// let memory = Tensor::randn(0f32, 1., (6, 2, 16), &dev)?; // [S, B, E]
/// let y = layer.call(DecoderInput::new(&tgt, &memory).tgt_is_causal(true))?;
/// assert_eq!(y.dims(), [4, 2, 16]);
/// # Ok::<(), module_runtime::Error>(())
/// ```
///
/// Typed paths into it: [`TransformerDecoderLayerPath`], from [`TransformerDecoderLayer::path`].
#[derive(Module, Clone, Debug)]
#[module(crate = module_core)]
#[module(paths)]
#[module(extra_repr)]
pub struct TransformerDecoderLayer {
    /// The self-attention over the target.
    pub self_attn: MultiheadAttention,
    /// The attention over `memory`.
    pub multihead_attn: MultiheadAttention,
    /// `d_model → dim_feedforward`.
    pub linear1: Linear,
    /// Dropout inside the feed-forward block.
    pub dropout: Dropout,
    /// `dim_feedforward → d_model`.
    pub linear2: Linear,
    /// The norm of the self-attention block.
    pub norm1: LayerNorm,
    /// The norm of the attention over `memory`.
    pub norm2: LayerNorm,
    /// The norm of the feed-forward block.
    pub norm3: LayerNorm,
    /// Dropout after the self-attention.
    pub dropout1: Dropout,
    /// Dropout after the attention over `memory`.
    pub dropout2: Dropout,
    /// Dropout after the feed-forward block.
    pub dropout3: Dropout,
    /// The feed-forward activation.
    pub activation: TransformerActivation,
    norm_first: bool,
}

impl TransformerDecoderLayer {
    /// A float32 layer with PyTorch's defaults.
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
        config.check("TransformerDecoderLayer")?;
        let attention = || config.attention(d_model, nhead, device);
        let (self_attn, multihead_attn) = (attention()?, attention()?);
        let (linear1, dropout, linear2) = config.feed_forward(d_model, device)?;
        Ok(Self {
            self_attn,
            multihead_attn,
            linear1,
            dropout,
            linear2,
            norm1: config.norm(d_model, device)?,
            norm2: config.norm(d_model, device)?,
            norm3: config.norm(d_model, device)?,
            dropout1: Dropout::new(config.dropout),
            dropout2: Dropout::new(config.dropout),
            dropout3: Dropout::new(config.dropout),
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

    /// `dropout1(self_attn(x, x, x))` with the target's masks.
    fn sa_block(&self, x: &Tensor, input: &DecoderInput) -> Result<Tensor> {
        let masks = (&input.tgt_mask, &input.tgt_key_padding_mask);
        attention_block(&self.self_attn, &self.dropout1, x, x, masks_of(masks))
    }

    /// `dropout2(multihead_attn(x, memory, memory))` with the memory's masks.
    fn mha_block(&self, x: &Tensor, input: &DecoderInput) -> Result<Tensor> {
        let masks = (&input.memory_mask, &input.memory_key_padding_mask);
        let (attention, memory) = (&self.multihead_attn, &input.memory);
        attention_block(attention, &self.dropout2, x, memory, masks_of(masks))
    }

    /// `dropout3(linear2(dropout(activation(linear1(x)))))`.
    fn ff_block(&self, x: &Tensor) -> Result<Tensor> {
        let dropouts = [&self.dropout, &self.dropout3];
        feed_forward(
            [&self.linear1, &self.linear2],
            &self.activation,
            dropouts,
            x,
        )
    }
}

/// The borrowed form of an attention mask and key padding mask.
fn masks_of<'a>(
    (mask, padding): (&'a Option<Tensor>, &'a Option<Tensor>),
) -> (Option<&'a Tensor>, Option<&'a Tensor>) {
    (mask.as_ref(), padding.as_ref())
}

impl Forward<DecoderInput> for TransformerDecoderLayer {
    type Output = Tensor;

    fn forward(&self, input: DecoderInput) -> Result<Tensor> {
        let input = input.resolved(self.batch_first())?;
        let x = &input.tgt;
        if self.norm_first {
            let x = residual_sum(x, &self.sa_block(&self.norm1.call(x)?, &input)?)?;
            let x = residual_sum(&x, &self.mha_block(&self.norm2.call(&x)?, &input)?)?;
            residual_sum(&x, &self.ff_block(&self.norm3.call(&x)?)?)
        } else {
            let x = self.norm1.call_residual(x, &self.sa_block(x, &input)?)?;
            let x = self.norm2.call_residual(&x, &self.mha_block(&x, &input)?)?;
            self.norm3.call_residual(&x, &self.ff_block(&x)?)
        }
    }
}

impl Forward<DecoderInput> for TransformerDecoder {
    type Output = Tensor;

    fn forward(&self, input: DecoderInput) -> Result<Tensor> {
        let batch_first = self.layers.first().is_some_and(|l| l.batch_first());
        let mut input = input.resolved(batch_first)?;
        for layer in &self.layers {
            let x = layer.call(input.clone())?;
            input.tgt = x;
        }
        self.final_norm(input.tgt)
    }
}
