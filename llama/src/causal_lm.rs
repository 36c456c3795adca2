//! Hugging Face's `LlamaForCausalLM`: the decoder stack and its head, loading a checkpoint folder,
//! and the [`Recurrent`] convention with the [`KvCache`] as state: prefill is [`scan`] over the
//! prompt (one parallel pass), decoding is [`step`].
//!
//! [`scan`]: Recurrent::scan
//! [`step`]: Recurrent::step

use std::path::Path;
use std::sync::atomic::Ordering;

use module_runtime::nn::{Linear, QuantizeReport};
use module_runtime::prelude::*;

use crate::cache::KvCache;
use crate::config::{invalid, LlamaConfig};
use crate::model::{LayerInput, LlamaModel};

/// The cache capacity [`Recurrent::initial_state`] starts with (it grows when needed).
const INITIAL_CAPACITY: usize = 256;

/// A Llama-family causal language model: Hugging Face's `LlamaForCausalLM`.
///
/// Its parameters are the checkpoint's (`model.embed_tokens.weight`, `model.layers.N.…`,
/// `model.norm.weight`, `lm_head.weight`). With `tie_word_embeddings`, `lm_head.weight` *is*
/// `model.embed_tokens.weight` (one parameter under two paths), and a checkpoint without
/// `lm_head.weight` loads into it.
///
/// ```
/// use llama::{KvCache, LlamaForCausalLM};
/// use module_runtime::prelude::*;
/// let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-llama");
/// let model = LlamaForCausalLM::from_pretrained(&dir, &Device::Cpu)?;
/// let prompt = Tensor::new(&[[242u32, 175, 307]], &Device::Cpu)?;
/// let (logits, cache) = model.scan(&prompt, model.initial_state(1)?)?; // prefill
/// assert_eq!(logits.dims(), [1, 3, 384]);
/// let (next, cache) = model.step(&Tensor::new(&[5u32], &Device::Cpu)?, cache)?; // one token
/// assert_eq!((next.dims(), cache.len()), (&[1usize, 384][..], 4));
/// # Ok::<(), module_runtime::Error>(())
/// ```
#[derive(Module)]
#[module(paths)]
pub struct LlamaForCausalLM {
    /// The decoder stack.
    pub model: LlamaModel,
    /// `[vocab, hidden]`: the output projection (the embedding itself when tied).
    pub lm_head: Linear,
    /// The configuration the model was built from.
    #[module(skip)]
    pub config: LlamaConfig,
    /// RoPE's inverse frequencies, from the configuration (transformers' non-persistent
    /// `rotary_emb.inv_freq`; not a checkpoint entry).
    #[module(skip)]
    inv_freq: Vec<f32>,
}

/// One decoder layer without a cache through [`checkpoint`](module_runtime::checkpoint):
/// transformers' `self._gradient_checkpointing_func(decoder_layer.__call__, ...)`. The layer
/// inside the `Arc` is called, which hooks know by its path.
fn checkpointed_layer(
    layer: &std::sync::Arc<crate::model::LlamaDecoderLayer>,
    hidden: Tensor,
    cos: &Tensor,
    sin: &Tensor,
    mask: Option<&Tensor>,
) -> Result<Tensor> {
    let layer = layer.clone();
    let run = move |xs: &[Tensor]| {
        let input = LayerInput {
            hidden: xs[0].clone(),
            cos: xs[1].clone(),
            sin: xs[2].clone(),
            mask: xs.get(3).cloned(),
            keys: None,
            values: None,
            filled: 0,
        };
        Ok(vec![(*layer).call(input)?])
    };
    let mut inputs = vec![hidden, cos.clone(), sin.clone()];
    inputs.extend(mask.cloned());
    Ok(module_runtime::checkpoint(run, &inputs)?.remove(0))
}

