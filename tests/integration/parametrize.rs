//! Parametrizations against PyTorch (`fixtures/make_parametrize_fixtures.py`): weight norm and
//! spectral norm (and orthogonal) on `Linear`, `Conv1d`, `Conv2d` and `ConvTranspose2d`, each
//! loaded strictly from PyTorch's parametrized state dict: eval outputs, gradients w.r.t. the
//! originals, the output and `_u`/`_v` after a training forward, the weight
//! `remove_parametrizations` leaves, the older functions' keys (`weight_g`/`weight_v`,
//! `weight_orig`/`weight_u`/`weight_v`) loaded through `legacy_keys`, our state dict's keys and
//! shapes equal to PyTorch's; and the errors, each naming the path with the model untouched.

use std::collections::HashMap;
use std::path::PathBuf;

use module_runtime::nn::parametrize::{
    is_parametrized, legacy_keys, orthogonal, parametrized_tensor, remove_parametrizations,
    spectral_norm, weight_norm, SpectralNormOptions,
};
use module_runtime::nn::{Conv1d, Conv2d, ConvTranspose2d, Embedding};
use module_runtime::prelude::*;
use module_runtime::ParametrizeError;

#[path = "parametrize_errors.rs"]
mod errors;

fn fixture(case: &str) -> HashMap<String, Tensor> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/pytorch/parametrize")
        .join(format!("{case}.safetensors"));
    candle_core::safetensors::load(path, &Device::Cpu).unwrap()
}

/// The fixture's tensors under `prefix.`, without it.
fn section(f: &HashMap<String, Tensor>, prefix: &str) -> StateDict {
    let mut keys: Vec<&String> = f.keys().collect();
    keys.sort();
    let mut sd = StateDict::new();
    for k in keys {
        if let Some(rest) = k.strip_prefix(&format!("{prefix}.")) {
            sd.insert(rest, f[k].clone());
        }
    }
    sd
}

/// `max |a - b|` over `max(1, max |b|)`: a spectral norm's output divided by a small `σ` (the
/// older function's unrefined vectors) is large.
fn rel_diff(a: &Tensor, b: &Tensor) -> f32 {
    let scale = b.abs().unwrap().flatten_all().unwrap().max(0).unwrap();
    max_diff(a, b) / scale.to_scalar::<f32>().unwrap().max(1.0)
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
        .to_scalar::<f32>()
        .unwrap()
}

fn keys_and_shapes(sd: &StateDict) -> Vec<(String, Vec<usize>)> {
    let mut v: Vec<_> = sd
        .iter()
        .map(|(k, t)| (k.to_owned(), t.dims().to_vec()))
        .collect();
    v.sort();
    v
}

