//! llama.cpp's GGUF files: the configuration from the `llama.*` metadata, llama.cpp's tensor
//! names mapped to Hugging Face's ([`llama_names`]), and the row order of `attn_q`/`attn_k`
//! put back, so [`LlamaForCausalLM::from_gguf`] loads a (quantized) GGUF Llama into the same
//! modules a transformers checkpoint loads into.

use std::path::Path;
use std::sync::Arc;

use module_runtime::candle_core::quantized::{GgmlDType, QTensor};
use module_runtime::prelude::*;
use module_runtime::{permute_rows, GgufFile, KeyRule};

use crate::config::LlamaConfig;
use crate::LlamaForCausalLM;

/// llama.cpp's names of a Llama's tensors (`blk.N.attn_q.weight`) as Hugging Face's
/// (`model.layers.N.self_attn.q_proj.weight`): the key rules [`LlamaForCausalLM::from_gguf`]
/// loads with (`LoadOptions::rule`). Biases (`attention_bias`, `mlp_bias`) are mapped as well.
///
/// ```
/// use module_runtime::LoadOptions;
/// let options = llama::llama_names().into_iter().fold(LoadOptions::default(), LoadOptions::rule);
/// assert_eq!(options.map_key("blk.3.ffn_down.weight"), "model.layers.3.mlp.down_proj.weight");
/// ```
pub fn llama_names() -> Vec<KeyRule> {
    let rule = |from: &str, to: &str| KeyRule::RenameKey(from.to_owned(), to.to_owned());
    let mut rules = vec![
        rule("token_embd.weight", "model.embed_tokens.weight"),
        rule("output_norm.weight", "model.norm.weight"),
        rule("output.weight", "lm_head.weight"),
        rule(
            "blk.*.attn_norm.weight",
            "model.layers.*.input_layernorm.weight",
        ),
        rule(
            "blk.*.ffn_norm.weight",
            "model.layers.*.post_attention_layernorm.weight",
        ),
    ];
    let linears = [
        ("attn_q", "self_attn.q_proj"),
        ("attn_k", "self_attn.k_proj"),
        ("attn_v", "self_attn.v_proj"),
        ("attn_output", "self_attn.o_proj"),
        ("ffn_gate", "mlp.gate_proj"),
        ("ffn_up", "mlp.up_proj"),
        ("ffn_down", "mlp.down_proj"),
    ];
    for (gguf, hf) in linears {
        for what in ["weight", "bias"] {
            rules.push(rule(
                &format!("blk.*.{gguf}.{what}"),
                &format!("model.layers.*.{hf}.{what}"),
            ));
        }
    }
    rules
}

/// The configuration a GGUF Llama's metadata gives (`llama.embedding_length`,
/// `llama.block_count`, `llama.attention.head_count(_kv)`, `llama.feed_forward_length`,
/// `llama.attention.layer_norm_rms_epsilon`, `llama.rope.freq_base`, `llama.context_length`,
/// `llama.attention.key_length`, `llama.vocab_size` or the embedding's rows); the head is tied
/// when the file has no `output.weight`. RoPE scaling other than `linear`, and a `rope_freqs`
/// tensor (llama3 frequencies), are refused rather than ignored. Metadata that contradicts the
/// tensors (a block count other than the file's blocks, head counts or widths that do not give
/// the tensors' shapes) is [`QuantizeError::Gguf`](module_runtime::QuantizeError::Gguf) naming
/// the tensor and the keys, before any model is built.
pub fn config_from_gguf(file: &GgufFile) -> Result<LlamaConfig> {
    let arch = file.get("general.architecture")?;
    if arch.to_string().ok().map(String::as_str) != Some("llama") {
        return Err(file.error(format!(
            "general.architecture is {arch:?}; only \"llama\" is supported"
        )));
    }
    if file.tensors.contains_key("rope_freqs.weight") {
        return Err(
            file.error("a `rope_freqs.weight` tensor (llama3 RoPE) is not supported".into())
        );
    }
    let opt = |key: &str| file.metadata.contains_key(key);
    let heads = file.get_usize("llama.attention.head_count")?;
    let mut json = serde_json::json!({
        "hidden_size": file.get_usize("llama.embedding_length")?,
        "intermediate_size": file.get_usize("llama.feed_forward_length")?,
        "num_hidden_layers": file.get_usize("llama.block_count")?,
        "num_attention_heads": heads,
        "num_key_value_heads": if opt("llama.attention.head_count_kv") {
            file.get_usize("llama.attention.head_count_kv")?
        } else {
            heads
        },
        "rms_norm_eps": file.get_f64("llama.attention.layer_norm_rms_epsilon")?,
        "tie_word_embeddings": !file.tensors.contains_key("output.weight"),
        "attention_bias": file.tensors.contains_key("blk.0.attn_q.bias"),
        "mlp_bias": file.tensors.contains_key("blk.0.ffn_up.bias"),
    });
    let vocab = if opt("llama.vocab_size") {
        file.get_usize("llama.vocab_size")?
    } else {
        match file.tensors.get("token_embd.weight") {
            Some(t) => t.shape().dims()[0],
            None => {
                return Err(file.error("no `token_embd.weight` and no `llama.vocab_size`".into()))
            }
        }
    };
    json["vocab_size"] = vocab.into();
    if opt("llama.attention.key_length") {
        json["head_dim"] = file.get_usize("llama.attention.key_length")?.into();
    }
    if opt("llama.rope.freq_base") {
        json["rope_theta"] = file.get_f64("llama.rope.freq_base")?.into();
    }
    if opt("llama.context_length") {
        json["max_position_embeddings"] = file.get_usize("llama.context_length")?.into();
    }
    if opt("tokenizer.ggml.eos_token_id") {
        json["eos_token_id"] = file.get_usize("tokenizer.ggml.eos_token_id")?.into();
    }
    if opt("llama.rope.scaling.type") {
        match file
            .get("llama.rope.scaling.type")?
            .to_string()
            .map(String::as_str)
        {
            Ok("none") => {}
            Ok("linear") => {
                json["rope_scaling"] = serde_json::json!({
                    "rope_type": "linear",
                    "factor": file.get_f64("llama.rope.scaling.factor")?,
                });
            }
            other => {
                return Err(file.error(format!(
                    "llama.rope.scaling.type {other:?} is not supported (none, linear are)"
                )))
            }
        }
    }
    let cfg = LlamaConfig::from_json(&json).map_err(|e| file.error(e))?;
    check_tensors(file, &cfg)?;
    Ok(cfg)
}

