//! Mixed precision against PyTorch's CPU `torch.autocast`: `fixtures/pytorch/autocast/`
//! (`fixtures/make_autocast_fixtures.py`). A small model written by a user from the runtime's
//! layers (`Linear`, `LayerNorm`, softmax attention, GELU, `cross_entropy`) runs under
//! `autocast("cpu", BF16)` and `autocast("cpu", F16)`: each output has PyTorch's dtype and values
//! within half-precision rounding of PyTorch's, the parameters stay float32 and get float32
//! gradients close to PyTorch's autocast gradients. The op table (`dtypes.json`) holds the dtype
//! PyTorch returns for each op the runtime follows, from a float32 and from a half input.

use std::collections::HashMap;
use std::path::PathBuf;

use module_runtime::amp::{autocast, autocast_cast, is_autocast_enabled, Autocast, AutocastOp};
use module_runtime::nn::functional::{scaled_dot_product_attention, SdpaOptions};
use module_runtime::nn::loss::{cross_entropy, mse_loss};
use module_runtime::nn::{
    AttentionInput, BatchNorm1d, Conv1d, ConvTranspose2d, GroupNorm, LayerNorm, Linear, LogSoftmax,
    MultiheadAttention, PReLU, RmsNorm, Softmax, GELU,
};
use module_runtime::prelude::*;

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures/pytorch/autocast")
}

