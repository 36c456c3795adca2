//! `save_gguf`: the tiny Llama written as llama.cpp's GGUF and read back (the same model as
//! `quantize` of the safetensors one), and its vocabulary from a `tokenizer.json` of each kind:
//! SentencePiece's (byte fallback), byte-level BPE, none; and the errors, which leave no file.

use std::path::{Path, PathBuf};

use llama::{save_gguf, LlamaForCausalLM};
use module_runtime::candle_core::quantized::GgmlDType;
use module_runtime::nn::quantize;
use module_runtime::prelude::*;
use module_runtime::{GgufFile, GgufValue};
use serde_json::json;

use super::{device, fixture};

/// A fresh folder holding the tiny Llama's `config.json` and `model.safetensors`, and
/// `tokenizer.json` when given.
fn folder(name: &str, tokenizer: Option<serde_json::Value>) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("llama-gguf-export-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for file in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture().join(file), dir.join(file)).unwrap();
    }
    if let Some(tokenizer) = tokenizer {
        std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    }
    dir
}

/// A SentencePiece-style tokenizer (BPE with byte fallback) of the model's 384 ids: `<unk>`,
/// `<s>`, `</s>`, the 256 byte tokens, then pieces; ids 380–383 left out (padded rows).
fn sentencepiece() -> serde_json::Value {
    let mut vocab = serde_json::Map::new();
    for (id, t) in ["<unk>", "<s>", "</s>"].iter().enumerate() {
        vocab.insert(t.to_string(), json!(id));
    }
    for b in 0..256 {
        vocab.insert(format!("<0x{b:02X}>"), json!(3 + b));
    }
    for id in 259..380 {
        vocab.insert(format!("▁p{id}"), json!(id));
    }
    json!({
        "model": {"type": "BPE", "byte_fallback": true, "unk_token": "<unk>", "vocab": vocab,
                  "merges": []},
        "added_tokens": [
            {"id": 0, "content": "<unk>", "special": true},
            {"id": 1, "content": "<s>", "special": true},
            {"id": 2, "content": "</s>", "special": true}
        ]
    })
}

/// A byte-level BPE tokenizer (GPT-2's kind) with merges in both of `tokenizers`' forms.
fn byte_level() -> serde_json::Value {
    let mut vocab = serde_json::Map::new();
    for id in 0..300 {
        vocab.insert(format!("t{id}"), json!(id));
    }
    json!({
        "model": {"type": "BPE", "vocab": vocab, "merges": ["t1 t2", ["t3", "t4"]]},
        "added_tokens": [
            {"id": 300, "content": "<|endoftext|>", "special": true},
            {"id": 301, "content": "<tool>", "special": false}
        ]
    })
}

