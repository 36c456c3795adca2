//! Float32 matrix products on the CPU, split over candle's barrier pool.
//!
//! candle's CPU matmul calls the `gemm` crate with rayon's parallelism inside one call. On the
//! development machine (2 cores) that made the same product's time vary by up to 1.9× from call
//! to call: the median of the MiniLM and SmolLM projections ran at 90–180 GFLOP/s where the
//! fastest calls reached 200 (BENCHMARKS.md, "Matmuls on candle's barrier pool"). Here the output
//! is split into a grid of at most one block per thread, fixed in advance (on two threads, halves
//! of the rows or of the columns), and each thread runs `gemm`'s single-threaded kernel on its
//! block, on the pool candle's own elementwise kernels use (its threads wait spinning between
//! calls, so a call starts without waking anyone). The kernel is the same, and so is each output's
//! sum over the shared dimension up to `gemm`'s blocking of it: the result is candle's within
//! float32 rounding (to the bit for the products the benchmarks run).
//!
//! [`matmul`] is one candle op with a backward (`da = g bᵀ`, `db = aᵀ g`, the same products
//! again), so a graph through it trains. It serves float32 CPU matrices; anything else goes to
//! candle's `matmul`. Built with candle's `mkl` or `accelerate` features, these products still run
//! here (candle's other kernels use those libraries): on the development machine this path ran
//! level with or ahead of PyTorch's MKL products in the same minute.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Layout, Shape, Tensor};

use crate::capability::CpuCapability;
use crate::error::Result;
use crate::gemm_kernel::{gemm_block, Block};

/// `a b` for matrices `a` `[m, k]` and `b` `[k, n]` (any strides: a transposed view is read in
/// place), as candle's `matmul` computes it, recording the same gradient. Float32 CPU matrices
/// run on the barrier pool (see the module's documentation); other dtypes, devices and ranks go
/// to candle's `matmul`.
pub(crate) fn matmul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    Ok(matmul_candle(a, b)?)
}

/// [`matmul`] with candle's error type, for the backward passes.
pub(crate) fn matmul_candle(a: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    let applies = a.rank() == 2
        && b.rank() == 2
        && a.dtype() == DType::F32
        && b.dtype() == DType::F32
        && a.device().is_cpu()
        && b.device().is_cpu()
        && a.dim(1)? == b.dim(0)?;
    if applies {
        return a.apply_op2(b, MatMul);
    }
    product_operand(a)?.matmul(&product_operand(b)?)
}

/// `t` as candle's `matmul` takes it on its device: on the CPU itself (any strides); elsewhere
/// itself when its rows or columns are packed (a contiguous matrix or its transpose), otherwise a
/// contiguous copy, since candle's CUDA and Metal products refuse other strides (a row-strided
/// slice, such as a time step of a batch-first sequence).
pub fn product_operand(t: &Tensor) -> candle_core::Result<Tensor> {
    if t.device().is_cpu() || t.rank() < 2 || t.is_contiguous() || t.t()?.is_contiguous() {
        Ok(t.clone())
    } else {
        t.contiguous()
    }
}

/// Below this many multiply-adds a product stays on the calling thread: handing half of a few
/// microseconds' work to another thread costs about as much as it saves.
const PARALLEL_MIN_MACS: usize = 1 << 18;

/// The candle op of [`matmul`]: `a b` for two float32 matrices.
struct MatMul;