impl LlamaForCausalLM {
    /// Checkpoints every decoder layer of the training forward (`call`) from now on
    /// (transformers' `model.gradient_checkpointing_enable()`): in training, with gradients on,
    /// each layer's activations are dropped after its forward and recomputed in the backward
    /// ([`checkpoint`](module_runtime::checkpoint)), for less memory at the cost of a second
    /// forward of the layers; the gradients are the same, bit for bit. Generation (`scan`,
    /// `step`, with a cache) is not affected.
    pub fn gradient_checkpointing_enable(&self) {
        self.model
            .gradient_checkpointing
            .store(true, Ordering::Relaxed);
    }

    /// Stops checkpointing the decoder layers (transformers' `gradient_checkpointing_disable()`).
    pub fn gradient_checkpointing_disable(&self) {
        self.model
            .gradient_checkpointing
            .store(false, Ordering::Relaxed);
    }

    /// A randomly initialized model (PyTorch's default initializations), in training mode.
    pub fn new(cfg: &LlamaConfig, device: &Device) -> Result<Self> {
        let model = LlamaModel::new(cfg, device)?;
        let lm_head = if cfg.tie_word_embeddings {
            Linear::from_params(model.embed_tokens.weight.clone(), None)
        } else {
            Linear::with_config(
                cfg.hidden_size,
                cfg.vocab_size,
                module_runtime::nn::LinearConfig {
                    bias: false,
                    ..Default::default()
                },
                device,
            )?
        };
        Ok(Self {
            model,
            lm_head,
            config: cfg.clone(),
            inv_freq: cfg.inv_freq(),
        })
    }

