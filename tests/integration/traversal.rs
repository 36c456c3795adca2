//! Traversal, identity, modes, freezing and conversions through the public API (issue 2's
//! "must show" cases).

use std::collections::BTreeMap;
use std::sync::Arc;

use candle_nn::Optimizer;
use module_runtime::prelude::*;
use module_runtime::Error;

/// The device under test: `MODULE_DEVICE` (`cuda:0`, …), the CPU when unset.
fn dev() -> Device {
    candle_module::device_from_env().expect("MODULE_DEVICE names a usable device")
}

#[derive(Module)]
struct Net {
    fc1: Linear,
    fc2: Linear,
}

fn net() -> Net {
    Net {
        fc1: Linear::new(2, 3, &dev()).unwrap(),
        fc2: Linear::new(3, 1, &dev()).unwrap(),
    }
}

fn names<T>(items: Vec<(String, T)>) -> Vec<String> {
    items.into_iter().map(|(n, _)| n).collect()
}

#[test]
fn named_parameters_in_declaration_order() {
    let net = net();
    assert_eq!(
        names(net.named_parameters()),
        ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    );
    let shapes: Vec<Vec<usize>> = net
        .parameters()
        .iter()
        .map(|p| p.shape().dims().to_vec())
        .collect();
    assert_eq!(shapes, [vec![3, 2], vec![3], vec![1, 3], vec![1]]);
    assert_eq!(net.num_parameters(), 6 + 3 + 3 + 1);
}

#[derive(Module)]
struct Block {
    proj: Linear,
    #[module(skip)]
    _note: &'static str,
}

#[derive(Module)]
struct Stack {
    layers: Vec<Block>,
    head: Option<Linear>,
    width: usize,
    shape: Vec<usize>,
}

#[test]
fn vec_indices_and_absent_option() {
    let stack = Stack {
        layers: (0..2)
            .map(|_| Block {
                proj: Linear::no_bias(2, 2, &dev()).unwrap(),
                _note: "",
            })
            .collect(),
        head: None,
        width: 2,
        shape: vec![1, 2],
    };
    assert_eq!(
        names(stack.named_parameters()),
        ["layers.0.proj.weight", "layers.1.proj.weight"]
    );
    assert_eq!(
        names(stack.named_modules()),
        [
            "",
            "layers",
            "layers.0",
            "layers.0.proj",
            "layers.1",
            "layers.1.proj"
        ]
    );
    assert_eq!(names(stack.named_children()), ["layers"]);
    assert_eq!(stack.width, 2);
    assert_eq!(stack.shape.len(), 2);
}

#[derive(Module)]
struct Tied {
    a: Linear,
    b: Linear,
}

#[test]
fn shared_parameters_are_listed_once() {
    let lin = Linear::new(2, 2, &dev()).unwrap();
    let tied = Tied {
        a: lin.clone(),
        b: lin,
    };
    assert_eq!(names(tied.named_parameters()), ["a.weight", "a.bias"]);
    assert_eq!(
        names(tied.named_parameters_with(&module_runtime::Names::new().keep_duplicates())),
        ["a.weight", "a.bias", "b.weight", "b.bias"]
    );
    assert_eq!(tied.trainable_vars().unwrap().len(), 2);
    // A write through one alias is seen through the other.
    tied.a
        .weight
        .set(&Tensor::ones((2, 2), DType::F32, &dev()).unwrap())
        .unwrap();
    let b = tied.b.weight.tensor().unwrap().sum_all().unwrap();
    assert_eq!(b.to_scalar::<f32>().unwrap(), 4.0);
}

#[derive(Module)]
struct Pair {
    l1: Arc<Linear>,
    l2: Arc<Linear>,
}

#[derive(Module)]
struct Seq(Arc<Pair>, Arc<Pair>);

#[test]
fn shared_modules_are_listed_once() {
    let l = Arc::new(Linear::new(2, 2, &dev()).unwrap());
    let n = Arc::new(Pair {
        l1: l.clone(),
        l2: l,
    });
    let seq = Seq(n.clone(), n);
    assert_eq!(names(seq.named_modules()), ["", "0", "0.l1"]);
    assert_eq!(names(seq.named_parameters()), ["0.l1.weight", "0.l1.bias"]);
    assert_eq!(
        seq.named_parameters_with(&module_runtime::Names::new().keep_duplicates())
            .len(),
        8
    );
    assert_eq!(seq.trainable_vars().unwrap().len(), 2);
}

