//! A Llama-family `config.json`: the hyperparameters [`LlamaForCausalLM`](crate::LlamaForCausalLM)
//! needs, read as transformers reads them (both the `rope_parameters` of transformers 5 and the
//! older `rope_theta` + `rope_scaling`).

use std::path::Path;

use module_runtime::Error;

/// How rotary position embeddings scale their frequencies: transformers' `rope_type`.
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    /// `"default"`: `inv_freq = 1 / theta^(2i / dim)`.
    Default,
    /// `"linear"`: every frequency divided by `factor` (position interpolation).
    Linear {
        /// The divisor.
        factor: f64,
    },
    /// `"llama3"` (Llama 3.1): low frequencies divided by `factor`, high ones kept, a smooth blend
    /// between.
    Llama3 {
        /// The divisor of the low frequencies.
        factor: f64,
        /// Wavelengths above `original_max_position_embeddings / low_freq_factor` are scaled.
        low_freq_factor: f64,
        /// Wavelengths below `original_max_position_embeddings / high_freq_factor` are kept.
        high_freq_factor: f64,
        /// The context length the model was pretrained with.
        original_max_position_embeddings: usize,
    },
}

/// The hyperparameters of a Llama-family decoder: the fields of a Hugging Face `config.json` it
/// needs, with transformers' defaults.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    /// Size of the vocabulary.
    pub vocab_size: usize,
    /// Width of the hidden states.
    pub hidden_size: usize,
    /// Width of the SwiGLU feed-forward layer.
    pub intermediate_size: usize,
    /// Number of decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads per layer.
    pub num_attention_heads: usize,
    /// Key/value heads per layer (grouped-query attention; 1 is multi-query attention).
    pub num_key_value_heads: usize,
    /// Width of one head (`hidden_size / num_attention_heads` unless the config says).
    pub head_dim: usize,
    /// The RMS norms' epsilon.
    pub rms_norm_eps: f64,
    /// RoPE's base wavelength.
    pub rope_theta: f64,
    /// RoPE's frequency scaling.
    pub rope_scaling: RopeScaling,
    /// The longest context the model was configured for (the default cache capacity).
    pub max_position_embeddings: usize,
    /// Whether `lm_head` is the token embedding (`tie_word_embeddings`).
    pub tie_word_embeddings: bool,
    /// Whether the attention projections have biases (`attention_bias`).
    pub attention_bias: bool,
    /// Whether the feed-forward projections have biases (`mlp_bias`).
    pub mlp_bias: bool,
    /// The end-of-sequence tokens (`eos_token_id`, a number or a list).
    pub eos_token_ids: Vec<u32>,
}

/// A configuration the model cannot be built from.
pub(crate) fn invalid(message: String) -> Error {
    candle_core::Error::Msg(message).into()
}

