//! PyTorch's channel and alpha dropouts: the identity in evaluation mode (against the fixtures of
//! `fixtures/make_nn_fixtures.py`), and in training mode the masks' structure, scale and
//! statistics (the masks are random, so PyTorch's own values cannot be compared), gradients
//! included; their names and errors.

use candle_core::{DType, Device, Tensor, Var};
use module_runtime::nn::{AlphaDropout, Dropout1d, Dropout2d, Dropout3d, FeatureAlphaDropout};
use module_runtime::{Error, Module, ModuleExt};

use crate::nn_fixture::check_unary;

/// ATen's alpha dropout constants for `p`: the kept scale `a` and the kept and dropped shifts.
fn alpha_constants(p: f64) -> (f64, f64, f64) {
    let alpha = 1.758_099_340_847_376_6;
    let a = 1.0 / ((alpha * alpha * p + 1.0) * (1.0 - p)).sqrt();
    (a, alpha * a * p, alpha * a * (p - 1.0))
}

#[test]
fn eval_mode_is_the_identity_as_in_pytorch() {
    let d2 = Dropout2d::new(0.3);
    d2.eval();
    check_unary("dropout2d_eval", &d2);
    let alpha = AlphaDropout::new(0.3);
    alpha.eval();
    check_unary("alpha_dropout_eval", &alpha);
}

#[test]
fn channel_dropout_zeroes_whole_channels_and_scales_the_rest() {
    let dev = Device::Cpu;
    let x = Var::from_tensor(&Tensor::ones((4, 64, 2, 3), DType::F32, &dev).unwrap()).unwrap();
    let y = Dropout2d::new(0.25).call(x.as_tensor()).unwrap();
    let per_channel = y
        .sum((2, 3))
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    let kept = 6.0 / 0.75;
    assert!(per_channel
        .iter()
        .all(|&s| s == 0.0 || (s - kept).abs() < 1e-4));
    let dropped = per_channel.iter().filter(|&&s| s == 0.0).count() as f64 / 256.0;
    assert!((dropped - 0.25).abs() < 0.1, "{dropped}");
    // The gradient is the mask's scale.
    let grads = y.sum_all().unwrap().backward().unwrap();
    let g = grads.get(x.as_tensor()).unwrap();
    assert_eq!(
        g.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        y.flatten_all().unwrap().to_vec1::<f32>().unwrap()
    );

    // Unbatched Dropout1d [C, L] and Dropout3d [C, D, H, W]: one draw per channel.
    let y = Dropout1d::new(0.5)
        .call(&Tensor::ones((32, 5), DType::F32, &dev).unwrap())
        .unwrap();
    for row in y.to_vec2::<f32>().unwrap() {
        assert!(row.iter().all(|&v| v == row[0]), "{row:?}");
    }
    let y = Dropout3d::new(0.5)
        .call(&Tensor::ones((8, 2, 2, 2), DType::F32, &dev).unwrap())
        .unwrap();
    let sums = y.sum((1, 2, 3)).unwrap().to_vec1::<f32>().unwrap();
    assert!(sums.iter().all(|&s| s == 0.0 || s == 16.0), "{sums:?}");
    // Dropout2d reads a 3-D input as [N, C, L], as PyTorch does.
    let y = Dropout2d::new(0.5)
        .call(&Tensor::ones((3, 16, 4), DType::F32, &dev).unwrap())
        .unwrap();
    let sums = y
        .sum(2)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    assert!(sums.iter().all(|&s| s == 0.0 || s == 8.0), "{sums:?}");
}

#[test]
fn alpha_dropout_keeps_a_standard_normal_input_standard() {
    let dev = Device::Cpu;
    let p = 0.3;
    let x = Var::from_tensor(&Tensor::randn(0f32, 1., 200_000, &dev).unwrap()).unwrap();
    let y = AlphaDropout::new(p).call(x.as_tensor()).unwrap();
    let values = y.to_vec1::<f32>().unwrap();
    let mean = values.iter().map(|&v| v as f64).sum::<f64>() / values.len() as f64;
    let var = values
        .iter()
        .map(|&v| (v as f64 - mean).powi(2))
        .sum::<f64>()
        / values.len() as f64;
    assert!(
        mean.abs() < 0.02 && (var - 1.0).abs() < 0.03,
        "mean {mean}, var {var}"
    );
    // Dropped elements sit at ATen's constant; kept ones have gradient `a`.
    let (a, _, dropped) = alpha_constants(p);
    let grads = y.sum_all().unwrap().backward().unwrap();
    let g = grads.get(x.as_tensor()).unwrap().to_vec1::<f32>().unwrap();
    for (v, g) in values.iter().zip(&g) {
        if *g == 0.0 {
            assert!((*v as f64 - dropped).abs() < 1e-5, "{v}");
        } else {
            assert!((*g as f64 - a).abs() < 1e-5, "{g}");
        }
    }
    let share = g.iter().filter(|&&g| g == 0.0).count() as f64 / g.len() as f64;
    assert!((share - p).abs() < 0.01, "{share}");
}

#[test]
fn feature_alpha_dropout_drops_whole_channels() {
    let p = 0.5;
    let (a, kept_shift, dropped) = alpha_constants(p);
    let x = Tensor::ones((4, 16, 3), DType::F32, &Device::Cpu).unwrap();
    let y = FeatureAlphaDropout::new(p).call(&x).unwrap();
    for channel in y.reshape((64, 3)).unwrap().to_vec2::<f32>().unwrap() {
        let v = channel[0] as f64;
        assert!(channel.iter().all(|&c| c == channel[0]));
        assert!(
            (v - (a + kept_shift)).abs() < 1e-5 || (v - dropped).abs() < 1e-5,
            "{v}"
        );
    }
}

#[test]
fn names_p_one_and_errors() {
    assert_eq!(<Dropout2d as Module>::type_class_name(), "Dropout2d");
    let x = Tensor::ones((2, 3), DType::F32, &Device::Cpu).unwrap();
    assert_eq!(
        AlphaDropout::new(1.0)
            .call(&x)
            .unwrap()
            .to_vec2::<f32>()
            .unwrap(),
        [[0.0; 3]; 2]
    );
    let err = Dropout2d::new(0.5).call(&x).unwrap_err();
    assert!(
        matches!(
            err.inner(),
            Error::InputShape {
                layer: "Dropout2d",
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("[2, 3]"), "{err}");
    let flat = Tensor::ones(3, DType::F32, &Device::Cpu).unwrap();
    assert!(FeatureAlphaDropout::new(0.5).call(&flat).is_err());
}