/// The largest difference between two models' logits for one fixed prompt.
fn logits_diff(a: &LlamaForCausalLM, b: &LlamaForCausalLM, device: &Device) -> f32 {
    let ids = Tensor::new(&[[1u32, 5, 77, 300, 12]], device).unwrap();
    let logits = |model: &LlamaForCausalLM| {
        let state = model.initial_state(1).unwrap();
        without_grad(|| model.scan(&ids, state)).unwrap().0
    };
    (logits(a) - logits(b))
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

fn read(path: &Path) -> GgufFile {
    GgufFile::read(path, &Device::Cpu).unwrap()
}

fn string(file: &GgufFile, key: &str) -> String {
    file.get(key).unwrap().to_string().unwrap().clone()
}

fn array(file: &GgufFile, key: &str) -> Vec<GgufValue> {
    file.get(key).unwrap().to_vec().unwrap().clone()
}

/// Written in `q8_0` and read back with `from_gguf`: the same weights and logits as `quantize` of
/// the safetensors model (llama.cpp's names and row order went out and came back).
#[test]
fn a_saved_gguf_reads_back_as_the_quantized_model() {
    let dir = folder("roundtrip", Some(sentencepiece()));
    let path = dir.join("model-q8_0.gguf");
    save_gguf(&dir, &path, GgmlDType::Q8_0).unwrap();
    assert!(!dir.join("model-q8_0.gguf.partial").exists());
    let loaded = LlamaForCausalLM::from_gguf(&path, &device()).unwrap();
    let ours = LlamaForCausalLM::from_pretrained(&dir, &device()).unwrap();
    let _ = quantize(&ours, "**", GgmlDType::Q8_0).unwrap();
    assert_eq!(loaded.config, ours.config);
    let diff = logits_diff(&loaded, &ours, &device());
    assert!(diff < 1e-4, "{diff}");
    // The 176-wide `down_proj` rows do not fit 32-blocks: kept in float32, as `quantize` keeps it.
    assert!(!loaded
        .get_parameter("model.layers.0.mlp.down_proj.weight")
        .unwrap()
        .is_quantized());
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_sentencepiece_vocabulary_is_written_as_llamas() {
    let dir = folder("spm", Some(sentencepiece()));
    let path = dir.join("m.gguf");
    save_gguf(&dir, &path, GgmlDType::F16).unwrap();
    let file = read(&path);
    assert_eq!(string(&file, "tokenizer.ggml.model"), "llama");
    let tokens = array(&file, "tokenizer.ggml.tokens");
    assert_eq!(tokens.len(), 384, "one token per embedding row");
    assert_eq!(tokens[3].to_string().unwrap(), "<0x00>");
    assert_eq!(tokens[383].to_string().unwrap(), "[PAD383]");
    let types: Vec<i32> = array(&file, "tokenizer.ggml.token_type")
        .iter()
        .map(|v| v.to_i32().unwrap())
        .collect();
    // control, byte, normal, unused (llama.cpp's token types)
    assert_eq!([types[1], types[3], types[300], types[383]], [3, 6, 1, 5]);
    assert_eq!(array(&file, "tokenizer.ggml.scores").len(), 384);
    assert_eq!(file.get_usize("tokenizer.ggml.bos_token_id").unwrap(), 1);
    assert_eq!(file.get_usize("tokenizer.ggml.eos_token_id").unwrap(), 2);
    assert_eq!(
        file.get_usize("tokenizer.ggml.unknown_token_id").unwrap(),
        0
    );
    assert!(file
        .get("tokenizer.ggml.add_bos_token")
        .unwrap()
        .to_bool()
        .unwrap());
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_byte_level_vocabulary_is_written_as_gpt2s_with_its_merges() {
    let dir = folder("bpe", Some(byte_level()));
    let path = dir.join("m.gguf");
    save_gguf(&dir, &path, GgmlDType::F16).unwrap();
    let file = read(&path);
    assert_eq!(string(&file, "tokenizer.ggml.model"), "gpt2");
    assert_eq!(string(&file, "tokenizer.ggml.pre"), "default");
    let merges: Vec<String> = array(&file, "tokenizer.ggml.merges")
        .iter()
        .map(|v| v.to_string().unwrap().clone())
        .collect();
    assert_eq!(merges, ["t1 t2", "t3 t4"]);
    let types = array(&file, "tokenizer.ggml.token_type");
    assert_eq!(types[300].to_i32().unwrap(), 3, "special: control");
    assert_eq!(types[301].to_i32().unwrap(), 4, "added: user-defined");
    assert!(file.get("tokenizer.ggml.scores").is_err());
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn without_a_tokenizer_the_vocabulary_is_a_placeholder() {
    let dir = folder("none", None);
    let path = dir.join("m.gguf");
    save_gguf(&dir, &path, GgmlDType::Q4_0).unwrap();
    let file = read(&path);
    assert_eq!(string(&file, "tokenizer.ggml.model"), "none");
    assert_eq!(file.get_usize("llama.vocab_size").unwrap(), 384);
    std::fs::remove_dir_all(dir).unwrap();
}

/// A tokenizer with more ids than the model has rows, or of a kind llama.cpp's Llama does not
/// take: a typed error naming the file, and no file written.
#[test]
fn a_tokenizer_that_does_not_fit_is_an_error_and_writes_nothing() {
    let mut too_many = byte_level();
    too_many["added_tokens"][0]["id"] = json!(384);
    let wordpiece = json!({"model": {"type": "WordPiece", "vocab": {}}});
    for (name, tokenizer, says) in [
        (
            "too-many",
            too_many,
            "has id 384, but the model has 384 embedding rows",
        ),
        ("wordpiece", wordpiece, "WordPiece"),
    ] {
        let dir = folder(name, Some(tokenizer));
        let path = dir.join("m.gguf");
        let err = save_gguf(&dir, &path, GgmlDType::Q8_0)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(says) && err.contains("tokenizer.json"),
            "{err}"
        );
        assert!(!path.exists() && !dir.join("m.gguf.partial").exists());
        std::fs::remove_dir_all(dir).unwrap();
    }
}

/// A Llama with attention biases: the `attn_q`/`attn_k` biases take llama.cpp's row order as
/// their weights do, so the file reads back as the same model.
#[test]
fn attention_biases_take_the_files_row_order() {
    let dir = folder("bias", None);
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    config["attention_bias"] = json!(true);
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let cfg = llama::LlamaConfig::from_json_file(&dir.join("config.json")).unwrap();
    let model = LlamaForCausalLM::new(&cfg, &Device::Cpu).unwrap();
    let bias = model
        .get_parameter("model.layers.0.self_attn.q_proj.bias")
        .unwrap();
    assert!(
        bias.tensor()
            .unwrap()
            .abs()
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
            > 0.0
    );
    model
        .state_dict()
        .unwrap()
        .save_safetensors(dir.join("model.safetensors"))
        .unwrap();
    let path = dir.join("m.gguf");
    save_gguf(&dir, &path, GgmlDType::F32).unwrap();
    let loaded = LlamaForCausalLM::from_gguf(&path, &Device::Cpu).unwrap();
    let diff = logits_diff(&loaded, &model, &Device::Cpu);
    assert!(diff < 1e-5, "{diff}");
    std::fs::remove_dir_all(dir).unwrap();
}
