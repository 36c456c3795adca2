//! The tiny Llama placed by a device map (`nn::big_modeling`): split over two stand-in devices
//! with a layer on disk, it computes the unmapped model's logits and greedy tokens, moves its
//! activations only where the placement changes, reads the disk layer's weights once per
//! forward, and keeps its state dict.

use llama::{generate, GenerationConfig};
use module_runtime::nn::big_modeling::{dispatch_model, DeviceMap, Move, Placement};
use module_runtime::prelude::*;

use super::{device, max_diff, model};

fn stand_in(name: &str) -> Placement {
    Placement::stand_in(name, &device())
}

#[test]
fn a_mapped_llama_with_a_layer_on_disk_matches_the_unmapped_one() {
    let (mapped, whole) = (model(), model());
    let folder = std::env::temp_dir().join(format!("llama-device-map-{}", std::process::id()));
    // The head is tied to the embedding: both on gpu0.
    let map = DeviceMap::new()
        .insert("model.embed_tokens", stand_in("gpu0"))
        .and_then(|m| m.insert("model.layers.0", stand_in("gpu0")))
        .and_then(|m| m.insert("model.layers.1", Placement::Disk))
        .and_then(|m| m.insert("model.norm", stand_in("gpu1")))
        .and_then(|m| m.insert("lm_head", stand_in("gpu0")))
        .and_then(|m| m.no_split("model.layers.*"))
        .unwrap()
        .offload_folder(&folder);
    let dispatched = dispatch_model(&mapped, &map).unwrap();
    assert!(mapped.model.layers[1].mlp.up_proj.weight.is_offloaded());
    let ids = Tensor::new(&[[1u32, 5, 9, 2, 7], [3, 3, 8, 1, 4]], &device()).unwrap();
    let logits = dispatched.call(&ids).unwrap();
    // Hooks make the layers take their unfused paths: float32 rounding apart.
    assert!(max_diff(&logits, &whole.call(&ids).unwrap()) < 1e-5);
    assert_eq!(
        dispatched.trace().loads(),
        9,
        "layer 1's nine weights, once each"
    );
    let mv = |path: &str, from: &str, to: &str| Move {
        path: path.into(),
        from: from.into(),
        to: to.into(),
        tensors: 1,
    };
    let caller = module_runtime::device_name(&device());
    assert_eq!(
        dispatched.trace().moves(),
        [
            mv("model.embed_tokens", &caller, "gpu0"),
            mv("model.norm", "gpu0", "gpu1"),
            mv("lm_head", "gpu1", "gpu0"),
            mv("", "gpu0", &caller),
        ]
    );
    // Generation through the mapped model: the same greedy tokens.
    let config = GenerationConfig {
        max_new_tokens: 8,
        ..Default::default()
    };
    let prompts = [vec![1u32, 5, 9], vec![3, 3, 8, 1]];
    let got = dispatched.run(|m| generate(m, &prompts, &config)).unwrap();
    assert_eq!(got, generate(&whole, &prompts, &config).unwrap());
    let (sd, expected) = (mapped.state_dict().unwrap(), whole.state_dict().unwrap());
    assert_eq!(
        sd.keys().collect::<Vec<_>>(),
        expected.keys().collect::<Vec<_>>()
    );
    for (key, t) in expected.iter() {
        assert_eq!(max_diff(sd.get(key).unwrap(), t), 0.0, "{key}");
    }
    std::fs::remove_dir_all(&folder).ok();
}

/// `infer_auto_device_map` on the tiny Llama: whole decoder layers filling two stand-in devices
/// by budget, the head tied to the embedding kept with it; the dispatched model computes the
/// unmapped one's logits.
#[test]
fn an_automatic_map_keeps_layers_whole_and_the_tied_head_with_the_embedding() {
    use module_runtime::nn::big_modeling::{infer_auto_device_map, MaxMemory};
    let (mapped, whole) = (model(), model());
    let bytes = |prefix: &str| -> usize {
        mapped
            .named_parameters()
            .iter()
            .filter(|(p, _)| p.starts_with(prefix))
            .map(|(_, p)| p.elem_count() * 4)
            .sum()
    };
    let (embed, layer) = (bytes("model.embed_tokens."), bytes("model.layers.0."));
    let budget = MaxMemory::new()
        .placement(stand_in("gpu0"), embed + layer + layer / 2)
        .placement(stand_in("gpu1"), 2 * layer);
    let map = infer_auto_device_map(&mapped, &budget, &["model.layers.*"]).unwrap();
    let entries: Vec<(&str, &str)> = map.entries().map(|(p, d)| (p, d.name())).collect();
    assert_eq!(
        entries,
        [
            ("model.embed_tokens", "gpu0"),
            ("model.layers.0", "gpu0"),
            ("model.layers.1", "gpu1"),
            ("model.norm", "gpu1"),
            ("lm_head", "gpu0"),
        ]
    );
    let dispatched = dispatch_model(&mapped, &map).unwrap();
    let ids = Tensor::new(&[[1u32, 5, 9, 2, 7]], &device()).unwrap();
    let logits = dispatched.call(&ids).unwrap();
    assert!(max_diff(&logits, &whole.call(&ids).unwrap()) < 1e-5);
}