/// One fixture case on `make()`'s layer, parametrized by `apply`.
fn check<M, F, A>(case: &str, make: F, apply: A)
where
    M: Module + for<'a> Forward<&'a Tensor, Output = Tensor>,
    F: Fn() -> M,
    A: Fn(&mut M),
{
    let f = fixture(case);
    let state = section(&f, "state");
    let x = &f["x"];

    // Registered on the layer PyTorch started from, the originals are PyTorch's (spectral norm's
    // vectors and a non-square orthogonal's completion are random draws, made by each runtime's
    // own generator).
    let mut model = make();
    model
        .load_state_dict(&section(&f, "plain"), &LoadOptions::default())
        .unwrap();
    apply(&mut model);
    let ours = model.state_dict().unwrap();
    for (key, expected) in state.iter() {
        let random = key.ends_with("._u") || key.ends_with("._v");
        if random || (key.ends_with(".base") && case.contains("householder")) {
            continue;
        }
        let d = max_diff(ours.get(key).unwrap(), expected);
        assert!(d < 1e-5, "{case}: {key} as registered, {d}");
    }
    // With `PARAMETRIZE_WRITE_RUST_SAVED=1`, our state dict (our own registration: spectral norm's
    // vectors from our generator) and its eval output, for the fixture script's `--check`, which
    // loads it strictly into PyTorch's parametrized layer and compares the outputs.
    if std::env::var_os("PARAMETRIZE_WRITE_RUST_SAVED").is_some() {
        model.eval();
        let mut saved = StateDict::new();
        for (k, t) in ours.iter() {
            saved.insert(format!("state.{k}"), t.clone());
        }
        saved.insert("y_eval", model.call(x).unwrap());
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("fixtures/pytorch/parametrize/rust_saved");
        std::fs::create_dir_all(&dir).unwrap();
        saved
            .save_safetensors(dir.join(format!("{case}.safetensors")))
            .unwrap();
        model.train();
    }
    // Our keys and shapes are PyTorch's: each loads strictly into the other.
    assert_eq!(
        keys_and_shapes(&model.state_dict().unwrap()),
        keys_and_shapes(&state),
        "{case}"
    );
    model
        .load_state_dict(&state, &LoadOptions::default())
        .unwrap();

    // Eval output, and gradients w.r.t. the originals.
    model.eval();
    let y = model.call(x).unwrap();
    let d = max_diff(&y, &f["y_eval"]);
    assert!(d < 1e-5, "{case}: eval output {d}");
    let loss = (&y * &f["g_out"]).unwrap().sum_all().unwrap();
    let grads = loss.backward().unwrap();
    let grad_keys: Vec<&String> = f.keys().filter(|k| k.starts_with("grad.")).collect();
    assert!(!grad_keys.is_empty());
    for key in grad_keys {
        let p = model.get_parameter(&key["grad.".len()..]).unwrap();
        let g = grads.get(&p.tensor().unwrap()).expect("a gradient");
        let d = max_diff(g, &f[key]);
        assert!(d < 1e-5, "{case}: {key} {d}\n{g}\n{}", f[key]);
    }

    // A training forward: spectral norm's power iteration moves `_u` and `_v` as PyTorch's.
    model.train();
    let y = model.call(x).unwrap();
    assert!(max_diff(&y, &f["y_train"]) < 1e-5, "{case}: train output");
    let after = model.state_dict().unwrap();
    for (key, expected) in section(&f, "train").iter() {
        let got = after.get(key).unwrap();
        assert!(
            max_diff(got, expected) < 1e-5,
            "{case}: {key} after training"
        );
    }

    // remove_parametrizations in eval leaves the parametrized weight as a plain parameter.
    let mut removed = make();
    apply(&mut removed);
    removed
        .load_state_dict(&state, &LoadOptions::default())
        .unwrap();
    removed.eval();
    remove_parametrizations(&mut removed, "weight", true).unwrap();
    assert!(!is_parametrized(&removed, "weight"));
    let names: Vec<String> = removed
        .named_parameters()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    let plain: Vec<String> = make()
        .named_parameters()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert_eq!(names, plain, "{case}");
    let w = removed.get_parameter("weight").unwrap().tensor().unwrap();
    assert!(max_diff(&w, &f["removed.weight"]) < 1e-5, "{case}: removed");

    // The older functions' keys load into the same model.
    let legacy = section(&f, "legacy");
    if !legacy.is_empty() {
        let mut old = make();
        apply(&mut old);
        let options = legacy_keys(&old)
            .into_iter()
            .fold(LoadOptions::default(), LoadOptions::rule);
        old.load_state_dict(&legacy, &options).unwrap();
        old.eval();
        let y = old.call(x).unwrap();
        assert!(rel_diff(&y, &f["y_legacy"]) < 1e-5, "{case}: legacy");
    }
}

fn dev() -> Device {
    Device::Cpu
}

#[test]
fn weight_norm_linear() {
    check(
        "weight_norm_linear",
        || Linear::new(5, 4, &dev()).unwrap(),
        |m| weight_norm(m, "weight", Some(0)).unwrap(),
    );
}

