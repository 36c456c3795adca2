//! One block of a float32 product through `gemm`'s single-threaded kernel, built for the
//! instruction set the caller chose ([`KernelChoice::products`](crate::KernelChoice)).
//!
//! `gemm::gemm` picks its kernel once per process: AVX-512 wherever the CPU has it when built with
//! its `x86-v4` feature, AVX2 + FMA otherwise. Neither is right on every host (AVX-512 ran slower
//! on AMD's Zen 4 and up to twice as fast on Intel's Xeons), so this file calls `gemm`'s generic
//! driver (`gemm_common::gemm::gemm_basic_generic`) with the micro-kernels of the level asked
//! for, taken from `gemm-f32`: the same driver and kernels `gemm::gemm` runs, chosen per call.
//! As `gemm::gemm` does, a row-major output is computed as its transpose (`Cᵀ = Bᵀ Aᵀ`, the
//! column-major form the micro-kernels prefer).

#[cfg(target_arch = "x86_64")]
use gemm_common::{gemm::gemm_basic_generic, Parallelism};

use crate::capability::CpuCapability;

/// A row-major `[m, n]` block of outputs at `dst` (rows `n_stride` apart), `a` `[m, k]` and `b`
/// `[k, n]` strided matrices.
pub(crate) struct Block {
    pub(crate) m: usize,
    pub(crate) n: usize,
    pub(crate) k: usize,
    pub(crate) dst: *mut f32,
    pub(crate) dst_row_stride: usize,
    pub(crate) a: *const f32,
    pub(crate) a_strides: (usize, usize),
    pub(crate) b: *const f32,
    pub(crate) b_strides: (usize, usize),
}

/// `dst = a b` (`accumulate` false) or `dst += a b` (`accumulate` true) over `block`, on the
/// calling thread, with the micro-kernels of `level` (or the widest below it this build has).
///
/// # Safety
///
/// `block.dst` points at `m` rows of `n` writable values `dst_row_stride` apart, written by no
/// one else meanwhile; `a` and `b` point at matrices of the block's shapes at their strides; the
/// CPU has the instructions of `level` (what [`kernel_choice`](crate::kernel_choice) gives
/// guarantees it).
pub(crate) unsafe fn gemm_block(level: CpuCapability, block: &Block, accumulate: bool) {
    // The transpose: `m` and `n` swap, `b` is the left operand with its strides swapped.
    let (m, n, k) = (block.n, block.m, block.k);
    let (dst_cs, dst_rs) = (block.dst_row_stride as isize, 1isize);
    let (lhs, lhs_cs, lhs_rs) = (
        block.b,
        block.b_strides.0 as isize,
        block.b_strides.1 as isize,
    );
    let (rhs, rhs_cs, rhs_rs) = (
        block.a,
        block.a_strides.0 as isize,
        block.a_strides.1 as isize,
    );
    let alpha = if accumulate { 1.0 } else { 0.0 };
    // `f(before.., the arguments gemm's drivers share, after..)`.
    macro_rules! call {
        ($f:expr, [$($before:expr),*], [$($after:expr),*]) => {
            $f(
                $($before,)* m, n, k, block.dst, dst_cs, dst_rs, accumulate, lhs, lhs_cs, lhs_rs,
                rhs, rhs_cs, rhs_rs, alpha, 1.0, false, false, false, $($after),*
            )
        };
    }
    #[cfg(target_arch = "x86_64")]
    macro_rules! run {
        ($simd:expr, $kernels:path, $lanes:expr) => {{
            use $kernels as kernels;
            let driver = gemm_basic_generic::<
                _,
                f32,
                { $lanes },
                { kernels::MR_DIV_N * $lanes },
                { kernels::NR },
                { kernels::MR_DIV_N },
                { kernels::H_M },
                { kernels::H_N },
            >;
            // SAFETY: the caller's: the pointers and strides describe the matrices, and `$simd`
            // was made by `try_new`, which checks the CPU.
            unsafe {
                call!(
                    driver,
                    [$simd],
                    [
                        |a, b, c| a * b + c,
                        &kernels::UKR,
                        &kernels::H_UKR,
                        false,
                        Parallelism::None
                    ]
                )
            }
        }};
    }
    #[cfg(target_arch = "x86_64")]
    {
        use gemm_common::simd::{MixedSimd, Scalar, V3, V4};
        if level >= CpuCapability::Avx512
            && let Some(simd) = <V4 as MixedSimd<f32, f32, f32, f32>>::try_new()
        {
            return run!(simd, gemm_f32::microkernel::avx512f::f32, 16);
        }
        if level >= CpuCapability::Avx2
            && let Some(simd) = <V3 as MixedSimd<f32, f32, f32, f32>>::try_new()
        {
            return run!(simd, gemm_f32::microkernel::fma::f32, 8);
        }
        run!(Scalar, gemm_f32::microkernel::scalar::f32, 1)
    }
    // Elsewhere `gemm` chooses (NEON on aarch64): one level there.
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = level;
        // SAFETY: the caller's, as above.
        unsafe { call!(gemm::gemm, [], [gemm::Parallelism::None]) }
    }
}