#[test]
fn cloned_struct_is_a_new_module_with_the_same_parameters() {
    let pair = Pair {
        l1: Arc::new(Linear::new(2, 2, &dev()).unwrap()),
        l2: Arc::new(Linear::new(2, 2, &dev()).unwrap()),
    };
    #[derive(Module)]
    struct Two {
        x: Linear,
        y: Linear,
    }
    let x = (*pair.l1).clone();
    let two = Two { y: x.clone(), x };
    // Two modules, one set of parameters.
    assert_eq!(names(two.named_modules()), ["", "x", "y"]);
    assert_eq!(names(two.named_parameters()), ["x.weight", "x.bias"]);
}

#[derive(Module)]
struct Encoder {
    layers: Vec<Attn>,
}

#[derive(Module)]
struct Attn {
    attn: Linear,
}

#[derive(Module)]
struct Model {
    encoder: Encoder,
    head: Linear,
}

fn model() -> Model {
    Model {
        encoder: Encoder {
            layers: (0..2)
                .map(|_| Attn {
                    attn: Linear::new(3, 3, &dev()).unwrap(),
                })
                .collect(),
        },
        head: Linear::new(3, 2, &dev()).unwrap(),
    }
}

#[test]
fn freeze_by_pattern_and_train() {
    let model = model();
    assert_eq!(model.freeze("encoder.*").unwrap(), 4);
    let frozen: Vec<String> = model
        .named_parameters()
        .into_iter()
        .filter(|(_, p)| !p.requires_grad())
        .map(|(n, _)| n)
        .collect();
    assert_eq!(
        frozen,
        [
            "encoder.layers.0.attn.weight",
            "encoder.layers.0.attn.bias",
            "encoder.layers.1.attn.weight",
            "encoder.layers.1.attn.bias"
        ]
    );
    let vars = model.trainable_vars().unwrap();
    assert_eq!(vars.len(), 2);

    let before: Vec<Vec<f32>> = model
        .parameters()
        .iter()
        .map(|p| {
            p.var()
                .unwrap()
                .as_tensor()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap()
        })
        .collect();
    let mut opt = candle_nn::AdamW::new_lr(vars, 0.1).unwrap();
    let x = Tensor::randn(0f32, 1., (4, 3), &dev()).unwrap();
    let mut h = x;
    for layer in &model.encoder.layers {
        h = layer.attn.call(&h).unwrap();
    }
    let loss = model
        .head
        .call(&h)
        .unwrap()
        .sqr()
        .unwrap()
        .sum_all()
        .unwrap();
    opt.backward_step(&loss).unwrap();
    let after: Vec<Vec<f32>> = model
        .parameters()
        .iter()
        .map(|p| {
            p.var()
                .unwrap()
                .as_tensor()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap()
        })
        .collect();
    for i in 0..4 {
        assert_eq!(before[i], after[i], "frozen parameter {i} changed");
    }
    for i in 4..6 {
        assert_ne!(
            before[i], after[i],
            "trainable parameter {i} did not change"
        );
    }

    assert_eq!(model.unfreeze("**").unwrap(), 6);
    assert_eq!(model.trainable_vars().unwrap().len(), 6);
    assert!(matches!(
        model.freeze("decoder"),
        Err(Error::NoMatch { .. })
    ));
    assert!(matches!(
        model.freeze("a..b"),
        Err(Error::InvalidPattern { .. })
    ));
}

#[derive(Module)]
struct WithBuffers {
    fc: Linear,
    position_ids: Buffer,
    stats: Buffer,
}