impl candle_core::CustomOp2 for MatMul {
    fn name(&self) -> &'static str {
        "matmul-pool"
    }

    fn cpu_fwd(
        &self,
        a: &CpuStorage,
        a_layout: &Layout,
        b: &CpuStorage,
        b_layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let name = self.name();
        let (CpuStorage::F32(a), CpuStorage::F32(b)) = (a, b) else {
            return Err(candle_core::Error::UnsupportedDTypeForOp(a.dtype(), name));
        };
        let (m, k) = a_layout.shape().dims2()?;
        let (k2, n) = b_layout.shape().dims2()?;
        if k != k2 {
            return Err(candle_core::Error::ShapeMismatchBinaryOp {
                lhs: a_layout.shape().clone(),
                rhs: b_layout.shape().clone(),
                op: name,
            });
        }
        let product = product(
            Matrix::new(a, a_layout),
            Matrix::new(b, b_layout),
            (m, n, k),
            None,
        )?;
        Ok((CpuStorage::F32(product), Shape::from((m, n))))
    }

    /// `da = g bᵀ` and `db = aᵀ g`, each only for an argument that records a gradient.
    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        _out: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let da = match a.track_op() {
            true => Some(matmul_candle(grad, &b.detach().t()?)?),
            false => None,
        };
        let db = match b.track_op() {
            true => Some(matmul_candle(&a.detach().t()?, grad)?),
            false => None,
        };
        Ok((da, db))
    }
}

/// A strided matrix in a CPU storage (of float32 values unless `T` says otherwise; the bfloat16
/// products read bfloat16 bits, `u16`): its values from its first one on, and the distance
/// between rows and between columns.
#[derive(Clone, Copy)]
pub(crate) struct Matrix<'a, T = f32> {
    pub(crate) values: &'a [T],
    pub(crate) row_stride: usize,
    pub(crate) col_stride: usize,
}

impl<'a, T> Matrix<'a, T> {
    /// The matrix a rank-2 layout describes in `values` (checked against them by candle).
    pub(crate) fn new(values: &'a [T], layout: &Layout) -> Self {
        let stride = layout.stride();
        Self {
            values: &values[layout.start_offset()..],
            row_stride: stride[0],
            col_stride: stride[1],
        }
    }

    /// The transpose of the row-major matrix of rows `width` long in `values`: `values` read
    /// column by column.
    pub(crate) fn transposed(values: &'a [T], width: usize) -> Self {
        Self {
            values,
            row_stride: 1,
            col_stride: width,
        }
    }

    /// An error unless the values hold a `[rows, cols]` matrix (both non-zero) at these strides.
    pub(crate) fn check(&self, rows: usize, cols: usize) -> candle_core::Result<()> {
        let last = (rows - 1)
            .checked_mul(self.row_stride)
            .zip((cols - 1).checked_mul(self.col_stride))
            .and_then(|(r, c)| r.checked_add(c));
        match last {
            Some(last) if last < self.values.len() => Ok(()),
            _ => Err(candle_core::Error::Msg(format!(
                "matmul: {} values cannot hold a [{rows}, {cols}] matrix at strides [{}, {}]",
                self.values.len(),
                self.row_stride,
                self.col_stride
            ))),
        }
    }

    /// The row-major matrix of rows `width` long in `values`.
    pub(crate) fn rows(values: &'a [T], width: usize) -> Self {
        Self {
            values,
            row_stride: width,
            col_stride: 1,
        }
    }

    /// The transpose: the same values, rows and columns swapped.
    pub(crate) fn t(self) -> Self {
        Self {
            values: self.values,
            row_stride: self.col_stride,
            col_stride: self.row_stride,
        }
    }
}

/// `a b + bias`, `[m, n]` row-major, with `a` `[m, k]`, `b` `[k, n]` and an optional `bias` `[n]`
/// added to every row: split into one block per thread and run by `gemm`'s single-threaded kernel
/// on each. The bias is written into each block first and the kernel adds the product to it, so
/// it costs no pass of its own.
///
/// An error if `a` or `b` is too short for its matrix, or `bias` is not `n` long.
pub(crate) fn product(
    a: Matrix<'_>,
    b: Matrix<'_>,
    (m, n, k): (usize, usize, usize),
    bias: Option<&[f32]>,
) -> candle_core::Result<Vec<f32>> {
    if let Some(bias) = bias.filter(|bias| bias.len() != n) {
        return Err(candle_core::Error::Msg(format!(
            "matmul: a bias of {} values for {n} output columns",
            bias.len()
        )));
    }
    if k == 0 || m == 0 || n == 0 {
        return Ok(match bias {
            Some(bias) => bias.repeat(m),
            None => vec![0f32; m * n],
        });
    }
    a.check(m, k)?;
    b.check(k, n)?;
    let level = crate::kernel_choice().products;
    Ok(product_in(
        a,
        b,
        (m, n, k),
        bias,
        Blocks::new(m, n, k),
        level,
    ))
}

