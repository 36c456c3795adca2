//! A Hugging Face Llama folder written as llama.cpp's GGUF file: the tensors under llama.cpp's
//! names (the key rules of [`llama_names`](crate::llama_names) turned around), `attn_q`/`attn_k`
//! rows in llama.cpp's order, the matrices quantized, the `llama.*` configuration, and the
//! vocabulary from the folder's `tokenizer.json` — so that llama.cpp (`llama-cli`,
//! `llama-bench`) loads the file, and [`LlamaForCausalLM::from_gguf`](crate::LlamaForCausalLM)
//! reads it back.
//!
//! # The vocabulary
//!
//! | `tokenizer.json` | `tokenizer.ggml.model` | what is written |
//! |---|---|---|
//! | BPE with `byte_fallback` (Llama 2, Mistral, TinyLlama: SentencePiece's) | `"llama"` | tokens in id order, scores (`-id`: SentencePiece's BPE ranks tokens by id), types (byte `<0xNN>`, unknown, control for special added tokens, user-defined for other added ones) |
//! | byte-level BPE (GPT-2, Llama 3, SmolLM) | `"gpt2"` | tokens, types, the merges (`"a b"`), `tokenizer.ggml.pre = "default"` |
//! | none in the folder | `"none"` | no tokens: llama.cpp makes `llama.vocab_size` placeholders (enough for `llama-bench`, which draws random ids; text cannot be tokenized) |
//!
//! Ids missing from the tokenizer up to the model's `vocab_size` (padded embeddings) are written
//! as unused `[PAD{id}]` tokens, as llama.cpp's converter does; a tokenizer with more ids than the
//! model has rows, or of another kind (WordPiece, Unigram), is an error. `bos_token_id` and
//! `eos_token_id` come from `config.json`, `add_bos_token` from `tokenizer_config.json` (else on
//! for SentencePiece vocabularies only). llama.cpp's converter also names the byte-level
//! pre-tokenizer (`smollm`, `llama-bpe`, …) by hashing its output on a test text; this writer
//! says `default`, which llama.cpp loads with a warning and splits text with GPT-2's rule.

use std::collections::HashSet;
use std::path::Path;

use module_runtime::candle_core::quantized::gguf_file::{self, Value};
use module_runtime::candle_core::quantized::{GgmlDType, QTensor};
use module_runtime::prelude::*;
use module_runtime::KeyRule;
use serde_json::Value as Json;

use crate::config::{invalid, LlamaConfig};
use crate::gguf::permute_heads;

/// llama.cpp's token types (`llama_token_type`).
const NORMAL: i32 = 1;
const UNKNOWN: i32 = 2;
const CONTROL: i32 = 3;
const USER_DEFINED: i32 = 4;
const UNUSED: i32 = 5;
const BYTE: i32 = 6;

