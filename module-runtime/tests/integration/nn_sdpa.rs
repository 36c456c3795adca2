//! `nn::functional::scaled_dot_product_attention` against PyTorch's `F.scaled_dot_product_attention`
//! (`fixtures/pytorch/nn/sdpa_*.safetensors`, made by `fixtures/make_sdpa_fixtures.py`): the fused
//! inference pass, the fused training op and the composed path all give PyTorch's output, the
//! last two PyTorch's gradients; dropout in training drops and rescales; strided inputs (heads as a
//! view of `[B, L, H, E]`) give the same result as contiguous ones; bad shapes are typed errors.

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::{DType, Device, Tensor, Var};
use module_runtime::nn::functional::{scaled_dot_product_attention, SdpaOptions};
use module_runtime::nn::without_fusion;
use module_runtime::{no_grad, Error};

use crate::nn_fixture::assert_close;

fn load(name: &str) -> HashMap<String, Tensor> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../fixtures/pytorch/nn")
        .join(format!("{name}.safetensors"));
    candle_core::safetensors::load(&path, &Device::Cpu).unwrap()
}

/// The cases of the fixture script, with their arguments.
fn cases() -> [(&'static str, SdpaOptions); 6] {
    let o = SdpaOptions::default();
    let causal = SdpaOptions {
        is_causal: true,
        ..o
    };
    [
        ("sdpa_plain", o),
        (
            "sdpa_float_mask_scale",
            SdpaOptions {
                scale: Some(0.3),
                ..o
            },
        ),
        ("sdpa_bool_mask", o),
        ("sdpa_causal_rect", causal),
        (
            "sdpa_gqa_causal",
            SdpaOptions {
                enable_gqa: true,
                ..causal
            },
        ),
        ("sdpa_padding_mask", o),
    ]
}

fn mask(fx: &HashMap<String, Tensor>) -> Option<&Tensor> {
    fx.get("mask").or_else(|| fx.get("mask_u8"))
}

/// The fused pass (inference) and the composed path (with fusion off) give PyTorch's output.
#[test]
fn both_paths_match_pytorchs_output() {
    for (case, options) in cases() {
        let fx = load(case);
        let run = || {
            scaled_dot_product_attention(&fx["query"], &fx["key"], &fx["value"], mask(&fx), options)
                .unwrap()
        };
        let fused = {
            let _inference = no_grad();
            run()
        };
        assert_close(&format!("{case} fused"), &fused, &fx["output"]);
        let composed = without_fusion(run);
        assert_close(&format!("{case} composed"), &composed, &fx["output"]);
    }
}

/// Both paths that record a gradient, the fused training op (CPU float32, fusion on) and the
/// composed ops (fusion off), give PyTorch's output and gradients.
#[test]
fn gradients_match_pytorch_on_both_paths() {
    for (case, options) in cases() {
        let fx = load(case);
        let (q, k, v) = (
            Var::from_tensor(&fx["query"]).unwrap(),
            Var::from_tensor(&fx["key"]).unwrap(),
            Var::from_tensor(&fx["value"]).unwrap(),
        );
        let run = || scaled_dot_product_attention(&q, &k, &v, mask(&fx), options).unwrap();
        for (path, y) in [("fused", run()), ("composed", without_fusion(run))] {
            assert_close(&format!("{case} {path} output"), &y, &fx["output"]);
            let grads = (y * &fx["upstream"])
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            for (name, var) in [("query", &q), ("key", &k), ("value", &v)] {
                let g = grads.get(var.as_tensor()).unwrap();
                assert_close(
                    &format!("{case} {path} grad.{name}"),
                    g,
                    &fx[&format!("grad.{name}")],
                );
            }
        }
    }
}

/// Dropout on the attention weights while a gradient is recorded (the fused training op): about
/// `p` of the weights are dropped and the others scaled by `1 / (1 - p)`, so with values of one
/// the outputs average one; the gradient reaches the values.
#[test]
fn dropout_in_training_drops_and_rescales_weights() {
    let dev = Device::Cpu;
    let (b, h, l, s, e) = (4, 4, 32, 32, 4);
    let q = Var::from_tensor(&Tensor::zeros((b, h, l, e), DType::F32, &dev).unwrap()).unwrap();
    let v = Var::from_tensor(&Tensor::ones((b, h, s, e), DType::F32, &dev).unwrap()).unwrap();
    let options = SdpaOptions {
        dropout_p: 0.5,
        ..Default::default()
    };
    // Equal scores: every weight is 1/S before dropout, 2/S or 0 after.
    let y = scaled_dot_product_attention(&q, &q, &v, None, options).unwrap();
    let values: Vec<f32> = y.flatten_all().unwrap().to_vec1().unwrap();
    let mean = values.iter().sum::<f32>() / values.len() as f32;
    assert!((mean - 1.0).abs() < 0.05, "mean {mean}");
    assert!(
        values.iter().any(|&x| (x - 1.0).abs() > 0.1),
        "some weights dropped"
    );
    for x in &values {
        // Each output is (2/S) times the number of kept weights.
        let kept = x * s as f32 / 2.0;
        assert!((kept - kept.round()).abs() < 1e-4, "{x}");
    }
    let grads = y.sum_all().unwrap().backward().unwrap();
    let dv = grads.get(v.as_tensor()).unwrap();
    assert_eq!(dv.dims(), [b, h, s, e]);
}

/// Heads as a strided view of a `[B, L, H, E]` projection, as attention layers make them: the
/// fused pass reads them in place, with the same result as from contiguous copies; its output,
/// transposed back, is contiguous.
#[test]
fn strided_heads_read_in_place() {
    let (fx, options) = (load("sdpa_padding_mask"), SdpaOptions::default());
    let _inference = no_grad();
    let view = |t: &Tensor| {
        t.transpose(1, 2)
            .unwrap()
            .contiguous()
            .unwrap()
            .transpose(1, 2)
            .unwrap()
    };
    let (q, k, v) = (view(&fx["query"]), view(&fx["key"]), view(&fx["value"]));
    assert!(!q.is_contiguous());
    let y = scaled_dot_product_attention(&q, &k, &v, mask(&fx), options).unwrap();
    assert_close("strided", &y, &fx["output"]);
    assert!(y.transpose(1, 2).unwrap().is_contiguous());
}

/// A query that may attend to no key gets NaN on both paths, as PyTorch's composed path gives.
#[test]
fn a_fully_masked_query_is_nan_on_both_paths() {
    let dev = Device::Cpu;
    let q = Tensor::ones((1, 1, 2, 4), DType::F32, &dev).unwrap();
    let kv = Tensor::ones((1, 1, 3, 4), DType::F32, &dev).unwrap();
    let mask = Tensor::new(&[[1u8, 1, 1], [0, 0, 0]], &dev).unwrap();
    let run = || scaled_dot_product_attention(&q, &kv, &kv, Some(&mask), SdpaOptions::default());
    for y in [run().unwrap(), without_fusion(run).unwrap()] {
        let rows: Vec<Vec<f32>> = y.squeeze(0).unwrap().squeeze(0).unwrap().to_vec2().unwrap();
        assert!(rows[0].iter().all(|x| (x - 1.0).abs() < 1e-6), "{rows:?}");
        assert!(rows[1].iter().all(|x| x.is_nan()), "{rows:?}");
    }
}

#[test]
fn shapes_that_do_not_agree_are_errors_naming_them() {
    let dev = Device::Cpu;
    let t = |dims: &[usize]| Tensor::zeros(dims, DType::F32, &dev).unwrap();
    let err = |q: &Tensor, k: &Tensor, v: &Tensor, m: Option<&Tensor>, o| {
        scaled_dot_product_attention(q, k, v, m, o).unwrap_err()
    };
    let e = err(
        &t(&[2, 4, 5, 8]),
        &t(&[2, 2, 5, 8]),
        &t(&[2, 2, 5, 8]),
        None,
        SdpaOptions::default(),
    );
    assert!(matches!(e, Error::InvalidConfig { .. }), "{e}");
    assert!(e.to_string().contains("set enable_gqa"), "{e}");
    let e = err(
        &t(&[2, 4, 5, 8]),
        &t(&[2, 4, 5, 6]),
        &t(&[2, 4, 5, 8]),
        None,
        SdpaOptions::default(),
    );
    assert!(e.to_string().contains("[2, 4, 5, 6]"), "{e}");
    let e = err(
        &t(&[2, 4, 5, 8]),
        &t(&[2, 4, 5, 8]),
        &t(&[2, 4, 5, 8]),
        Some(&t(&[3, 1, 1, 5])),
        SdpaOptions::default(),
    );
    assert!(
        e.to_string()
            .contains("[3, 1, 1, 5] does not broadcast to [B, Hq, L, S] = [2, 4, 5, 5]"),
        "{e}"
    );
}

/// `packed_heads`: the projections' `[B, L, H·E]` as they are give the values and gradients of
/// splitting the heads, calling the function and joining them back, bit for bit: on the fused
/// training op (float32, and bfloat16 under the same op), the inference pass and the composed
/// path, for every fixture case (grouped-query heads and masks included). Widths that do not
/// split into heads are typed errors naming the shapes.
#[test]
fn packed_heads_give_the_split_heads_values_and_gradients() {
    let pack = |t: &Tensor| {
        let (b, h, l, e) = t.dims4().unwrap();
        t.transpose(1, 2).unwrap().reshape((b, l, h * e)).unwrap()
    };
    for dtype in [DType::F32, DType::BF16] {
        for (case, options) in cases() {
            let fx = load(case);
            let hq = fx["query"].dim(1).unwrap();
            let h = fx["key"].dim(1).unwrap();
            let var =
                |name: &str| Var::from_tensor(&pack(&fx[name]).to_dtype(dtype).unwrap()).unwrap();
            let (q, k, v) = (var("query"), var("key"), var("value"));
            let m = mask(&fx).map(|m| match m.dtype() {
                DType::U8 => m.clone(),
                _ => m.to_dtype(dtype).unwrap(),
            });
            let split = |t: &Tensor, heads: usize| {
                let (b, l, w) = t.dims3().unwrap();
                t.reshape((b, l, heads, w / heads))
                    .unwrap()
                    .transpose(1, 2)
                    .unwrap()
            };
            let packed = || {
                let o = SdpaOptions {
                    packed_heads: Some(hq),
                    ..options
                };
                scaled_dot_product_attention(&q, &k, &v, m.as_ref(), o).unwrap()
            };
            let joined = || {
                let (sq, sk, sv) = (split(&q, hq), split(&k, h), split(&v, h));
                let y = scaled_dot_product_attention(&sq, &sk, &sv, m.as_ref(), options).unwrap();
                pack(&y)
            };
            let upstream = pack(&fx["upstream"]);
            let bits = |t: &Tensor| {
                t.to_dtype(DType::F32)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap()
                    .iter()
                    .map(|x| x.to_bits())
                    .collect::<Vec<_>>()
            };
            let grads = |y: &Tensor| {
                let g = (y.to_dtype(DType::F32).unwrap() * &upstream)
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .backward()
                    .unwrap();
                [&q, &k, &v].map(|x| bits(g.get(x.as_tensor()).unwrap()))
            };
            for (path, fused) in [("fused", true), ("composed", false)] {
                let run = |f: &dyn Fn() -> Tensor| if fused { f() } else { without_fusion(f) };
                let (a, b) = (run(&packed), run(&joined));
                assert_eq!(a.dims(), b.dims(), "{case} {dtype:?} {path}");
                assert_eq!(a.dtype(), dtype);
                assert!(bits(&a) == bits(&b), "{case} {dtype:?} {path} output");
                assert!(grads(&a) == grads(&b), "{case} {dtype:?} {path} gradients");
            }
            let _inference = no_grad();
            assert!(
                bits(&packed()) == bits(&joined()),
                "{case} {dtype:?} inference"
            );
        }
    }
    // Chunks of one stacked projection (`MultiheadAttention`'s `[B, L, 3·E]`), strided: read in
    // place by the training op, with the split path's values and gradients.
    // (A case with as many keys as queries and one head count, as self-attention has.)
    let (fx, options) = cases()
        .into_iter()
        .map(|(case, options)| (load(case), options))
        .find(|(fx, _)| fx["query"].dims() == fx["key"].dims())
        .expect("a self-attention case");
    let hq = fx["query"].dim(1).unwrap();
    let stacked = Tensor::cat(
        &[pack(&fx["query"]), pack(&fx["key"]), pack(&fx["value"])],
        2,
    );
    let stacked = Var::from_tensor(&stacked.unwrap()).unwrap();
    let width = fx["query"].dim(1).unwrap() * fx["query"].dim(3).unwrap();
    let chunk = |i: usize| stacked.as_tensor().narrow(2, i * width, width).unwrap();
    let (q, k, v) = (chunk(0), chunk(1), chunk(2));
    assert!(!q.is_contiguous());
    let m = mask(&fx);
    let o = SdpaOptions {
        packed_heads: Some(hq),
        ..options
    };
    let in_place = scaled_dot_product_attention(&q, &k, &v, m, o).unwrap();
    let copied = [&q, &k, &v].map(|t| t.contiguous().unwrap());
    let [cq, ck, cv] = [&copied[0], &copied[1], &copied[2]];
    let reference = scaled_dot_product_attention(cq, ck, cv, m, o).unwrap();
    let upstream = pack(&fx["upstream"]);
    let grad = |y: &Tensor| {
        let g = (y * &upstream)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        g.get(stacked.as_tensor())
            .unwrap()
            .to_vec3::<f32>()
            .unwrap()
    };
    assert_eq!(
        in_place.to_vec3::<f32>().unwrap(),
        reference.to_vec3::<f32>().unwrap()
    );
    assert_eq!(grad(&in_place), grad(&reference));
    // Read in place: the graph is the reference's without its three contiguous copies.
    let nodes = |y: &Tensor| y.sorted_nodes().len();
    assert_eq!(nodes(&in_place) + 3, nodes(&reference));

    let t = |dims: &[usize]| Tensor::zeros(dims, DType::F32, &Device::Cpu).unwrap();
    let o = SdpaOptions {
        packed_heads: Some(3),
        ..Default::default()
    };
    let e =
        scaled_dot_product_attention(&t(&[2, 5, 12]), &t(&[2, 5, 10]), &t(&[2, 5, 12]), None, o)
            .unwrap_err();
    assert!(matches!(e, Error::InvalidConfig { .. }), "{e}");
    assert!(e.to_string().contains("[2, 5, 10]"), "{e}");
    let e =
        scaled_dot_product_attention(&t(&[2, 4, 5, 8]), &t(&[2, 5, 8]), &t(&[2, 5, 8]), None, o)
            .unwrap_err();
    assert!(e.to_string().contains("[B, L, Hq·E]"), "{e}");
}

/// Under `autocast` the composed path (fusion off here; every path off the CPU kernels) computes
/// in the autocast dtype: the output is bfloat16 and within bfloat16 rounding of float32's. (On
/// CUDA, whose autocast list puts `softmax` in float32, the weights are cast back before the
/// product with the values: a float32 × bfloat16 product failed there, found on an H200.)
#[test]
fn the_composed_path_under_autocast_stays_in_the_autocast_dtype() {
    let fx = load("sdpa_padding_mask");
    let run = || {
        scaled_dot_product_attention(
            &fx["query"],
            &fx["key"],
            &fx["value"],
            mask(&fx),
            SdpaOptions::default(),
        )
    };
    let y = without_fusion(|| module_runtime::amp::autocast("cpu", DType::BF16, run)).unwrap();
    assert_eq!(y.dtype(), DType::BF16);
    let values = |t: &Tensor| -> Vec<f32> {
        let t = t.to_dtype(DType::F32).unwrap();
        t.flatten_all().unwrap().to_vec1().unwrap()
    };
    let (got, want) = (values(&y), values(&fx["output"]));
    let close = got.iter().zip(&want).all(|(g, w)| (g - w).abs() < 0.05);
    assert!(close, "{got:?} against float32's {want:?}");
}
