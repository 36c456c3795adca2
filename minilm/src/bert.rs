//! A BERT encoder written with `#[derive(Module)]`, whose parameter paths are Hugging Face's
//! (`embeddings.LayerNorm.weight`, `encoder.layer.3.attention.self.query.weight`, …), so a
//! `transformers` `BertModel` checkpoint such as all-MiniLM-L6-v2 loads into it strictly, by name.
//!
//! Field names give most of the keys; `#[module(rename)]` gives the two that are not Rust
//! identifiers in snake case (`LayerNorm`, `self`). Every submodule is run with `call`, so hooks see
//! each of them under its checkpoint path.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use module_runtime::nn::functional::{scaled_dot_product_attention, SdpaOptions};
use module_runtime::nn::{Dropout, Embedding, LayerNorm, LayerNormConfig, Linear, GELU};
use module_runtime::prelude::*;
use module_runtime::{checkpoint, is_grad_enabled, Buffer, Error};

/// The hyperparameters of a BERT encoder: the fields of a Hugging Face `config.json` it needs.
#[derive(Clone, Debug, PartialEq)]
pub struct BertConfig {
    /// Size of the vocabulary.
    pub vocab_size: usize,
    /// Width of the hidden states.
    pub hidden_size: usize,
    /// Number of encoder layers.
    pub num_hidden_layers: usize,
    /// Attention heads per layer.
    pub num_attention_heads: usize,
    /// Width of the feed-forward layer.
    pub intermediate_size: usize,
    /// Longest sequence the position embeddings cover.
    pub max_position_embeddings: usize,
    /// Number of token types (segments).
    pub type_vocab_size: usize,
    /// The layer norms' epsilon.
    pub layer_norm_eps: f64,
    /// Dropout on hidden states (training only).
    pub hidden_dropout_prob: f64,
    /// Dropout on attention probabilities (training only).
    pub attention_probs_dropout_prob: f64,
}

impl BertConfig {
    /// all-MiniLM-L6-v2's configuration: 6 layers, hidden size 384, 12 heads.
    pub fn minilm_l6() -> Self {
        Self {
            vocab_size: 30522,
            hidden_size: 384,
            num_hidden_layers: 6,
            num_attention_heads: 12,
            intermediate_size: 1536,
            max_position_embeddings: 512,
            type_vocab_size: 2,
            layer_norm_eps: 1e-12,
            hidden_dropout_prob: 0.1,
            attention_probs_dropout_prob: 0.1,
        }
    }

    /// BERT-base's configuration: 12 layers, hidden size 768, 12 heads (about 110M parameters).
    pub fn base() -> Self {
        Self {
            hidden_size: 768,
            num_hidden_layers: 12,
            intermediate_size: 3072,
            ..Self::minilm_l6()
        }
    }

    /// Reads the fields above from a Hugging Face `config.json`. Only `hidden_act: "gelu"` (exact
    /// GELU) and absolute position embeddings are supported; anything else is an error.
    pub fn from_json_file(path: &Path) -> std::result::Result<Self, Box<dyn std::error::Error>> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        let json: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| format!("{} is not JSON: {e}", path.display()))?;
        let usize_of = |key: &str| -> std::result::Result<usize, String> {
            json[key]
                .as_u64()
                .map(|v| v as usize)
                .ok_or_else(|| format!("{}: `{key}` is missing or not an integer", path.display()))
        };
        let f64_of = |key: &str, default: f64| json[key].as_f64().unwrap_or(default);
        let str_of =
            |key: &str, default: &'static str| json[key].as_str().unwrap_or(default).to_owned();
        if str_of("hidden_act", "gelu") != "gelu" {
            return Err(
                format!("{}: only hidden_act \"gelu\" is supported", path.display()).into(),
            );
        }
        if str_of("position_embedding_type", "absolute") != "absolute" {
            return Err(format!(
                "{}: only absolute position embeddings are supported",
                path.display()
            )
            .into());
        }
        Ok(Self {
            vocab_size: usize_of("vocab_size")?,
            hidden_size: usize_of("hidden_size")?,
            num_hidden_layers: usize_of("num_hidden_layers")?,
            num_attention_heads: usize_of("num_attention_heads")?,
            intermediate_size: usize_of("intermediate_size")?,
            max_position_embeddings: usize_of("max_position_embeddings")?,
            type_vocab_size: usize_of("type_vocab_size")?,
            layer_norm_eps: f64_of("layer_norm_eps", 1e-12),
            hidden_dropout_prob: f64_of("hidden_dropout_prob", 0.1),
            attention_probs_dropout_prob: f64_of("attention_probs_dropout_prob", 0.1),
        })
    }
}

