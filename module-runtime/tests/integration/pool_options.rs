//! `MaxPool2d` / `AvgPool2d` with PyTorch's options (`padding`, `dilation`, `ceil_mode`,
//! `count_include_pad`, `divisor_override`, per spatial dimension), checked against a naive
//! reference written from PyTorch's definitions, forward and backward.
//!
//! The reference follows PyTorch's CPU kernels: `pooling_output_shape_pad_lr` in
//! `aten/src/ATen/native/Pool.h` for the output size, `cpu_max_pool` in
//! `aten/src/ATen/native/cpu/MaxPoolKernel.cpp` (padding never wins a max; the first maximum of a
//! window gets its gradient) and `cpu_avg_pool` in `aten/src/ATen/native/cpu/AvgPoolKernel.cpp`
//! (the divisor).

use candle_core::{Device, Tensor, Var};
use module_runtime::nn::{AvgPool2d, MaxPool2d, PerDim, Pool2dConfig};
use module_runtime::{Error, Forward, Result};

/// Options along one spatial dimension.
#[derive(Clone, Copy, Debug)]
struct Ax {
    k: usize,
    s: usize,
    p: usize,
    d: usize,
}

/// PyTorch's output size (`pooling_output_shape_pad_lr`, with `div_rtn` rounding toward -inf),
/// including the `ceil_mode` rule that the last window must start inside the input or its left
/// padding.
fn torch_out(size: usize, a: Ax, ceil: bool) -> i64 {
    let (size, k, s, p, d) = (size as i64, a.k as i64, a.s as i64, a.p as i64, a.d as i64);
    let num = size + 2 * p - d * (k - 1) - 1 + if ceil { s - 1 } else { 0 };
    let mut out = num.div_euclid(s) + 1;
    if ceil && (out - 1) * s >= size + p {
        out -= 1;
    }
    out
}

struct Case {
    h: usize,
    w: usize,
    ah: Ax,
    aw: Ax,
    ceil: bool,
    count_include_pad: bool,
    divisor_override: Option<usize>,
}

impl Case {
    fn config(&self) -> Pool2dConfig {
        Pool2dConfig {
            stride: Some((self.ah.s, self.aw.s).into()),
            padding: PerDim::HW(self.ah.p, self.aw.p),
            dilation: [self.ah.d, self.aw.d].into(),
            ceil_mode: self.ceil,
            count_include_pad: self.count_include_pad,
            divisor_override: self.divisor_override,
        }
    }

    fn out(&self) -> (usize, usize) {
        (
            torch_out(self.h, self.ah, self.ceil) as usize,
            torch_out(self.w, self.aw, self.ceil) as usize,
        )
    }

    fn valid(&self) -> bool {
        self.ah.p <= self.ah.k / 2
            && self.aw.p <= self.aw.k / 2
            && torch_out(self.h, self.ah, self.ceil) >= 1
            && torch_out(self.w, self.aw, self.ceil) >= 1
    }

    /// The input positions (row, col) of window (i, j), in PyTorch's scan order, as signed
    /// coordinates (padding is outside `0..h`, `0..w`).
    fn window(&self, i: usize, j: usize) -> Vec<(i64, i64)> {
        let (ah, aw) = (self.ah, self.aw);
        let mut pos = Vec::new();
        for a in 0..ah.k {
            for b in 0..aw.k {
                let r = (i * ah.s + a * ah.d) as i64 - ah.p as i64;
                let c = (j * aw.s + b * aw.d) as i64 - aw.p as i64;
                pos.push((r, c));
            }
        }
        pos
    }

    fn inside(&self, (r, c): (i64, i64)) -> bool {
        r >= 0 && c >= 0 && r < self.h as i64 && c < self.w as i64
    }

    /// Naive max pooling of one `[h, w]` plane, and the position of each window's first maximum.
    fn max_ref(&self, x: &[f32]) -> (Vec<f32>, Vec<usize>) {
        let (ho, wo) = self.out();
        let (mut out, mut arg) = (Vec::new(), Vec::new());
        for i in 0..ho {
            for j in 0..wo {
                let mut best = (f32::NEG_INFINITY, usize::MAX);
                for pos in self.window(i, j) {
                    if self.inside(pos) {
                        let idx = pos.0 as usize * self.w + pos.1 as usize;
                        if x[idx] > best.0 {
                            best = (x[idx], idx);
                        }
                    }
                }
                out.push(best.0);
                arg.push(best.1);
            }
        }
        (out, arg)
    }

