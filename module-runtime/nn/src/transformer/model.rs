//! `nn.Transformer`: an encoder and a decoder stack.

use candle_core::{Device, Tensor};

use super::{layer_norm, xavier_reset, DecoderInput, EncoderInput};
use super::{TransformerDecoder, TransformerDecoderLayer, TransformerEncoder};
use super::{TransformerEncoderLayer, TransformerLayerConfig};
use crate::error::{Error, Result};
use crate::{Forward, Module, ModuleExt};

/// How a [`Transformer`] is built: PyTorch's keyword arguments, with PyTorch's defaults. Those
/// that every layer shares (`dim_feedforward`, `dropout`, `activation`, `layer_norm_eps`,
/// `batch_first`, `norm_first`, `bias`) are in [`layer`](Self::layer).
#[derive(Clone, Debug)]
pub struct TransformerConfig {
    /// The model width (default `512`).
    pub d_model: usize,
    /// The number of attention heads (default `8`).
    pub nhead: usize,
    /// Encoder layers (default `6`).
    pub num_encoder_layers: usize,
    /// Decoder layers (default `6`).
    pub num_decoder_layers: usize,
    /// The encoder and decoder layers' arguments; its `layer_norm_eps` and `bias` also apply to the
    /// final norms.
    pub layer: TransformerLayerConfig,
}

impl Default for TransformerConfig {
    fn default() -> Self {
        Self {
            d_model: 512,
            nhead: 8,
            num_encoder_layers: 6,
            num_decoder_layers: 6,
            layer: TransformerLayerConfig::default(),
        }
    }
}

/// The arguments of a [`Transformer`] call: PyTorch's `forward(src, tgt, src_mask=None,
/// tgt_mask=None, memory_mask=None, src_key_padding_mask=None, tgt_key_padding_mask=None,
/// memory_key_padding_mask=None, src_is_causal=None, tgt_is_causal=None, memory_is_causal=False)`.
/// See [`EncoderInput`] and [`DecoderInput`] for each.
#[derive(Clone, Debug)]
pub struct TransformerInput {
    /// The encoder's input, `[B, S, E]` (batch first) or `[S, B, E]`.
    pub src: Tensor,
    /// The decoder's input, `[B, T, E]` or `[T, B, E]`.
    pub tgt: Tensor,
    /// The encoder's attention mask, `[S, S]`.
    pub src_mask: Option<Tensor>,
    /// The decoder's self-attention mask, `[T, T]`.
    pub tgt_mask: Option<Tensor>,
    /// The decoder's mask over the encoder's output, `[T, S]`.
    pub memory_mask: Option<Tensor>,
    /// `[B, S]`.
    pub src_key_padding_mask: Option<Tensor>,
    /// `[B, T]`.
    pub tgt_key_padding_mask: Option<Tensor>,
    /// `[B, S]`.
    pub memory_key_padding_mask: Option<Tensor>,
    /// Causal encoder self-attention.
    pub src_is_causal: bool,
    /// Causal decoder self-attention.
    pub tgt_is_causal: bool,
    /// Causal attention over the encoder's output.
    pub memory_is_causal: bool,
}

impl TransformerInput {
    /// `src` and `tgt` with no masks.
    pub fn new(src: &Tensor, tgt: &Tensor) -> Self {
        Self {
            src: src.clone(),
            tgt: tgt.clone(),
            src_mask: None,
            tgt_mask: None,
            memory_mask: None,
            src_key_padding_mask: None,
            tgt_key_padding_mask: None,
            memory_key_padding_mask: None,
            src_is_causal: false,
            tgt_is_causal: false,
            memory_is_causal: false,
        }
    }

    input_setters!(masks {
        src_mask, tgt_mask, memory_mask, src_key_padding_mask, tgt_key_padding_mask,
        memory_key_padding_mask
    } flags { src_is_causal, tgt_is_causal, memory_is_causal });

    fn encoder_input(&self) -> EncoderInput {
        EncoderInput {
            src: self.src.clone(),
            src_mask: self.src_mask.clone(),
            src_key_padding_mask: self.src_key_padding_mask.clone(),
            is_causal: self.src_is_causal,
        }
    }

    fn decoder_input(&self, memory: Tensor) -> DecoderInput {
        DecoderInput {
            tgt: self.tgt.clone(),
            memory,
            tgt_mask: self.tgt_mask.clone(),
            memory_mask: self.memory_mask.clone(),
            tgt_key_padding_mask: self.tgt_key_padding_mask.clone(),
            memory_key_padding_mask: self.memory_key_padding_mask.clone(),
            tgt_is_causal: self.tgt_is_causal,
            memory_is_causal: self.memory_is_causal,
        }
    }
}

