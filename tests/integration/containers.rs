//! Sequential, ModuleList, ModuleDict, Functional, wrapped candle-nn layers and `summary()`,
//! through the public API.

use std::sync::Arc;

use candle_nn::{Optimizer, VarBuilder, VarMap};
use module_runtime::nn::{Functional, ModuleDict, ModuleList, Native, Sequential, SequentialLayer};
use module_runtime::prelude::*;

/// The device under test: `MODULE_DEVICE` (`cuda:0`, …), the CPU when unset.
fn dev() -> Device {
    candle_module::device_from_env().expect("MODULE_DEVICE names a usable device")
}

fn names<T>(items: Vec<(String, T)>) -> Vec<String> {
    items.into_iter().map(|(n, _)| n).collect()
}

fn relu() -> Functional {
    Functional::named("ReLU", |x: &Tensor| x.relu())
}

#[test]
fn sequential_names_children_by_position_and_runs_in_order() {
    let seq = Sequential::new()
        .add(Linear::new(3, 4, &dev()).unwrap())
        .add(relu())
        .add(Sequential::new().add(Linear::no_bias(4, 2, &dev()).unwrap()));
    assert_eq!(seq.len(), 3);
    assert_eq!(
        names(seq.named_parameters()),
        ["0.weight", "0.bias", "2.0.weight"]
    );
    assert_eq!(names(seq.named_modules()), ["", "0", "1", "2", "2.0"]);
    let inner: &Linear = seq.get_submodule("2.0").unwrap();
    assert_eq!(inner.out_features(), 2);
    assert!(seq.get(1).unwrap().is::<Functional>());

    let x = Tensor::randn(0f32, 1., (5, 3), &dev()).unwrap();
    let y = seq.call(&x).unwrap();
    let l0: &Linear = seq.get_submodule("0").unwrap();
    let expected = inner.call(&l0.call(&x).unwrap().relu().unwrap()).unwrap();
    assert_eq!(
        y.to_vec2::<f32>().unwrap(),
        expected.to_vec2::<f32>().unwrap()
    );
    // Usable as a candle module too, and empty means identity.
    let via_candle = x.apply(&seq).unwrap();
    assert_eq!(via_candle.dims(), [5, 2]);
    let empty = Sequential::new();
    assert_eq!(empty.call(&x).unwrap().dims(), [5, 3]);
}

#[derive(Module)]
struct Tower {
    stem: Sequential,
    blocks: ModuleList<Linear>,
    mixed: ModuleList,
    heads: ModuleDict<Linear>,
}

fn tower() -> Tower {
    let mut mixed = ModuleList::new();
    mixed.push_layer(Linear::new(2, 2, &dev()).unwrap());
    mixed.push_layer(relu());
    let mut heads = ModuleDict::new();
    heads
        .insert("zeta", Linear::new(2, 1, &dev()).unwrap())
        .unwrap();
    heads
        .insert("alpha", Linear::new(2, 3, &dev()).unwrap())
        .unwrap();
    Tower {
        stem: Sequential::new().add(Linear::new(4, 2, &dev()).unwrap()),
        blocks: (0..2).map(|_| Linear::new(2, 2, &dev()).unwrap()).collect(),
        mixed,
        heads,
    }
}

