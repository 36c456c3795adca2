//! `Conv2d` / `Conv1d` with PyTorch's per-dimension kernel, stride, padding and dilation
//! (`nn.Conv2d(8, 12, (3, 5), stride=(1, 2), padding=(1, 2))`), checked against a naive
//! convolution written from PyTorch's definition (`torch.nn.Conv2d` docs: cross-correlation,
//! zero padding on both sides, `out = (in + 2 padding - dilation (kernel - 1) - 1) / stride + 1`),
//! forward and backward (input and weight gradients).

use candle_core::{Device, Tensor, Var};
use module_runtime::nn::{Conv1d, Conv2d, ConvConfig, LazyConv2d, PerDim};
use module_runtime::{Error, Forward, LoadOptions, ModuleExt, Result};

#[derive(Clone, Copy, Debug)]
struct Case {
    h: usize,
    w: usize,
    k: (usize, usize),
    s: (usize, usize),
    p: (usize, usize),
    d: (usize, usize),
    groups: usize,
}

impl Case {
    fn out(&self) -> Option<(usize, usize)> {
        let o = |size: usize, k: usize, s: usize, p: usize, d: usize| {
            let span = d * (k - 1) + 1;
            (size + 2 * p >= span).then(|| (size + 2 * p - span) / s + 1)
        };
        Some((
            o(self.h, self.k.0, self.s.0, self.p.0, self.d.0)?,
            o(self.w, self.k.1, self.s.1, self.p.1, self.d.1)?,
        ))
    }
}

/// Naive convolution of `x` `[N, Cin, H, W]` with `w` `[Cout, Cin / g, kH, kW]` and `b`, and the
/// gradients of `sum(y * up)` with respect to `x` and `w`.
#[allow(clippy::type_complexity, clippy::needless_range_loop)]
fn naive(
    c: &Case,
    x: &Tensor,
    w: &Tensor,
    b: &Tensor,
    up: &Tensor,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (n, cin, h, wd) = x.dims4().unwrap();
    let (cout, cin_g, kh, kw) = w.dims4().unwrap();
    let (ho, wo) = c.out().unwrap();
    let xs = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let ws = w.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let bs = b.to_vec1::<f32>().unwrap();
    let ups = up.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let mut y = vec![0f32; n * cout * ho * wo];
    let (mut gx, mut gw) = (vec![0f32; xs.len()], vec![0f32; ws.len()]);
    let cout_g = cout / c.groups;
    for bi in 0..n {
        for o in 0..cout {
            let g = o / cout_g;
            for i in 0..ho {
                for j in 0..wo {
                    let yi = ((bi * cout + o) * ho + i) * wo + j;
                    let mut acc = bs[o];
                    for ci in 0..cin_g {
                        let xc = g * cin_g + ci;
                        for a in 0..kh {
                            for bb in 0..kw {
                                let r = (i * c.s.0 + a * c.d.0) as i64 - c.p.0 as i64;
                                let col = (j * c.s.1 + bb * c.d.1) as i64 - c.p.1 as i64;
                                if r < 0 || col < 0 || r >= h as i64 || col >= wd as i64 {
                                    continue;
                                }
                                let xi = ((bi * cin + xc) * h + r as usize) * wd + col as usize;
                                let wi = ((o * cin_g + ci) * kh + a) * kw + bb;
                                acc += xs[xi] * ws[wi];
                                gx[xi] += ws[wi] * ups[yi];
                                gw[wi] += xs[xi] * ups[yi];
                            }
                        }
                    }
                    y[yi] = acc;
                }
            }
        }
    }
    (y, gx, gw)
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0., f32::max)
}

