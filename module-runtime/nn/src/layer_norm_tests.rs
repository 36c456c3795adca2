//! Tests of `layer_norm.rs`: fused and composed paths agree, float64 norms, `call_residual`, shapes.

use super::*;
use crate::common::max_diff;
use crate::{Forward, ModuleExt};

/// With frozen parameters and a plain input nothing needs a gradient: the fused kernel runs, and
/// it agrees with the differentiable path.
#[test]
fn fused_and_composed_paths_agree() -> Result<()> {
    let dev = Device::Cpu;
    let x = (Tensor::randn(0f32, 2., (3, 5, 16), &dev)? + 0.5)?;
    let ln = LayerNorm::new(16, &dev)?;
    ln.weight
        .as_ref()
        .unwrap()
        .set(&Tensor::randn(1f32, 0.5, 16, &dev)?)?;
    ln.bias
        .as_ref()
        .unwrap()
        .set(&Tensor::randn(0f32, 0.5, 16, &dev)?)?;
    let config = RmsNormConfig {
        eps: Some(1e-6),
        ..Default::default()
    };
    let rms = RmsNorm::with_config(16, config, &dev)?;
    rms.weight
        .as_ref()
        .unwrap()
        .set(&Tensor::randn(1f32, 0.5, 16, &dev)?)?;
    let composed = (ln.forward(&x)?, rms.forward(&x)?);
    ln.freeze("**")?;
    rms.freeze("**")?;
    let fused = (ln.forward(&x)?, rms.forward(&x)?);
    assert!(max_diff(&composed.0, &fused.0) < 1e-5);
    assert!(max_diff(&composed.1, &fused.1) < 1e-5);
    Ok(())
}

/// candle's fused kernels take no `f64`: under `no_grad` a float64 norm takes the composed
/// path, and gives what it gives with gradients on.
#[test]
fn float64_norms_work_under_no_grad() -> Result<()> {
    let dev = Device::Cpu;
    let x = Tensor::randn(0f64, 2., (3, 5, 16), &dev)?;
    let ln = LayerNorm::with_config(
        16,
        LayerNormConfig {
            dtype: DType::F64,
            ..Default::default()
        },
        &dev,
    )?;
    ln.bias
        .as_ref()
        .unwrap()
        .set(&Tensor::randn(0f64, 0.5, 16, &dev)?)?;
    let rms = RmsNorm::with_config(
        16,
        RmsNormConfig {
            dtype: DType::F64,
            ..Default::default()
        },
        &dev,
    )?;
    let tracked = (ln.forward(&x)?, rms.forward(&x)?);
    assert!(tracked.0.track_op() && tracked.1.track_op());
    let inference =
        crate::without_grad(|| Ok::<_, crate::Error>((ln.forward(&x)?, rms.forward(&x)?)))?;
    assert!(!inference.0.track_op() && !inference.1.track_op());
    assert_eq!(inference.0.to_vec3::<f64>()?, tracked.0.to_vec3::<f64>()?);
    assert_eq!(inference.1.to_vec3::<f64>()?, tracked.1.to_vec3::<f64>()?);
    Ok(())
}

/// `call_residual` under `no_grad` against the sum and the call with fusion off (candle's
/// fused kernel), within 1e-5, with and without the affine parameters; with a graph it is the
/// differentiable sum and call.
#[test]
fn call_residual_matches_the_unfused_norm() -> Result<()> {
    // 1,344 values stay on the calling thread; 92,160 are split over the thread pool.
    check_call_residual((4, 7, 48))?;
    check_call_residual((40, 48, 48))
}

fn check_call_residual(shape: (usize, usize, usize)) -> Result<()> {
    let dev = Device::Cpu;
    let x = (Tensor::randn(0f32, 3., shape, &dev)? + 2.0)?;
    let residual = Tensor::randn(0f32, 1., shape, &dev)?;
    let affine = LayerNorm::new(48, &dev)?;
    affine
        .weight
        .as_ref()
        .unwrap()
        .set(&Tensor::randn(1f32, 0.5, 48, &dev)?)?;
    affine
        .bias
        .as_ref()
        .unwrap()
        .set(&Tensor::randn(0f32, 0.5, 48, &dev)?)?;
    let plain = LayerNormConfig {
        elementwise_affine: false,
        eps: 1e-12,
        ..Default::default()
    };
    let no_bias = LayerNormConfig {
        bias: false,
        ..Default::default()
    };
    for ln in [
        affine,
        LayerNorm::with_config(48, plain, &dev)?,
        LayerNorm::with_config(48, no_bias, &dev)?,
    ] {
        let unfused_with_graph = ln.call(&(&x + &residual)?)?;
        let tracked = ln.call_residual(&x, &residual)?;
        assert_eq!(tracked.track_op(), ln.weight.is_some());
        assert!(max_diff(&tracked, &unfused_with_graph) < 1e-5);
        let _inference = crate::no_grad();
        let fused = ln.call_residual(&x, &residual)?;
        let unfused = crate::without_fusion(|| ln.call_residual(&x, &residual))?;
        assert_eq!(fused.dims(), x.dims());
        assert!(max_diff(&fused, &unfused) < 1e-5, "{ln:?}");
    }
    // Mismatched shapes are the sum's error, as without fusion.
    let ln = LayerNorm::new(48, &dev)?;
    let short = Tensor::zeros((4, 48), DType::F32, &dev)?;
    let err = crate::without_grad(|| ln.call_residual(&x, &short));
    assert!(err.is_err());
    Ok(())
}

#[test]
fn layer_norm_over_two_trailing_dims() -> Result<()> {
    let dev = Device::Cpu;
    let ln = LayerNorm::new((2, 3), &dev)?;
    let x = Tensor::randn(0f32, 1., (4, 2, 3), &dev)?;
    let y = ln.forward(&x)?;
    let no_affine = LayerNormConfig {
        elementwise_affine: false,
        ..Default::default()
    };
    let flat = LayerNorm::with_config(6, no_affine, &dev)?.forward(&x.reshape((4, 6))?)?;
    assert!(max_diff(&y.reshape((4, 6))?, &flat) < 1e-6);
    Ok(())
}

#[test]
fn wrong_trailing_dims_are_an_input_shape_error() -> Result<()> {
    let ln = LayerNorm::new(4, &Device::Cpu)?;
    let err = ln
        .forward(&Tensor::zeros((2, 3), DType::F32, &Device::Cpu)?)
        .unwrap_err();
    assert!(
        matches!(
            err,
            crate::Error::InputShape {
                layer: "LayerNorm",
                ..
            }
        ),
        "{err}"
    );
    Ok(())
}