/// [`product`] over the given blocks (checked operands, `k`, `m`, `n` non-zero).
fn product_in(
    a: Matrix<'_>,
    b: Matrix<'_>,
    (m, n, k): (usize, usize, usize),
    bias: Option<&[f32]>,
    blocks: Blocks,
    level: CpuCapability,
) -> Vec<f32> {
    split_product((m, n), bias, &blocks, |rows, cols, dst, accumulate| {
        let block = Block {
            m: rows.len(),
            n: cols.len(),
            k,
            dst,
            dst_row_stride: n,
            a: a.values[rows.start * a.row_stride..].as_ptr(),
            a_strides: (a.row_stride, a.col_stride),
            b: b.values[cols.start * b.col_stride..].as_ptr(),
            b_strides: (b.row_stride, b.col_stride),
        };
        // SAFETY: `split_product`'s promise: `dst` is this block's own `rows × cols` outputs,
        // rows `n` apart; the kernel reads `a` and `b` only inside the `[m, k]` and `[k, n]`
        // matrices the caller guarantees; `level` is what `kernel_choice` gives for this CPU.
        unsafe { gemm_block(level, &block, accumulate) };
    })
}

/// The `[m, n]` row-major output of a product split into `blocks`: `kernel(rows, cols, dst,
/// accumulate)` runs once per block, on the barrier pool, and must write (`accumulate` false) or
/// add to (`accumulate` true) every output of its block, whose first one `dst` points at (rows
/// `n` apart). With a `bias` (`n` long) each block's outputs hold it when its kernel starts, and
/// `accumulate` is true; without one they are uninitialized and `accumulate` is false.
///
/// The kernel's `dst` points at outputs no other block writes, so it may write them through it
/// (within its `rows × cols` only): that is the promise a kernel's `unsafe` relies on.
pub(crate) fn split_product(
    (m, n): (usize, usize),
    bias: Option<&[f32]>,
    blocks: &Blocks,
    kernel: impl Fn(std::ops::Range<usize>, std::ops::Range<usize>, *mut f32, bool) + Sync,
) -> Vec<f32> {
    let mut out = Vec::<f32>::with_capacity(m * n);
    let dst = SharedOut(out.as_mut_ptr());
    let run = |block: usize| {
        let (rows, cols) = blocks.get(block);
        if let Some(bias) = bias {
            for row in rows.clone() {
                // SAFETY: this block's own outputs, inside `[m, n]`, which no other block
                // overlaps.
                let out = unsafe {
                    std::slice::from_raw_parts_mut(dst.at(row * n + cols.start), cols.len())
                };
                out.copy_from_slice(&bias[cols.clone()]);
            }
        }
        let at = dst.0.wrapping_add(rows.start * n + cols.start);
        kernel(rows, cols, at, bias.is_some());
    };
    match blocks.count {
        1 => run(0),
        count => candle_core::utils::barrier_pool().execute_chunked(count, |range| {
            range.for_each(run);
        }),
    }
    // SAFETY: the blocks cover `[m, n]`, and each block's kernel wrote all of its outputs.
    unsafe { out.set_len(m * n) };
    out
}

/// An output pointer, shared by the threads that write disjoint parts of it through it (this
/// file's blocks of a product, the `q8_0` kernel's tiles).
#[derive(Clone, Copy)]
pub(crate) struct SharedOut(pub(crate) *mut f32);

// SAFETY: the threads write disjoint parts (each user says which).
unsafe impl Send for SharedOut {}
unsafe impl Sync for SharedOut {}

impl SharedOut {
    /// The pointer to output `offset`.
    ///
    /// # Safety
    /// `offset` is inside the output.
    pub(crate) unsafe fn at(self, offset: usize) -> *mut f32 {
        // SAFETY: the caller's.
        unsafe { self.0.add(offset) }
    }
}