#[test]
fn to_dtype_converts_floats_only() {
    let m = WithBuffers {
        fc: Linear::new(2, 2, &dev()).unwrap(),
        position_ids: Buffer::new(Tensor::arange(0i64, 5, &dev()).unwrap()),
        stats: Buffer::non_persistent(Tensor::zeros(3, DType::F32, &dev()).unwrap()),
    };
    m.to_dtype(DType::F16).unwrap();
    for p in m.parameters() {
        assert_eq!(p.dtype(), DType::F16);
    }
    assert_eq!(m.position_ids.dtype(), DType::I64);
    assert_eq!(m.stats.dtype(), DType::F16);
    assert_eq!(
        names(m.named_buffers()),
        ["position_ids", "stats"],
        "non-persistent buffers are listed too"
    );
    assert!(!m.stats.is_persistent());
    // Still computes, in the new dtype.
    let y =
        m.fc.call(&Tensor::ones((1, 2), DType::F16, &dev()).unwrap())
            .unwrap();
    assert_eq!(y.dtype(), DType::F16);
    m.to_device(&dev()).unwrap();
    // PyTorch's `Module.to(torch.int64)` is refused too ("nn.Module.to only accepts floating point
    // or complex dtypes", torch/nn/modules/module.py); the error says which dtype was asked for.
    let err = m.to_dtype(DType::I64).unwrap_err();
    assert!(
        matches!(err, Error::NonFloatDType { dtype: DType::I64 }),
        "{err}"
    );
    assert!(err.to_string().contains("I64"), "{err}");
}

#[test]
fn get_submodule_errors_name_the_path() {
    let model = model();
    let lin: &Linear = model.get_submodule("encoder.layers.1.attn").unwrap();
    assert_eq!(lin.in_features(), 3);
    let err = model
        .get_submodule::<Linear>("encoder.layers.3.attn")
        .unwrap_err();
    match &err {
        Error::NoSubmodule {
            path,
            parent,
            missing,
            children,
            ..
        } => {
            assert_eq!(path, "encoder.layers.3.attn");
            assert_eq!(parent, "encoder.layers");
            assert_eq!(missing, "3");
            assert_eq!(children, &["0", "1"]);
        }
        other => panic!("unexpected {other:?}"),
    }
    let msg = err.to_string();
    assert!(
        msg.contains("encoder.layers.3.attn") && msg.contains("`3`"),
        "{msg}"
    );

    let err = model.get_submodule::<Encoder>("head").err().unwrap();
    assert_eq!(
        err.to_string(),
        "submodule `head` is a `Linear`, not a `Encoder`"
    );
    assert!(matches!(
        model.get_submodule::<Linear>("head.weight"),
        Err(Error::WrongKind { .. })
    ));
    let w = model.get_parameter("encoder.layers.0.attn.weight").unwrap();
    assert_eq!(w.shape().dims(), [3, 3]);
    assert!(model.get_parameter("encoder.layers.0.attn").is_err());
    assert!(model.get_parameter("head.nope").is_err());
}

#[test]
fn get_submodule_mut_replaces_a_layer() {
    let mut model = model();
    let head: &mut Linear = model.get_submodule_mut("head").unwrap();
    *head = Linear::new(3, 7, &dev()).unwrap();
    assert_eq!(model.head.out_features(), 7);
    let shared = Pair {
        l1: Arc::new(Linear::new(1, 1, &dev()).unwrap()),
        l2: Arc::new(Linear::new(1, 1, &dev()).unwrap()),
    };
    let _alias = shared.l1.clone();
    let mut shared = shared;
    assert!(matches!(
        shared.get_submodule_mut::<Linear>("l1"),
        Err(Error::SharedModule { .. })
    ));
    assert!(shared.get_submodule_mut::<Linear>("l2").is_ok());
}

#[test]
fn apply_visits_children_before_parents() {
    let model = model();
    let mut order = Vec::new();
    model.apply(&mut |m| order.push(short(m.type_name())));
    assert_eq!(
        order,
        [
            "Linear",
            "Attn",
            "Linear",
            "Attn",
            "Vec<Attn>",
            "Encoder",
            "Linear",
            "Model"
        ]
    );
}

fn short(name: &str) -> String {
    module_runtime::short_type_name(name)
}

#[derive(Module)]
struct WithMode {
    inner: Inner,
    mode: Mode,
}

#[derive(Module)]
struct Inner {
    mode: Mode,
    fc: Linear,
}