/// Checks the metadata against the tensors before anything is built from it: the blocks are
/// `blk.0` to `blk.{block_count - 1}` (no more, no fewer, so a crafted count builds no huge
/// model), the head counts and dimensions give every tensor's shape, and the heads split
/// `attn_q`/`attn_k` into whole, even rows (which [`unpermute_heads`] divides by).
fn check_tensors(file: &GgufFile, cfg: &LlamaConfig) -> Result<()> {
    let (hidden, d, ffn) = (cfg.hidden_size, cfg.head_dim, cfg.intermediate_size);
    if d == 0 {
        return Err(file.error(format!(
            "a head width of 0 (llama.embedding_length {hidden} over \
             llama.attention.head_count {}, or llama.attention.key_length)",
            cfg.num_attention_heads
        )));
    }
    let (Some(q), Some(kv)) = (
        cfg.num_attention_heads.checked_mul(d),
        cfg.num_key_value_heads.checked_mul(d),
    ) else {
        return Err(file.error(format!(
            "llama.attention.head_count {} of width {d} overflows",
            cfg.num_attention_heads
        )));
    };
    let mut blocks = std::collections::BTreeSet::new();
    for (name, t) in &file.tensors {
        let (block, what) = match name.strip_prefix("blk.") {
            Some(rest) => {
                let Some((n, what)) = rest.split_once('.') else {
                    continue;
                };
                let Ok(n) = n.parse::<usize>() else { continue };
                if n >= cfg.num_hidden_layers {
                    return Err(file.error(format!(
                        "tensor `{name}` is beyond llama.block_count {}",
                        cfg.num_hidden_layers
                    )));
                }
                blocks.insert(n);
                (true, what)
            }
            None => (false, name.as_str()),
        };
        let expected: &[usize] = match (block, what) {
            (false, "token_embd.weight" | "output.weight") => &[cfg.vocab_size, hidden],
            (false, "output_norm.weight") | (true, "attn_norm.weight" | "ffn_norm.weight") => {
                &[hidden]
            }
            (true, "attn_q.weight") => &[q, hidden],
            (true, "attn_k.weight" | "attn_v.weight") => &[kv, hidden],
            (true, "attn_output.weight") => &[hidden, q],
            (true, "ffn_gate.weight" | "ffn_up.weight") => &[ffn, hidden],
            (true, "ffn_down.weight") => &[hidden, ffn],
            (true, "attn_q.bias") => &[q],
            (true, "attn_k.bias" | "attn_v.bias") => &[kv],
            (true, "attn_output.bias" | "ffn_down.bias") => &[hidden],
            (true, "ffn_gate.bias" | "ffn_up.bias") => &[ffn],
            // Anything else is the load's to report (an unexpected key).
            _ => continue,
        };
        if t.shape().dims() != expected {
            return Err(file.error(format!(
                "tensor `{name}` has shape {:?}, but the metadata (llama.embedding_length \
                 {hidden}, llama.feed_forward_length {ffn}, llama.attention.head_count {} and \
                 head_count_kv {} of width {d}, vocabulary {}) gives {expected:?}",
                t.shape().dims(),
                cfg.num_attention_heads,
                cfg.num_key_value_heads,
                cfg.vocab_size,
            )));
        }
    }
    if blocks.len() != cfg.num_hidden_layers {
        return Err(file.error(format!(
            "llama.block_count is {}, but the file holds tensors of {} blocks",
            cfg.num_hidden_layers,
            blocks.len()
        )));
    }
    Ok(())
}