    /// Writes a model folder of a randomly initialized model (PyTorch's default initializations)
    /// of the `config.json` value `json`: `config.json` and `model.safetensors`, as transformers'
    /// `LlamaForCausalLM(LlamaConfig(**json)).save_pretrained(dir)` does. What benchmarks and
    /// examples use for a model of a given shape; [`from_pretrained`](Self::from_pretrained)
    /// reads it back.
    ///
    /// ```
    /// use llama::LlamaForCausalLM;
    /// use module_runtime::prelude::*;
    ///
    /// let json = serde_json::json!({
    ///     "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
    ///     "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64,
    ///     "rms_norm_eps": 1e-5, "tie_word_embeddings": true,
    /// });
    /// let dir = std::env::temp_dir().join(format!("llama-random-doc-{}", std::process::id()));
    /// LlamaForCausalLM::save_random_pretrained(&dir, &json)?;
    /// let model = LlamaForCausalLM::from_pretrained(&dir, &Device::Cpu)?;
    /// assert_eq!(model.config.num_hidden_layers, 2);
    /// # std::fs::remove_dir_all(&dir).ok();
    /// # Ok::<(), module_runtime::Error>(())
    /// ```
    pub fn save_random_pretrained(dir: &Path, json: &serde_json::Value) -> Result<()> {
        let cfg = LlamaConfig::from_json(json).map_err(invalid)?;
        let model = Self::new(&cfg, &Device::Cpu)?;
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| Error::Io { path, source }
        };
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        let config = dir.join("config.json");
        let text = serde_json::to_string_pretty(json).map_err(|e| invalid(e.to_string()))?;
        std::fs::write(&config, text).map_err(io(&config))?;
        model.save_safetensors(dir.join("model.safetensors"))
    }

    /// Loads a Hugging Face model folder (`config.json` and `model.safetensors`, or the shards of
    /// `model.safetensors.index.json`) strictly by name, in evaluation mode. No random values
    /// are drawn: the model is built empty, then loaded.
    pub fn from_pretrained(dir: &Path, device: &Device) -> Result<Self> {
        let cfg = LlamaConfig::from_json_file(&dir.join("config.json"))?;
        let model = module_runtime::build_empty(|| Self::new(&cfg, device))?;
        model.load_state_dict(dir, &Self::load_options(&cfg))?;
        model.eval();
        Ok(model)
    }

    /// Loads a Hugging Face model folder as [`from_pretrained`](Self::from_pretrained) does, with
    /// the `Linear` layers whose path matches `pattern` (`**` for every one) quantized to `kind`
    /// (`q8_0`, `q4_0`, `q4_K`, …) **on the way in**: the empty model's weights are marked
    /// ([`quantize`] before the load) and each is quantized as the load reads it, so the float32
    /// model is never in memory — transformers' `from_pretrained(dir, quantization_config=...)`,
    /// and what QLoRA loads its base with. The model equals `from_pretrained` followed by
    /// `quantize(&model, pattern, kind)` bit for bit, and the [`QuantizeReport`] is the one that
    /// call gives (layers whose rows the kind's blocks do not fit stay in float, listed in
    /// `kept_float`).
    ///
    /// Errors: those of [`quantize`] (a pattern matching no `Linear`, a kind no layer's rows fit)
    /// before anything is read, and those of the load (all or nothing: the model is not
    /// returned).
    ///
    /// ```
    /// use llama::LlamaForCausalLM;
    /// use module_runtime::prelude::*;
    /// let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-llama");
    /// let (model, report) =
    ///     LlamaForCausalLM::from_pretrained_quantized(&dir, &Device::Cpu, "**", GgmlDType::Q4_0)?;
    /// let q_proj = &model.model.layers[0].self_attn.q_proj.weight;
    /// assert!(q_proj.is_quantized());
    /// assert_eq!(report.quantized.len(), 13); // 6 projections of each layer's 7, and the head
    /// # Ok::<(), module_runtime::Error>(())
    /// ```
    pub fn from_pretrained_quantized(
        dir: &Path,
        device: &Device,
        pattern: &str,
        kind: GgmlDType,
    ) -> Result<(Self, QuantizeReport)> {
        let cfg = LlamaConfig::from_json_file(&dir.join("config.json"))?;
        let model = module_runtime::build_empty(|| Self::new(&cfg, device))?;
        let report = module_runtime::nn::quantize(&model, pattern, kind)?;
        model.load_state_dict(dir, &Self::load_options(&cfg))?;
        model.eval();
        Ok((model, report))
    }

    /// The options a checkpoint of `cfg` loads with ([`from_pretrained`](Self::from_pretrained),
    /// [`from_gguf`](Self::from_gguf), or a model built by hand): strict, and with
    /// `tie_word_embeddings` the head is the embedding, which the checkpoint names once, under
    /// the embedding's path (transformers' `_tied_weights_keys`, llama.cpp's `token_embd`); a
    /// checkpoint that saved both loads as well.
    pub fn load_options(cfg: &LlamaConfig) -> LoadOptions {
        let options = LoadOptions::default();
        if !cfg.tie_word_embeddings {
            return options;
        }
        options.post_hook(|_, keys| {
            keys.missing_keys.retain(|k| k != "lm_head.weight");
            Ok(())
        })
    }

    /// The last hidden states `[batch, new, hidden]` of `ids` `[batch, new]` after the tokens in
    /// `cache`, and the cache with them. Runs without gradients (`no_grad`): the cache is written
    /// in place.
    pub fn forward_hidden(&self, ids: &Tensor, mut cache: KvCache) -> Result<(Tensor, KvCache)> {
        let (b, s) = ids.dims2()?;
        if b != cache.batch() || cache.layers.len() != self.model.layers.len() {
            return Err(invalid(format!(
                "input ids {:?} against a cache of {} rows and {} layers (model: {} layers)",
                ids.dims(),
                cache.batch(),
                cache.layers.len(),
                self.model.layers.len()
            )));
        }
        if s == 0 {
            return Err(invalid("input ids have no tokens".to_owned()));
        }
        // The cache is written in place, which no gradient can flow through: inference only, so the
        // runtime's fused kernels run.
        let _no_grad = module_runtime::no_grad();
        cache.reserve(s)?;
        let filled = cache.len();
        let device = ids.device();
        let (cos, sin) = self.rotary_tables(cache.padding(), filled, s, device)?;
        let mask = attention_bias(cache.padding(), filled, s, device)?;
        let buffers = cache
            .layers
            .iter()
            .map(|(k, v)| (Some(k.clone()), Some(v.clone())));
        let h = self.decoder(ids, (cos, sin), mask, buffers, filled)?;
        cache.advance(s);
        Ok((h, cache))
    }

    /// The decoder stack on `ids` with the given rotary tables, attention bias and each layer's
    /// cache buffers (`None`: no cache), after the final norm.
    fn decoder(
        &self,
        ids: &Tensor,
        (cos, sin): (Tensor, Tensor),
        mask: Option<Tensor>,
        buffers: impl Iterator<Item = (Option<Tensor>, Option<Tensor>)>,
        filled: usize,
    ) -> Result<Tensor> {
        let mut h = self.model.embed_tokens.call(ids)?;
        let checkpointed = self.model.gradient_checkpointing.load(Ordering::Relaxed)
            && module_runtime::is_grad_enabled()
            && self.is_training();
        for (layer, (keys, values)) in self.model.layers.iter().zip(buffers) {
            if checkpointed && keys.is_none() && values.is_none() {
                h = checkpointed_layer(layer, h, &cos, &sin, mask.as_ref())?;
                continue;
            }
            h = layer.call(LayerInput {
                hidden: h,
                cos: cos.clone(),
                sin: sin.clone(),
                mask: mask.clone(),
                keys,
                values,
                filled,
            })?;
        }
        self.model.norm.call(&h)
    }

    /// Logits `[batch, vocab]` of the last token of each row, and the cache: a prompt's prefill
    /// for generation (the head runs on one position per row, not all of them).
    pub fn prefill(&self, ids: &Tensor, cache: KvCache) -> Result<(Tensor, KvCache)> {
        let (h, cache) = self.forward_hidden(ids, cache)?;
        let last = h.narrow(1, h.dim(1)? - 1, 1)?.squeeze(1)?;
        Ok((self.lm_head.call(&last)?, cache))
    }

    /// [`scan`](Recurrent::scan) of a left-padded batch: `attention_mask` `[batch, new]` is 1 for
    /// tokens and 0 for padding, and every row's zeros come first (transformers' left padding).
    /// Positions count each row's tokens only, so each row computes what it would alone. Only on
    /// an empty cache (the prompt); returns logits `[batch, new, vocab]`.
    pub fn scan_masked(
        &self,
        ids: &Tensor,
        attention_mask: &Tensor,
        mut cache: KvCache,
    ) -> Result<(Tensor, KvCache)> {
        cache.set_padding(left_padding(ids, attention_mask)?)?;
        self.scan(ids, cache)
    }

    /// A fresh cache for `batch` rows with room for `capacity` tokens before it grows.
    pub fn cache_with_capacity(&self, batch: usize, capacity: usize) -> Result<KvCache> {
        // The embedding's dtype and device (read without its values: a quantized table has no
        // float copy to read).
        let embed = &self.model.embed_tokens.weight;
        let mut cache = KvCache::new(
            self.model.layers.len(),
            batch,
            // This rank's key/value heads under tensor parallelism (`tensor_parallel`).
            (self.model.layers.first()).map_or(self.config.num_key_value_heads, |l| {
                l.self_attn.num_key_value_heads
            }),
            self.config.head_dim,
            capacity,
            embed.dtype(),
            &embed.device(),
        )?;
        // Layers placed on other devices (`dispatch_model`): each layer's buffers where it
        // computes, so that it writes them in place (a moved copy would lose its writes).
        for ((keys, values), layer) in cache.layers.iter_mut().zip(&self.model.layers) {
            let device = layer.self_attn.k_proj.weight.device();
            if !keys.device().same_device(&device) {
                *keys = keys.to_device(&device)?;
                *values = values.to_device(&device)?;
            }
        }
        Ok(cache)
    }

    /// `cos` and `sin` of the new tokens' angles (`position * inv_freq`, in float32 as
    /// transformers computes them): `[new, head_dim / 2]` when every row is at the same position,
    /// else `[batch, new, head_dim / 2]`.
    fn rotary_tables(
        &self,
        padding: &[usize],
        filled: usize,
        new: usize,
        device: &Device,
    ) -> Result<(Tensor, Tensor)> {
        // One table for all rows when they all start at the same slot.
        let rows = if padding.iter().all(|p| *p == padding[0]) {
            &padding[..1]
        } else {
            padding
        };
        let half = self.inv_freq.len();
        let (mut cos, mut sin) = (Vec::new(), Vec::new());
        for pad in rows {
            for t in 0..new {
                // Padding slots (before the row's first token) get position 0; they are masked.
                let pos = (filled + t).saturating_sub(*pad) as f32;
                for f in &self.inv_freq {
                    let angle = pos * f;
                    cos.push(angle.cos());
                    sin.push(angle.sin());
                }
            }
        }
        let dtype = self.model.embed_tokens.weight.dtype();
        let table = |v: Vec<f32>| -> Result<Tensor> {
            let t = Tensor::from_vec(v, (rows.len(), new, half), device)?.to_dtype(dtype)?;
            Ok(if rows.len() == 1 { t.squeeze(0)? } else { t })
        };
        Ok((table(cos)?, table(sin)?))
    }
}

