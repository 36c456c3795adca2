//! `Linear::call_each`: several layers on one input give the separate calls' values, whichever
//! path runs them (one pass of the `q8_0` kernel, or the calls in turn), and hooks still see
//! each layer's own call.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use module_runtime::nn::{quantize, GgmlDType, Linear, LinearConfig, Q8_0_MAX_ROWS};
use module_runtime::prelude::*;

/// Three projections of one 64-wide input: 40 outputs (not a whole number of the kernel's
/// 16-row tiles), 16 with a bias, 96.
#[derive(Module)]
struct Projections {
    a: Linear,
    b: Linear,
    c: Linear,
}

fn projections() -> Result<Projections> {
    let with_bias = LinearConfig {
        bias: true,
        ..Default::default()
    };
    Ok(Projections {
        a: Linear::no_bias(64, 40, &Device::Cpu)?,
        b: Linear::with_config(64, 16, with_bias, &Device::Cpu)?,
        c: Linear::no_bias(64, 96, &Device::Cpu)?,
    })
}

fn each(m: &Projections, x: &Tensor) -> Result<[Tensor; 3]> {
    Linear::call_each([&m.a, &m.b, &m.c], x)
}

fn values(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.flatten_all()?.to_vec1::<f32>()?)
}

/// Bit for bit the separate calls' outputs, for each input shape.
fn assert_separate_calls(m: &Projections, shapes: &[&[usize]]) -> Result<()> {
    for shape in shapes {
        let x = Tensor::randn(0f32, 1., *shape, &Device::Cpu)?;
        let together = each(m, &x)?;
        let separate = [m.a.call(&x)?, m.b.call(&x)?, m.c.call(&x)?];
        for (t, s) in together.iter().zip(&separate) {
            assert_eq!(t.dims(), s.dims(), "input {shape:?}");
            assert_eq!(values(t)?, values(s)?, "input {shape:?}");
        }
    }
    Ok(())
}

#[test]
fn q8_0_layers_give_the_separate_calls_values() -> Result<()> {
    let m = projections()?;
    let report = quantize(&m, "**", GgmlDType::Q8_0)?;
    assert_eq!(report.quantized.len(), 3);
    // One row (decoding), a batch of rows, more rows than one pass of a tile takes (5), leading
    // dimensions, and more rows than the kernel takes (the float path, layer by layer).
    let many = [Q8_0_MAX_ROWS + 8, 64];
    assert_separate_calls(&m, &[&[1, 64], &[3, 64], &[5, 64], &[2, 1, 64], &many])
}

#[test]
fn float_and_mixed_layers_give_the_separate_calls_values() -> Result<()> {
    let m = projections()?;
    assert_separate_calls(&m, &[&[1, 64], &[3, 2, 64]])?;
    m.b.weight.quantize(GgmlDType::Q8_0)?; // one quantized layer among float ones
    assert_separate_calls(&m, &[&[1, 64], &[4, 64]])
}

#[test]
fn hooks_see_each_layers_own_call() -> Result<()> {
    let m = projections()?;
    assert_eq!(quantize(&m, "**", GgmlDType::Q8_0)?.quantized.len(), 3);
    let x = Tensor::randn(0f32, 1., (1, 64), &Device::Cpu)?;
    let plain = each(&m, &x)?;
    let hooks = Hooks::new();
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    hooks.register_forward_hook(
        "*",
        move |_, _, _| {
            counted.fetch_add(1, Ordering::Relaxed);
            Ok(None)
        },
        HookOptions::default(),
    )?;
    // A hook on `b` that replaces its output: the call sees the replacement.
    hooks.register_forward_hook(
        "b",
        |_, _, output| Ok(Some(vec![output[0].neg()?])),
        HookOptions::default(),
    )?;
    let hooked = hooks.run(&m, |m| each(m, &x))?;
    assert_eq!(calls.load(Ordering::Relaxed), 3);
    assert_eq!(values(&hooked[0])?, values(&plain[0])?);
    assert_eq!(values(&hooked[1])?, values(&plain[1].neg()?)?);
    assert_eq!(values(&hooked[2])?, values(&plain[2])?);
    Ok(())
}

#[test]
fn gradients_flow_as_through_the_separate_calls() -> Result<()> {
    let m = projections()?;
    let x = Tensor::randn(0f32, 1., (2, 64), &Device::Cpu)?;
    let [a, b, c] = each(&m, &x)?;
    let loss = (a.sum_all()? + b.sqr()?.sum_all()? + c.mean_all()?)?;
    let grads = loss.backward()?;
    let separate =
        (m.a.call(&x)?.sum_all()? + m.b.call(&x)?.sqr()?.sum_all()? + m.c.call(&x)?.mean_all()?)?
            .backward()?;
    for (path, p) in m.named_parameters() {
        let w = p.tensor()?;
        let (g, s) = (grads.get(&w).unwrap(), separate.get(&w).unwrap());
        assert_eq!(values(g)?, values(s)?, "{path}");
    }
    Ok(())
}