#[test]
fn lists_and_dicts_name_like_torch() {
    let mut t = tower();
    assert_eq!(
        names(t.named_parameters()),
        [
            "stem.0.weight",
            "stem.0.bias",
            "blocks.0.weight",
            "blocks.0.bias",
            "blocks.1.weight",
            "blocks.1.bias",
            "mixed.0.weight",
            "mixed.0.bias",
            // insertion order, not key order
            "heads.zeta.weight",
            "heads.zeta.bias",
            "heads.alpha.weight",
            "heads.alpha.bias",
        ]
    );
    assert_eq!(t.heads.keys().collect::<Vec<_>>(), ["zeta", "alpha"]);
    // Replacing a key keeps its position.
    let old = t
        .heads
        .insert("zeta", Linear::new(2, 7, &dev()).unwrap())
        .unwrap();
    assert!(old.is_some());
    assert_eq!(t.heads.keys().collect::<Vec<_>>(), ["zeta", "alpha"]);
    assert_eq!(t.heads["zeta"].out_features(), 7);
    assert_eq!(t.heads.remove("zeta").unwrap().out_features(), 7);
    assert_eq!(t.heads.len(), 1);
    // Mutable traversal reaches into every container.
    let m: &mut Linear = t.get_submodule_mut("mixed.0").unwrap();
    assert_eq!(m.in_features(), 2);
    let b: &mut Linear = t.get_submodule_mut("blocks.1").unwrap();
    assert_eq!(b.out_features(), 2);
    // A heterogeneous list runs element by element.
    let mut x = Tensor::ones((1, 2), DType::F32, &dev()).unwrap();
    for layer in t.mixed.iter() {
        x = layer.forward_tensor(x).unwrap();
    }
    assert!(x.min_all().unwrap().to_scalar::<f32>().unwrap() >= 0.0);
    let boxed: &dyn SequentialLayer = &*t.mixed[1];
    assert_eq!(boxed.as_module().type_name(), "ReLU");
}

#[test]
// `module_runtime::Error` is large (clippy's result_large_err); the closure below returns it on
// purpose, to show both error types are accepted.
#[allow(clippy::result_large_err)]
fn functional_wraps_closures_and_candle_modules() {
    let gelu = Functional::from_module(candle_nn::Activation::Gelu);
    let x = Tensor::new(&[-1f32, 0., 1.], &dev()).unwrap();
    let expected = x.apply(&candle_nn::Activation::Gelu).unwrap();
    assert_eq!(
        gelu.call(&x).unwrap().to_vec1::<f32>().unwrap(),
        expected.to_vec1::<f32>().unwrap()
    );
    assert_eq!(gelu.num_parameters(), 0);
    assert_eq!(gelu.class_name(), "Activation");
    // A closure may use this crate's error type.
    let double = Functional::new(|x: &Tensor| -> module_runtime::Result<Tensor> { Ok((x * 2.0)?) });
    assert_eq!(
        double.call(&x).unwrap().to_vec1::<f32>().unwrap(),
        [-2., 0., 2.]
    );
}

#[derive(Module)]
struct NativeNet {
    emb: Native<candle_nn::Embedding>,
    conv: Native<candle_nn::Conv1d>,
    norm: Native<candle_nn::LayerNorm>,
    fc: Native<candle_nn::Linear>,
}