    /// Naive average pooling of one plane, and each window's divisor. PyTorch (cpu_avg_pool):
    /// `hend = min(hstart + kH, H + padH)`, `pool_size = (hend - hstart) * (wend - wstart)`, then
    /// clip to the input; divide by `divisor_override`, `pool_size` (count_include_pad) or the
    /// clipped area.
    fn avg_ref(&self, x: &[f32]) -> (Vec<f32>, Vec<f32>) {
        let (ho, wo) = self.out();
        let (ah, aw) = (self.ah, self.aw);
        let (h, w) = (self.h as i64, self.w as i64);
        let (mut out, mut div) = (Vec::new(), Vec::new());
        for i in 0..ho as i64 {
            for j in 0..wo as i64 {
                let hs = i * ah.s as i64 - ah.p as i64;
                let ws = j * aw.s as i64 - aw.p as i64;
                let he = (hs + ah.k as i64).min(h + ah.p as i64);
                let we = (ws + aw.k as i64).min(w + aw.p as i64);
                let pool_size = (he - hs) * (we - ws);
                let (hs, ws, he, we) = (hs.max(0), ws.max(0), he.min(h), we.min(w));
                let mut sum = 0f32;
                for r in hs..he {
                    for c in ws..we {
                        sum += x[(r * w + c) as usize];
                    }
                }
                let d = match self.divisor_override {
                    Some(d) => d as f32,
                    None if self.count_include_pad => pool_size as f32,
                    None => ((he - hs) * (we - ws)) as f32,
                };
                out.push(sum / d);
                div.push(d);
            }
        }
        (out, div)
    }
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0., f32::max)
}

fn planes(t: &Tensor) -> Vec<Vec<f32>> {
    let (n, c, h, w) = t.dims4().unwrap();
    let flat = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    (0..n * c)
        .map(|p| flat[p * h * w..(p + 1) * h * w].to_vec())
        .collect()
}

/// Runs `layer` on `x` without and with a gradient; returns both outputs and the input gradient
/// of `sum(y * upstream)`.
fn run(
    layer: &impl for<'a> Forward<&'a Tensor, Output = Tensor>,
    x: &Tensor,
    upstream: &Tensor,
) -> Result<(Tensor, Tensor, Tensor)> {
    let plain = layer.forward(x)?;
    let var = Var::from_tensor(x)?;
    let tracked = layer.forward(var.as_tensor())?;
    let grads = (&tracked * upstream)?.sum_all()?.backward()?;
    let g = grads.get(var.as_tensor()).expect("a gradient").clone();
    Ok((plain, tracked, g))
}

fn axes() -> Vec<Ax> {
    let mut axes = Vec::new();
    for k in [1, 2, 3, 4] {
        for s in [1, 2, 3] {
            for p in 0..=k / 2 {
                for d in [1, 2] {
                    axes.push(Ax { k, s, p, d });
                }
            }
        }
    }
    axes
}

/// Every combination of per-dimension kernel, stride, padding and dilation (a sample of pairs,
/// unequal along the height and the width) on odd sizes, with and without `ceil_mode`.
fn cases(avg: bool) -> Vec<Case> {
    let axes: Vec<Ax> = axes().into_iter().filter(|a| !avg || a.d == 1).collect();
    let mut cases = Vec::new();
    let mut n = 0usize;
    for (hi, &ah) in axes.iter().enumerate() {
        for (wi, &aw) in axes.iter().enumerate() {
            // A deterministic sample of the pairs, always including the equal ones.
            n += 1;
            if hi != wi && !n.is_multiple_of(7) {
                continue;
            }
            for ceil in [false, true] {
                for (count_include_pad, divisor_override) in
                    [(true, None), (false, None), (true, Some(5))]
                {
                    if !avg && (!count_include_pad || divisor_override.is_some()) {
                        continue;
                    }
                    for (h, w) in [(11, 13), (5, 4)] {
                        let case = Case {
                            h,
                            w,
                            ah,
                            aw,
                            ceil,
                            count_include_pad,
                            divisor_override,
                        };
                        if case.valid() {
                            cases.push(case);
                        }
                    }
                }
            }
        }
    }
    cases
}