/// Each row's number of leading zeros in a `[batch, new]` 0/1 mask; an error if a row has a zero
/// after a one (right padding) or the shapes differ.
fn left_padding(ids: &Tensor, attention_mask: &Tensor) -> Result<Vec<usize>> {
    if attention_mask.dims() != ids.dims() {
        return Err(invalid(format!(
            "attention_mask has shape {:?}, input ids {:?}: they must match",
            attention_mask.dims(),
            ids.dims()
        )));
    }
    let rows = attention_mask.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    rows.iter()
        .enumerate()
        .map(|(i, row)| {
            let pad = row.iter().take_while(|m| **m == 0.0).count();
            if row[pad..].contains(&0.0) || pad == row.len() {
                return Err(invalid(format!(
                    "attention_mask row {i} is not left padding (zeros, then at least one 1)"
                )));
            }
            Ok(pad)
        })
        .collect()
}

/// The additive attention bias for `new` tokens after `filled` slots: key `j` is visible to the
/// new token `t` of row `i` when `padding[i] <= j <= filled + t`; hidden keys get the lowest float
/// (not -inf, as transformers: a padding row stays finite). `None` when everything is visible.
fn attention_bias(
    padding: &[usize],
    filled: usize,
    new: usize,
    device: &Device,
) -> Result<Option<Tensor>> {
    let padded = padding.iter().any(|p| *p > 0);
    // One new token sees every slot; new tokens after an empty cache are plain causal attention,
    // which the attention applies itself (skipping the masked half of the scores).
    if !padded && (new == 1 || filled == 0) {
        return Ok(None);
    }
    let total = filled + new;
    let rows: &[usize] = if padded { padding } else { &[0] };
    let mut bias = Vec::with_capacity(rows.len() * new * total);
    for pad in rows {
        for t in 0..new {
            bias.extend((0..total).map(|j| {
                if j >= *pad && j <= filled + t {
                    0.0
                } else {
                    f32::MIN
                }
            }));
        }
    }
    Ok(Some(Tensor::from_vec(
        bias,
        (rows.len(), 1, new, total),
        device,
    )?))
}

