//! Forward and backward parity with PyTorch for Linear, MultiheadAttention, LSTM and GRU.
//!
//! Each fixture's `param.*` is loaded by PyTorch name, the forward is compared with `output` (and
//! the extra outputs), then `loss = (output * upstream).sum()` is backpropagated and `grad.input`
//! and every `grad.param.*` are compared.
//!
//! Tolerance: 1e-5 absolute plus 1e-5 relative (the fixtures are within 1.5e-6 of float64).

use candle_core::Var;
use candle_module::fixtures::{assert_close, Fixture};
use module_runtime::nn::{
    AttentionInput, Gru, LinearConfig, Lstm, MultiheadAttention, MultiheadAttentionConfig,
    RnnConfig,
};
use module_runtime::prelude::*;

/// The device under test: `MODULE_DEVICE` (`cuda:0`, …), the CPU when unset.
fn dev() -> Device {
    candle_module::device_from_env().expect("MODULE_DEVICE names a usable device")
}

/// Backpropagates `(output * upstream).sum()` and compares the input's and every parameter's
/// gradient with the fixture's.
fn check_backward(fx: &Fixture, model: &dyn Module, input: &Var, output: &Tensor) {
    let loss = (output * fx.get("upstream")).unwrap().sum_all().unwrap();
    let grads = loss.backward().unwrap();
    let grad_input = grads
        .get(input.as_tensor())
        .expect("no gradient for the input");
    assert_close("grad.input", grad_input, &fx.get("grad.input"));
    let params = model.named_parameters();
    let keys = fx.keys_under("grad.param.");
    assert_eq!(keys.len(), params.len(), "a gradient for every parameter");
    for (name, p) in params {
        let grad = grads
            .get(p.var().unwrap().as_tensor())
            .unwrap_or_else(|| panic!("no gradient for {name}"));
        assert_close(
            &format!("grad.{name}"),
            grad,
            &fx.get(&format!("grad.param.{name}")),
        );
    }
}

fn check_linear(name: &str, bias: bool) {
    let fx = Fixture::load(name);
    let model = Linear::with_config(
        7,
        5,
        LinearConfig {
            bias,
            ..Default::default()
        },
        &dev(),
    )
    .unwrap();
    fx.load_state(&model);
    let x = Var::from_tensor(&fx.get("input")).unwrap();
    let y = model.call(x.as_tensor()).unwrap();
    assert_close("output", &y, &fx.get("output"));
    check_backward(&fx, &model, &x, &y);
    fx.assert_all_used();
}

#[test]
fn linear() {
    check_linear("linear", true);
}

#[test]
fn linear_nobias() {
    check_linear("linear_nobias", false);
}

#[test]
fn multihead_attention() {
    let fx = Fixture::load("multihead_attention");
    let config = MultiheadAttentionConfig {
        batch_first: true,
        ..Default::default()
    };
    let model = MultiheadAttention::with_config(8, 2, config, &dev()).unwrap();
    model.eval();
    fx.load_state(&model);
    let x = Var::from_tensor(&fx.get("input")).unwrap();
    let x = x.as_tensor();
    let mask = fx.get("mask");
    let (y, weights) = model
        .call(AttentionInput::new(x, x, x).key_padding_mask(&mask))
        .unwrap();
    assert_close("output", &y, &fx.get("output"));
    assert_close("weights", &weights.unwrap(), &fx.get("output.weights"));
    // The mask's dtype does not matter, only which entries are non-zero.
    let mask_i64 = mask.to_dtype(DType::I64).unwrap();
    let (y_i64, _) = model
        .call(AttentionInput::self_attention(x).key_padding_mask(&mask_i64))
        .unwrap();
    assert_close("output with an i64 mask", &y_i64, &y);
    check_backward(&fx, &model, &Var::from_tensor(x).unwrap(), &y);
    fx.assert_all_used();
}