/// Writes the Llama in `dir` (`config.json`, `model.safetensors`, and `tokenizer.json` when
/// present) to `path` as llama.cpp's GGUF: matrices in `kind` (`Q8_0`, `Q4_0`, `Q4K`, `F16`,
/// `F32`, …; a matrix whose rows the kind's blocks do not divide in float32), norms in float32, the
/// vocabulary as the module's documentation says. Written beside
/// and renamed into place: a failed or interrupted write leaves no partial file at `path`.
///
/// ```no_run
/// use module_runtime::candle_core::quantized::GgmlDType;
/// # fn main() -> module_runtime::Result<()> {
/// llama::save_gguf("SmolLM-135M".as_ref(), "smollm-q8_0.gguf".as_ref(), GgmlDType::Q8_0)?;
/// # Ok(()) }
/// ```
pub fn save_gguf(dir: &Path, path: &Path, kind: GgmlDType) -> Result<()> {
    let cfg = LlamaConfig::from_json_file(&dir.join("config.json"))?;
    let weights = candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu)?;
    let to_gguf = crate::llama_names()
        .into_iter()
        .map(|rule| match rule {
            KeyRule::RenameKey(gguf, hf) => KeyRule::RenameKey(hf, gguf),
            other => other,
        })
        .fold(LoadOptions::default(), LoadOptions::rule);
    let mut names: Vec<&String> = weights.keys().collect();
    names.sort();
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    for name in names {
        let t = &weights[name];
        if name == "lm_head.weight" && cfg.tie_word_embeddings {
            continue; // tied: the head is the embedding, as the converter writes it
        }
        let gguf = to_gguf.map_key(name);
        if gguf == *name {
            return Err(invalid(format!(
                "{}: tensor `{name}` is not one of a Llama's",
                dir.display()
            )));
        }
        // Norms in float32; a matrix whose rows the kind's blocks do not divide stays float32 too
        // (llama.cpp's converter falls back the same way; `quantize` keeps such layers float).
        let row = t.dims().last().copied().unwrap_or(0);
        let tensor_kind = match t.rank() {
            1 => GgmlDType::F32,
            _ if row % kind.block_size() != 0 => GgmlDType::F32,
            _ => kind,
        };
        let q = QTensor::quantize(&t.to_dtype(DType::F32)?, tensor_kind)?;
        // Weights and biases alike (the reader puts both back).
        let heads = if gguf.contains(".attn_q.") {
            Some(cfg.num_attention_heads)
        } else if gguf.contains(".attn_k.") {
            Some(cfg.num_key_value_heads)
        } else {
            None
        };
        let q = match heads {
            Some(heads) => permute_heads(&q, heads)?,
            None => q,
        };
        tensors.push((gguf, q));
    }
    let mut metadata = configuration(&cfg);
    metadata.extend(vocabulary(dir, cfg.vocab_size)?);
    let metadata: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensors: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let partial = path.with_extension("gguf.partial");
    let written = (|| -> Result<()> {
        let mut file = std::io::BufWriter::new(std::fs::File::create(&partial)?);
        gguf_file::write(&mut file, &metadata, &tensors)?;
        std::io::Write::flush(&mut file)?;
        file.get_ref().sync_all()?;
        Ok(())
    })();
    match written.and_then(|()| Ok(std::fs::rename(&partial, path)?)) {
        Ok(()) => Ok(()),
        Err(e) => {
            let _ = std::fs::remove_file(&partial);
            Err(e)
        }
    }
}

/// The `general.architecture` and `llama.*` keys of `cfg`.
fn configuration(cfg: &LlamaConfig) -> Vec<(String, Value)> {
    let u32_value = |v: usize| Value::U32(v as u32);
    let mut keys = vec![
        ("general.architecture", Value::String("llama".to_owned())),
        ("llama.block_count", u32_value(cfg.num_hidden_layers)),
        ("llama.embedding_length", u32_value(cfg.hidden_size)),
        (
            "llama.feed_forward_length",
            u32_value(cfg.intermediate_size),
        ),
        (
            "llama.attention.head_count",
            u32_value(cfg.num_attention_heads),
        ),
        (
            "llama.attention.head_count_kv",
            u32_value(cfg.num_key_value_heads),
        ),
        ("llama.attention.key_length", u32_value(cfg.head_dim)),
        ("llama.attention.value_length", u32_value(cfg.head_dim)),
        ("llama.rope.dimension_count", u32_value(cfg.head_dim)),
        (
            "llama.context_length",
            u32_value(cfg.max_position_embeddings),
        ),
        ("llama.vocab_size", u32_value(cfg.vocab_size)),
        (
            "llama.attention.layer_norm_rms_epsilon",
            Value::F32(cfg.rms_norm_eps as f32),
        ),
        ("llama.rope.freq_base", Value::F32(cfg.rope_theta as f32)),
    ];
    if let Some(&eos) = cfg.eos_token_ids.first() {
        keys.push(("tokenizer.ggml.eos_token_id", Value::U32(eos)));
    }
    owned(keys)
}