/// How a `[m, n]` output is split: a grid of blocks, at most one per thread of
/// candle's pool. Each block's thread packs its own rows of `a` and columns of `b` (what `gemm`
/// does before its kernel), so the grid is the one whose largest block costs least, its products
/// plus [`PACK_COST`] per packed value: on two threads one block of rows or of columns each, on
/// many a grid that packs neither operand once per thread.
#[derive(Debug)]
pub(crate) struct Blocks {
    m: usize,
    n: usize,
    /// The rows (columns) of each block but the last of its column (row).
    row_len: usize,
    col_len: usize,
    /// The blocks across.
    cols: usize,
    /// The blocks, `cols` in each row of blocks.
    count: usize,
}

/// What packing one value of an operand costs, in multiply-adds (a load and a store against the
/// kernel's 16 multiply-adds a cycle per core).
const PACK_COST: usize = 8;

/// The narrowest block of columns a product is split into (`gemm`'s widest tile is 16).
const MIN_COLS: usize = 32;

/// The fewest rows in a block of rows.
const MIN_ROWS: usize = 16;

impl Blocks {
    pub(crate) fn new(m: usize, n: usize, k: usize) -> Self {
        let threads = candle_core::utils::barrier_pool().n_workers() + 1;
        Self::for_threads(m, n, k, threads)
    }

    fn for_threads(m: usize, n: usize, k: usize, threads: usize) -> Self {
        let grid = |row_len: usize, col_len: usize| {
            let cols = n.div_ceil(col_len);
            Self {
                m,
                n,
                row_len,
                col_len,
                cols,
                count: m.div_ceil(row_len) * cols,
            }
        };
        let one = grid(m.max(1), n.max(1));
        if threads <= 1 || m.saturating_mul(n).saturating_mul(k) < PARALLEL_MIN_MACS {
            return one;
        }
        let cost = |b: &Self| b.row_len * b.col_len * k + PACK_COST * (b.row_len + b.col_len) * k;
        let mut best = one;
        for down in 1..=threads {
            let across = threads / down;
            if (down > 1 && m / down < MIN_ROWS) || (across > 1 && n / across < MIN_COLS) {
                continue;
            }
            let row_len = m.div_ceil(down).next_multiple_of(8).min(m);
            let col_len = n.div_ceil(across).next_multiple_of(16).min(n);
            let candidate = grid(row_len, col_len);
            if cost(&candidate) < cost(&best) {
                best = candidate;
            }
        }
        best
    }

