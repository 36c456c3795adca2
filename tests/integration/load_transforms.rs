//! Checkpoints that do not map one to one onto a model, made by PyTorch
//! (`fixtures/transforms/make_fixtures.py`): `nn.MultiheadAttention`'s stacked `in_proj_weight`
//! split onto three `Linear`s, GPT-2's `Conv1D` blocks transposed and split into `Linear`s, an
//! LSTM's gate chunks, separate projections concatenated into a fused one, each giving PyTorch's
//! outputs, and the errors, each leaving the model as it was; state-dict hooks by type and by path
//! in `load_transforms_hooks.rs`.

use std::path::PathBuf;

use module_runtime::nn::Linear;
use module_runtime::prelude::*;
use module_runtime::{StateDict, TransformError};

#[path = "load_transforms_hooks.rs"]
mod hooks;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/transforms")
        .join(name)
}

fn io(name: &str) -> StateDict {
    StateDict::read(
        fixture(&format!("{name}_io.safetensors")),
        &LoadOptions::default(),
    )
    .unwrap()
}

fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.dims(), b.dims());
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar()
        .unwrap()
}

/// The transform error inside `err`.
fn transform_error(err: &Error) -> &TransformError {
    match err {
        Error::Transform(e) => e,
        other => panic!("not a transform error: {other}"),
    }
}

fn linear(i: usize, o: usize) -> Linear {
    Linear::new(i, o, &Device::Cpu).unwrap()
}