/// The `tokenizer.ggml.*` keys for the folder `dir` of a model with `vocab_size` embedding rows.
pub fn vocabulary(dir: &Path, vocab_size: usize) -> Result<Vec<(String, Value)>> {
    let path = dir.join("tokenizer.json");
    let mut keys: Vec<(&str, Value)> = Vec::new();
    if !path.exists() {
        keys.push(("tokenizer.ggml.model", Value::String("none".to_owned())));
        return Ok(owned(keys));
    }
    let bad = |what: String| invalid(format!("{}: {what}", path.display()));
    let json = read_json(&path)?;
    let model = &json["model"];
    if model["type"].as_str() != Some("BPE") {
        return Err(bad(format!(
            "a {} tokenizer: the GGUF writer takes BPE tokenizers (byte-level or with byte \
             fallback)",
            model["type"]
        )));
    }
    let vocab = model["vocab"]
        .as_object()
        .ok_or_else(|| bad("`model.vocab` is not an object".to_owned()))?;
    let mut tokens: Vec<Option<String>> = vec![None; vocab_size];
    let mut put = |id: &Json, text: &str| -> Result<usize> {
        let id = id
            .as_u64()
            .ok_or_else(|| bad(format!("token {text:?} has id {id}")))? as usize;
        let slot = tokens.get_mut(id).ok_or_else(|| {
            bad(format!(
                "token {text:?} has id {id}, but the model has {vocab_size} embedding rows"
            ))
        })?;
        *slot = Some(text.to_owned());
        Ok(id)
    };
    for (text, id) in vocab {
        put(id, text)?;
    }
    let (mut special, mut added) = (HashSet::new(), HashSet::new());
    for token in json["added_tokens"].as_array().into_iter().flatten() {
        let text = token["content"].as_str().unwrap_or_default();
        let id = put(&token["id"], text)?;
        match token["special"].as_bool() == Some(true) {
            true => special.insert(id),
            false => added.insert(id),
        };
    }
    let unk = model["unk_token"]
        .as_str()
        .and_then(|t| vocab.get(t))
        .and_then(Json::as_u64)
        .map(|id| id as usize);
    let byte_fallback = model["byte_fallback"].as_bool() == Some(true);
    let types: Vec<i32> = (0..vocab_size)
        .map(|id| match &tokens[id] {
            None => UNUSED,
            Some(_) if special.contains(&id) => CONTROL,
            Some(_) if added.contains(&id) => USER_DEFINED,
            Some(_) if Some(id) == unk => UNKNOWN,
            Some(t) if byte_fallback && is_byte_token(t) => BYTE,
            Some(_) => NORMAL,
        })
        .collect();
    let texts: Vec<Value> = tokens
        .into_iter()
        .enumerate()
        .map(|(id, t)| Value::String(t.unwrap_or_else(|| format!("[PAD{id}]"))))
        .collect();
    let types = Value::Array(types.into_iter().map(Value::I32).collect());
    if byte_fallback {
        keys.push(("tokenizer.ggml.model", Value::String("llama".to_owned())));
        let scores = (0..vocab_size).map(|id| Value::F32(-(id as f32))).collect();
        keys.push(("tokenizer.ggml.tokens", Value::Array(texts)));
        keys.push(("tokenizer.ggml.scores", Value::Array(scores)));
        keys.push(("tokenizer.ggml.token_type", types));
        if let Some(unk) = unk {
            keys.push(("tokenizer.ggml.unknown_token_id", Value::U32(unk as u32)));
        }
    } else {
        keys.push(("tokenizer.ggml.model", Value::String("gpt2".to_owned())));
        keys.push(("tokenizer.ggml.pre", Value::String("default".to_owned())));
        keys.push(("tokenizer.ggml.tokens", Value::Array(texts)));
        keys.push(("tokenizer.ggml.token_type", types));
        let merges = model["merges"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|m| match m {
                Json::String(s) => Ok(s.clone()),
                Json::Array(pair) if pair.len() == 2 => Ok(format!(
                    "{} {}",
                    pair[0].as_str().unwrap_or_default(),
                    pair[1].as_str().unwrap_or_default()
                )),
                other => Err(bad(format!(
                    "a merge {other} is neither \"a b\" nor [a, b]"
                ))),
            })
            .map(|m| m.map(Value::String))
            .collect::<Result<Vec<_>>>()?;
        keys.push(("tokenizer.ggml.merges", Value::Array(merges)));
    }
    let config: Json = read_json(&dir.join("config.json"))?;
    if let Some(bos) = config["bos_token_id"].as_u64() {
        keys.push(("tokenizer.ggml.bos_token_id", Value::U32(bos as u32)));
    }
    let add_bos = read_json(&dir.join("tokenizer_config.json"))
        .ok()
        .and_then(|c| c["add_bos_token"].as_bool())
        .unwrap_or(byte_fallback);
    keys.push(("tokenizer.ggml.add_bos_token", Value::Bool(add_bos)));
    Ok(owned(keys))
}

/// SentencePiece's byte tokens: `<0x00>` … `<0xFF>`.
fn is_byte_token(t: &str) -> bool {
    t.len() == 6
        && t.starts_with("<0x")
        && t.ends_with('>')
        && t[3..5].chars().all(|c| c.is_ascii_hexdigit())
}

fn read_json(path: &Path) -> Result<Json> {
    let text = std::fs::read_to_string(path)?;
    serde_json::from_str(&text).map_err(|e| invalid(format!("{}: {e}", path.display())))
}

fn owned(keys: Vec<(&str, Value)>) -> Vec<(String, Value)> {
    keys.into_iter().map(|(k, v)| (k.to_owned(), v)).collect()
}
