//! Numeric parity of the runtime's layers with PyTorch, forward and backward, against the reference
//! fixtures in `fixtures/pytorch/` (see its README).
//!
//! Each test builds the layer, loads the fixture's `param.*` by PyTorch name (every key must be
//! used), runs the forward pass, compares `output`, backpropagates
//! `loss = (output * upstream).sum()`, and compares `grad.input` and every `grad.param.*`.
//! Tolerance: `|actual - expected| <= 1e-5 + 1e-5 * |expected|` (see `candle_module::fixtures::TOL`).

use candle_core::Var;
use candle_module::fixtures::{assert_close, assert_equal, Fixture};
use candle_nn::Optimizer;
use module_runtime::nn::{
    self, loss, AvgPool2d, BatchNorm1d, BatchNorm2d, Conv1d, Conv2d, ConvConfig, ConvTranspose2d,
    ConvTransposeConfig, Dropout, Embedding, GroupNorm, LayerNorm, LayerNormConfig, LogSoftmax,
    MaxPool2d, RmsNorm, RmsNormConfig, Softmax, GELU,
};
use module_runtime::prelude::*;

/// The device under test: `MODULE_DEVICE` (`cuda:0`, …), the CPU when unset.
fn dev() -> Device {
    candle_module::device_from_env().expect("MODULE_DEVICE names a usable device")
}

/// Compares `output` with the fixture, backpropagates `(output * upstream).sum()`, and compares the
/// gradients of the named `inputs` (`grad.<name>`) and of every parameter (`grad.param.<name>`).
fn check_output_and_grads(
    fx: &Fixture,
    output: &Tensor,
    inputs: &[(&str, &Tensor)],
    params: Vec<(String, Param)>,
) {
    assert_close(&format!("{}: output", fx.name), output, &fx.get("output"));
    let loss = (output * fx.get("upstream")).unwrap().sum_all().unwrap();
    let grads = loss.backward().unwrap();
    for (name, t) in inputs {
        let key = format!("grad.{name}");
        let expected = fx.get(&key);
        let got = grads
            .get(t)
            .unwrap_or_else(|| panic!("{}: no gradient for `{name}`", fx.name));
        assert_close(&format!("{}: {key}", fx.name), got, &expected);
    }
    let names: std::collections::BTreeSet<String> = params.iter().map(|(n, _)| n.clone()).collect();
    assert_eq!(
        names,
        fx.keys_under("grad.param."),
        "{}: parameters with gradients",
        fx.name
    );
    for (name, p) in params {
        let got = grads
            .get(&p.tensor().unwrap())
            .unwrap_or_else(|| panic!("{}: no gradient for parameter `{name}`", fx.name));
        assert_close(
            &format!("{}: grad.param.{name}", fx.name),
            got,
            &fx.get(&format!("grad.param.{name}")),
        );
    }
}

/// The whole check for a layer with one input; returns the fixture for extra checks.
fn check_layer<M>(case: &str, layer: &M) -> Fixture
where
    M: ModuleExt + for<'a> Forward<&'a Tensor, Output = Tensor>,
{
    let fx = Fixture::load(case);
    fx.load_state(layer);
    let input = fx.get("input");
    let output;
    if input.dtype().is_float() {
        let x = Var::from_tensor(&input).unwrap();
        output = layer.call(x.as_tensor()).unwrap();
        check_output_and_grads(
            &fx,
            &output,
            &[("input", x.as_tensor())],
            layer.named_parameters(),
        );
    } else {
        // Integer ids have no gradient, and the fixture has no `grad.input`.
        assert!(fx.try_get("grad.input").is_none());
        output = layer.call(&input).unwrap();
        check_output_and_grads(&fx, &output, &[], layer.named_parameters());
    }
    fx
}

#[test]
fn embedding() {
    check_layer("embedding", &Embedding::new(11, 6, &dev()).unwrap());
}

#[test]
fn layer_norm() {
    check_layer("layer_norm", &LayerNorm::new(8, &dev()).unwrap());
}