/// Word, position and token-type embeddings, summed and normalized.
#[derive(Module)]
#[module(paths)]
pub struct BertEmbeddings {
    /// `[vocab_size, hidden]`.
    pub word_embeddings: Embedding,
    /// `[max_position_embeddings, hidden]`.
    pub position_embeddings: Embedding,
    /// `[type_vocab_size, hidden]`.
    pub token_type_embeddings: Embedding,
    /// Normalizes the sum.
    #[module(rename = "LayerNorm")]
    pub layer_norm: LayerNorm,
    /// Dropout after the norm.
    pub dropout: Dropout,
    /// `[1, max_position_embeddings]` int64 `0, 1, 2, …`: a persistent buffer in the checkpoint.
    pub position_ids: Buffer,
}

/// Queries, keys and values (Hugging Face's `BertSelfAttention`); its output is the per-head
/// context, heads side by side: `[batch, seq, heads * head_dim]`.
#[derive(Module)]
#[module(paths)]
pub struct BertSelfAttention {
    /// `[hidden, hidden]`.
    pub query: Linear,
    /// `[hidden, hidden]`.
    pub key: Linear,
    /// `[hidden, hidden]`.
    pub value: Linear,
    /// Dropout on the attention probabilities.
    pub dropout: Dropout,
    /// Number of heads.
    pub num_heads: usize,
}

/// Self-attention and its output projection.
#[derive(Module)]
#[module(paths)]
pub struct BertAttention {
    /// The attention proper (checkpoint name `self`).
    #[module(rename = "self")]
    pub self_attention: BertSelfAttention,
    /// Projection, residual and norm.
    pub output: BertOutput,
}

/// The first half of the feed-forward block.
#[derive(Module)]
#[module(paths)]
pub struct BertIntermediate {
    /// `[intermediate, hidden]`.
    pub dense: Linear,
    /// Exact GELU.
    pub activation: GELU,
}

/// A projection, dropout, the residual connection and a norm: Hugging Face's `BertSelfOutput`
/// (after attention, `[hidden, hidden]`) and `BertOutput` (the feed-forward block's second half,
/// `[hidden, intermediate]`), which are the same layers and computation, so one type serves both.
#[derive(Module)]
#[module(paths)]
pub struct BertOutput {
    /// `[hidden, hidden]` after attention, `[hidden, intermediate]` in the feed-forward block.
    pub dense: Linear,
    /// Normalizes `dense(x) + residual`.
    #[module(rename = "LayerNorm")]
    pub layer_norm: LayerNorm,
    /// Dropout before the residual sum.
    pub dropout: Dropout,
}

/// One transformer layer.
#[derive(Module)]
#[module(paths)]
pub struct BertLayer {
    /// Attention block.
    pub attention: BertAttention,
    /// Feed-forward, first half.
    pub intermediate: BertIntermediate,
    /// Feed-forward, second half.
    pub output: BertOutput,
}

/// The stack of layers.
#[derive(Module)]
#[module(paths)]
pub struct BertEncoder {
    /// `layer.0`, `layer.1`, … Each is held through an `Arc` (its path is the same), so that a
    /// checkpointed layer can be run again during the backward.
    pub layer: Vec<Arc<BertLayer>>,
    /// Whether each layer's call is checkpointed in training (Hugging Face's
    /// `BertEncoder.gradient_checkpointing`): set by
    /// [`gradient_checkpointing_enable`](BertModel::gradient_checkpointing_enable).
    #[module(skip)]
    pub gradient_checkpointing: AtomicBool,
}

