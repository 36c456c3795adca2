//! Parametrizations against PyTorch (`fixtures/make_parametrize_fixtures.py`): weight norm,
//! spectral norm and orthogonal on `Linear`, `Conv1d` (wav2vec2's grouped one), `Conv2d`,
//! `ConvTranspose1d/2d` and `Embedding`, each loaded strictly from PyTorch's parametrized state
//! dict: eval outputs, gradients w.r.t. the originals, the output and `_u`/`_v` after a training
//! forward, the weight `remove_parametrizations` leaves, the originals a registration makes, the
//! older functions' keys (`weight_g`/`weight_v`, `weight_orig`/`weight_u`/`weight_v`) loaded
//! through `legacy_keys`, our state dict's keys and shapes equal to PyTorch's. In models:
//! `parametrize_models.rs`; the errors, each naming the path with the model untouched:
//! `parametrize_errors.rs`.

use std::collections::HashMap;
use std::path::PathBuf;

use module_runtime::nn::parametrize::{
    is_parametrized, legacy_keys, orthogonal, remove_parametrizations, spectral_norm, weight_norm,
    SpectralNormOptions,
};
use module_runtime::nn::{Conv1d, Conv2d, ConvTranspose2d, Embedding};
use module_runtime::prelude::*;

#[path = "parametrize_errors.rs"]
mod errors;
#[path = "parametrize_models.rs"]
mod models;

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
        let random = key.ends_with("._u") || key.ends_with("._v") || case.contains("perturbed");
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

/// Each map away from its starting point (the original set to normal draws): `matrix_exp`,
/// `cayley` and `householder` values and gradients, on a wide weight.
#[test]
fn orthogonal_maps_perturbed() {
    use module_runtime::nn::parametrize::OrthogonalMap;
    for (case, map) in [
        ("orthogonal_matrix_exp_perturbed", OrthogonalMap::MatrixExp),
        ("orthogonal_cayley_perturbed", OrthogonalMap::Cayley),
        (
            "orthogonal_householder_perturbed",
            OrthogonalMap::Householder,
        ),
    ] {
        check(
            case,
            || Linear::new(5, 4, &dev()).unwrap(),
            |m| orthogonal(m, "weight", Some(map)).unwrap(),
        );
    }
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