impl Forward<&Tensor> for LlamaForCausalLM {
    type Output = Tensor;

    /// transformers' `model(input_ids).logits` without a cache: logits `[batch, seq, vocab]` of
    /// every position of `ids` `[batch, seq]` (causal attention among them, positions from 0).
    /// The training forward: gradients flow to every parameter that requires them (LoRA
    /// adapters over a float or quantized base, see [`finetune`](crate::finetune)), where
    /// [`scan`](Recurrent::scan) runs without gradients into a cache. The same logits as `scan`
    /// on an empty cache.
    ///
    /// ```
    /// use llama::LlamaForCausalLM;
    /// use module_runtime::prelude::*;
    /// let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-llama");
    /// let model = LlamaForCausalLM::from_pretrained(&dir, &Device::Cpu)?;
    /// let ids = Tensor::new(&[[242u32, 175, 307]], &Device::Cpu)?;
    /// let logits = model.call(&ids)?;
    /// let (scanned, _) = model.scan(&ids, model.initial_state(1)?)?;
    /// let diff = (logits - scanned)?.abs()?.max_all()?.to_scalar::<f32>()?;
    /// assert!(diff < 1e-5);
    /// # Ok::<(), module_runtime::Error>(())
    /// ```
    fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        self.lm_head.call(&self.hidden_states(ids)?)
    }
}