/// `tanh(dense(hidden[:, 0]))`: the first token's pooled output.
#[derive(Module)]
#[module(paths)]
pub struct BertPooler {
    /// `[hidden, hidden]`.
    pub dense: Linear,
}

/// Hugging Face's `BertModel`: embeddings, encoder and pooler.
///
/// `call((&input_ids, &attention_mask))` takes `[batch, seq]` token ids (u32 or i64) and a
/// `[batch, seq]` mask (1 for tokens, 0 for padding, any dtype) and returns the last hidden state
/// `[batch, seq, hidden]`; the token types are all 0 (single-segment input). The pooler is part
/// of the checkpoint and is loaded, but [`pool`](Self::pool) runs it only when asked.
#[derive(Module)]
#[module(paths)]
pub struct BertModel {
    /// Input embeddings.
    pub embeddings: BertEmbeddings,
    /// Transformer layers.
    pub encoder: BertEncoder,
    /// First-token pooler.
    pub pooler: BertPooler,
}

/// A configuration or input the model cannot run with.
fn invalid(message: String) -> Error {
    candle_core::Error::Msg(message).into()
}

fn dropout(p: f64) -> Result<Dropout> {
    if !(0.0..=1.0).contains(&p) {
        return Err(invalid(format!("dropout probability {p} is not in [0, 1]")));
    }
    Ok(Dropout::new(p))
}

impl BertModel {
    /// Checkpoints every encoder layer from now on (Hugging Face's
    /// `model.gradient_checkpointing_enable()`): in training, with gradients on, each layer's
    /// activations are dropped after its forward and recomputed in the backward
    /// ([`checkpoint`]), for less memory at the cost of a second
    /// forward of the layers; the gradients are the same, bit for bit.
    pub fn gradient_checkpointing_enable(&self) {
        self.encoder
            .gradient_checkpointing
            .store(true, Ordering::Relaxed);
    }

    /// Stops checkpointing the encoder layers (Hugging Face's
    /// `gradient_checkpointing_disable()`).
    pub fn gradient_checkpointing_disable(&self) {
        self.encoder
            .gradient_checkpointing
            .store(false, Ordering::Relaxed);
    }

    /// A randomly initialized model (PyTorch's default initializations of each layer), in training
    /// mode. Load a checkpoint into it with `load_state_dict(path, ..)`.
    pub fn new(cfg: &BertConfig, device: &Device) -> Result<Self> {
        let h = cfg.hidden_size;
        if cfg.num_attention_heads == 0 || !h.is_multiple_of(cfg.num_attention_heads) {
            return Err(invalid(format!(
                "hidden_size {h} is not a multiple of num_attention_heads {}",
                cfg.num_attention_heads
            )));
        }
        let norm_config = LayerNormConfig {
            eps: cfg.layer_norm_eps,
            ..Default::default()
        };
        let norm = || LayerNorm::with_config(h, norm_config, device);
        let layer = || -> Result<BertLayer> {
            Ok(BertLayer {
                attention: BertAttention {
                    self_attention: BertSelfAttention {
                        query: Linear::new(h, h, device)?,
                        key: Linear::new(h, h, device)?,
                        value: Linear::new(h, h, device)?,
                        dropout: dropout(cfg.attention_probs_dropout_prob)?,
                        num_heads: cfg.num_attention_heads,
                    },
                    output: BertOutput {
                        dense: Linear::new(h, h, device)?,
                        layer_norm: norm()?,
                        dropout: dropout(cfg.hidden_dropout_prob)?,
                    },
                },
                intermediate: BertIntermediate {
                    dense: Linear::new(h, cfg.intermediate_size, device)?,
                    activation: GELU::new(),
                },
                output: BertOutput {
                    dense: Linear::new(cfg.intermediate_size, h, device)?,
                    layer_norm: norm()?,
                    dropout: dropout(cfg.hidden_dropout_prob)?,
                },
            })
        };
        let positions = Tensor::arange(0i64, cfg.max_position_embeddings as i64, device)?
            .reshape((1, cfg.max_position_embeddings))?;
        Ok(Self {
            embeddings: BertEmbeddings {
                word_embeddings: Embedding::new(cfg.vocab_size, h, device)?,
                position_embeddings: Embedding::new(cfg.max_position_embeddings, h, device)?,
                token_type_embeddings: Embedding::new(cfg.type_vocab_size, h, device)?,
                layer_norm: norm()?,
                dropout: dropout(cfg.hidden_dropout_prob)?,
                position_ids: Buffer::new(positions),
            },
            encoder: BertEncoder {
                layer: (0..cfg.num_hidden_layers)
                    .map(|_| layer().map(Arc::new))
                    .collect::<Result<_>>()?,
                gradient_checkpointing: AtomicBool::new(false),
            },
            pooler: BertPooler {
                dense: Linear::new(h, h, device)?,
            },
        })
    }