/// `nn.MaxPool2d` forward (candle's kernel or padded windows) and backward (the first maximum of
/// each window gets the window's gradient, as in PyTorch's `cpu_max_pool_backward`) match the naive
/// reference over the grid of options.
#[test]
fn max_pool2d_matches_pytorch_definition_for_padding_dilation_ceil_mode() -> Result<()> {
    let dev = Device::Cpu;
    let cases = cases(false);
    assert!(cases.len() > 200, "{}", cases.len());
    for case in &cases {
        let x = Tensor::randn(0f32, 1., (2, 2, case.h, case.w), &dev)?;
        let (ho, wo) = case.out();
        let up = Tensor::randn(0f32, 1., (2, 2, ho, wo), &dev)?;
        let layer = MaxPool2d::with_config((case.ah.k, case.aw.k), case.config());
        let (plain, tracked, g) = run(&layer, &x, &up)?;
        assert_eq!(plain.dims(), [2, 2, ho, wo], "{:?} {:?}", case.ah, case.aw);
        let (ups, gs) = (planes(&up), planes(&g));
        for (p, ((xp, yp), tp)) in planes(&x)
            .iter()
            .zip(planes(&plain))
            .zip(planes(&tracked))
            .enumerate()
        {
            let (expected, arg) = case.max_ref(xp);
            assert_eq!(
                max_diff(&yp, &expected),
                0.0,
                "{:?} {:?} ceil {}",
                case.ah,
                case.aw,
                case.ceil
            );
            assert_eq!(max_diff(&tp, &expected), 0.0);
            let mut grad = vec![0f32; case.h * case.w];
            for (o, &idx) in arg.iter().enumerate() {
                grad[idx] += ups[p][o];
            }
            assert!(
                max_diff(&gs[p], &grad) < 1e-5,
                "{:?} {:?} ceil {}",
                case.ah,
                case.aw,
                case.ceil
            );
        }
    }
    Ok(())
}

/// `nn.AvgPool2d` forward and backward (each window's gradient spread over its real elements,
/// divided by the window's divisor) match the naive reference over the grid of options, including
/// `count_include_pad=False` and `divisor_override`.
#[test]
fn avg_pool2d_matches_pytorch_definition_for_padding_ceil_mode_and_divisors() -> Result<()> {
    let dev = Device::Cpu;
    let cases = cases(true);
    assert!(cases.len() > 200, "{}", cases.len());
    for case in &cases {
        let x = Tensor::randn(0f32, 1., (1, 3, case.h, case.w), &dev)?;
        let (ho, wo) = case.out();
        let up = Tensor::randn(0f32, 1., (1, 3, ho, wo), &dev)?;
        let layer = AvgPool2d::with_config((case.ah.k, case.aw.k), case.config());
        let (plain, tracked, g) = run(&layer, &x, &up)?;
        assert_eq!(plain.dims(), [1, 3, ho, wo]);
        let (ups, gs) = (planes(&up), planes(&g));
        let what = || {
            format!(
                "{:?} {:?} ceil {} count_include_pad {} divisor {:?} on {}x{}",
                case.ah,
                case.aw,
                case.ceil,
                case.count_include_pad,
                case.divisor_override,
                case.h,
                case.w
            )
        };
        for (p, ((xp, yp), tp)) in planes(&x)
            .iter()
            .zip(planes(&plain))
            .zip(planes(&tracked))
            .enumerate()
        {
            let (expected, div) = case.avg_ref(xp);
            assert!(max_diff(&yp, &expected) < 1e-5, "{}", what());
            assert!(max_diff(&tp, &expected) < 1e-5, "{}", what());
            let mut grad = vec![0f32; case.h * case.w];
            for i in 0..ho {
                for j in 0..wo {
                    for pos in case.window(i, j) {
                        if case.inside(pos) {
                            grad[pos.0 as usize * case.w + pos.1 as usize] +=
                                ups[p][i * wo + j] / div[i * wo + j];
                        }
                    }
                }
            }
            assert!(max_diff(&gs[p], &grad) < 1e-5, "{}", what());
        }
    }
    Ok(())
}

