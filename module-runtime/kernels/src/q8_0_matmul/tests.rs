//! The `q8_0` and `q4_0` products against candle's, every inner loop against the scalar one,
//! and the tiles' life with their weight.

use super::*;
use candle_core::Device;
use std::sync::Arc;

/// The product with one weight, as [`q8_0_matmul_each`] computes it.
fn q8_0_matmul(x: &Tensor, w: &Param) -> Result<Option<Tensor>> {
    Ok(q8_0_matmul_each(x, &[w])?.and_then(|products| products.into_iter().next()))
}

/// The kinds the kernels take.
const KINDS: [GgmlDType; 3] = [GgmlDType::Q8_0, GgmlDType::Q4_0, GgmlDType::Q4K];

/// A weight `[n, k]` quantized to `kind` and input `[rows, k]` with values of both signs, exact
/// zeros and a zero row (a zero scale).
fn case_of(kind: GgmlDType, n: usize, k: usize, rows: usize) -> (Param, Tensor) {
    let dev = Device::Cpu;
    let w: Vec<f32> = (0..n * k)
        .map(|i| {
            let zero = i % 97 == 0 || i / k == 1;
            if zero {
                0.0
            } else {
                (i * 7919 % 1000) as f32 / 500.0 - 1.0
            }
        })
        .collect();
    let x: Vec<f32> = (0..rows * k)
        .map(|i| ((i * 104729 % 997) as f32 / 498.5 - 1.0) * 3.0)
        .collect();
    let w = Param::new(Tensor::from_vec(w, (n, k), &dev).unwrap()).unwrap();
    w.quantize(kind).unwrap();
    (w, Tensor::from_vec(x, (rows, k), &dev).unwrap())
}

/// [`case_of`] in `q8_0`.
fn case(n: usize, k: usize, rows: usize) -> (Param, Tensor) {
    case_of(GgmlDType::Q8_0, n, k, rows)
}

/// The largest difference relative to `b`'s largest magnitude (at least 1).
fn max_rel_diff(a: &Tensor, b: &Tensor) -> f32 {
    let scale = b
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    crate::cpu::max_diff(a, b) / scale.max(1.0)
}

/// For [`case_of`]: the weight, the input, candle's quantized product (taken first: the kernel's
/// tiles then replace the weight's bytes) and ours, of the right shape; `None` where this CPU has
/// no SIMD loop (candle's kernel runs instead).
fn products(
    kind: GgmlDType,
    n: usize,
    k: usize,
    rows: usize,
) -> Option<(Param, Tensor, Tensor, Tensor)> {
    let (w, x) = case_of(kind, n, k, rows);
    let candle = x
        .apply_op1_no_bwd(&*w.quantized().unwrap().unwrap())
        .unwrap();
    let Some(ours) = q8_0_matmul(&x, &w).unwrap() else {
        assert_eq!(Kernel::detect(), Kernel::Scalar);
        return None;
    };
    assert_eq!(ours.dims(), [rows, n]);
    Some((w, x, candle, ours))
}

#[test]
fn equals_candles_quantized_matmul() {
    // Partial last tiles, one to four rows, blocks counts that are not multiples of 8; and
    // several groups of rows (rounded on the pool), the last one partial.
    for (n, k, rows) in [
        (64, 96, 1),
        (37, 576, 1),
        (130, 64, 3),
        (5, 32, 4),
        (16, 64, 2),
        (37, 576, 13),
        (130, 64, 9),
    ] {
        for kind in [GgmlDType::Q8_0, GgmlDType::Q4_0] {
            let Some((_, _, candle, ours)) = products(kind, n, k, rows) else {
                continue;
            };
            let diff = max_rel_diff(&ours, &candle);
            assert!(diff < 1e-5, "{kind:?} {n}x{k}, {rows} rows: {diff}");
        }
    }
}

/// `q4_K`: candle (as llama.cpp) rounds the input per 256 (`q8_K`), this kernel per 32 as for the
/// other kinds, so both are checked against the float product of the dequantized weight with
/// the input as it is: within the rounding of the input, and the kernel no further than candle.
#[test]
fn q4k_is_the_dequantized_product_within_the_inputs_rounding() {
    for (n, k, rows) in [
        (64, 256, 1),
        (37, 512, 1),
        (130, 256, 3),
        (5, 768, 4),
        (37, 512, 13),
    ] {
        let Some((w, x, candle, ours)) = products(GgmlDType::Q4K, n, k, rows) else {
            continue;
        };
        // The weight's values, made again from the tiles (the same: `quantize.rs` tests it).
        let exact = x.matmul(&w.tensor().unwrap().t().unwrap()).unwrap();
        let (ours, candle) = (max_rel_diff(&ours, &exact), max_rel_diff(&candle, &exact));
        assert!(
            ours < 1e-2 && ours <= candle * 1.5,
            "{n}x{k}, {rows} rows: {ours} (candle {candle})"
        );
    }
}

#[test]
fn rounding_is_f32_round() {
    for v in [
        0.0f32,
        0.5,
        -0.5,
        1.5,
        -1.5,
        2.5,
        0.49999997,
        -0.49999997,
        126.5,
        -127.0,
        3.7,
    ] {
        assert_eq!(round_half_away(v), v.round() as i32, "{v}");
    }
    for i in -127_000..=127_000 {
        let v = i as f32 / 1000.0;
        assert_eq!(round_half_away(v), v.round() as i32, "{v}");
    }
}