    /// The pooled output `[batch, hidden]` of a last hidden state.
    pub fn pool(&self, hidden: &Tensor) -> Result<Tensor> {
        self.pooler.call(hidden)
    }
}

impl Forward<&Tensor> for BertEmbeddings {
    type Output = Tensor;

    /// `[batch, seq]` ids → `[batch, seq, hidden]`.
    fn forward(&self, input_ids: &Tensor) -> Result<Tensor> {
        let (_, seq_len) = input_ids.dims2()?;
        let positions = self.position_ids.tensor()?.narrow(1, 0, seq_len)?;
        let words = self.word_embeddings.call(input_ids)?;
        let positions = self.position_embeddings.call(&positions)?;
        // Single-segment input: every token type is 0, so its embedding is row 0 for all tokens.
        let token_type = self
            .token_type_embeddings
            .weight
            .tensor()?
            .narrow(0, 0, 1)?;
        let sum = words
            .broadcast_add(&positions)?
            .broadcast_add(&token_type)?;
        let normed = self.layer_norm.call(&sum)?;
        self.dropout.call(&normed)
    }
}

impl Forward<(&Tensor, &Tensor)> for BertSelfAttention {
    type Output = Tensor;

    /// `(hidden [batch, seq, hidden], mask bias [batch, 1, 1, seq])` → `[batch, seq, hidden]`.
    ///
    /// The attention is PyTorch's `scaled_dot_product_attention` (`nn::functional`), with the
    /// dropout module's `p` as `dropout_p` in training and 0 in evaluation, as transformers'
    /// `sdpa` attention (its default) calls it: the dropout module is not itself called, so a
    /// hook on `attention.self.dropout` does not fire. On the CPU the attention reads the heads in
    /// place and computes each head in one pass, in inference and, with its backward, in training.
    fn forward(&self, (x, mask_bias): (&Tensor, &Tensor)) -> Result<Tensor> {
        let hidden = x.dim(2)?;
        let head_dim = hidden / self.num_heads;
        let options = SdpaOptions {
            scale: Some(1.0 / (head_dim as f64).sqrt()),
            dropout_p: if self.dropout.is_training() {
                self.dropout.p
            } else {
                0.0
            },
            // The projections' [batch, seq, hidden] as they are: the heads are split and joined
            // inside (transformers' `view(...).transpose(1, 2)` and back).
            packed_heads: Some(self.num_heads),
            ..Default::default()
        };
        let (q, k, v) = (self.query.call(x)?, self.key.call(x)?, self.value.call(x)?);
        scaled_dot_product_attention(&q, &k, &v, Some(mask_bias), options)
    }
}

impl Forward<(&Tensor, &Tensor)> for BertAttention {
    type Output = Tensor;

    /// `(hidden, mask bias)` → hidden.
    fn forward(&self, (x, mask_bias): (&Tensor, &Tensor)) -> Result<Tensor> {
        let context = self.self_attention.call((x, mask_bias))?;
        self.output.call((&context, x))
    }
}