/// PyTorch drops a `ceil_mode` window that would start in the right padding
/// (`pooling_output_shape_pad_lr`: "ensure that the last pooling starts inside the image"):
/// `nn.MaxPool2d(2, stride=2, padding=1, ceil_mode=True)` on width 5 gives 3 columns, not 4.
#[test]
fn ceil_mode_drops_a_last_window_starting_in_the_right_padding() -> Result<()> {
    let dev = Device::Cpu;
    let x = Tensor::arange(0f32, 5., &dev)?.reshape((1, 1, 1, 5))?;
    let cfg = Pool2dConfig {
        stride: Some(2.into()),
        padding: (0, 1).into(),
        ceil_mode: true,
        ..Default::default()
    };
    let y = MaxPool2d::with_config((1, 2), cfg).forward(&x)?;
    assert_eq!(y.flatten_all()?.to_vec1::<f32>()?, [0., 2., 4.]);
    // Without padding the ceil window starts inside the input and is kept: 3 windows of 5.
    let cfg = Pool2dConfig {
        stride: Some(2.into()),
        ceil_mode: true,
        ..Default::default()
    };
    let y = AvgPool2d::with_config((1, 2), cfg).forward(&x)?;
    // The overhanging window [4, 6) is clipped to the input: divisor 1 (hend = min(6, 5 + 0)).
    assert_eq!(y.flatten_all()?.to_vec1::<f32>()?, [0.5, 2.5, 4.]);
    Ok(())
}

/// GapNet's pools: `nn.MaxPool2d(3, stride=1, padding=1)` keeps 11x13, and
/// `nn.AvgPool2d(3, stride=2, ceil_mode=True, count_include_pad=False, padding=1)` on 11x7 gives
/// 6x4; a `[C, H, W]` input works too.
#[test]
fn gapnet_pools_have_pytorch_output_sizes() -> Result<()> {
    let dev = Device::Cpu;
    let x = Tensor::randn(0f32, 1., (2, 8, 11, 13), &dev)?;
    let max = MaxPool2d::with_config(
        3,
        Pool2dConfig {
            stride: Some(1.into()),
            padding: 1.into(),
            ..Default::default()
        },
    );
    assert_eq!(max.forward(&x)?.dims(), [2, 8, 11, 13]);
    let avg = AvgPool2d::with_config(
        3,
        Pool2dConfig {
            stride: Some(2.into()),
            padding: 1.into(),
            ceil_mode: true,
            count_include_pad: false,
            ..Default::default()
        },
    );
    let x = Tensor::randn(0f32, 1., (12, 11, 7), &dev)?;
    assert_eq!(avg.forward(&x)?.dims(), [12, 6, 4]);
    Ok(())
}

/// PyTorch's checks: padding at most half the window (`pool2d_shape_check`), no dilation for
/// `AvgPool2d` (it has none), a non-zero `divisor_override`, and an output of at least 1x1.
#[test]
fn invalid_pool_options_are_typed_errors() -> Result<()> {
    let x = Tensor::zeros((1, 1, 6, 6), candle_core::DType::F32, &Device::Cpu)?;
    let kind = |result: Result<Tensor>| match result {
        Err(Error::InputShape { layer, .. }) => format!("{layer}: shape"),
        Err(Error::InvalidConfig { layer, .. }) => format!("{layer}: config"),
        other => format!("{other:?}"),
    };
    let cfg = |f: fn(&mut Pool2dConfig)| {
        let mut c = Pool2dConfig::default();
        f(&mut c);
        c
    };
    let too_much_padding = cfg(|c| c.padding = (0, 2).into());
    assert_eq!(
        kind(MaxPool2d::with_config(3, too_much_padding).forward(&x)),
        "MaxPool2d: config"
    );
    let dilated = cfg(|c| c.dilation = 2.into());
    assert_eq!(
        kind(AvgPool2d::with_config(3, dilated).forward(&x)),
        "AvgPool2d: config"
    );
    assert!(MaxPool2d::with_config(3, dilated).forward(&x).is_ok());
    let zero = cfg(|c| c.divisor_override = Some(0));
    assert_eq!(
        kind(AvgPool2d::with_config(3, zero).forward(&x)),
        "AvgPool2d: config"
    );
    // Dilation 3 with a 3-window spans 7 > 6.
    let wide = cfg(|c| c.dilation = (1, 3).into());
    assert_eq!(
        kind(MaxPool2d::with_config(3, wide).forward(&x)),
        "MaxPool2d: shape"
    );
    Ok(())
}
