//! PyTorch's activations (issue 29), forward and input/parameter gradients against the fixtures of
//! `fixtures/make_nn_fixtures.py`, and their errors on inputs they do not take.

use candle_core::{DType, Device, Tensor};
use module_runtime::nn::{
    Hardshrink, Hardsigmoid, Hardswish, Hardtanh, LeakyReLU, LogSigmoid, Mish, PReLU, PReLUConfig,
    RReLU, ReLU6, Softmax2d, Softmin, Softplus, Softshrink, Softsign, Tanhshrink, Threshold, CELU,
    ELU, GLU, SELU,
};
use module_runtime::{Error, ModuleExt};

use crate::nn_fixture::check_unary;

#[test]
fn prelu_shared_and_per_channel_slopes() {
    let shared = PReLU::new(1, &Device::Cpu).unwrap();
    assert_eq!(
        shared.weight.tensor().unwrap().to_vec1::<f32>().unwrap(),
        [0.25]
    );
    check_unary("prelu", &shared);
    let config = PReLUConfig {
        init: 0.1,
        ..Default::default()
    };
    let channels = PReLU::with_config(4, config, &Device::Cpu).unwrap();
    assert_eq!(channels.num_parameters(), 4);
    check_unary("prelu_channels", &channels);
}

#[test]
fn piecewise_activations_match_pytorch() {
    check_unary("leaky_relu", &LeakyReLU::new());
    check_unary("leaky_relu_slope", &LeakyReLU::with_slope(0.2));
    check_unary("elu", &ELU::with_alpha(0.7));
    check_unary("selu", &SELU::new());
    check_unary("celu", &CELU::with_alpha(1.5));
    check_unary("hardswish", &Hardswish::new());
    check_unary("hardsigmoid", &Hardsigmoid::new());
    check_unary("hardtanh", &Hardtanh::with_range(-0.5, 1.5));
    check_unary("relu6", &ReLU6::new());
    check_unary("threshold", &Threshold::new(0.5, -1.0));
    check_unary("hardshrink", &Hardshrink::with_lambda(0.7));
    check_unary("softshrink", &Softshrink::new());
    let rrelu = RReLU::with_range(0.1, 0.3);
    rrelu.eval();
    check_unary("rrelu_eval", &rrelu);
}

/// In training mode each negative input gets its own slope in `[lower, upper]`, and its gradient
/// is that slope.
#[test]
fn rrelu_draws_a_slope_per_negative_element_in_training() {
    let x =
        candle_core::Var::from_tensor(&Tensor::full(-1f32, 1000, &Device::Cpu).unwrap()).unwrap();
    let rrelu = RReLU::new();
    let y = rrelu.call(x.as_tensor()).unwrap();
    let slopes: Vec<f32> = y.neg().unwrap().to_vec1().unwrap();
    assert!(slopes
        .iter()
        .all(|&a| (0.125..=1.0 / 3.0 + 1e-6).contains(&a)));
    let spread = slopes.iter().cloned().fold(f32::MIN, f32::max)
        - slopes.iter().cloned().fold(f32::MAX, f32::min);
    assert!(spread > 0.1, "{spread}");
    let grads = y.sum_all().unwrap().backward().unwrap();
    let g: Vec<f32> = grads.get(x.as_tensor()).unwrap().to_vec1().unwrap();
    assert_eq!(g, slopes);
}

#[test]
fn smooth_activations_match_pytorch() {
    check_unary("mish", &Mish::new());
    check_unary("softplus", &Softplus::new());
    check_unary("softplus_beta", &Softplus::with_beta(2.0, 3.0));
    check_unary("softsign", &Softsign::new());
    check_unary("tanhshrink", &Tanhshrink::new());
    check_unary("log_sigmoid", &LogSigmoid::new());
}

#[test]
fn dimension_activations_match_pytorch() {
    check_unary("glu", &GLU::new());
    check_unary("glu_dim1", &GLU::with_dim(1));
    check_unary("softmin", &Softmin::new(1));
    check_unary("softmax2d", &Softmax2d::new());
}

/// No overflow into NaN or infinity, forward or backward, far out on either side.
#[test]
fn softplus_family_stays_finite_for_large_inputs() {
    let x = candle_core::Var::new(&[-200f32, -30., 0., 30., 200.], &Device::Cpu).unwrap();
    for y in [
        Softplus::new().call(x.as_tensor()).unwrap(),
        LogSigmoid::new().call(x.as_tensor()).unwrap(),
        Mish::new().call(x.as_tensor()).unwrap(),
        ELU::new().call(x.as_tensor()).unwrap(),
    ] {
        let grads = y.sum_all().unwrap().backward().unwrap();
        let g = grads.get(x.as_tensor()).unwrap().to_vec1::<f32>().unwrap();
        let v = y.to_vec1::<f32>().unwrap();
        assert!(v.iter().chain(&g).all(|v| v.is_finite()), "{v:?} {g:?}");
    }
}

#[test]
fn bad_inputs_are_typed_errors_naming_the_shapes() {
    let dev = Device::Cpu;
    let odd = Tensor::zeros((2, 3), DType::F32, &dev).unwrap();
    let err = GLU::new().call(&odd).unwrap_err();
    assert!(
        matches!(err.inner(), Error::InputShape { layer: "GLU", .. }),
        "{err}"
    );
    assert!(err.to_string().contains("[2, 3]"), "{err}");

    let prelu = PReLU::new(4, &dev).unwrap();
    let err = prelu
        .call(&Tensor::zeros((2, 3, 5), DType::F32, &dev).unwrap())
        .unwrap_err();
    assert!(err.to_string().contains("num_parameters=4"), "{err}");
    assert!(err.to_string().contains("[2, 3, 5]"), "{err}");

    let err = Softmax2d::new().call(&odd).unwrap_err();
    assert!(err.to_string().contains("[N, C, H, W]"), "{err}");
    assert!(Softmin::new(2).call(&odd).is_err());
}

/// The harness does compare: an `ELU` with another `alpha` than the fixture's fails it.
#[test]
#[should_panic(expected = "elu: output")]
fn the_fixture_check_catches_a_wrong_layer() {
    check_unary("elu", &ELU::new());
}