#[test]
fn weight_norm_conv1d() {
    check(
        "weight_norm_conv1d",
        || Conv1d::new(3, 4, 3, &dev()).unwrap(),
        |m| weight_norm(m, "weight", Some(0)).unwrap(),
    );
}

/// wav2vec2's positional convolution (grouped, the norm along the kernel) and HiFi-GAN's
/// upsampling layers, with the older `weight_g`/`weight_v` keys their checkpoints hold.
#[test]
fn weight_norm_as_wav2vec2_and_hifigan_use_it() {
    use module_runtime::nn::{ConvConfig, ConvTranspose1d, ConvTransposeConfig};
    let config = ConvConfig {
        padding: 2.into(),
        groups: 2,
        ..Default::default()
    };
    check(
        "weight_norm_conv1d_wav2vec2",
        || Conv1d::with_config(8, 8, 5, config, &dev()).unwrap(),
        |m| weight_norm(m, "weight", Some(2)).unwrap(),
    );
    let config = ConvTransposeConfig {
        stride: 2,
        padding: 1,
        ..Default::default()
    };
    check(
        "weight_norm_conv_transpose1d",
        || ConvTranspose1d::with_config(4, 3, 4, config, &dev()).unwrap(),
        |m| weight_norm(m, "weight", Some(0)).unwrap(),
    );
}

#[test]
fn weight_norm_of_the_whole_tensor() {
    check(
        "weight_norm_conv2d_whole",
        || Conv2d::new(2, 3, 3, &dev()).unwrap(),
        |m| weight_norm(m, "weight", None).unwrap(),
    );
}

#[test]
fn spectral_norm_linear() {
    check(
        "spectral_norm_linear",
        || Linear::new(6, 5, &dev()).unwrap(),
        |m| spectral_norm(m, "weight", SpectralNormOptions::default()).unwrap(),
    );
}

#[test]
fn spectral_norm_conv2d() {
    let options = SpectralNormOptions {
        n_power_iterations: 2,
        ..Default::default()
    };
    check(
        "spectral_norm_conv2d",
        || Conv2d::new(3, 4, 3, &dev()).unwrap(),
        |m| spectral_norm(m, "weight", options).unwrap(),
    );
}

#[test]
fn spectral_norm_conv_transpose2d() {
    check(
        "spectral_norm_conv_transpose2d",
        || ConvTranspose2d::new(4, 3, 3, &dev()).unwrap(),
        |m| spectral_norm(m, "weight", SpectralNormOptions::default()).unwrap(),
    );
}

/// A projection discriminator's class embedding: spectral norm on an `Embedding`.
#[test]
fn spectral_norm_embedding() {
    check(
        "spectral_norm_embedding",
        || Embedding::new(10, 6, &dev()).unwrap(),
        |m| spectral_norm(m, "weight", SpectralNormOptions::default()).unwrap(),
    );
}

#[test]
fn orthogonal_linear() {
    check(
        "orthogonal_linear",
        || Linear::new(4, 4, &dev()).unwrap(),
        |m| orthogonal(m, "weight", None).unwrap(),
    );
}

#[test]
fn orthogonal_householder() {
    check(
        "orthogonal_householder_wide",
        || Linear::new(5, 3, &dev()).unwrap(),
        |m| orthogonal(m, "weight", None).unwrap(),
    );
    check(
        "orthogonal_householder_tall",
        || Linear::new(3, 5, &dev()).unwrap(),
        |m| orthogonal(m, "weight", None).unwrap(),
    );
}

#[derive(Module, Clone)]
struct Net {
    conv: Conv1d,
    embed: Embedding,
    fc: Linear,
}

fn net() -> Net {
    Net {
        conv: Conv1d::new(2, 3, 3, &dev()).unwrap(),
        embed: Embedding::new(5, 3, &dev()).unwrap(),
        fc: Linear::new(3, 2, &dev()).unwrap(),
    }
}