impl Forward<&Tensor> for BertIntermediate {
    type Output = Tensor;

    /// `GELU(dense(x))`: during inference on the CPU, the bias and the GELU in one pass over the
    /// matmul's output (`Linear::call_then`).
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.dense.call_then(x, &self.activation)
    }
}

impl Forward<(&Tensor, &Tensor)> for BertOutput {
    type Output = Tensor;

    /// `(attention context or intermediate, residual)` → normalized sum.
    /// During inference on the CPU the residual sum and the norm are one pass
    /// (`LayerNorm::call_residual`).
    fn forward(&self, (x, residual): (&Tensor, &Tensor)) -> Result<Tensor> {
        let h = self.dropout.call(&self.dense.call(x)?)?;
        self.layer_norm.call_residual(&h, residual)
    }
}

impl Forward<(&Tensor, &Tensor)> for BertLayer {
    type Output = Tensor;

    /// `(hidden, mask bias)` → hidden.
    fn forward(&self, (x, mask_bias): (&Tensor, &Tensor)) -> Result<Tensor> {
        let attended = self.attention.call((x, mask_bias))?;
        let inner = self.intermediate.call(&attended)?;
        self.output.call((&inner, &attended))
    }
}

impl Forward<(&Tensor, &Tensor)> for BertEncoder {
    type Output = Tensor;

    /// `(hidden, mask bias)` → hidden.
    fn forward(&self, (x, mask_bias): (&Tensor, &Tensor)) -> Result<Tensor> {
        let checkpointed = self.gradient_checkpointing.load(Ordering::Relaxed)
            && is_grad_enabled()
            && self.is_training();
        let mut h = x.clone();
        for layer in &self.layer {
            h = if checkpointed {
                // Hugging Face's `self._gradient_checkpointing_func(layer.__call__, ...)`.
                let layer = layer.clone();
                // The layer inside the `Arc`, which hooks know by its path.
                let run = move |xs: &[Tensor]| Ok(vec![(*layer).call((&xs[0], &xs[1]))?]);
                checkpoint(run, &[h, mask_bias.clone()])?.remove(0)
            } else {
                layer.call((&h, mask_bias))?
            };
        }
        Ok(h)
    }
}

impl Forward<&Tensor> for BertPooler {
    type Output = Tensor;

    /// `[batch, seq, hidden]` → `[batch, hidden]` from the first token.
    fn forward(&self, hidden: &Tensor) -> Result<Tensor> {
        let first = hidden.narrow(1, 0, 1)?.squeeze(1)?;
        Ok(self.dense.call(&first)?.tanh()?)
    }
}

impl Forward<(&Tensor, &Tensor)> for BertModel {
    type Output = Tensor;

    /// `(input_ids [batch, seq], attention_mask [batch, seq])` → last hidden state.
    fn forward(&self, (input_ids, attention_mask): (&Tensor, &Tensor)) -> Result<Tensor> {
        let (batch, seq_len) = input_ids.dims2()?;
        if attention_mask.dims() != [batch, seq_len] {
            return Err(invalid(format!(
                "attention_mask has shape {:?}, input_ids {:?}: they must match",
                attention_mask.dims(),
                input_ids.dims()
            )));
        }
        let embedded = self.embeddings.call(input_ids)?;
        // 0 where a key is a token, the dtype's lowest value where it is padding (as transformers
        // does): after the softmax, padding gets exactly zero weight.
        let dtype = embedded.dtype();
        let keep = attention_mask.to_dtype(dtype)?;
        let lowest = match dtype {
            DType::F16 => -65504.0,
            DType::BF16 => -3.3895313892515355e38,
            DType::F64 => f64::MIN,
            _ => f64::from(f32::MIN),
        };
        let mask_bias = ((1.0 - keep)? * lowest)?.reshape((batch, 1, 1, seq_len))?;
        self.encoder.call((&embedded, &mask_bias))
    }
}