#[test]
fn lstm() {
    let fx = Fixture::load("lstm");
    let config = RnnConfig {
        batch_first: true,
        ..Default::default()
    };
    let model = Lstm::with_config(4, 6, config, &dev()).unwrap();
    fx.load_state(&model);
    let x = Var::from_tensor(&fx.get("input")).unwrap();
    let (y, (h, c)) = model.call(x.as_tensor()).unwrap();
    assert_close("output", &y, &fx.get("output"));
    assert_close("h_n", &h, &fx.get("output.h"));
    assert_close("c_n", &c, &fx.get("output.c"));
    check_backward(&fx, &model, &x, &y);
    fx.assert_all_used();
}

#[test]
fn gru() {
    let fx = Fixture::load("gru");
    let config = RnnConfig {
        batch_first: true,
        ..Default::default()
    };
    let model = Gru::with_config(4, 6, config, &dev()).unwrap();
    fx.load_state(&model);
    let x = Var::from_tensor(&fx.get("input")).unwrap();
    let (y, h) = model.call(x.as_tensor()).unwrap();
    assert_close("output", &y, &fx.get("output"));
    assert_close("h_n", &h, &fx.get("output.h"));
    check_backward(&fx, &model, &x, &y);
    fx.assert_all_used();
}

/// Layer `k` of a stacked RNN is a one-layer RNN fed the previous layer's output: checks the
/// multi-layer wiring and the `[seq, batch, feature]` layout, which the fixtures do not cover.
#[test]
fn multi_layer_rnn_is_stacked_single_layers() {
    let dev = dev();
    let stacked = RnnConfig {
        num_layers: 2,
        ..Default::default()
    };
    let x = Tensor::randn(0f32, 1., (5, 2, 4), &dev).unwrap(); // [T, B, F]

    let lstm = Lstm::with_config(4, 6, stacked, &dev).unwrap();
    let l0 = Lstm::new(4, 6, &dev).unwrap();
    let l1 = Lstm::new(6, 6, &dev).unwrap();
    for (single, k) in [(&l0, 0), (&l1, 1)] {
        for (name, p) in single.named_parameters() {
            let src = lstm.get_parameter(&name.replace("l0", &format!("l{k}")));
            p.set(&src.unwrap().tensor().unwrap()).unwrap();
        }
    }
    let (y, (h, c)) = lstm.call(&x).unwrap();
    let (y0, (h0, c0)) = l0.call(&x).unwrap();
    let (y1, (h1, c1)) = l1.call(&y0).unwrap();
    assert_close("lstm output", &y, &y1);
    assert_close("lstm h_n", &h, &Tensor::cat(&[h0, h1], 0).unwrap());
    assert_close("lstm c_n", &c, &Tensor::cat(&[c0, c1], 0).unwrap());
    // Starting from the final state continues the sequence.
    let (y_next, _) = lstm.call((&x, (&h, &c))).unwrap();
    assert_eq!(y_next.dims(), [5, 2, 6]);

    let gru = Gru::with_config(4, 6, stacked, &dev).unwrap();
    let g0 = Gru::new(4, 6, &dev).unwrap();
    let g1 = Gru::new(6, 6, &dev).unwrap();
    for (single, k) in [(&g0, 0), (&g1, 1)] {
        for (name, p) in single.named_parameters() {
            let src = gru.get_parameter(&name.replace("l0", &format!("l{k}")));
            p.set(&src.unwrap().tensor().unwrap()).unwrap();
        }
    }
    let (y, h) = gru.call(&x).unwrap();
    let (y0, h0) = g0.call(&x).unwrap();
    let (y1, h1) = g1.call(&y0).unwrap();
    assert_close("gru output", &y, &y1);
    assert_close("gru h_n", &h, &Tensor::cat(&[h0, h1], 0).unwrap());
    let names: Vec<String> = gru.named_parameters().into_iter().map(|(n, _)| n).collect();
    assert_eq!(
        names,
        [
            "weight_ih_l0",
            "weight_hh_l0",
            "bias_ih_l0",
            "bias_hh_l0",
            "weight_ih_l1",
            "weight_hh_l1",
            "bias_ih_l1",
            "bias_hh_l1"
        ]
    );
}