/// Registered by path inside a model: PyTorch's keys and `print(model)`; the optimizer trains
/// the originals.
#[test]
fn by_path_in_a_model() {
    let mut model = net();
    weight_norm(&mut model, "conv.weight", Some(0)).unwrap();
    spectral_norm(&mut model, "fc.weight", SpectralNormOptions::default()).unwrap();
    let keys: Vec<String> = model
        .state_dict()
        .unwrap()
        .keys()
        .map(str::to_owned)
        .collect();
    assert_eq!(
        keys,
        [
            "conv.bias",
            "conv.parametrizations.weight.original0",
            "conv.parametrizations.weight.original1",
            "embed.weight",
            "fc.bias",
            "fc.parametrizations.weight.original",
            "fc.parametrizations.weight.0._u",
            "fc.parametrizations.weight.0._v",
        ]
    );
    assert_eq!(
        model.conv.to_string(),
        "ParametrizedConv1d(
  2, 3, kernel_size=(3,), stride=(1,)
  (parametrizations): ModuleDict(
    (weight): ParametrizationList(
      (0): _WeightNorm()
    )
  )
)"
    );
    // The stand-in refuses to be read; the computed weight is PyTorch's `module.weight`.
    assert!(matches!(
        model.fc.weight.tensor(),
        Err(Error::Parametrize(ParametrizeError::StandIn))
    ));
    assert_eq!(
        parametrized_tensor(&model, "fc.weight").unwrap().dims(),
        [2, 3]
    );
    // A step of SGD on the originals changes the computed weight.
    let before = parametrized_tensor(&model, "conv.weight").unwrap();
    let mut opt = SGD::new(&model, module_runtime::optim::SgdOptions::new(0.5)).unwrap();
    let x = Tensor::randn(0f32, 1., (1, 2, 5), &dev()).unwrap();
    let loss = model
        .conv
        .call(&x)
        .unwrap()
        .sqr()
        .unwrap()
        .sum_all()
        .unwrap();
    opt.backward_step(&loss).unwrap();
    let after = parametrized_tensor(&model, "conv.weight").unwrap();
    assert!(max_diff(&before, &after) > 1e-4);
}

/// Chained parametrizations (PyTorch's `ParametrizationList` of two), removed together.
#[test]
fn chained_and_removed() {
    let mut fc = Linear::new(4, 3, &dev()).unwrap();
    let w0 = fc.weight.tensor().unwrap();
    weight_norm(&mut fc, "weight", Some(0)).unwrap();
    spectral_norm(&mut fc, "weight", SpectralNormOptions::default()).unwrap();
    let keys: Vec<String> = fc.state_dict().unwrap().keys().map(str::to_owned).collect();
    assert_eq!(
        keys,
        [
            "bias",
            "parametrizations.weight.original0",
            "parametrizations.weight.original1",
            "parametrizations.weight.1._u",
            "parametrizations.weight.1._v",
        ]
    );
    fc.eval();
    let w = parametrized_tensor(&fc, "weight").unwrap();
    // Spectrally normalized: about w0 over its largest singular value.
    let ratio = (w0
        .abs()
        .unwrap()
        .sum_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap())
        / (w.abs()
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap());
    assert!(ratio > 0.1 && ratio < 10.0);
    remove_parametrizations(&mut fc, "weight", true).unwrap();
    assert!(max_diff(&fc.weight.tensor().unwrap(), &w) < 1e-6);
    assert_eq!(
        fc.to_string(),
        "Linear(in_features=4, out_features=3, bias=True)"
    );
}

