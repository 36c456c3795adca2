//! Streaming loads: a Hugging Face sharded checkpoint (`model.safetensors.index.json` over three
//! shards) read tensor by tensor into a model built empty (`build_empty`), quantized on the way
//! when `quantize` marked the empty model first — equal, byte for byte, to loading the float
//! model and quantizing it after.

use std::path::Path;

use llama::LlamaForCausalLM;
use module_runtime::nn::{quantize, GgmlDType, Linear};
use module_runtime::prelude::*;
use module_runtime::{build_empty, Error};

use super::{device, ids, max_diff, model, temp_dir};

/// Writes `model`'s state dict as `shards` safetensors files named as transformers names them,
/// and the index that maps each key to its file.
fn save_sharded(model: &LlamaForCausalLM, dir: &Path, shards: usize) {
    std::fs::create_dir_all(dir).unwrap();
    let mut entries: Vec<(String, Tensor)> = model
        .state_dict()
        .unwrap()
        .into_hash_map()
        .into_iter()
        .collect();
    entries.sort_by(|a, b| a.0.cmp(&b.0));
    let per_shard = entries.len().div_ceil(shards);
    let mut weight_map = serde_json::Map::new();
    for (i, chunk) in entries.chunks(per_shard).enumerate() {
        let file = format!("model-{:05}-of-{shards:05}.safetensors", i + 1);
        let shard: StateDict = chunk.iter().cloned().collect();
        shard.save_safetensors(dir.join(&file)).unwrap();
        for (key, _) in chunk {
            weight_map.insert(key.clone(), file.clone().into());
        }
    }
    let index = serde_json::json!({ "metadata": {}, "weight_map": weight_map });
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    let config = super::fixture().join("config.json");
    std::fs::copy(config, dir.join("config.json")).unwrap();
}

fn empty_model() -> LlamaForCausalLM {
    let cfg = model().config;
    build_empty(|| LlamaForCausalLM::new(&cfg, &device())).unwrap()
}

fn linears(model: &LlamaForCausalLM) -> Vec<(String, Linear)> {
    model
        .named_modules()
        .into_iter()
        .filter_map(|(path, m)| Some((path, m.downcast_ref::<Linear>()?.clone())))
        .collect()
}

#[test]
fn a_sharded_checkpoint_streams_into_an_empty_quantized_model() {
    let dir = temp_dir("stream-shards");
    let float = model();
    save_sharded(&float, &dir, 3);
    for kind in [GgmlDType::Q8_0, GgmlDType::Q4_0] {
        let streamed = empty_model();
        let marked = quantize(&streamed, "**", kind).unwrap();
        let after = model();
        let quantized = quantize(&after, "**", kind).unwrap();
        // The same layers marked as a built model quantizes (`down_proj`, 176 wide, stays float).
        assert_eq!(marked.quantized, quantized.quantized);
        assert_eq!(marked.kept_float, quantized.kept_float);
        let q_proj = &streamed.model.layers[0].self_attn.q_proj.weight;
        assert!(!q_proj.is_built() && !q_proj.is_quantized());
        assert_eq!(q_proj.quantized_dtype(), Some(kind));

        let options = LlamaForCausalLM::load_options(&streamed.config);
        streamed.load_state_dict(&dir, &options).unwrap();
        for ((path, got), (_, want)) in linears(&streamed).iter().zip(linears(&after)) {
            let (got, want) = (&got.weight, &want.weight);
            assert_eq!(got.quantized_dtype(), want.quantized_dtype(), "{path}");
            match (got.quantized().unwrap(), want.quantized().unwrap()) {
                (Some(g), Some(w)) => assert_eq!(g.data().unwrap(), w.data().unwrap(), "{path}"),
                (None, None) => assert_eq!(
                    max_diff(&got.tensor().unwrap(), &want.tensor().unwrap()),
                    0.0
                ),
                _ => panic!("{path}: one quantized, one not"),
            }
        }
        let input = ids(&[vec![1, 5, 9, 2]]);
        let logits = |m: &LlamaForCausalLM| m.scan(&input, m.initial_state(1).unwrap()).unwrap().0;
        assert_eq!(max_diff(&logits(&streamed), &logits(&after)), 0.0);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_failed_streaming_load_leaves_the_marked_model_empty() {
    let dir = temp_dir("stream-broken");
    save_sharded(&model(), &dir, 3);
    // The last shard goes missing: the load fails before any weight is taken.
    std::fs::remove_file(dir.join("model-00003-of-00003.safetensors")).unwrap();
    let streamed = empty_model();
    let _ = quantize(&streamed, "**", GgmlDType::Q8_0).unwrap();
    let options = LlamaForCausalLM::load_options(&streamed.config);
    let err = streamed.load_state_dict(&dir, &options).unwrap_err();
    assert!(err.to_string().contains("model-00003-of-00003"), "{err}");
    for p in streamed.parameters() {
        assert!(!p.is_built());
    }
    let q_proj = &streamed.model.layers[1].self_attn.q_proj.weight;
    assert_eq!(q_proj.quantized_dtype(), Some(GgmlDType::Q8_0));
    // An empty weight whose shape is not known yet cannot be marked: its own error.
    let lazy = build_empty(|| module_runtime::nn::LazyLinear::new(64, &device())).unwrap();
    assert!(matches!(
        quantize(&lazy, "**", GgmlDType::Q8_0),
        Err(Error::NotLoaded { .. })
    ));
    std::fs::remove_dir_all(&dir).unwrap();
}
