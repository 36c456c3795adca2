//! The sentence-transformers pipeline around [`BertModel`](crate::bert::BertModel): its
//! tokenizer (Hugging Face's `tokenizers`) set up as sentence-transformers does, and mean pooling
//! of the hidden states into normalized sentence embeddings.

use std::path::Path;

use module_runtime::prelude::*;
use tokenizers::{PaddingParams, PaddingStrategy, Tokenizer, TruncationParams};

/// Sentence embeddings as sentence-transformers computes them: the mean of the hidden states over
/// the attention mask, then L2-normalized. `hidden` is `[batch, seq, dim]`, `mask` `[batch, seq]`.
pub fn mean_pool_normalized(hidden: &Tensor, mask: &Tensor) -> Result<Tensor> {
    let mask = mask.to_dtype(hidden.dtype())?.unsqueeze(2)?;
    let summed = hidden.broadcast_mul(&mask)?.sum(1)?;
    let counts = mask.sum(1)?.clamp(1e-9, f64::INFINITY)?;
    let mean = summed.broadcast_div(&counts)?;
    let norm = mean
        .sqr()?
        .sum_keepdim(1)?
        .sqrt()?
        .clamp(1e-12, f64::INFINITY)?;
    Ok(mean.broadcast_div(&norm)?)
}

/// The tokenizer of a checkpoint folder (`tokenizer.json`), set up as sentence-transformers uses
/// it: each batch padded to its longest sentence, sentences truncated to `max_seq_length` (from
/// `sentence_bert_config.json`; 256 without one). The file's own fixed padding to 128 is replaced.
pub fn load_tokenizer(dir: &Path) -> std::result::Result<Tokenizer, Box<dyn std::error::Error>> {
    let max_len = std::fs::read_to_string(dir.join("sentence_bert_config.json"))
        .ok()
        .and_then(|text| serde_json::from_str::<serde_json::Value>(&text).ok())
        .and_then(|json| json["max_seq_length"].as_u64())
        .unwrap_or(256) as usize;
    let path = dir.join("tokenizer.json");
    let mut tokenizer =
        Tokenizer::from_file(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    tokenizer.with_padding(Some(PaddingParams {
        strategy: PaddingStrategy::BatchLongest,
        ..PaddingParams::default()
    }));
    tokenizer
        .with_truncation(Some(TruncationParams {
            max_length: max_len,
            ..TruncationParams::default()
        }))
        .map_err(|e| format!("{}: truncation: {e}", path.display()))?;
    Ok(tokenizer)
}

/// Tokenizes `sentences` as one padded batch: `(input_ids, attention_mask)`, both `[batch, seq]`
/// u32, ready for [`BertModel`](crate::bert::BertModel)'s `call`.
pub fn encode_batch(
    tokenizer: &Tokenizer,
    sentences: &[&str],
    device: &Device,
) -> std::result::Result<(Tensor, Tensor), Box<dyn std::error::Error>> {
    let encodings = tokenizer
        .encode_batch(sentences.to_vec(), true)
        .map_err(|e| format!("tokenizing: {e}"))?;
    let len = encodings.first().map_or(0, |e| e.get_ids().len());
    let ids: Vec<u32> = encodings
        .iter()
        .flat_map(|e| e.get_ids().iter().copied())
        .collect();
    let mask: Vec<u32> = encodings
        .iter()
        .flat_map(|e| e.get_attention_mask().iter().copied())
        .collect();
    Ok((
        Tensor::from_vec(ids, (sentences.len(), len), device)?,
        Tensor::from_vec(mask, (sentences.len(), len), device)?,
    ))
}