#[test]
fn train_and_eval_propagate() {
    let m = WithMode {
        inner: Inner {
            mode: Mode::new(),
            fc: Linear::new(1, 1, &dev()).unwrap(),
        },
        mode: Mode::new(),
    };
    assert!(m.is_training());
    m.eval();
    assert!(!m.is_training());
    assert!(!m.inner.mode.is_training());
    m.inner.train();
    assert!(m.inner.is_training());
    assert!(!m.mode.is_training(), "per-module flags");
    m.train();
    assert!(m.mode.is_training() && m.inner.mode.is_training());
}

#[derive(Module)]
struct Everything {
    list: [Linear; 2],
    map: BTreeMap<String, Linear>,
    pair: (Linear, Option<Linear>),
    boxed: Box<Linear>,
    #[module(rename = "LayerNorm")]
    norm: Linear,
    #[module(flatten)]
    flat: Net,
}

#[test]
fn containers_rename_and_flatten() {
    let lin = || Linear::no_bias(1, 1, &dev()).unwrap();
    let mut map = BTreeMap::new();
    map.insert("z".to_string(), lin());
    map.insert("a".to_string(), lin());
    let e = Everything {
        list: [lin(), lin()],
        map,
        pair: (lin(), None),
        boxed: Box::new(lin()),
        norm: lin(),
        flat: net(),
    };
    assert_eq!(
        names(e.named_parameters()),
        [
            "list.0.weight",
            "list.1.weight",
            "map.a.weight",
            "map.z.weight",
            "pair.0.weight",
            "boxed.weight",
            "LayerNorm.weight",
            "fc1.weight",
            "fc1.bias",
            "fc2.weight",
            "fc2.bias"
        ]
    );
    assert!(e.get_submodule::<Linear>("LayerNorm").is_ok());
    assert!(e.get_submodule::<Linear>("fc2").is_ok());
    assert!(e.get_submodule::<Linear>("boxed").is_ok());
}

#[derive(Module)]
enum Head {
    Linear(Linear),
    Deep { first: Linear, second: Linear },
    Identity,
}

#[derive(Module)]
struct WithHead {
    head: Head,
}

#[test]
fn enums() {
    let m = WithHead {
        head: Head::Linear(Linear::new(1, 1, &dev()).unwrap()),
    };
    assert_eq!(names(m.named_parameters()), ["head.weight", "head.bias"]);
    assert!(m.get_submodule::<Linear>("head").is_ok());
    let m = WithHead {
        head: Head::Deep {
            first: Linear::no_bias(1, 1, &dev()).unwrap(),
            second: Linear::no_bias(1, 1, &dev()).unwrap(),
        },
    };
    assert_eq!(
        names(m.named_parameters()),
        ["head.first.weight", "head.second.weight"]
    );
    let m = WithHead {
        head: Head::Identity,
    };
    assert!(m.named_parameters().is_empty());
    assert_eq!(names(m.named_modules()), ["", "head"]);
}

#[derive(Module)]
struct Generic<L, const N: usize> {
    layers: Vec<L>,
    sizes: [usize; N],
}

#[test]
fn generics() {
    let g = Generic::<Linear, 2> {
        layers: vec![Linear::no_bias(1, 1, &dev()).unwrap()],
        sizes: [1, 2],
    };
    assert_eq!(names(g.named_parameters()), ["layers.0.weight"]);
    assert_eq!(g.sizes.len(), 2);
}

#[test]
fn dyn_module_downcasts() {
    let model = model();
    let dynamic: &dyn Module = &model;
    assert_eq!(dynamic.named_parameters().len(), 6);
    let (path, head) = &dynamic.named_children()[1];
    assert_eq!(path, "head");
    assert!(head.downcast_ref::<Linear>().is_some());
    assert!(head.downcast_ref::<Encoder>().is_none());
}

#[test]
fn model_is_send_and_sync() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Model>();
    assert_send_sync::<Param>();
    assert_send_sync::<Buffer>();
}

#[test]
fn params_must_be_float() {
    let err = Param::new(Tensor::arange(0i64, 3, &dev()).unwrap()).unwrap_err();
    assert!(err.to_string().contains("I64"), "{err}");
}