#[test]
fn layer_norm_noaffine() {
    let no_affine = LayerNormConfig {
        elementwise_affine: false,
        ..Default::default()
    };
    let layer = LayerNorm::with_config(8, no_affine, &dev()).unwrap();
    check_layer("layer_norm_noaffine", &layer);
}

#[test]
fn rms_norm() {
    let eps = RmsNormConfig {
        eps: Some(1e-6),
        ..Default::default()
    };
    check_layer("rms_norm", &RmsNorm::with_config(8, eps, &dev()).unwrap());
}

#[test]
fn group_norm() {
    check_layer("group_norm", &GroupNorm::new(2, 4, &dev()).unwrap());
}

/// Training mode: batch statistics, and the running statistics updated as PyTorch does.
fn check_batch_norm_train<M>(case: &str, bn: &M)
where
    M: ModuleExt + for<'a> Forward<&'a Tensor, Output = Tensor>,
{
    assert!(bn.is_training());
    let fx = check_layer(case, bn);
    let buffers = bn.named_buffers();
    assert_eq!(buffers.len(), 3);
    for (name, b) in buffers {
        let expected = fx.get(&format!("after.{name}"));
        if expected.dtype().is_float() {
            assert_close(
                &format!("{case}: after.{name}"),
                &b.tensor().unwrap(),
                &expected,
            );
        } else {
            assert_equal(
                &format!("{case}: after.{name}"),
                &b.tensor().unwrap(),
                &expected,
            );
        }
    }
}

/// Evaluation mode: running statistics used, and left exactly as they were.
fn check_batch_norm_eval<M>(case: &str, bn: &M)
where
    M: ModuleExt + for<'a> Forward<&'a Tensor, Output = Tensor>,
{
    bn.eval();
    let fx = check_layer(case, bn);
    for (name, b) in bn.named_buffers() {
        assert_equal(
            &format!("{case}: {name} after an eval forward"),
            &b.tensor().unwrap(),
            &fx.get(&format!("param.{name}")),
        );
    }
}

#[test]
fn batch_norm1d_train() {
    check_batch_norm_train("batch_norm1d_train", &BatchNorm1d::new(4, &dev()).unwrap());
}

#[test]
fn batch_norm1d_eval() {
    check_batch_norm_eval("batch_norm1d_eval", &BatchNorm1d::new(4, &dev()).unwrap());
}

#[test]
fn batch_norm2d_train() {
    check_batch_norm_train("batch_norm2d_train", &BatchNorm2d::new(3, &dev()).unwrap());
}

#[test]
fn batch_norm2d_eval() {
    check_batch_norm_eval("batch_norm2d_eval", &BatchNorm2d::new(3, &dev()).unwrap());
}

#[test]
fn conv1d() {
    let cfg = ConvConfig {
        stride: 2.into(),
        padding: 1.into(),
        ..Default::default()
    };
    check_layer(
        "conv1d",
        &Conv1d::with_config(3, 4, 3, cfg, &dev()).unwrap(),
    );
}

#[test]
fn conv2d() {
    let cfg = ConvConfig {
        padding: 1.into(),
        ..Default::default()
    };
    check_layer(
        "conv2d",
        &Conv2d::with_config(3, 4, 3, cfg, &dev()).unwrap(),
    );
}

#[test]
fn conv2d_groups_stride() {
    let cfg = ConvConfig {
        stride: 2.into(),
        padding: 1.into(),
        groups: 2,
        ..Default::default()
    };
    check_layer(
        "conv2d_groups_stride",
        &Conv2d::with_config(4, 6, 3, cfg, &dev()).unwrap(),
    );
}

#[test]
fn conv_transpose2d() {
    let cfg = ConvTransposeConfig {
        stride: 2,
        padding: 1,
        output_padding: 1,
        ..Default::default()
    };
    check_layer(
        "conv_transpose2d",
        &ConvTranspose2d::with_config(3, 2, 3, cfg, &dev()).unwrap(),
    );
}

#[test]
fn max_pool2d() {
    check_layer("max_pool2d", &MaxPool2d::new(2));
}

