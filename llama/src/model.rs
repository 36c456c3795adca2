//! Hugging Face's `LlamaForCausalLM` as derived structs whose parameter paths are the checkpoint's
//! (`model.embed_tokens.weight`, `model.layers.3.self_attn.q_proj.weight`, `lm_head.weight`, …),
//! so a transformers Llama checkpoint loads into it strictly, by name.
//!
//! The layers run on the key/value buffers of a [`KvCache`](crate::KvCache): each attention
//! writes its new keys and values into its layer's buffers, in place, and attends over every
//! filled slot. [`LlamaForCausalLM`](crate::LlamaForCausalLM) drives them (`scan`, `step`).
//! Without buffers (training, `LlamaForCausalLM::call`) each attention attends over its own
//! keys and values, and gradients flow through every op.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use module_runtime::nn::functional::{rotary_embedding, scaled_dot_product_attention, SdpaOptions};
use module_runtime::nn::{Embedding, Linear, LinearConfig, RmsNorm, RmsNormConfig, SiLU};
use module_runtime::prelude::*;

use crate::config::{invalid, LlamaConfig};

/// Grouped-query self-attention with rotary position embeddings: `num_heads` query heads share
/// `num_key_value_heads` key/value heads (1: multi-query attention).
#[derive(Module)]
#[module(paths)]
pub struct LlamaAttention {
    /// `[heads * head_dim, hidden]`.
    pub q_proj: Linear,
    /// `[kv_heads * head_dim, hidden]`.
    pub k_proj: Linear,
    /// `[kv_heads * head_dim, hidden]`.
    pub v_proj: Linear,
    /// `[hidden, heads * head_dim]`.
    pub o_proj: Linear,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads (a divisor of `num_heads`).
    pub num_key_value_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
}

/// The SwiGLU feed-forward block: `down_proj(act_fn(gate_proj(x)) * up_proj(x))`, `act_fn` the
/// SiLU.
#[derive(Module)]
#[module(paths)]
pub struct LlamaMlp {
    /// `[intermediate, hidden]`.
    pub gate_proj: Linear,
    /// `[intermediate, hidden]`.
    pub up_proj: Linear,
    /// `[hidden, intermediate]`.
    pub down_proj: Linear,
    /// The activation of the gate, as transformers' `act_fn` (a module, so hooks can read or
    /// change it: `model.layers.N.mlp.act_fn`).
    pub act_fn: SiLU,
}

/// One pre-norm decoder layer: `x + attn(norm(x))`, then `h + mlp(norm(h))`.
#[derive(Module)]
#[module(paths)]
pub struct LlamaDecoderLayer {
    /// Self-attention.
    pub self_attn: LlamaAttention,
    /// Feed-forward block.
    pub mlp: LlamaMlp,
    /// Norm before the attention.
    pub input_layernorm: RmsNorm,
    /// Norm before the feed-forward block.
    pub post_attention_layernorm: RmsNorm,
}

/// The decoder stack without its head: Hugging Face's `LlamaModel`.
#[derive(Module)]
#[module(paths)]
pub struct LlamaModel {
    /// `[vocab, hidden]`.
    pub embed_tokens: Embedding,
    /// `layers.0`, `layers.1`, … Each is held through an `Arc` (its path is the same), so that a
    /// checkpointed layer can be run again during the backward.
    pub layers: Vec<Arc<LlamaDecoderLayer>>,
    /// The final norm.
    pub norm: RmsNorm,
    /// Whether each layer's call is checkpointed in training (transformers'
    /// `LlamaModel.gradient_checkpointing`): set by
    /// [`gradient_checkpointing_enable`](crate::LlamaForCausalLM::gradient_checkpointing_enable).
    #[module(skip)]
    pub gradient_checkpointing: AtomicBool,
}

/// What one decoder layer runs on: the hidden states of the new tokens, their rotary tables, the
/// attention bias, and the layer's cache buffers with the number of slots already filled (or no
/// buffers: the tokens attend to themselves only, differentiably).
#[derive(TensorStruct, Clone)]
pub struct LayerInput {
    /// `[batch, new, hidden]`.
    pub hidden: Tensor,
    /// `cos` of each new token's angles: `[new, head_dim / 2]`, or `[batch, new, head_dim / 2]`
    /// when rows have different positions.
    pub cos: Tensor,
    /// `sin` of the same angles.
    pub sin: Tensor,
    /// Additive attention bias `[batch or 1, 1, new, filled + new]` (0 or the lowest float), or
    /// `None` when none is needed: one new token (it sees every slot), or new tokens after an
    /// empty cache (causal attention, which the layer applies itself).
    pub mask: Option<Tensor>,
    /// The layer's key buffer `[batch, kv_heads, capacity, head_dim]`, written in place; `None`
    /// without a cache (then `filled` is 0).
    pub keys: Option<Tensor>,
    /// The layer's value buffer, the same shape.
    pub values: Option<Tensor>,
    /// Slots already filled; the new tokens' keys and values go after them.
    #[tensor(skip)]
    pub filled: usize,
}

fn linear(i: usize, o: usize, bias: bool, device: &Device) -> Result<Linear> {
    let config = LinearConfig {
        bias,
        ..Default::default()
    };
    Linear::with_config(i, o, config, device)
}

