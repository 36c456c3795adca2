//! The fused training passes (see `module_runtime::nn`'s docs): Linear with a bias, LayerNorm, the
//! exact GELU, RMSNorm, the last-dimension softmax, dropout and the cross-entropy of class ids are single
//! candle ops with a one-pass backward whenever a gradient is recorded on float32 CPU tensors. Here both paths, fused and composed
//! (`without_fusion`), are held to PyTorch's values and gradients (the `fixtures/pytorch` cases
//! the parity tests use), with contiguous and non-contiguous inputs, and to each other on inputs
//! large enough for the fused passes to split their rows over threads.

use candle_core::Var;
use candle_module::fixtures::{assert_close, Fixture};
use module_runtime::nn::{
    without_fusion, ClassLossConfig, CrossEntropyLoss, Dropout, LayerNorm, Linear, LossReduction,
    RmsNorm, Softmax, GELU,
};
use module_runtime::prelude::*;

/// What one forward and backward pass gives: the output, the input's gradient and every
/// parameter's, by name.
struct Pass {
    output: Tensor,
    grad_input: Tensor,
    grad_params: Vec<(String, Tensor)>,
}

/// `loss = (layer(x) * upstream).sum()` and its gradients, with `x` equal to `input`: contiguous,
/// or (`transposed`) a view of its last two dimensions swapped, so the layer reads strided memory.
fn pass<M>(layer: &M, input: &Tensor, upstream: &Tensor, transposed: bool) -> Pass
where
    M: ModuleExt + for<'a> Forward<&'a Tensor, Output = Tensor>,
{
    let last = input.rank() - 1;
    let stored = if transposed {
        input
            .transpose(last - 1, last)
            .unwrap()
            .contiguous()
            .unwrap()
    } else {
        input.clone()
    };
    let var = Var::from_tensor(&stored).unwrap();
    let x = if transposed {
        var.as_tensor().transpose(last - 1, last).unwrap()
    } else {
        var.as_tensor().clone()
    };
    assert_eq!(x.is_contiguous(), !transposed);
    let output = layer.call(&x).unwrap();
    let grads = (&output * upstream)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let grad_stored = grads
        .get(var.as_tensor())
        .expect("a gradient for the input");
    let grad_input = if transposed {
        grad_stored.transpose(last - 1, last).unwrap()
    } else {
        grad_stored.clone()
    };
    let grad_params = layer
        .named_parameters()
        .into_iter()
        .map(|(name, p)| {
            let g = grads
                .get(&p.tensor().unwrap())
                .expect("a parameter gradient");
            (name, g.clone())
        })
        .collect();
    Pass {
        output,
        grad_input,
        grad_params,
    }
}

/// Both paths, contiguous and not, against the fixture's output and gradients (the layer on the
/// fixture's device, `MODULE_DEVICE`'s).
fn check_fixture<M>(case: &str, layer: &M)
where
    M: ModuleExt + for<'a> Forward<&'a Tensor, Output = Tensor>,
{
    let fx = Fixture::load(case);
    fx.load_state(layer);
    let (input, upstream) = (fx.get("input"), fx.get("upstream"));
    for transposed in [false, true] {
        for fused in [true, false] {
            let what =
                |key: &str| format!("{case} (fused {fused}, transposed {transposed}): {key}");
            let run = || pass(layer, &input, &upstream, transposed);
            let got = if fused { run() } else { without_fusion(run) };
            assert_close(&what("output"), &got.output, &fx.get("output"));
            assert_close(&what("grad.input"), &got.grad_input, &fx.get("grad.input"));
            for (name, g) in &got.grad_params {
                let key = format!("grad.param.{name}");
                assert_close(&what(&key), g, &fx.get(&key));
            }
        }
    }
}

#[test]
fn layer_norm_matches_pytorch_fused_and_composed() {
    let dev = candle_module::device_from_env().unwrap();
    check_fixture("layer_norm", &LayerNorm::new(8, &dev).unwrap());
}