#[test]
fn rounding_the_input_is_the_same_on_this_cpu() {
    // Blocks of several ranges, with exact halves after scaling (a block whose largest value is
    // 127 scales by one), zeros, a zero block and subnormal values.
    let mut blocks: Vec<[f32; BLOCK]> = (0..400u32)
        .map(|b| {
            std::array::from_fn(|i| {
                let h =
                    (b.wrapping_mul(2654435761) ^ (i as u32 * 40503)).wrapping_mul(2246822519) >> 8;
                let v = h as f32 / (1 << 24) as f32 * 2.0 - 1.0;
                v * [1e-3, 1.0, 37.5, 1e6][b as usize % 4]
            })
        })
        .collect();
    blocks.push(std::array::from_fn(|i| {
        i as f32 * 4.0 - 62.5 - if i == 0 { 64.5 } else { 0.0 }
    }));
    blocks.push(std::array::from_fn(|i| (i as f32 - 16.0) + 0.5));
    blocks.push([0.0; BLOCK]);
    blocks.push(std::array::from_fn(|i| f32::from_bits(i as u32 + 1)));
    let kernel = Kernel::detect();
    for x in &blocks {
        let (mut a, mut b) = ([0i8; BLOCK], [0i8; BLOCK]);
        let want = round_block(x, &mut a);
        let got = kernel.round_block(x, &mut b);
        assert_eq!(
            (want.0.to_bits(), want.1, a),
            (got.0.to_bits(), got.1, b),
            "{x:?}"
        );
    }
}

#[test]
fn every_inner_loop_on_this_cpu_gives_the_same_sums() {
    // Every row count a pass takes (each is its own build of the SIMD loops).
    for (rows, kind) in (1..=MAX_M).flat_map(|rows| KINDS.map(|kind| (rows, kind))) {
        let (w, x) = case_of(kind, 21, 512, rows);
        let tiles = Tiles::new(&w.quantized().unwrap().unwrap()).unwrap();
        let x = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let xq = Quantized::new(&x, rows, 512, Kernel::detect());
        let mut kernels = vec![Kernel::Scalar, Kernel::detect()];
        #[cfg(target_arch = "x86_64")]
        if Kernel::has_avx2() {
            kernels.push(Kernel::Avx2);
        }
        for t in 0..2 {
            let (quads, scales) = tiles.tile(t);
            let format = tiles.format;
            let mut expected = vec![0f32; rows * ROWS];
            Kernel::Scalar.tile(format, quads, scales, &xq, &mut expected, false);
            // Streaming (prefetching past the tile's end, into the next tile) or not.
            for (kernel, stream) in kernels.iter().flat_map(|k| [(k, false), (k, true)]) {
                let mut out = vec![0f32; rows * ROWS];
                kernel.tile(format, quads, scales, &xq, &mut out, stream);
                for (a, b) in out.iter().zip(&expected) {
                    assert!(
                        (a - b).abs() <= 1e-4 * b.abs().max(1.0),
                        "{kernel:?} {format:?} ({rows} rows, stream: {stream}): {a} vs {b}"
                    );
                }
            }
        }
    }
}

#[test]
fn the_tiles_are_made_once_per_weight() {
    if Kernel::detect() == Kernel::Scalar {
        return; // candle's kernel runs on this CPU
    }
    let (w, x) = case(32, 64, 1);
    let first = w.quantized_layout(Tiles::new).unwrap();
    q8_0_matmul(&x, &w).unwrap().unwrap();
    assert!(Arc::ptr_eq(
        &first,
        &w.quantized_layout(Tiles::new).unwrap()
    ));
    // A new weight gets new tiles: the product follows it.
    w.set(&Tensor::ones((32, 64), DType::F32, &Device::Cpu).unwrap())
        .unwrap();
    assert!(!Arc::ptr_eq(
        &first,
        &w.quantized_layout(Tiles::new).unwrap()
    ));
    let y = q8_0_matmul(&x, &w).unwrap().unwrap();
    let expected = x.sum_keepdim(1).unwrap().broadcast_as((1, 32)).unwrap();
    assert!(max_rel_diff(&y, &expected) < 1e-2);
}

#[test]
fn other_kinds_and_dtypes_are_left_to_candle() {
    let (_, x) = case(4, 256, 1);
    let w = Param::new(Tensor::ones((4, 256), DType::F32, &Device::Cpu).unwrap()).unwrap();
    for kind in [
        GgmlDType::Q4_1,
        GgmlDType::Q5_0,
        GgmlDType::Q5K,
        GgmlDType::Q6K,
    ] {
        w.quantize(kind).unwrap();
        assert!(q8_0_matmul(&x, &w).unwrap().is_none(), "{kind:?}");
    }
    w.quantize(GgmlDType::Q8_0).unwrap();
    assert!(q8_0_matmul(&x.to_dtype(DType::F16).unwrap(), &w)
        .unwrap()
        .is_none());
    let simd = Kernel::detect() != Kernel::Scalar;
    assert_eq!(q8_0_matmul(&x, &w).unwrap().is_some(), simd);
}