impl LlamaModel {
    /// A randomly initialized stack (PyTorch's default initializations of each layer).
    pub fn new(cfg: &LlamaConfig, device: &Device) -> Result<Self> {
        let (h, d) = (cfg.hidden_size, cfg.head_dim);
        let norm_config = RmsNormConfig {
            eps: Some(cfg.rms_norm_eps),
            ..Default::default()
        };
        let norm = || RmsNorm::with_config(h, norm_config, device);
        let layer = || -> Result<LlamaDecoderLayer> {
            let (heads, kv) = (cfg.num_attention_heads, cfg.num_key_value_heads);
            let (ab, mb) = (cfg.attention_bias, cfg.mlp_bias);
            Ok(LlamaDecoderLayer {
                self_attn: LlamaAttention {
                    q_proj: linear(h, heads * d, ab, device)?,
                    k_proj: linear(h, kv * d, ab, device)?,
                    v_proj: linear(h, kv * d, ab, device)?,
                    o_proj: linear(heads * d, h, ab, device)?,
                    num_heads: heads,
                    num_key_value_heads: kv,
                    head_dim: d,
                },
                mlp: LlamaMlp {
                    gate_proj: linear(h, cfg.intermediate_size, mb, device)?,
                    up_proj: linear(h, cfg.intermediate_size, mb, device)?,
                    down_proj: linear(cfg.intermediate_size, h, mb, device)?,
                    act_fn: SiLU::new(),
                },
                input_layernorm: norm()?,
                post_attention_layernorm: norm()?,
            })
        };
        Ok(Self {
            embed_tokens: Embedding::new(cfg.vocab_size, h, device)?,
            layers: (0..cfg.num_hidden_layers)
                .map(|_| layer().map(Arc::new))
                .collect::<Result<_>>()?,
            norm: norm()?,
            gradient_checkpointing: AtomicBool::new(false),
        })
    }
}

impl Forward<LayerInput> for LlamaAttention {
    type Output = Tensor;

    /// The new tokens' attention output `[batch, new, hidden]`; their keys and values are
    /// written into the cache buffers at `filled..filled + new`.
    fn forward(&self, input: LayerInput) -> Result<Tensor> {
        let (b, s, _) = input.hidden.dims3()?;
        let (heads, kv, d) = (self.num_heads, self.num_key_value_heads, self.head_dim);
        let total = input.filled + s;
        // Rotate in the projections' own layout `[batch, new, heads, head_dim]`, then move heads
        // before positions: where a gradient flows the rotation writes that layout itself (the
        // transpose is then a view, and no copy is kept in the graph).
        let rotated = |t: Tensor, n: usize| -> Result<Tensor> {
            let t = rotary_embedding(&t.reshape((b, s, n, d))?, &input.cos, &input.sin)?;
            Ok(t.transpose(1, 2)?.contiguous()?)
        };
        // The three projections of one input: one pass of the q8_0 kernel when quantized.
        let [q, k, v] =
            Linear::call_each([&self.q_proj, &self.k_proj, &self.v_proj], &input.hidden)?;
        let q = rotated(q, heads)?;
        let k = rotated(k, kv)?;
        let v = v.reshape((b, s, kv, d))?.transpose(1, 2)?;
        let (keys, values) = match (&input.keys, &input.values) {
            (Some(keys), Some(values)) => {
                keys.slice_set(&k, 2, input.filled)?;
                values.slice_set(&v.contiguous()?, 2, input.filled)?;
                (keys.narrow(2, 0, total)?, values.narrow(2, 0, total)?)
            }
            // Attention reads the values where they lie (its last dimension is contiguous).
            (None, None) => (k, v),
            _ => {
                return Err(invalid(
                    "a layer input with a key buffer but no value buffer, or the reverse"
                        .to_owned(),
                ))
            }
        };
        // Every query head against its key/value head (`enable_gqa`: no repeated keys), the
        // cache's filled part read in place.
        let options = SdpaOptions {
            scale: Some((d as f64).powf(-0.5)),
            enable_gqa: heads != kv,
            // No bias for several new tokens: they start an empty cache (see `LayerInput::mask`).
            is_causal: input.mask.is_none() && s > 1,
            ..SdpaOptions::default()
        };
        let context =
            scaled_dot_product_attention(&q, &keys, &values, input.mask.as_ref(), options)?
                .transpose(1, 2)?
                .reshape((b, s, heads * d))?;
        self.o_proj.call(&context)
    }
}

impl Forward<&Tensor> for LlamaMlp {
    type Output = Tensor;

    /// `[…, hidden]` → `[…, hidden]`.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let [gate, up] = Linear::call_each([&self.gate_proj, &self.up_proj], x)?;
        // `act_fn(gate) * up` without `act_fn(gate)` kept for the backward (when no hook needs
        // to see `act_fn`'s output).
        self.down_proj.call(&self.act_fn.call_mul(&gate, &up)?)
    }
}

impl Forward<LayerInput> for LlamaDecoderLayer {
    type Output = Tensor;

    /// The new tokens' hidden states after this layer.
    fn forward(&self, input: LayerInput) -> Result<Tensor> {
        let residual = input.hidden.clone();
        let normed = self.input_layernorm.call(&input.hidden)?;
        let attended = self.self_attn.call(LayerInput {
            hidden: normed,
            ..input
        })?;
        let h = (residual + attended)?;
        let inner = self.mlp.call(&self.post_attention_layernorm.call(&h)?)?;
        Ok((h + inner)?)
    }
}