/// Multi-head attention over `[B, T, E]` from separate projections (`mask`: causal).
fn attention(q: &Tensor, k: &Tensor, v: &Tensor, heads: usize, causal: bool) -> Result<Tensor> {
    let (b, t, e) = q.dims3()?;
    let d = e / heads;
    let split = |x: &Tensor| x.reshape((b, t, heads, d))?.transpose(1, 2)?.contiguous();
    let (q, k, v) = (split(q)?, split(k)?, split(v)?);
    let mut scores = (q.matmul(&k.t()?)? / (d as f64).sqrt())?;
    if causal {
        let mask: Vec<f32> = (0..t * t)
            .map(|i| {
                if i % t > i / t {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            })
            .collect();
        scores = scores.broadcast_add(&Tensor::from_vec(mask, (t, t), &Device::Cpu)?)?;
    }
    let y = candle_nn_softmax(&scores)?.matmul(&v)?;
    Ok(y.transpose(1, 2)?.reshape((b, t, e))?)
}

fn candle_nn_softmax(x: &Tensor) -> Result<Tensor> {
    let max = x.max_keepdim(3)?;
    let e = x.broadcast_sub(&max)?.exp()?;
    Ok(e.broadcast_div(&e.sum_keepdim(3)?)?)
}

#[derive(Module)]
struct SplitAttention {
    q: Linear,
    k: Linear,
    v: Linear,
    out_proj: Linear,
}

impl SplitAttention {
    fn new() -> Self {
        Self {
            q: linear(8, 8),
            k: linear(8, 8),
            v: linear(8, 8),
            out_proj: linear(8, 8),
        }
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (q, k, v) = (self.q.call(x)?, self.k.call(x)?, self.v.call(x)?);
        self.out_proj.call(&attention(&q, &k, &v, 2, false)?)
    }
}

fn mha_split() -> LoadOptions {
    LoadOptions::default()
        .split("in_proj_weight", 0, ["q.weight", "k.weight", "v.weight"])
        .split("in_proj_bias", 0, ["q.bias", "k.bias", "v.bias"])
}

#[test]
fn multihead_attention_in_proj_splits_onto_three_linears() {
    let model = SplitAttention::new();
    let report = model
        .load_state_dict(fixture("mha.pth"), &mha_split())
        .unwrap();
    assert_eq!(report.loaded, 8);
    assert_eq!(report.transforms.len(), 2);
    assert_eq!(report.transforms[0].consumed, ["in_proj_weight"]);
    assert_eq!(
        report.transforms[0].produced,
        ["q.weight", "k.weight", "v.weight"]
    );
    assert_eq!(
        report.transforms[1].rule,
        r#"split("in_proj_bias", 0, ["q.bias", "k.bias", "v.bias"])"#
    );
    let io = io("mha");
    let y = model.forward(io.get("input").unwrap()).unwrap();
    let diff = max_diff(&y, io.get("output").unwrap());
    assert!(
        diff <= 1e-6,
        "attention output differs from PyTorch's by {diff}"
    );
}

/// GPT-2's `Conv1D` blocks as `Linear`s: `c_attn` transposed, then split into q, k, v.
#[derive(Module)]
struct Gpt2Attention {
    q: Linear,
    k: Linear,
    v: Linear,
    c_proj: Linear,
}

#[derive(Module)]
struct Gpt2Mlp {
    c_fc: Linear,
    c_proj: Linear,
}

#[derive(Module)]
struct Gpt2Block {
    attn: Gpt2Attention,
    mlp: Gpt2Mlp,
}

#[derive(Module)]
struct Gpt2 {
    h: Vec<Gpt2Block>,
}

impl Gpt2 {
    fn new() -> Self {
        let block = || Gpt2Block {
            attn: Gpt2Attention {
                q: linear(8, 8),
                k: linear(8, 8),
                v: linear(8, 8),
                c_proj: linear(8, 8),
            },
            mlp: Gpt2Mlp {
                c_fc: linear(8, 32),
                c_proj: linear(32, 8),
            },
        };
        Gpt2 {
            h: vec![block(), block()],
        }
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut x = x.clone();
        for b in &self.h {
            let a = &b.attn;
            let (q, k, v) = (a.q.call(&x)?, a.k.call(&x)?, a.v.call(&x)?);
            x = (&x + a.c_proj.call(&attention(&q, &k, &v, 2, true)?)?)?;
            x = (&x + b.mlp.c_proj.call(&b.mlp.c_fc.call(&x)?.gelu()?)?)?;
        }
        Ok(x)
    }
}

fn gpt2_options() -> LoadOptions {
    let qkv = |what: &str| ["q", "k", "v"].map(|p| format!("h.*.attn.{p}.{what}"));
    LoadOptions::default()
        .transpose("h.*.attn.c_attn.weight")
        .split("h.*.attn.c_attn.weight", 0, qkv("weight"))
        .split("h.*.attn.c_attn.bias", 0, qkv("bias"))
        .transpose("h.*.attn.c_proj.weight")
        .transpose("h.*.mlp.c_fc.weight")
        .transpose("h.*.mlp.c_proj.weight")
}

#[test]
fn gpt2_conv1d_checkpoint_loads_into_linears_by_transpose_then_split() {
    let model = Gpt2::new();
    let report = model
        .load_state_dict(fixture("gpt2_conv1d.pth"), &gpt2_options())
        .unwrap();
    assert_eq!(report.loaded, 24);
    assert_eq!(
        report.transforms[0].produced,
        ["h.0.attn.c_attn.weight", "h.1.attn.c_attn.weight"]
    );
    assert_eq!(report.transforms[1].consumed.len(), 2);
    assert_eq!(report.transforms[1].produced.len(), 6);
    assert_eq!(model.h[1].attn.q.weight.shape().dims(), [8, 8]);
    let io = io("gpt2_conv1d");
    let y = model.forward(io.get("input").unwrap()).unwrap();
    let diff = max_diff(&y, io.get("output").unwrap());
    assert!(
        diff <= 1e-5,
        "GPT-2 blocks' output differs from PyTorch's by {diff}"
    );
}

/// An LSTM's four gates as separate `Linear`s (PyTorch stacks the rows i, f, g, o).
#[derive(Module)]
struct Gates {
    i: Linear,
    f: Linear,
    g: Linear,
    o: Linear,
}

#[derive(Module)]
struct GateLstm {
    ih: Gates,
    hh: Gates,
}

#[test]
fn lstm_gate_chunks_split_into_one_linear_per_gate() {
    let gates = |i| Gates {
        i: linear(i, 4),
        f: linear(i, 4),
        g: linear(i, 4),
        o: linear(i, 4),
    };
    let model = GateLstm {
        ih: gates(3),
        hh: gates(4),
    };
    let to = |side: &str, what: &str| ["i", "f", "g", "o"].map(|g| format!("{side}.{g}.{what}"));
    let options = LoadOptions::default()
        .split("weight_ih_l0", 0, to("ih", "weight"))
        .split("bias_ih_l0", 0, to("ih", "bias"))
        .split("weight_hh_l0", 0, to("hh", "weight"))
        .split("bias_hh_l0", 0, to("hh", "bias"));
    model
        .load_state_dict(fixture("lstm.pth"), &options)
        .unwrap();

    let io = io("lstm");
    let x = io.get("input").unwrap();
    let (b, t, _) = x.dims3().unwrap();
    let mut h = Tensor::zeros((b, 4), DType::F32, &Device::Cpu).unwrap();
    let mut c = h.clone();
    let mut outputs = Vec::new();
    let gate = |g: &Linear, hg: &Linear, xt: &Tensor, h: &Tensor| -> Tensor {
        (g.call(xt).unwrap() + hg.call(h).unwrap()).unwrap()
    };
    for s in 0..t {
        let xt = x.narrow(1, s, 1).unwrap().squeeze(1).unwrap();
        let (ih, hh) = (&model.ih, &model.hh);
        let sigmoid = |z: Tensor| {
            candle_core::Tensor::ones_like(&z).unwrap()
                / (z.neg().unwrap().exp().unwrap() + 1.0).unwrap()
        };
        let i = sigmoid(gate(&ih.i, &hh.i, &xt, &h)).unwrap();
        let f = sigmoid(gate(&ih.f, &hh.f, &xt, &h)).unwrap();
        let g = gate(&ih.g, &hh.g, &xt, &h).tanh().unwrap();
        let o = sigmoid(gate(&ih.o, &hh.o, &xt, &h)).unwrap();
        c = ((f * &c).unwrap() + (i * g).unwrap()).unwrap();
        h = (o * c.tanh().unwrap()).unwrap();
        outputs.push(h.clone());
    }
    let y = Tensor::stack(&outputs, 1).unwrap();
    assert!(max_diff(&y, io.get("output").unwrap()) <= 1e-6);
    assert!(max_diff(&c, &io.get("c_n").unwrap().squeeze(0).unwrap()) <= 1e-6);
}

#[derive(Module)]
struct Fused {
    qkv: Linear,
}

#[derive(Module)]
struct FusedLayer {
    attn: Fused,
}

#[derive(Module)]
struct FusedLayers {
    layers: Vec<FusedLayer>,
}

#[test]
fn separate_projections_concatenate_into_a_fused_one() {
    let model = FusedLayers {
        layers: (0..2)
            .map(|_| FusedLayer {
                attn: Fused { qkv: linear(8, 24) },
            })
            .collect(),
    };
    let parts = |what: &str| ["q", "k", "v"].map(|p| format!("layers.*.attn.{p}_proj.{what}"));
    let options = LoadOptions::default()
        .cat(parts("weight"), 0, "layers.*.attn.qkv.weight")
        .cat(parts("bias"), 0, "layers.*.attn.qkv.bias");
    let report = model
        .load_state_dict(fixture("qkv_separate.pth"), &options)
        .unwrap();
    assert_eq!(report.loaded, 4);
    assert_eq!(
        report.transforms[0].consumed[..3],
        [
            "layers.0.attn.q_proj.weight",
            "layers.0.attn.k_proj.weight",
            "layers.0.attn.v_proj.weight"
        ]
    );
    assert_eq!(
        report.transforms[0].produced,
        ["layers.0.attn.qkv.weight", "layers.1.attn.qkv.weight"]
    );
    let io = io("qkv_separate");
    for (i, layer) in model.layers.iter().enumerate() {
        let y = layer.attn.qkv.call(io.get("input").unwrap()).unwrap();
        assert!(max_diff(&y, io.get(&format!("output.{i}")).unwrap()) <= 1e-6);
    }
}

/// Each error is typed, names the rule, the keys and the shapes, and leaves the model unchanged.
#[test]
fn transform_errors_name_rule_keys_and_shapes_and_change_nothing() {
    let model = SplitAttention::new();
    let before = model.state_dict().unwrap();
    let unchanged = |model: &SplitAttention| {
        for (k, v) in model.state_dict().unwrap().iter() {
            assert_eq!(max_diff(v, before.get(k).unwrap()), 0.0, "{k} changed");
        }
    };
    let load = |options: LoadOptions| {
        model
            .load_state_dict(fixture("mha.pth"), &options)
            .unwrap_err()
    };

    // A split whose pieces do not add up (24 rows in pieces of 8, 8, 4).
    let err = load(
        LoadOptions::default()
            .split_with_sizes(
                "in_proj_weight",
                [8, 8, 4],
                0,
                ["q.weight", "k.weight", "v.weight"],
            )
            .split("in_proj_bias", 0, ["q.bias", "k.bias", "v.bias"]),
    );
    match transform_error(&err) {
        TransformError::SplitSizes {
            key, shape, sizes, ..
        } => {
            assert_eq!(key, "in_proj_weight");
            assert_eq!(shape.dims(), [24, 8]);
            assert_eq!(sizes, &[8, 8, 4]);
        }
        other => panic!("{other}"),
    }
    let msg = err.to_string();
    assert!(
        msg.contains("split_with_sizes(\"in_proj_weight\", [8, 8, 4]"),
        "{msg}"
    );
    assert!(msg.contains("[24, 8]") && msg.contains("sum 20"), "{msg}");
    unchanged(&model);

    // An equal split the size does not divide.
    let err = load(mha_split().split("out_proj.weight", 0, ["a", "b", "c"]));
    assert!(
        err.to_string()
            .contains("does not divide into 3 equal pieces"),
        "{err}"
    );

    // A concatenation whose parts disagree outside the concatenated dim.
    let err = load(mha_split().cat(["out_proj.weight", "out_proj.bias"], 0, "out_proj.weight"));
    match transform_error(&err) {
        TransformError::CatShapes { keys, shapes, .. } => {
            assert_eq!(keys, &["out_proj.weight", "out_proj.bias"]);
            assert_eq!(shapes[1].dims(), [8]);
        }
        other => panic!("{other}"),
    }
    unchanged(&model);

    // A rule that matches no checkpoint key: an error in a strict load, reported otherwise.
    let err = load(mha_split().transpose("in_proj.weight"));
    assert!(
        matches!(transform_error(&err), TransformError::NoMatch { rule, .. } if rule == r#"transpose("in_proj.weight")"#),
        "{err}"
    );
    let report = model
        .load_state_dict(
            fixture("mha.pth"),
            &mha_split().transpose("in_proj.weight").non_strict(),
        )
        .unwrap();
    assert!(report.transforms[2].consumed.is_empty());
    let model = SplitAttention::new();
    let before = model.state_dict().unwrap();
    let unchanged = |model: &SplitAttention| {
        for (k, v) in model.state_dict().unwrap().iter() {
            assert_eq!(max_diff(v, before.get(k).unwrap()), 0.0, "{k} changed");
        }
    };

    // A produced key the model lacks.
    let err = model
        .load_state_dict(
            fixture("mha.pth"),
            &LoadOptions::default()
                .split(
                    "in_proj_weight",
                    0,
                    ["q.weight", "k.weight", "value.weight"],
                )
                .split("in_proj_bias", 0, ["q.bias", "k.bias", "v.bias"]),
        )
        .unwrap_err();
    match transform_error(&err) {
        TransformError::UnknownTarget { key, near, .. } => {
            assert_eq!(key, "value.weight");
            assert!(near.contains(&"v.weight".to_owned()), "{near:?}");
        }
        other => panic!("{other}"),
    }
    unchanged(&model);

    // A missing part of a concatenation.
    let err = model
        .load_state_dict(
            fixture("qkv_separate.pth"),
            &LoadOptions::default().cat(
                ["layers.*.attn.q_proj.weight", "layers.*.attn.w_proj.weight"],
                0,
                "layers.*.q.weight",
            ),
        )
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("`layers.0.attn.w_proj.weight` is not"),
        "{err}"
    );
    unchanged(&model);
}

/// A model built empty, for a load to fill (PyTorch's meta device with `assign=True`), takes the
/// split pieces as its parameters.
#[test]
fn transforms_fill_an_empty_model_with_assign() {
    let model = {
        let _empty = module_runtime::empty_weights();
        SplitAttention::new()
    };
    model
        .load_state_dict(fixture("mha.pth"), &mha_split().assign())
        .unwrap();
    let io = io("mha");
    let y = model.forward(io.get("input").unwrap()).unwrap();
    assert!(max_diff(&y, io.get("output").unwrap()) <= 1e-6);
}