impl LlamaForCausalLM {
    /// The final hidden states `[batch, seq, hidden_size]` (after the last norm), the head's
    /// input: transformers' `model.model(ids).last_hidden_state`. Training with a language
    /// model's loss reads them with the head, as transformers' `model(ids, labels=labels)`
    /// does, through [`linear_cross_entropy`](module_runtime::nn::loss::linear_cross_entropy),
    /// which never makes the `[positions, vocab_size]` logits whole:
    ///
    /// ```
    /// use module_runtime::prelude::*;
    /// use module_runtime::nn::loss::linear_cross_entropy;
    /// use llama::LlamaForCausalLM;
    /// let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-llama");
    /// let model = LlamaForCausalLM::from_pretrained(&dir, &Device::Cpu)?;
    /// let ids = Tensor::new(&[[242u32, 175, 307, 12]], &Device::Cpu)?;
    /// let (inputs, labels) = (ids.narrow(1, 0, 3)?, ids.narrow(1, 1, 3)?); // next tokens
    /// let loss = linear_cross_entropy(&model.hidden_states(&inputs)?, &model.lm_head, &labels, -100)?;
    /// let _grads = loss.backward()?; // the logits were never whole
    /// // The same as the logits' cross-entropy:
    /// let logits = model.call(&inputs)?.reshape((3, ()))?;
    /// let composed = module_runtime::nn::loss::cross_entropy(&logits, &labels.flatten_all()?)?;
    /// assert!((&loss - &composed)?.abs()?.to_scalar::<f32>()? < 1e-5);
    /// # Ok::<(), module_runtime::Error>(())
    /// ```
    pub fn hidden_states(&self, ids: &Tensor) -> Result<Tensor> {
        let (b, s) = ids.dims2()?;
        if s == 0 {
            return Err(invalid("input ids have no tokens".to_owned()));
        }
        let tables = self.rotary_tables(&vec![0; b], 0, s, ids.device())?;
        let buffers = std::iter::repeat_with(|| (None, None));
        self.decoder(ids, tables, None, buffers, 0)
    }
}

impl Recurrent for LlamaForCausalLM {
    type State = KvCache;

    /// An empty cache for `batch` rows (it grows as tokens come).
    fn initial_state(&self, batch: usize) -> Result<KvCache> {
        self.cache_with_capacity(batch, INITIAL_CAPACITY)
    }

    /// One token per row (`[batch]` ids) → its logits `[batch, vocab]` and the cache with it.
    fn step(&self, input: &Tensor, state: KvCache) -> Result<(Tensor, KvCache)> {
        let ids = input.unsqueeze(1)?;
        self.prefill(&ids, state)
    }

    /// A whole chunk `[batch, new]` of ids in one parallel pass (causal attention within it) →
    /// logits `[batch, new, vocab]` and the cache with it.
    fn scan(&self, inputs: &Tensor, state: KvCache) -> Result<(Tensor, KvCache)> {
        let (h, cache) = self.forward_hidden(inputs, state)?;
        Ok((self.lm_head.call(&h)?, cache))
    }
}