fn flat(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

fn check(case: Case) -> Result<()> {
    let dev = Device::Cpu;
    let cfg = ConvConfig {
        stride: case.s.into(),
        padding: case.p.into(),
        dilation: PerDim::HW(case.d.0, case.d.1),
        groups: case.groups,
        ..Default::default()
    };
    let (cin, cout) = (2 * case.groups, 3 * case.groups);
    let conv = Conv2d::with_config(cin, cout, case.k, cfg, &dev)?;
    let x = Tensor::randn(0f32, 1., (2, cin, case.h, case.w), &dev)?;
    let (ho, wo) = case.out().unwrap();
    let up = Tensor::randn(0f32, 1., (2, cout, ho, wo), &dev)?;
    let (w, b) = (conv.weight.tensor()?, conv.bias.as_ref().unwrap().tensor()?);
    let (y_ref, gx_ref, gw_ref) = naive(&case, &x, &w, &b, &up);

    // No gradient: candle's convolution (equal values) or the per-dimension path.
    let frozen = Conv2d::with_config(cin, cout, case.k, cfg, &dev)?;
    frozen.load_state_dict(&conv.state_dict()?, &LoadOptions::default())?;
    frozen.freeze("**")?;
    let y = frozen.forward(&x)?;
    assert_eq!(y.dims(), [2, cout, ho, wo], "{case:?}");
    assert!(max_diff(&flat(&y), &y_ref) < 1e-4, "{case:?}");

    // With gradients.
    let xv = Var::from_tensor(&x)?;
    let y = conv.forward(xv.as_tensor())?;
    assert!(max_diff(&flat(&y), &y_ref) < 1e-4, "{case:?}");
    let grads = (&y * &up)?.sum_all()?.backward()?;
    let gx = grads.get(xv.as_tensor()).expect("input gradient");
    let gw = grads.get(&w).expect("weight gradient");
    assert!(
        max_diff(&flat(gx), &gx_ref) < 1e-4,
        "input gradient {case:?}"
    );
    assert!(
        max_diff(&flat(gw), &gw_ref) < 1e-3,
        "weight gradient {case:?}"
    );
    Ok(())
}

/// PyTorch's `nn.Conv2d` takes kernel, stride, padding and dilation per dimension; every
/// combination of a sample of unequal (and equal) values matches the naive definition, with and
/// without gradients, on odd sizes and with groups.
#[test]
fn conv2d_per_dimension_options_match_pytorch_definition() -> Result<()> {
    let mut n = 0;
    for (h, w) in [(11, 13), (6, 5)] {
        for k in [(3, 5), (1, 2), (3, 3), (2, 1)] {
            for s in [(1, 2), (2, 1), (3, 2), (1, 1), (2, 2)] {
                for p in [(1, 2), (0, 1), (2, 0), (1, 1), (0, 0)] {
                    for d in [(1, 1), (2, 1), (1, 3), (2, 2)] {
                        for groups in [1, 2] {
                            n += 1;
                            if n % 3 != 0 {
                                continue; // a deterministic third of the grid
                            }
                            let case = Case {
                                h,
                                w,
                                k,
                                s,
                                p,
                                d,
                                groups,
                            };
                            if case.out().is_some() {
                                check(case)?;
                            }
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

/// GapNet's convolutions: `nn.Conv2d(8, 12, (3, 5), stride=(1, 2), padding=(1, 2))` on 11x13 gives
/// 11x7, and `nn.Conv2d(12, 16, 3, dilation=2, padding=2)` keeps the size.
#[test]
fn gapnet_convolutions_match_pytorch_definition() -> Result<()> {
    let base = Case {
        h: 11,
        w: 13,
        k: (3, 5),
        s: (1, 2),
        p: (1, 2),
        d: (1, 1),
        groups: 1,
    };
    assert_eq!(base.out(), Some((11, 7)));
    check(base)?;
    check(Case {
        h: 6,
        w: 4,
        k: (3, 3),
        s: (1, 1),
        p: (2, 2),
        d: (2, 2),
        groups: 1,
    })?;
    Ok(())
}

/// A lazy convolution takes per-dimension values too, and `Conv1d` a single one.
#[test]
fn lazy_conv2d_and_conv1d_take_pytorch_style_values() -> Result<()> {
    let dev = Device::Cpu;
    let cfg = ConvConfig {
        stride: (1, 2).into(),
        padding: (1, 2).into(),
        ..Default::default()
    };
    let lazy = LazyConv2d::with_config(4, (3, 5), cfg, &dev)?;
    let y = lazy.forward(&Tensor::zeros(
        (1, 3, 11, 13),
        candle_core::DType::F32,
        &dev,
    )?)?;
    assert_eq!(y.dims(), [1, 4, 11, 7]);
    let cfg = ConvConfig {
        stride: 2.into(),
        padding: 1.into(),
        ..Default::default()
    };
    let conv1 = Conv1d::with_config(3, 4, 3, cfg, &dev)?;
    let y = conv1.forward(&Tensor::zeros((2, 3, 9), candle_core::DType::F32, &dev)?)?;
    assert_eq!(y.dims(), [2, 4, 5]);
    Ok(())
}

/// A `(h, w)` pair does not fit a 1-D convolution, and stride and dilation must be positive
/// (PyTorch: "non-positive stride is not supported").
#[test]
fn invalid_per_dimension_conv_options_are_typed_errors() {
    let dev = Device::Cpu;
    let pair = ConvConfig {
        stride: (1, 2).into(),
        ..Default::default()
    };
    let err = Conv1d::with_config(3, 4, 3, pair, &dev).unwrap_err();
    assert!(
        matches!(
            err,
            Error::InvalidConfig {
                layer: "Conv1d",
                ..
            }
        ),
        "{err}"
    );
    let zero = ConvConfig {
        dilation: (1, 0).into(),
        ..Default::default()
    };
    let err = Conv2d::with_config(3, 4, 3, zero, &dev).unwrap_err();
    assert!(
        matches!(
            err,
            Error::InvalidConfig {
                layer: "Conv2d",
                ..
            }
        ),
        "{err}"
    );
    let err = LazyConv2d::with_config(
        4,
        3,
        ConvConfig {
            stride: 0.into(),
            ..Default::default()
        },
        &dev,
    )
    .unwrap_err();
    assert!(
        matches!(
            err,
            Error::InvalidConfig {
                layer: "LazyConv2d",
                ..
            }
        ),
        "{err}"
    );
}