/// `cached`: inside the scope the weight is computed once (a change to the original is not seen
/// until the scope ends, as in PyTorch's `parametrize.cached()`), and gradients still reach it.
#[test]
fn cached_computes_once() {
    use module_runtime::nn::parametrize::cached;
    let mut fc = Linear::new(3, 2, &dev()).unwrap();
    weight_norm(&mut fc, "weight", Some(0)).unwrap();
    let x = Tensor::ones((1, 3), DType::F32, &dev()).unwrap();
    let v = fc
        .get_parameter("parametrizations.weight.original1")
        .unwrap();
    let (first, second) = cached(|| {
        let first = fc.call(&x).unwrap();
        v.set(&(v.tensor().unwrap() * 2.0).unwrap().neg().unwrap())
            .unwrap();
        (first, fc.call(&x).unwrap())
    });
    assert_eq!(max_diff(&first, &second), 0.0);
    let grads = second.sum_all().unwrap().backward().unwrap();
    assert!(grads.get(&v.tensor().unwrap()).is_some());
    // Outside the scope, the changed original is seen: v's direction flipped.
    let third = fc.call(&x).unwrap();
    assert!(max_diff(&first, &third) > 1e-3);
}

/// A parametrized bias, and `Linear::call_each` beside a quantized layer: each layer computes
/// its own parametrized tensors.
#[test]
fn a_parametrized_bias_and_call_each() {
    let mut q = Linear::new(32, 4, &dev()).unwrap();
    let mut k = Linear::new(32, 4, &dev()).unwrap();
    let bias = k.bias.as_ref().unwrap().tensor().unwrap();
    weight_norm(&mut q, "weight", Some(0)).unwrap();
    spectral_norm(&mut k, "bias", SpectralNormOptions::default()).unwrap();
    assert_eq!(
        k.state_dict().unwrap().keys().collect::<Vec<_>>(),
        ["weight", "parametrizations.bias.original"]
    );
    // A 1-D tensor's spectral norm is its normalization.
    let expected = bias.broadcast_div(&bias.sqr().unwrap().sum_all().unwrap().sqrt().unwrap());
    let got = parametrized_tensor(&k, "bias").unwrap();
    assert!(max_diff(&got, &expected.unwrap()) < 1e-6);
    let x = Tensor::randn(0f32, 1., (2, 32), &dev()).unwrap();
    let v = Linear::new(32, 4, &dev()).unwrap();
    v.weight.quantize(GgmlDType::Q8_0).unwrap();
    let [qx, kx, vx] =
        module_runtime::without_grad(|| Linear::call_each([&q, &k, &v], &x)).unwrap();
    assert!(max_diff(&qx, &q.call(&x).unwrap()) < 1e-6);
    assert!(max_diff(&kx, &k.call(&x).unwrap()) < 1e-6);
    assert!(max_diff(&vx, &v.call(&x).unwrap()) < 1e-6);
}

/// A parametrized model converts to another dtype (originals and buffers move; the weight is
/// computed in the new dtype), and `deep_clone` copies it independently.
#[test]
fn to_dtype_and_deep_clone() {
    let mut model = net();
    weight_norm(&mut model, "conv.weight", Some(0)).unwrap();
    spectral_norm(&mut model, "fc.weight", SpectralNormOptions::default()).unwrap();
    model.to_dtype(DType::F64).unwrap();
    assert_eq!(
        parametrized_tensor(&model, "fc.weight").unwrap().dtype(),
        DType::F64
    );
    let x = Tensor::randn(0f64, 1., (1, 2, 5), &dev()).unwrap();
    assert_eq!(model.conv.call(&x).unwrap().dtype(), DType::F64);
    let h = Tensor::randn(0f64, 1., (4, 3), &dev()).unwrap();
    assert_eq!(model.fc.call(&h).unwrap().dtype(), DType::F64);

    let copy = model.deep_clone().unwrap();
    let before = parametrized_tensor(&model, "conv.weight").unwrap();
    let v = copy
        .get_parameter("conv.parametrizations.weight.original1")
        .unwrap();
    v.set(&v.tensor().unwrap().ones_like().unwrap()).unwrap();
    let after = parametrized_tensor(&model, "conv.weight").unwrap();
    assert_eq!(
        max_diff(
            &before.to_dtype(DType::F32).unwrap(),
            &after.to_dtype(DType::F32).unwrap()
        ),
        0.0
    );
    let copied = parametrized_tensor(&copy, "conv.weight").unwrap();
    assert!(
        max_diff(
            &before.to_dtype(DType::F32).unwrap(),
            &copied.to_dtype(DType::F32).unwrap()
        ) > 1e-3
    );
}