#[test]
fn avg_pool2d() {
    check_layer("avg_pool2d", &AvgPool2d::new(2));
}

#[test]
fn dropout_eval() {
    let dropout = Dropout::new(0.5);
    dropout.eval();
    check_layer("dropout_eval", &dropout);
}

#[test]
fn gelu() {
    check_layer("gelu", &GELU::new());
}

#[test]
fn gelu_tanh() {
    check_layer("gelu_tanh", &GELU::tanh());
}

#[test]
fn silu() {
    check_layer("silu", &nn::SiLU::new());
}

#[test]
fn relu() {
    check_layer("relu", &nn::ReLU::new());
}

#[test]
fn sigmoid() {
    check_layer("sigmoid", &nn::Sigmoid::new());
}

#[test]
fn tanh() {
    check_layer("tanh", &nn::Tanh::new());
}

#[test]
fn softmax_last() {
    check_layer("softmax_last", &Softmax::new(-1));
}

#[test]
fn log_softmax_last() {
    check_layer("log_softmax_last", &LogSoftmax::new(-1));
}

#[test]
fn activation_enum_matches_its_layers() {
    check_layer("gelu_tanh", &nn::Activation::gelu_tanh());
    check_layer("softmax_last", &nn::Activation::softmax(-1));
}

#[test]
fn cross_entropy() {
    let fx = Fixture::load("cross_entropy");
    let x = Var::from_tensor(&fx.get("input")).unwrap();
    let output = loss::cross_entropy(x.as_tensor(), &fx.get("target")).unwrap();
    check_output_and_grads(&fx, &output, &[("input", x.as_tensor())], vec![]);
}

#[test]
fn mse() {
    let fx = Fixture::load("mse");
    let x = Var::from_tensor(&fx.get("input")).unwrap();
    let target = Var::from_tensor(&fx.get("target")).unwrap();
    let output = loss::mse_loss(x.as_tensor(), target.as_tensor()).unwrap();
    check_output_and_grads(
        &fx,
        &output,
        &[("input", x.as_tensor()), ("target", target.as_tensor())],
        vec![],
    );
}

/// Regression for candle's fused `layer_norm`, which records no gradient (candle #2168, #3011): a
/// Linear followed by our LayerNorm must learn, both the norm's affine parameters and the Linear
/// below it.
#[test]
fn linear_then_layer_norm_learns() {
    #[derive(Module)]
    struct Block {
        fc: Linear,
        norm: LayerNorm,
    }
    let block = Block {
        fc: Linear::new(4, 8, &dev()).unwrap(),
        norm: LayerNorm::new(8, &dev()).unwrap(),
    };
    let x = Tensor::randn(0f32, 1., (5, 4), &dev()).unwrap();
    let target = Tensor::randn(0f32, 1., (5, 8), &dev()).unwrap();

    // What this guards against: through candle's fused kernel, the Linear gets no gradient.
    let h = block.fc.call(&x).unwrap();
    let (w, b) = (block.norm.weight.as_ref(), block.norm.bias.as_ref());
    let fused = candle_nn::ops::layer_norm(
        &h,
        &w.unwrap().tensor().unwrap(),
        &b.unwrap().tensor().unwrap(),
        1e-5,
    )
    .unwrap();
    let grads = loss::mse_loss(&fused, &target).unwrap().backward().unwrap();
    assert!(grads.get(&block.fc.weight.tensor().unwrap()).is_none());

    let before: Vec<Vec<f32>> = block
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
    let mut sgd = candle_nn::SGD::new(block.trainable_vars().unwrap(), 0.1).unwrap();
    let y = block.norm.call(&block.fc.call(&x).unwrap()).unwrap();
    sgd.backward_step(&loss::mse_loss(&y, &target).unwrap())
        .unwrap();
    for ((name, p), old) in block.named_parameters().into_iter().zip(before) {
        // The Linear's bias only shifts what the norm then centres: its exact gradient is zero.
        if name == "fc.bias" {
            continue;
        }
        let new: Vec<f32> = p
            .tensor()
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        assert!(new != old, "`{name}` did not change after an SGD step");
    }
}