impl LlamaConfig {
    /// Reads a Hugging Face `config.json`. Only `hidden_act: "silu"` and the rope types
    /// `default`, `linear` and `llama3` are supported; anything else is an error naming the field.
    ///
    /// ```
    /// let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-llama");
    /// let cfg = llama::LlamaConfig::from_json_file(&dir.join("config.json"))?;
    /// assert_eq!((cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim), (4, 1, 16));
    /// assert!(cfg.tie_word_embeddings);
    /// # Ok::<(), module_runtime::Error>(())
    /// ```
    pub fn from_json_file(path: &Path) -> Result<Self, Error> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| invalid(format!("cannot read {}: {e}", path.display())))?;
        let json: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| invalid(format!("{} is not JSON: {e}", path.display())))?;
        Self::from_json(&json).map_err(|e| invalid(format!("{}: {e}", path.display())))
    }

    /// Reads the fields of a parsed `config.json`.
    pub fn from_json(json: &serde_json::Value) -> Result<Self, String> {
        let usize_of = |key: &str| -> Result<usize, String> {
            json[key]
                .as_u64()
                .map(|v| v as usize)
                .ok_or_else(|| format!("`{key}` is missing or not an integer"))
        };
        let hidden_act = json["hidden_act"].as_str().unwrap_or("silu");
        if hidden_act != "silu" {
            return Err(format!(
                "hidden_act {hidden_act:?}: only \"silu\" is supported"
            ));
        }
        let num_attention_heads = usize_of("num_attention_heads")?;
        let hidden_size = usize_of("hidden_size")?;
        if num_attention_heads == 0 {
            return Err("num_attention_heads is 0".to_owned());
        }
        let head_dim = match json["head_dim"].as_u64() {
            Some(d) => d as usize,
            None => hidden_size / num_attention_heads,
        };
        let num_key_value_heads = json["num_key_value_heads"]
            .as_u64()
            .map_or(num_attention_heads, |v| v as usize);
        if num_key_value_heads == 0 || num_attention_heads % num_key_value_heads != 0 {
            return Err(format!(
                "num_attention_heads {num_attention_heads} is not a multiple of \
                 num_key_value_heads {num_key_value_heads}"
            ));
        }
        if head_dim % 2 != 0 {
            return Err(format!("head_dim {head_dim} is odd: RoPE rotates pairs"));
        }
        let max_position_embeddings = json["max_position_embeddings"].as_u64().unwrap_or(2048);
        // transformers 5 keeps theta and scaling in `rope_parameters`; older configs have
        // `rope_theta` at the top and `rope_scaling` (`type` or `rope_type`) beside it.
        let params = match &json["rope_parameters"] {
            serde_json::Value::Object(_) => &json["rope_parameters"],
            _ => &json["rope_scaling"],
        };
        let rope_theta = params["rope_theta"]
            .as_f64()
            .or_else(|| json["rope_theta"].as_f64())
            .unwrap_or(10000.0);
        let rope_type = params["rope_type"]
            .as_str()
            .or_else(|| params["type"].as_str())
            .unwrap_or("default");
        let factor = || {
            params["factor"]
                .as_f64()
                .ok_or_else(|| format!("rope type {rope_type:?} needs a `factor`"))
        };
        let rope_scaling = match rope_type {
            "default" => RopeScaling::Default,
            "linear" => RopeScaling::Linear { factor: factor()? },
            "llama3" => RopeScaling::Llama3 {
                factor: factor()?,
                low_freq_factor: params["low_freq_factor"].as_f64().unwrap_or(1.0),
                high_freq_factor: params["high_freq_factor"].as_f64().unwrap_or(4.0),
                original_max_position_embeddings: params["original_max_position_embeddings"]
                    .as_u64()
                    .unwrap_or(max_position_embeddings)
                    as usize,
            },
            other => {
                return Err(format!(
                    "rope type {other:?} is not supported (default, linear, llama3 are)"
                ))
            }
        };
        let eos_token_ids = match &json["eos_token_id"] {
            serde_json::Value::Number(n) => n.as_u64().map(|v| v as u32).into_iter().collect(),
            serde_json::Value::Array(ids) => ids
                .iter()
                .filter_map(|v| v.as_u64().map(|v| v as u32))
                .collect(),
            _ => Vec::new(),
        };
        Ok(Self {
            vocab_size: usize_of("vocab_size")?,
            hidden_size,
            intermediate_size: usize_of("intermediate_size")?,
            num_hidden_layers: usize_of("num_hidden_layers")?,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rms_norm_eps: json["rms_norm_eps"].as_f64().unwrap_or(1e-6),
            rope_theta,
            rope_scaling,
            max_position_embeddings: max_position_embeddings as usize,
            tie_word_embeddings: json["tie_word_embeddings"].as_bool().unwrap_or(false),
            attention_bias: json["attention_bias"].as_bool().unwrap_or(false),
            mlp_bias: json["mlp_bias"].as_bool().unwrap_or(false),
            eos_token_ids,
        })
    }

    /// RoPE's inverse frequencies (`head_dim / 2` of them), computed in float32 as transformers'
    /// `ROPE_INIT_FUNCTIONS` do.
    pub fn inv_freq(&self) -> Vec<f32> {
        let dim = self.head_dim;
        let base = self.rope_theta as f32;
        let plain = (0..dim)
            .step_by(2)
            .map(|i| 1.0 / base.powf(i as f32 / dim as f32));
        match self.rope_scaling {
            RopeScaling::Default => plain.collect(),
            RopeScaling::Linear { factor } => plain.map(|f| f / factor as f32).collect(),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                let (factor, low, high) = (
                    factor as f32,
                    low_freq_factor as f32,
                    high_freq_factor as f32,
                );
                let old_len = original_max_position_embeddings as f32;
                let low_freq_wavelen = old_len / low;
                let high_freq_wavelen = old_len / high;
                plain
                    .map(|f| {
                        let wavelen = 2.0 * std::f32::consts::PI / f;
                        if wavelen > low_freq_wavelen {
                            f / factor
                        } else if wavelen < high_freq_wavelen {
                            f
                        } else {
                            let smooth = (old_len / wavelen - low) / (high - low);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    })
                    .collect()
            }
        }
    }
}