#[test]
fn wrapped_candle_nn_layers_are_listed_and_train() {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &dev());
    let net = NativeNet {
        emb: Native::new(candle_nn::embedding(10, 4, vb.pp("emb")).unwrap()).unwrap(),
        conv: Native::new(candle_nn::conv1d(4, 4, 3, Default::default(), vb.pp("conv")).unwrap())
            .unwrap(),
        // Built from plain tensors, not Vars: the wrapper copies them into fresh parameters.
        norm: Native::new(candle_nn::LayerNorm::new(
            Tensor::ones(4, DType::F32, &dev()).unwrap(),
            Tensor::zeros(4, DType::F32, &dev()).unwrap(),
            1e-5,
        ))
        .unwrap(),
        fc: Native::new(candle_nn::linear(4, 3, vb.pp("fc")).unwrap()).unwrap(),
    };
    assert_eq!(
        names(net.named_parameters()),
        [
            "emb.weight",
            "conv.weight",
            "conv.bias",
            "norm.weight",
            "norm.bias",
            "fc.weight",
            "fc.bias"
        ]
    );
    let before: Vec<Vec<f32>> = net
        .parameters()
        .iter()
        .map(|p| {
            p.tensor()
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap()
        })
        .collect();
    let mut opt = candle_nn::SGD::new(net.trainable_vars().unwrap(), 0.5).unwrap();
    let ids = Tensor::new(&[[1u32, 2, 3, 4, 5]], &dev()).unwrap();
    let h = net.emb.call(&ids).unwrap(); // [1, 5, 4]
    let h = net.conv.call(&h.transpose(1, 2).unwrap()).unwrap(); // [1, 4, 3]
    let h = net
        .norm
        .call(&h.transpose(1, 2).unwrap().contiguous().unwrap())
        .unwrap();
    let y = net.fc.call(&h).unwrap();
    let target = Tensor::randn(0f32, 1., y.shape(), &dev()).unwrap();
    let loss = (y - target).unwrap().sqr().unwrap().sum_all().unwrap();
    opt.backward_step(&loss).unwrap();
    for ((name, p), before) in net.named_parameters().into_iter().zip(before) {
        let after: Vec<f32> = p
            .tensor()
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        assert_ne!(after, before, "{name} did not change after a step");
    }
    // The VarMap and the wrapper share storage.
    let fc_in_varmap = varmap.data().lock().unwrap()["fc.weight"].clone();
    let fc_param = net.get_parameter("fc.weight").unwrap().tensor().unwrap();
    assert_eq!(
        fc_in_varmap
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap(),
        fc_param.flatten_all().unwrap().to_vec1::<f32>().unwrap()
    );
    // Freezing a wrapped layer stops its updates.
    net.freeze("fc").unwrap();
    assert_eq!(net.trainable_vars().unwrap().len(), 5);
}

#[derive(Module)]
struct Shared {
    a: Arc<Linear>,
    b: Arc<Linear>,
    head: Linear,
}

#[test]
fn summary_lists_modules_and_totals() {
    let t = tower();
    t.freeze("blocks").unwrap();
    let s = t.summary();
    let rows: Vec<(&str, &str, usize)> = s
        .rows
        .iter()
        .map(|r| (r.path.as_str(), r.type_name.as_str(), r.params))
        .collect();
    assert_eq!(
        rows[..4],
        [
            ("", "Tower", 10 + 12 + 6 + 3 + 9),
            ("stem", "Sequential", 10),
            ("stem.0", "Linear", 10),
            ("blocks", "ModuleList<Linear>", 12),
        ]
    );
    assert_eq!(s.total_params, t.num_parameters());
    assert_eq!(s.trainable_params, t.num_parameters() - 12);
    assert_eq!(s.non_trainable_params, 12);
    assert_eq!(s.param_bytes, 4 * t.num_parameters());
    let text = s.to_string();
    assert!(text.contains("Total params: 40"), "{text}");
    assert!(text.contains("Trainable params: 28"), "{text}");
    assert!(text.contains("Non-trainable params: 12"), "{text}");
    assert!(text.contains("Params size (MB): 0.00"), "{text}");
    let blocks_line = text
        .lines()
        .find(|l| l.trim_start().starts_with("blocks "))
        .unwrap();
    assert!(blocks_line.ends_with("no"), "{blocks_line}");
    let root_line = text.lines().find(|l| l.starts_with("(root)")).unwrap();
    assert!(root_line.ends_with("partly"), "{root_line}");
    let relu_line = text.lines().find(|l| l.contains("ReLU")).unwrap();
    assert!(relu_line.ends_with('-'), "{relu_line}");

    // A module shared through Arc, and a tied weight, count once.
    let shared = Arc::new(Linear::new(5, 5, &dev()).unwrap());
    let head = Linear::new(5, 5, &dev()).unwrap();
    let tied = Linear::from_params(shared.weight.clone(), head.bias.clone());
    let m = Shared {
        a: shared.clone(),
        b: shared,
        head: tied,
    };
    let s = m.summary();
    assert_eq!(s.total_params, 30 + 5);
    assert_eq!(
        s.rows.iter().map(|r| r.path.as_str()).collect::<Vec<_>>(),
        ["", "a", "head"]
    );
    assert_eq!(s.rows[2].params, 5);
}