#[test]
fn linear_matches_pytorch_fused_and_composed() {
    let dev = candle_module::device_from_env().unwrap();
    check_fixture("linear", &Linear::new(7, 5, &dev).unwrap());
}

#[test]
fn gelu_matches_pytorch_fused_and_composed() {
    check_fixture("gelu", &GELU::new());
}

#[test]
fn softmax_matches_pytorch_fused_and_composed() {
    check_fixture("softmax_last", &Softmax::new(-1));
}

/// Asserts `|a - b| <= tol * max(1, max |b|)` elementwise.
fn assert_near(what: &str, a: &Tensor, b: &Tensor, tol: f32) {
    assert_eq!(a.dims(), b.dims(), "{what}: shape");
    let scale = b
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
        .max(1.0);
    let diff = (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert!(
        diff <= tol * scale,
        "{what}: fused and composed differ by {diff} (scale {scale})"
    );
}

/// The fused pass against the composed one on `input` (contiguous and not), large enough that
/// the fused pass splits its rows over threads.
fn check_against_composed<M>(what: &str, layer: &M, input: &Tensor, tol: f32)
where
    M: ModuleExt + for<'a> Forward<&'a Tensor, Output = Tensor>,
{
    let output = layer.call(input).unwrap();
    let upstream = output.randn_like(0.0, 1.0).unwrap();
    for transposed in [false, true] {
        let fused = pass(layer, input, &upstream, transposed);
        let composed = without_fusion(|| pass(layer, input, &upstream, transposed));
        let what = |key: &str| format!("{what} (transposed {transposed}): {key}");
        assert_near(&what("output"), &fused.output, &composed.output, tol);
        assert_near(
            &what("grad input"),
            &fused.grad_input,
            &composed.grad_input,
            tol,
        );
        for ((name, f), (_, c)) in fused.grad_params.iter().zip(&composed.grad_params) {
            assert_near(&what(name), f, c, tol);
        }
        assert_eq!(fused.grad_params.len(), composed.grad_params.len());
    }
}

#[test]
fn fused_layer_norm_matches_composed_on_many_rows() {
    let dev = Device::Cpu;
    let ln = LayerNorm::new(384, &dev).unwrap();
    for p in [&ln.weight, &ln.bias] {
        let p = p.as_ref().unwrap();
        p.set(&Tensor::randn(0f32, 1., 384, &dev).unwrap()).unwrap();
    }
    let x = (Tensor::randn(0f32, 3., (4, 96, 384), &dev).unwrap() + 1.0).unwrap();
    check_against_composed("LayerNorm", &ln, &x, 2e-5);
}

#[test]
fn fused_rms_norm_matches_composed_on_many_rows() {
    let dev = Device::Cpu;
    let norm = RmsNorm::new(576, &dev).unwrap();
    norm.weight
        .as_ref()
        .unwrap()
        .set(&Tensor::randn(0f32, 1., 576, &dev).unwrap())
        .unwrap();
    let x = (Tensor::randn(0f32, 3., (4, 64, 576), &dev).unwrap() + 0.5).unwrap();
    check_against_composed("RMSNorm", &norm, &x, 2e-5);
}

#[test]
fn fused_linear_matches_composed_on_many_rows() {
    let x = Tensor::randn(0f32, 1., (4, 64, 384), &Device::Cpu).unwrap();
    let fc = Linear::new(384, 1536, &Device::Cpu).unwrap();
    check_against_composed("Linear", &fc, &x, 2e-5);
}

#[test]
fn fused_gelu_matches_composed_on_many_values() {
    let x = Tensor::randn(0f32, 3., (4, 96, 400), &Device::Cpu).unwrap();
    check_against_composed("GELU", &GELU::new(), &x, 2e-5);
}

/// Rows as attention has them: 25 keys, the padded ones at the float32 minimum.
#[test]
fn fused_softmax_matches_composed_on_masked_rows() {
    let dev = Device::Cpu;
    let scores = Tensor::randn(0f32, 2., (8, 12, 25, 25), &dev).unwrap();
    let keep: Vec<f32> = (0..8 * 25)
        .map(|i| f32::from(i % 25 < 25 - i / 25))
        .collect();
    let mask = ((1.0 - Tensor::from_vec(keep, (8, 1, 1, 25), &dev).unwrap()).unwrap()
        * f64::from(f32::MIN))
    .unwrap();
    let x = scores.broadcast_add(&mask).unwrap();
    // Random rows and upstream: the input gradient's row sums `Σ g y` are added in another order
    // by the two paths, so they differ by float32 rounding (up to ~1.3e-6 seen), as the others.
    check_against_composed("Softmax", &Softmax::new(-1), &x, 1e-5);
}

/// Dropout, fused or composed: each element is dropped or scaled by `1 / (1 - p)`, about a
/// fraction `p` is dropped, and the gradient is the upstream gradient through the same mask.
#[test]
fn dropout_masks_values_and_gradients_alike() {
    let p = 0.25f32;
    let scale = 1.0 / (1.0 - p);
    let dropout = Dropout::new(f64::from(p));
    let dev = Device::Cpu;
    // Never zero, so a kept value is never mistaken for a dropped one.
    let x = Tensor::rand(0.5f32, 1.5, (3, 200, 150), &dev).unwrap();
    let upstream = x.randn_like(0.0, 1.0).unwrap();
    for transposed in [false, true] {
        for fused in [true, false] {
            let run = || pass(&dropout, &x, &upstream, transposed);
            let got = if fused { run() } else { without_fusion(run) };
            let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let (x, y, u, g) = (
                flat(&x),
                flat(&got.output),
                flat(&upstream),
                flat(&got.grad_input),
            );
            let mut dropped = 0;
            for i in 0..x.len() {
                let kept = y[i] != 0.0;
                dropped += usize::from(!kept);
                let mask = if kept { scale } else { 0.0 };
                assert_eq!(y[i], x[i] * mask, "fused {fused}: value {i}");
                assert_eq!(g[i], u[i] * mask, "fused {fused}: gradient {i}");
            }
            let fraction = dropped as f32 / x.len() as f32;
            assert!(
                (fraction - p).abs() < 0.01,
                "fused {fused}: dropped {fraction}"
            );
        }
    }
}

/// The cross-entropy of class ids (a language model's loss: many rows, a wide vocabulary, the
/// padded positions at `ignore_index`), fused or composed: the same loss under every reduction and
/// the same gradient of the logits.
#[test]
fn fused_cross_entropy_matches_composed_with_ignored_rows() {
    let dev = Device::Cpu;
    let logits = Var::from_tensor(&Tensor::randn(0f32, 3., (300, 1000), &dev).unwrap()).unwrap();
    let ids: Vec<i64> = (0..300)
        .map(|i| {
            if i % 7 == 3 {
                -100
            } else {
                (i * 37 % 1000) as i64
            }
        })
        .collect();
    let targets = Tensor::new(ids.as_slice(), &dev).unwrap();
    for reduction in [LossReduction::Mean, LossReduction::Sum, LossReduction::None] {
        let loss_fn = CrossEntropyLoss::with_config(
            ClassLossConfig {
                reduction,
                ..Default::default()
            },
            &dev,
        )
        .unwrap();
        let run = || {
            let loss = loss_fn.call((logits.as_tensor(), &targets)).unwrap();
            let grads = loss.sum_all().unwrap().backward().unwrap();
            (loss, grads.get(&logits).unwrap().clone())
        };
        let (loss, grad) = run();
        let (composed_loss, composed_grad) = without_fusion(run);
        let what = format!("cross-entropy ({reduction:?})");
        assert_near(&format!("{what}: loss"), &loss, &composed_loss, 2e-6);
        // At 1e-5, as the other layers' gradients: the logits are drawn anew each run, and the
        // fused pass's vectorized exp rounds differently from the composed one (3.7e-6 seen).
        assert_near(&format!("{what}: grad"), &grad, &composed_grad, 1e-5);
    }
}

/// A class id outside the classes is a typed error naming it and its row, fused or not.
#[test]
fn cross_entropy_refuses_a_target_outside_the_classes() {
    let dev = Device::Cpu;
    let logits = Var::from_tensor(&Tensor::zeros((3, 5), DType::F32, &dev).unwrap()).unwrap();
    let targets = Tensor::new(&[1i64, 5, 0], &dev).unwrap();
    let err = CrossEntropyLoss::new()
        .call((logits.as_tensor(), &targets))
        .unwrap_err();
    let Error::Forward { source, .. } = &err else {
        panic!("not a forward error: {err:?}");
    };
    assert!(
        matches!(&**source, Error::InvalidInput { layer: "cross_entropy", message } if message.contains("target 5 of row 1")),
        "{err}"
    );
}

/// A head and its loss by blocks of the vocabulary (5000 words: two blocks), against the head
/// called and the loss composed: the loss, the hidden states' and the trained weight's
/// gradients; a frozen quantized head too, against its dequantized values.
#[test]
fn linear_cross_entropy_by_blocks_matches_the_composed_head_and_loss() {
    use module_runtime::nn::loss::linear_cross_entropy;
    let dev = Device::Cpu;
    let head = Linear::no_bias(16, 5000, &dev).unwrap();
    let x = Var::from_tensor(&Tensor::randn(0f32, 1., (2, 9, 16), &dev).unwrap()).unwrap();
    let ids: Vec<i64> = (0..18)
        .map(|i| {
            if i % 5 == 2 {
                -100
            } else {
                (i * 977 % 5000) as i64
            }
        })
        .collect();
    let labels = Tensor::from_vec(ids, (2, 9), &dev).unwrap();
    let run = |fused: bool| {
        let loss = if fused {
            linear_cross_entropy(x.as_tensor(), &head, &labels, -100).unwrap()
        } else {
            let logits = head
                .call(x.as_tensor())
                .unwrap()
                .reshape((18, 5000))
                .unwrap();
            let config = ClassLossConfig {
                ignore_index: -100,
                ..Default::default()
            };
            let ce = CrossEntropyLoss::with_config(config, &dev).unwrap();
            ce.call((&logits, &labels.flatten_all().unwrap())).unwrap()
        };
        let grads = loss.backward().unwrap();
        let w = head.weight.var().unwrap();
        (
            loss,
            grads.get(&x).unwrap().clone(),
            grads.get(w.as_tensor()).unwrap().clone(),
        )
    };
    let (loss, dx, dw) = run(true);
    let (c_loss, c_dx, c_dw) = run(false);
    assert_near("linear_cross_entropy: loss", &loss, &c_loss, 2e-6);
    assert_near("linear_cross_entropy: input grad", &dx, &c_dx, 1e-5);
    assert_near("linear_cross_entropy: weight grad", &dw, &c_dw, 1e-5);

    // Quantized and frozen: the rows dequantized by blocks, the same loss as the float head
    // holding the dequantized values.
    let xq = Var::from_tensor(&Tensor::randn(0f32, 1., (18, 32), &dev).unwrap()).unwrap();
    let q = Linear::no_bias(32, 5000, &dev).unwrap();
    let kind = module_runtime::nn::parse_quant_kind("q8_0").unwrap();
    let _ = module_runtime::nn::quantize(&q, "**", kind).unwrap();
    q.weight.set_requires_grad(false);
    let plain = Linear::no_bias(32, 5000, &dev).unwrap();
    plain.weight.set(&q.weight.tensor().unwrap()).unwrap();
    plain.weight.set_requires_grad(false);
    let lq = linear_cross_entropy(xq.as_tensor(), &q, &labels, -100).unwrap();
    let lp = linear_cross_entropy(xq.as_tensor(), &plain, &labels, -100).unwrap();
    assert_near("quantized head: loss", &lq, &lp, 1e-6);
    let (gq, gp) = (lq.backward().unwrap(), lp.backward().unwrap());
    assert_near(
        "quantized head: input grad",
        gq.get(&xq).unwrap(),
        gp.get(&xq).unwrap(),
        1e-6,
    );
}