input_tensors!(TransformerInput { src, tgt } masks {
    src_mask, tgt_mask, memory_mask, src_key_padding_mask, tgt_key_padding_mask,
    memory_key_padding_mask
});

/// An encoder-decoder Transformer: PyTorch's `nn.Transformer`.
///
/// A [`TransformerEncoder`] of `num_encoder_layers` layers with a final norm (`encoder.norm`) and a
/// [`TransformerDecoder`] of `num_decoder_layers` layers with a final norm (`decoder.norm`); the
/// decoder attends to the encoder's output. Parameters of rank 2 are initialized Xavier-uniform, as
/// PyTorch's `_reset_parameters` does. State-dict keys are PyTorch's
/// (`encoder.layers.0.self_attn.in_proj_weight`, `decoder.layers.0.multihead_attn.out_proj.weight`,
/// `decoder.norm.bias`, …).
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::{
///     generate_square_subsequent_mask, Transformer, TransformerConfig, TransformerInput,
///     TransformerLayerConfig,
/// };
///
/// let dev = Device::Cpu;
/// let layer = TransformerLayerConfig { dim_feedforward: 32, batch_first: true, ..Default::default() };
/// let config = TransformerConfig {
///     d_model: 16, nhead: 2, num_encoder_layers: 1, num_decoder_layers: 1, layer,
/// };
/// let model = Transformer::with_config(config, &dev)?;
/// let src = Tensor::randn(0f32, 1., (2, 6, 16), &dev)?;
/// let tgt = Tensor::randn(0f32, 1., (2, 4, 16), &dev)?;
/// let causal = generate_square_subsequent_mask(4, DType::F32, &dev)?;
/// let input = TransformerInput::new(&src, &tgt).tgt_mask(&causal);
/// assert_eq!(model.call(input)?.dims(), [2, 4, 16]);
/// # Ok::<(), module_runtime::Error>(())
/// ```
///
/// Typed paths into it: [`TransformerPath`], from [`Transformer::path`].
#[derive(Module, Debug)]
#[module(crate = module_core)]
#[module(paths)]
pub struct Transformer {
    /// The encoder stack, with its final norm.
    pub encoder: TransformerEncoder,
    /// The decoder stack, with its final norm.
    pub decoder: TransformerDecoder,
    d_model: usize,
    batch_first: bool,
}

impl Transformer {
    /// A float32 model with PyTorch's defaults (`d_model = 512`, 8 heads, 6 + 6 layers).
    pub fn new(device: &Device) -> Result<Self> {
        Self::with_config(TransformerConfig::default(), device)
    }

    /// A model built as `config` says.
    pub fn with_config(config: TransformerConfig, device: &Device) -> Result<Self> {
        let (d, heads, layer) = (config.d_model, config.nhead, config.layer);
        let norm = || layer_norm(d, layer.layer_norm_eps, layer.bias, layer.dtype, device);
        let batch_first = layer.batch_first;
        let enc = TransformerEncoderLayer::with_config(d, heads, layer.clone(), device)?;
        let dec = TransformerDecoderLayer::with_config(d, heads, layer.clone(), device)?;
        let model = Self {
            encoder: TransformerEncoder::new(&enc, config.num_encoder_layers, Some(norm()?))?,
            decoder: TransformerDecoder::new(&dec, config.num_decoder_layers, Some(norm()?))?,
            d_model: d,
            batch_first,
        };
        xavier_reset(&model)?;
        Ok(model)
    }

    /// The model width.
    pub fn d_model(&self) -> usize {
        self.d_model
    }

    /// Checks what PyTorch checks: equal batch sizes, and `d_model` features.
    fn check(&self, src: &Tensor, tgt: &Tensor) -> Result<()> {
        let invalid = |message| {
            Err(Error::InvalidInput {
                layer: "Transformer",
                message,
            })
        };
        let batch = if self.batch_first { 0 } else { 1 };
        if src.rank() == 3 && tgt.rank() == 3 && src.dim(batch)? != tgt.dim(batch)? {
            let (s, t) = (src.dims(), tgt.dims());
            return invalid(format!(
                "the batch number of src and tgt must be equal, got src {s:?} and tgt {t:?}"
            ));
        }
        for (name, x) in [("src", src), ("tgt", tgt)] {
            let features = x.dims().last().copied().unwrap_or(0);
            if features != self.d_model {
                let dims = x.dims();
                let d = self.d_model;
                return invalid(format!(
                    "the feature number of {name} must be d_model = {d}, got {name} {dims:?}"
                ));
            }
        }
        Ok(())
    }
}

impl Forward<TransformerInput> for Transformer {
    type Output = Tensor;

    fn forward(&self, input: TransformerInput) -> Result<Tensor> {
        self.check(&input.src, &input.tgt)?;
        let memory = self.encoder.call(input.encoder_input())?;
        self.decoder.call(input.decoder_input(memory))
    }
}