/// The rows of a GGUF `attn_q`/`attn_k` tensor (weight `[heads * head_dim, in]` or bias) in
/// Hugging Face's order. llama.cpp's converter interleaves each head's two RoPE halves
/// (`w.reshape(heads, 2, head_dim / 2, in).swapaxes(1, 2)`), so Hugging Face's row
/// `h·d + j·d/2 + i` is the file's row `h·d + 2i + j`. Rows move whole, quantized or not (blocks
/// run along a row), so nothing is requantized.
pub fn unpermute_heads(t: &QTensor, heads: usize) -> Result<QTensor> {
    reorder_heads(t, heads, false)
}

/// The converse of [`unpermute_heads`]: Hugging Face's rows in llama.cpp's order, as the
/// converter (and [`save_gguf`](crate::save_gguf)) writes them.
pub(crate) fn permute_heads(t: &QTensor, heads: usize) -> Result<QTensor> {
    reorder_heads(t, heads, true)
}

/// The rows of `t` moved between Hugging Face's order and llama.cpp's (`to_gguf`), each head's
/// `d` rows split in two RoPE halves: Hugging Face's row `h·d + j·d/2 + i` is llama.cpp's
/// `h·d + 2i + j`.
fn reorder_heads(t: &QTensor, heads: usize, to_gguf: bool) -> Result<QTensor> {
    let rows = t.shape().dims()[0];
    if heads == 0 || !rows.is_multiple_of(heads) || !(rows / heads).is_multiple_of(2) {
        return Err(module_runtime::Error::InvalidConfig {
            layer: if to_gguf {
                "permute_heads"
            } else {
                "unpermute_heads"
            },
            message: format!("{rows} rows are not {heads} heads of an even width"),
        });
    }
    let d = rows / heads;
    let half = d / 2;
    let order: Vec<usize> = (0..rows)
        .map(|r| {
            let (h, k) = (r / d, r % d);
            match to_gguf {
                // Row r of the file is Hugging Face's `h·d + (k % 2)·half + k / 2`.
                true => h * d + (k % 2) * half + k / 2,
                false => h * d + 2 * (k % half) + k / half,
            }
        })
        .collect();
    if t.rank() == 2 {
        return permute_rows(t, &order);
    }
    // A bias: a float vector, reordered as a tensor.
    let device = t.device();
    let v = t.dequantize(&device)?;
    let idx = Tensor::new(order.iter().map(|&r| r as u32).collect::<Vec<_>>(), &device)?;
    Ok(QTensor::quantize(
        &v.index_select(&idx, 0)?,
        GgmlDType::F32,
    )?)
}

impl LlamaForCausalLM {
    /// Loads a llama.cpp GGUF file (`f32`, `f16`, `q8_0`, `q4_0`, `q4_k`, … tensors) strictly, in
    /// evaluation mode: the configuration from its metadata ([`config_from_gguf`]), the tensors
    /// renamed by [`llama_names`], `attn_q`/`attn_k` put back in Hugging Face's row order
    /// ([`unpermute_heads`]). Quantized tensors become quantized parameters (`Linear` layers
    /// multiply with them; an embedding reads its table dequantized, as llama.cpp does); float
    /// ones load as float32 values. A missing or unexpected tensor is an
    /// [`Error::Load`] naming it, and nothing is loaded.
    ///
    /// ```
    /// use llama::LlamaForCausalLM;
    /// use module_runtime::prelude::*;
    /// let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    /// let model = LlamaForCausalLM::from_gguf(&dir.join("tiny-llama-q8_0.gguf"), &Device::Cpu)?;
    /// assert_eq!(model.model.layers[0].self_attn.q_proj.weight.quantized_dtype(), Some(GgmlDType::Q8_0));
    /// let (logits, _) = model.scan(&Tensor::new(&[[242u32, 175]], &Device::Cpu)?, model.initial_state(1)?)?;
    /// assert_eq!(logits.dims(), [1, 2, 384]);
    /// # Ok::<(), module_runtime::Error>(())
    /// ```
    pub fn from_gguf(path: &Path, device: &Device) -> Result<Self> {
        let mut file = GgufFile::read(path, device)?;
        let cfg = config_from_gguf(&file)?;
        for (name, t) in file.tensors.iter_mut() {
            let heads = if name.contains(".attn_q.") {
                cfg.num_attention_heads
            } else if name.contains(".attn_k.") {
                cfg.num_key_value_heads
            } else {
                continue;
            };
            *t = Arc::new(unpermute_heads(t, heads)?);
        }
        let model = module_runtime::build_empty(|| Self::new(&cfg, device))?;
        let options = llama_names()
            .into_iter()
            .fold(Self::load_options(&cfg), LoadOptions::rule);
        model.load_state_dict(&file, &options)?;
        model.eval();
        Ok(model)
    }
}
