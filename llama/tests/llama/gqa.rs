//! The second fixture, `tests/fixtures/tiny-llama-gqa` (made by `make_tiny_llama_gqa.py`):
//! grouped-query attention (4 query heads on 2 key/value heads), an untied `lm_head`, llama3 RoPE
//! scaling, and four safetensors shards with their index: logits and greedy generations against
//! transformers', and the cache against recomputing.

use std::path::PathBuf;

use llama::{generate, GenerationConfig, LlamaForCausalLM, RopeScaling};
use module_runtime::prelude::*;

use super::{device, max_diff};

fn dir() -> PathBuf {
    super::fixture().join("../tiny-llama-gqa")
}

#[test]
fn sharded_untied_gqa_llama3_matches_transformers() {
    let model = LlamaForCausalLM::from_pretrained(&dir(), &device()).unwrap();
    let cfg = &model.config;
    assert_eq!((cfg.num_attention_heads, cfg.num_key_value_heads), (4, 2));
    assert!(!cfg.tie_word_embeddings);
    assert!(matches!(cfg.rope_scaling, RopeScaling::Llama3 { .. }));
    // Untied: the head is a parameter of its own, loaded from its shard.
    let names: Vec<String> = model
        .named_parameters()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert!(names.contains(&"lm_head.weight".to_owned()));

    let reference =
        candle_core::safetensors::load(dir().join("reference.safetensors"), &device()).unwrap();
    let prompts = reference["prompts"].to_dtype(DType::U32).unwrap();
    let (logits, _) = model
        .scan(&prompts, model.initial_state(2).unwrap())
        .unwrap();
    let diff = max_diff(&logits, &reference["logits"]);
    assert!(diff < 1e-4, "max logit difference {diff}");

    let rows: Vec<Vec<u32>> = prompts.to_vec2().unwrap();
    let generated: Vec<Vec<u32>> = reference["generated"]
        .to_dtype(DType::U32)
        .unwrap()
        .to_vec2()
        .unwrap();
    let config = GenerationConfig {
        max_new_tokens: 20,
        ..Default::default()
    };
    let out = generate(&model, &rows, &config).unwrap();
    for (i, (got, want)) in out.iter().zip(&generated).enumerate() {
        assert_eq!(got[..], want[rows[i].len()..], "prompt {i}");
    }
}