/// Lazy layers take parametrizations once built (their paths are the layer's); before, a typed
/// error.
#[test]
fn lazy_layers_once_built() {
    use module_runtime::nn::LazyLinear;
    let mut fc = LazyLinear::new(3, &dev()).unwrap();
    let err = weight_norm(&mut fc, "weight", Some(0)).unwrap_err();
    assert!(err.to_string().contains("unbuilt"), "{err}");
    let x = Tensor::randn(0f32, 1., (2, 4), &dev()).unwrap();
    let y0 = fc.call(&x).unwrap();
    weight_norm(&mut fc, "weight", Some(0)).unwrap();
    assert!(max_diff(&y0, &fc.call(&x).unwrap()) < 1e-5);
    assert!(fc
        .get_parameter("parametrizations.weight.original0")
        .is_ok());

    #[derive(Module)]
    struct Cell {
        fc: Lazy<Linear>,
    }
    let mut cell = Cell { fc: Lazy::new() };
    let err = spectral_norm(&mut cell, "fc.weight", SpectralNormOptions::default()).unwrap_err();
    assert!(err.to_string().contains("not built"), "{err}");
    cell.fc.get_or_build(|| Linear::new(4, 3, &dev())).unwrap();
    spectral_norm(&mut cell, "fc.weight", SpectralNormOptions::default()).unwrap();
    assert!(cell.get_buffer("fc.parametrizations.weight.0._u").is_ok());
    assert_eq!(cell.fc.get().unwrap().call(&x).unwrap().dims(), [2, 3]);
}

/// PyTorch's `module.weight = value` on a parametrized layer: `ParametrizationList::right_inverse`
/// sets the originals so that the layer computes `value` (a plain checkpoint's weight into a
/// weight-normed layer); a value of another shape changes nothing.
#[test]
fn assigning_through_right_inverse() {
    use module_runtime::nn::parametrize::ParametrizationList;
    let w = Tensor::randn(0f32, 1., (4, 4), &dev()).unwrap();
    let mut fc = Linear::new(4, 4, &dev()).unwrap();
    weight_norm(&mut fc, "weight", Some(0)).unwrap();
    let list: &ParametrizationList = fc.get_submodule("parametrizations.weight").unwrap();
    list.right_inverse(&w).unwrap();
    assert!(max_diff(&parametrized_tensor(&fc, "weight").unwrap(), &w) < 1e-5);

    // Orthogonal: an orthogonal value is kept (its base becomes it).
    let mut q = Linear::new(4, 4, &dev()).unwrap();
    orthogonal(&mut q, "weight", None).unwrap();
    let target = parametrized_tensor(&fc, "weight").unwrap();
    let list: &ParametrizationList = q.get_submodule("parametrizations.weight").unwrap();
    list.right_inverse(&Tensor::eye(4, DType::F32, &dev()).unwrap())
        .unwrap();
    let eye = Tensor::eye(4, DType::F32, &dev()).unwrap();
    assert!(max_diff(&parametrized_tensor(&q, "weight").unwrap(), &eye) < 1e-6);

    let before: Vec<(String, Tensor)> = (fc.state_dict().unwrap().iter())
        .map(|(k, t)| (k.to_owned(), t.copy().unwrap()))
        .collect();
    let list: &ParametrizationList = fc.get_submodule("parametrizations.weight").unwrap();
    let err = list
        .right_inverse(&w.t().unwrap().narrow(0, 0, 3).unwrap())
        .unwrap_err();
    assert!(err.to_string().contains("[3, 4]"), "{err}");
    for (k, t) in &before {
        assert_eq!(max_diff(t, fc.state_dict().unwrap().get(k).unwrap()), 0.0);
    }
    assert!(max_diff(&parametrized_tensor(&fc, "weight").unwrap(), &target) < 1e-6);
}
