//! `LlamaForCausalLM::from_gguf` on files whose metadata contradicts their tensors (head counts,
//! widths, block counts): each is `QuantizeError::Gguf` naming the key or tensor, raised before
//! any model is built, never a panic. The files are the q8_0 fixture rewritten with one metadata
//! entry changed.

use std::path::PathBuf;

use llama::LlamaForCausalLM;
use module_runtime::candle_core::quantized::gguf_file;
use module_runtime::prelude::*;
use module_runtime::{GgufFile, GgufValue, QuantizeError};

use super::device;

/// The q8_0 fixture with `key` set to `value` (or removed when `None`), written to a file of
/// the test's own.
fn rewritten(name: &str, key: &str, value: Option<GgufValue>) -> PathBuf {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let file = GgufFile::read(dir.join("tiny-llama-q8_0.gguf"), &Device::Cpu).unwrap();
    let mut metadata = file.metadata.clone();
    match value {
        Some(v) => metadata.insert(key.to_owned(), v),
        None => metadata.remove(key),
    };
    let metadata: Vec<(&str, &GgufValue)> = metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensors: Vec<(&str, &_)> = file
        .tensors
        .iter()
        .map(|(k, t)| (k.as_str(), &**t))
        .collect();
    let path = std::env::temp_dir().join(format!("llama-meta-{name}-{}.gguf", std::process::id()));
    let mut out = std::fs::File::create(&path).unwrap();
    gguf_file::write(&mut out, &metadata, &tensors).unwrap();
    path
}

/// The reason `from_gguf` gives for the file with `key` set to `value`.
fn refused(name: &str, key: &str, value: Option<GgufValue>) -> String {
    let path = rewritten(name, key, value);
    let result = LlamaForCausalLM::from_gguf(&path, &device());
    std::fs::remove_file(&path).unwrap();
    match result {
        Err(Error::Quantize(QuantizeError::Gguf { file, reason })) => {
            assert_eq!(file, path);
            reason
        }
        Err(e) => panic!("{name}: {e}"),
        Ok(_) => panic!("{name}: loaded"),
    }
}

#[test]
fn the_rewritten_fixture_loads() {
    let path = rewritten(
        "same",
        "general.name",
        Some(GgufValue::String("same".into())),
    );
    LlamaForCausalLM::from_gguf(&path, &device()).unwrap();
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn head_counts_that_do_not_fit_the_tensors_are_errors() {
    let heads = "llama.attention.head_count";
    let kv = "llama.attention.head_count_kv";
    // Zero heads (a division by zero when the rows are put back in order).
    let r = refused("heads0", heads, Some(GgufValue::U32(0)));
    assert!(r.contains("num_attention_heads is 0"), "{r}");
    let r = refused("kv0", kv, Some(GgufValue::U32(0)));
    assert!(r.contains("num_key_value_heads 0"), "{r}");
    // Heads of width 0 (a division by zero when the rows are put back in order).
    let r = refused(
        "keylen0",
        "llama.attention.key_length",
        Some(GgufValue::U32(0)),
    );
    assert!(r.contains("head width of 0"), "{r}");
    let r = refused("heads-wide", heads, Some(GgufValue::U32(1 << 20)));
    assert!(r.contains("has shape"), "{r}");
    let r = refused("heads-overflow", heads, Some(GgufValue::U64(1 << 62)));
    assert!(r.contains("overflows"), "{r}");
    // Heads that do not divide the width: widths that do not give the tensors' shapes.
    let r = refused("heads3", heads, Some(GgufValue::U32(3)));
    assert!(r.contains("attn_"), "{r}");
    let r = refused("kv2", kv, Some(GgufValue::U32(2)));
    assert!(r.contains("tensor `blk.0.attn_k.weight`"), "{r}");
    // An odd head width (RoPE rotates pairs).
    let r = refused(
        "keylen",
        "llama.attention.key_length",
        Some(GgufValue::U32(33)),
    );
    assert!(r.contains("odd"), "{r}");
    let r = refused(
        "keylen-big",
        "llama.attention.key_length",
        Some(GgufValue::U32(1 << 30)),
    );
    assert!(r.contains("attn_"), "{r}");
}

#[test]
fn block_counts_other_than_the_files_blocks_are_errors() {
    let key = "llama.block_count";
    for (name, n) in [
        ("blocks0", 0u64),
        ("blocks1", 1),
        ("blocks-huge", u64::MAX >> 8),
    ] {
        let r = refused(name, key, Some(GgufValue::U64(n)));
        assert!(
            r.contains("block_count") || r.contains("beyond"),
            "{name}: {r}"
        );
    }
    let r = refused("blocks-none", key, None);
    assert!(r.contains("`llama.block_count`"), "{r}");
}

#[test]
fn widths_that_contradict_the_tensors_are_errors() {
    for (name, key, n) in [
        ("width", "llama.embedding_length", 96u32),
        ("ffn", "llama.feed_forward_length", 7),
        ("vocab", "llama.vocab_size", 1 << 30),
    ] {
        let r = refused(name, key, Some(GgufValue::U32(n)));
        assert!(r.contains("has shape"), "{name}: {r}");
    }
    let r = refused(
        "width-str",
        "llama.embedding_length",
        Some(GgufValue::String("64".into())),
    );
    assert!(r.contains("not a size"), "{r}");
}
