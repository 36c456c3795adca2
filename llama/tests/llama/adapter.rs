//! A PEFT LoRA adapter made by `peft` for the tiny Llama (`tests/fixtures/tiny-llama-lora`,
//! `fixtures/peft/make_llama_adapter.py`): loaded onto the model, greedy generation equals
//! transformers + peft's token for token, through `generate` and the example's code path.

use super::*;
use module_runtime::nn::peft::{PeftExt, DEFAULT_ADAPTER};

fn adapter() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-llama-lora")
}

fn adapter_reference() -> (Vec<Vec<u32>>, Vec<Vec<u32>>) {
    let text = std::fs::read_to_string(adapter().join("reference.json")).unwrap();
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    let ids = |key: &str| -> Vec<Vec<u32>> { serde_json::from_value(json[key].clone()).unwrap() };
    (ids("prompts"), ids("generated"))
}

#[test]
fn greedy_generation_with_a_peft_adapter_matches_transformers_and_peft() {
    let mut model = model();
    let layers = model
        .load_adapter(adapter(), DEFAULT_ADAPTER, false)
        .unwrap();
    // 7 projections in each of the 2 layers.
    assert_eq!(layers.len(), 14);
    assert!(layers.contains(&"model.layers.1.mlp.down_proj".to_owned()));
    let (prompts, expected) = adapter_reference();
    let config = GenerationConfig {
        max_new_tokens: 40,
        stop_tokens: model.config.eos_token_ids.clone(),
        ..Default::default()
    };
    for (prompt, want) in prompts.iter().zip(&expected) {
        let got = generate(&model, std::slice::from_ref(prompt), &config).unwrap();
        assert_eq!(&got[0], want);
    }
    // The example's code path (what `generate --adapter` runs after loading).
    let input: String = prompts
        .iter()
        .map(|p| serde_json::to_string(p).unwrap() + "\n")
        .collect();
    let mut out = Vec::new();
    generate_json_lines(&model, &config, input.as_bytes(), &mut out).unwrap();
    let lines: Vec<Vec<u32>> = String::from_utf8(out)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines, expected);
    // Without the adapter, the base model's generations (tiny-llama/reference.json).
    let (_, base) = reference_json();
    let first = model
        .disable_adapter(|| generate(&model, &prompts[..1], &config))
        .unwrap()
        .unwrap();
    assert_eq!(first[0], base[0]);
    assert_ne!(first[0], expected[0]);
}