    /// The rows and columns of block `i`.
    fn get(&self, i: usize) -> (std::ops::Range<usize>, std::ops::Range<usize>) {
        let (r, c) = (i / self.cols, i % self.cols);
        (
            r * self.row_len..((r + 1) * self.row_len).min(self.m),
            c * self.col_len..((c + 1) * self.col_len).min(self.n),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    use crate::cpu::max_diff;

    /// Every split (one block, columns, rows, ragged last blocks) and every stride pattern equals
    /// candle's matmul.
    #[test]
    fn equals_candle_for_shapes_and_strides() {
        let dev = Device::Cpu;
        for (m, k, n) in [
            (1, 1, 1),
            (3, 5, 7),
            (800, 384, 384),
            (200, 96, 1536),
            (100, 64, 40),
            (97, 33, 65),
            (1000, 70, 20),
            (5, 0, 4),
        ] {
            let a = Tensor::randn(0f32, 1., (m, k), &dev).unwrap();
            let bt = Tensor::randn(0f32, 1., (n, k), &dev).unwrap();
            let b = bt.t().unwrap().contiguous().unwrap();
            let at = a.t().unwrap().contiguous().unwrap();
            for (a, b) in [
                (a.clone(), b.clone()),
                (a.clone(), bt.t().unwrap()),
                (at.t().unwrap(), b.clone()),
                (at.t().unwrap(), bt.t().unwrap()),
            ] {
                let ours = matmul(&a, &b).unwrap();
                let theirs = a.matmul(&b).unwrap();
                assert_eq!(ours.dims(), [m, n]);
                let scale = (k as f32).sqrt().max(1.);
                assert!(max_diff(&ours, &theirs) <= 1e-5 * scale, "{m}x{k}x{n}");
            }
        }
    }

    /// For any thread count the blocks cover the output once, and two threads split MiniLM's
    /// and a decoder's products in two.
    #[test]
    fn blocks_cover_the_output_once() {
        for (m, n, k) in [
            (800, 384, 384),
            (1, 1536, 576),
            (1536, 384, 200),
            (97, 65, 300),
        ] {
            for threads in 1..=16 {
                let blocks = Blocks::for_threads(m, n, k, threads);
                assert!(blocks.count <= threads.max(1), "{blocks:?}");
                let mut covered = vec![0u8; m * n];
                for i in 0..blocks.count {
                    let (rows, cols) = blocks.get(i);
                    for r in rows {
                        cols.clone().for_each(|c| covered[r * n + c] += 1);
                    }
                }
                assert!(
                    covered.iter().all(|&c| c == 1),
                    "{m}x{n}, {threads}: {blocks:?}"
                );
            }
        }
        // A grid of blocks gives the single block's values, with and without a bias.
        let (m, n, k) = (97, 130, 50);
        let a: Vec<f32> = (0..m * k).map(|i| (i % 17) as f32 - 8.0).collect();
        let b: Vec<f32> = (0..k * n).map(|i| (i % 13) as f32 * 0.5).collect();
        let bias: Vec<f32> = (0..n).map(|i| i as f32).collect();
        let (a, b) = (Matrix::rows(&a, k), Matrix::rows(&b, n));
        for bias in [None, Some(&bias[..])] {
            let level = crate::kernel_choice().products;
            let one = product_in(
                a,
                b,
                (m, n, k),
                bias,
                Blocks::for_threads(m, n, k, 1),
                level,
            );
            let grid = Blocks::for_threads(m, n, k, 12);
            assert!(grid.count > grid.cols && grid.cols > 1, "{grid:?}");
            assert_eq!(product_in(a, b, (m, n, k), bias, grid, level), one);
        }
        assert_eq!(Blocks::for_threads(800, 384, 384, 2).count, 2);
        assert_eq!(Blocks::for_threads(1, 1536, 576, 2).cols, 2);
        assert!(Blocks::for_threads(800, 384, 384, 16).count > 8);
    }

    #[test]
    fn gradients_equal_candles() {
        let dev = Device::Cpu;
        let a = Var::randn(0f32, 1., (70, 40), &dev).unwrap();
        let b = Var::randn(0f32, 1., (40, 90), &dev).unwrap();
        let w = Tensor::randn(0f32, 1., (70, 90), &dev).unwrap();
        let ours = (matmul(&a, &b).unwrap() * &w).unwrap().sum_all().unwrap();
        let theirs = (a.matmul(&b).unwrap() * &w).unwrap().sum_all().unwrap();
        let (g1, g2) = (ours.backward().unwrap(), theirs.backward().unwrap());
        for v in [&a, &b] {
            let d = max_diff(g1.get(v).unwrap(), g2.get(v).unwrap());
            assert!(d < 1e-4, "{d}");
        }
    }

    #[test]
    fn other_dtypes_and_ranks_take_candles_matmul() {
        let dev = Device::Cpu;
        let a = Tensor::randn(0f64, 1., (2, 3, 4), &dev).unwrap();
        let b = Tensor::randn(0f64, 1., (2, 4, 5), &dev).unwrap();
        assert_eq!(matmul(&a, &b).unwrap().dims(), [2, 3, 5]);
        let a = Tensor::randn(0f32, 1., (3, 4), &dev).unwrap();
        let b = Tensor::randn(0f32, 1., (5, 6), &dev).unwrap();
        assert!(matmul(&a, &b).is_err());
    }
}