fn table() -> serde_json::Value {
    let text = std::fs::read_to_string(dir().join("dtypes.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn name(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        other => panic!("unexpected dtype {other:?}"),
    }
}

/// The user's model: the runtime's layers, and attention written with candle's ops.
#[derive(Module)]
struct Net {
    fc_in: Linear,
    norm: LayerNorm,
    q: Linear,
    k: Linear,
    v: Linear,
    fc_mid: Linear,
    fc_out: Linear,
}

impl Net {
    fn new() -> Result<Self> {
        let dev = &Device::Cpu;
        Ok(Self {
            fc_in: Linear::new(8, 16, dev)?,
            norm: LayerNorm::new(16, dev)?,
            q: Linear::new(16, 16, dev)?,
            k: Linear::new(16, 16, dev)?,
            v: Linear::new(16, 16, dev)?,
            fc_mid: Linear::new(16, 32, dev)?,
            fc_out: Linear::new(32, 4, dev)?,
        })
    }

    /// Every step's output by the fixture's names.
    fn run(&self, x: &Tensor, target: &Tensor) -> Result<Vec<(&'static str, Tensor)>> {
        let mut out = Vec::new();
        let h = self.fc_in.call(x)?;
        out.push(("fc_in", h.clone()));
        let h = self.norm.call(&h)?;
        out.push(("norm", h.clone()));
        let (q, k, v) = (self.q.call(&h)?, self.k.call(&h)?, self.v.call(&h)?);
        out.push(("q", q.clone()));
        // Products written with candle's ops take the policy through `autocast_cast`.
        let [q, kt] = autocast_cast(AutocastOp::MatMul, [&q, &k.transpose(1, 2)?])?;
        let s = (q.matmul(&kt)? * 0.25)?;
        out.push(("scores", s.clone()));
        let p = Softmax::new(-1).call(&s)?;
        out.push(("probs", p.clone()));
        let [p, v] = autocast_cast(AutocastOp::MatMul, [&p, &v])?;
        let a = p.matmul(&v)?;
        out.push(("attn", a.clone()));
        let [h, a] = module_runtime::amp::promote([&h, &a])?;
        let r = (h + a)?;
        out.push(("residual", r.clone()));
        let g = GELU::new().call(&self.fc_mid.call(&r)?)?;
        out.push(("gelu", g.clone()));
        let logits = self.fc_out.call(&g)?;
        out.push(("logits", logits.clone()));
        let loss = cross_entropy(&logits.reshape(((), 4))?, target)?;
        out.push(("loss", loss));
        Ok(out)
    }
}

fn max_rel(a: &Tensor, b: &Tensor) -> f32 {
    let a = a.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
    let b = b.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
    let scale = b
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
        .max(1e-3);
    let diff = (a - b).unwrap().abs().unwrap().max_all().unwrap();
    diff.to_scalar::<f32>().unwrap() / scale
}

fn check_model(dtype: DType, tolerance: f32, grad_tolerance: f32) {
    let file = dir().join(format!("model_{}.safetensors", name(dtype)));
    let fixture: HashMap<String, Tensor> =
        candle_core::safetensors::load(file, &Device::Cpu).unwrap();
    let net = Net::new().unwrap();
    let params: HashMap<String, Tensor> = fixture
        .iter()
        .filter_map(|(k, v)| k.strip_prefix("param.").map(|k| (k.to_owned(), v.clone())))
        .collect();
    net.load_state_dict(&StateDict::from(params), &LoadOptions::default())
        .unwrap();
    let (x, target) = (&fixture["x"], &fixture["target"]);
    let outputs = autocast("cpu", dtype, || net.run(x, target)).unwrap();
    let dtypes = &table()["model"][name(dtype)];
    for (step, y) in &outputs {
        assert_eq!(name(y.dtype()), dtypes[step], "{step}: PyTorch's dtype");
        let rel = max_rel(y, &fixture[&format!("out.{step}")]);
        assert!(rel < tolerance, "{step}: {rel} from PyTorch's");
    }
    let loss = &outputs.last().unwrap().1;
    let grads = loss.backward().unwrap();
    for (path, p) in net.named_parameters() {
        assert_eq!(p.dtype(), DType::F32, "{path}: master weights stay float32");
        let g = grads.get(&p.tensor().unwrap()).expect("a gradient");
        assert_eq!(g.dtype(), DType::F32, "{path}: a float32 gradient");
        let rel = max_rel(g, &fixture[&format!("grad.{path}")]);
        assert!(
            rel < grad_tolerance,
            "{path}: gradient {rel} from PyTorch's"
        );
    }
    // Nothing changes outside the scope.
    assert!(!is_autocast_enabled("cpu"));
    let plain = net.run(x, target).unwrap();
    assert!(plain.iter().all(|(_, y)| y.dtype() == DType::F32));
}

// The forward values come out equal to PyTorch's on the machines measured (the same roundings
// at the same points: each op computes in float32 and rounds once); the bounds allow one
// rounding step of the half dtype (8 bits of mantissa for bfloat16, 11 for float16), relative to
// the largest value. PyTorch's backward runs some elementwise ops' gradients in the half dtype
// where the runtime computes them in float32 and rounds at the casts: measured up to 2^-5.5
// (bfloat16) and 2^-8 (float16) of the largest gradient, on the small bias gradients.
#[test]
fn bfloat16_model_matches_pytorch() {
    check_model(DType::BF16, 2f32.powi(-7), 2f32.powi(-5));
}

#[test]
fn float16_model_matches_pytorch() {
    check_model(DType::F16, 2f32.powi(-10), 2f32.powi(-7));
}

#[test]
fn disabled_inside_runs_in_float32() {
    let fc = Linear::new(4, 3, &Device::Cpu).unwrap();
    let x = Tensor::ones((2, 4), DType::F32, &Device::Cpu).unwrap();
    let (outer, inner, again) = autocast("cpu", DType::BF16, || {
        let outer = fc.call(&x)?;
        let inner = Autocast::new("cpu").enabled(false).run(|| fc.call(&x))?;
        Ok::<_, Error>((outer, inner, fc.call(&x)?))
    })
    .unwrap();
    assert_eq!(outer.dtype(), DType::BF16);
    assert_eq!(inner.dtype(), DType::F32);
    assert_eq!(again.dtype(), DType::BF16);
    // The float32 result is the plain layer's, to the bit.
    let plain = fc.call(&x).unwrap();
    assert_eq!(max_rel(&inner, &plain), 0.0);
}

/// Each op's output dtype under CPU autocast, from a float32 input and from a half one, as
/// PyTorch's (`dtypes.json` `ops`).
#[test]
fn op_dtypes_are_pytorchs() {
    let table = table();
    let dev = &Device::Cpu;
    let x32 = Tensor::randn(0f32, 1.0, (4, 6, 8), dev).unwrap();
    let t = Tensor::new(&[0i64, 3, 1, 2], dev).unwrap();
    let fc = Linear::new(8, 3, dev).unwrap();
    let conv = Conv1d::new(6, 3, 3, dev).unwrap();
    let conv_t = ConvTranspose2d::new(4, 3, 3, dev).unwrap();
    let ln = LayerNorm::new(8, dev).unwrap();
    let rms = RmsNorm::new(8, dev).unwrap();
    let gn = GroupNorm::new(2, 6, dev).unwrap();
    let bn = BatchNorm1d::new(6, dev).unwrap();
    let prelu = PReLU::new(6, dev).unwrap();
    let mha = MultiheadAttention::new(8, 2, dev).unwrap();
    type Op<'a> = Box<dyn Fn(&Tensor) -> Result<Tensor> + 'a>;
    let ops: Vec<(&str, Op)> = vec![
        ("linear", Box::new(|x| fc.call(x))),
        ("conv1d", Box::new(|x| conv.call(x))),
        (
            "conv_transpose2d",
            Box::new(|x| conv_t.call(&x.unsqueeze(0)?)),
        ),
        ("layer_norm", Box::new(|x| ln.call(x))),
        ("rms_norm", Box::new(|x| rms.call(x))),
        ("group_norm", Box::new(|x| gn.call(x))),
        ("batch_norm", Box::new(|x| bn.call(x))),
        ("softmax", Box::new(|x| Softmax::new(-1).call(x))),
        ("log_softmax", Box::new(|x| LogSoftmax::new(-1).call(x))),
        ("gelu", Box::new(|x| GELU::new().call(x))),
        ("prelu", Box::new(|x| prelu.call(x))),
        (
            "sdpa",
            Box::new(|x| {
                let x = x.unsqueeze(0)?;
                scaled_dot_product_attention(&x, &x, &x, None, SdpaOptions::default())
            }),
        ),
        (
            "multihead_attention",
            Box::new(|x| {
                let x = x.transpose(0, 1)?; // [L, B, E], PyTorch's default layout
                Ok(mha.call(AttentionInput::new(&x, &x, &x))?.0)
            }),
        ),
        (
            "cross_entropy",
            Box::new(|x| cross_entropy(&x.narrow(1, 0, 1)?.squeeze(1)?, &t)),
        ),
        ("mse_loss", Box::new(|x| mse_loss(x, &(x * 2.0)?))),
    ];
    for dtype in [DType::BF16, DType::F16] {
        for (op, f) in &ops {
            for (i, x) in [x32.clone(), x32.to_dtype(dtype).unwrap()]
                .iter()
                .enumerate()
            {
                let y = autocast("cpu", dtype, || f(x)).unwrap();
                let expected = &table["ops"][op][name(dtype)][i];
                assert_eq!(
                    name(y.dtype()),
                    expected,
                    "{op} under {dtype:?}, input {:?}",
                    x.dtype()
                );
            }
        }
    }
    // The running statistics stay float32 after training steps on half-precision inputs.
    for (_, b) in bn.named_buffers() {
        assert_eq!(
            b.dtype(),
            if b.dtype() == DType::I64 {
                DType::I64
            } else {
                DType::F32
            }
        );
    }
}

/// The weight cache: within one scope a float32 parameter is cast once, however many products
/// read it; it is emptied when the scope ends. (The bfloat16 kernel reads parameters in place.)
#[test]
fn parameter_casts_are_cached_per_scope() {
    let fc = Linear::new(4, 4, &Device::Cpu).unwrap();
    let x = Tensor::ones((2, 4), DType::F32, &Device::Cpu).unwrap();
    autocast("cpu", DType::F16, || {
        fc.call(&fc.call(&x)?)?;
        assert_eq!(
            module_runtime::amp::autocast_cache_len(),
            2,
            "weight and bias, once each"
        );
        Ok::<_, Error>(())
    })
    .unwrap();
    assert_eq!(module_runtime::amp::autocast_cache_len(), 0);
    // The AVX512-BF16 kernel reads float32 parameters in place, rounding them as it reads: no
    // cast, so nothing cached; elsewhere bfloat16 takes the cache as float16 does.
    let bf16_kernel = module_runtime::backends::cpu::kernel_choice().bf16_products;
    autocast("cpu", DType::BF16, || {
        fc.call(&fc.call(&x)?)?;
        let cached = module_runtime::amp::autocast_cache_len();
        assert_eq!(cached, if bf16_kernel { 0 } else { 2 });
        Ok::<_, Error>(())
    })
    .unwrap();
}

/// `checkpoint` recomputes under the forward's autocast settings, as PyTorch's does: the
/// recomputation outside the scope casts as the forward did, and the gradients are those of the
/// same autocast run without checkpointing, to the bit.
#[test]
fn checkpoint_recomputes_under_the_forwards_autocast() {
    let dev = &Device::Cpu;
    let fc1 = std::sync::Arc::new(Linear::new(8, 16, dev).unwrap());
    let fc2 = std::sync::Arc::new(Linear::new(16, 4, dev).unwrap());
    let x = Tensor::randn(0f32, 1.0, (3, 8), dev).unwrap();
    let block = {
        let (fc1, fc2) = (fc1.clone(), fc2.clone());
        move |xs: &[Tensor]| -> Result<Vec<Tensor>> {
            Ok(vec![fc2.call(&GELU::new().call(&fc1.call(&xs[0])?)?)?])
        }
    };
    let grads = |checkpointed: bool| -> Vec<Vec<f32>> {
        let y = autocast("cpu", DType::BF16, || {
            if checkpointed {
                Ok::<_, Error>(
                    module_runtime::checkpoint(block.clone(), std::slice::from_ref(&x))?.remove(0),
                )
            } else {
                Ok(block(std::slice::from_ref(&x))?.remove(0))
            }
        })
        .unwrap();
        assert_eq!(y.dtype(), DType::BF16);
        let g = y
            .to_dtype(DType::F32)
            .unwrap()
            .sqr()
            .unwrap()
            .sum_all()
            .unwrap();
        let g = g.backward().unwrap();
        [&fc1.weight, &fc2.weight]
            .iter()
            .map(|p| {
                let t = g.get(&p.tensor().unwrap()).unwrap();
                assert_eq!(t.dtype(), DType::F32);
                t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
            })
            .collect()
    };
    assert_eq!(grads(true), grads(false));
}
