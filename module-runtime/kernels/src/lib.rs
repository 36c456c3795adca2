//! The runtime's CPU kernels, below the layers: float32 products on candle's barrier pool, the
//! `q8_0`/`q4_0`/`q4_K` quantized products, the vectorized elementwise activations, the fused
//! normalization passes, attention in one pass per head, and the fused training ops (one candle op
//! each, with a one-pass backward).
//!
//! # One entry per operation
//!
//! A layer calls one function per operation and knows no kernel: the entry chooses among its
//! implementations by what it is given (dtype, device, whether a gradient is recorded, whether
//! fusion is on) and returns a candle tensor that records the gradient wherever its input does.
//!
//! | entry | what it computes | the implementations it chooses among |
//! |---|---|---|
//! | [`linear`] | `x Wᵀ + b` | the fused training op; the barrier pool's GEMM or candle's `matmul`, the bias in place |
//! | [`quantized_linear`], [`quantized_linear_each`] | `x Wᵀ + b`, `W` quantized | the `q8_0` kernel's tiles; candle's quantized matmul; [`linear`] over the dequantized weight |
//! | [`add_bias`] | a bias along one dimension of a fresh output | in place; `broadcast_add` |
//! | [`gelu_erf`], [`silu`] | the exact GELU, the SiLU | vectorized passes; the fused training op (GELU); candle's ops |
//! | [`activation_in_place`] | an [`Elementwise`] function over a fresh output | one vectorized pass over the barrier pool |
//! | [`softmax`] | `softmax` along a dimension | candle-nn's kernel; the fused training op; composed ops |
//! | [`dropout`] | dropout in training | the fused training op; a mask of candle ops |
//! | [`layer_norm`], [`rms_norm`] | normalization over the last dimension | candle-nn's kernels; the fused training op; composed ops |
//! | [`residual_layer_norm`] | `LayerNorm(x + residual)` | one pass (inference) |
//! | [`scaled_dot_product_attention`] | `softmax(q kᵀ · scale + mask) v` | one pass per head (inference); the fused training op; composed ops |
//! | [`chunked_update`] in [`update_in_place`] | an optimizer's element-wise step over a parameter | a [`ChunkRule`]'s loop, compiled for AVX2 where the CPU has it, in chunks over the barrier pool |
//!
//! [`without_fusion`] turns every fused kernel off on a thread (each entry then takes its
//! composed path).
//!
//! Under `module_runtime::amp::autocast` the entries of the ops in PyTorch's autocast lists
//! ([`linear`], [`scaled_dot_product_attention`], [`layer_norm`] and [`softmax`] on CUDA) cast
//! their inputs first (the core's `autocast_cast`), and half-precision CPU inputs are computed on
//! the float32 kernels from their values and rounded once.
//!
//! # One binary for every host
//!
//! Each SIMD kernel is compiled for several instruction sets and picks one per call from
//! [`kernel_choice`]: what the CPU has, lowered by `ATEN_CPU_CAPABILITY` or
//! [`with_cpu_capability`] (see `capability.rs`). The products call `gemm`'s driver with the
//! chosen level's micro-kernels (`gemm_kernel.rs`) rather than `gemm::gemm`, which fixes one per
//! process.
//!
//! # This crate
//!
//! `module-kernels` sits below `module-nn` (the layers) and `module-optim` (the optimizers), as
//! candle-core's CPU backend sits below candle-nn, on `module-core` alone (for the runtime's error type and `Param`). It names no
//! layer and no optimizer. All of the runtime's SIMD, its thread-pool plumbing, the allocator settings
//! [`reuse_freed_memory`] and [`return_freed_memory`] and the `unsafe` they need are here, each `unsafe` block with its SAFETY
//! reasoning.
#![warn(missing_docs)]

// The lower crate's items, under the names this crate's files use (`crate::error::Result`).
use module_core::{error, random, Param};

mod capability;
mod cpu;
#[cfg(target_os = "linux")]
mod file_read;
mod fusion;
mod memory;
mod pool;
mod vector_exp;

mod bf16_gemm;
mod bias;
mod elementwise;
mod fused_grad;
mod gemm_kernel;
mod matmul;
mod q8_0_matmul;
mod residual_norm;
mod sdpa_kernel;
mod update;

mod dropout;
mod linear;
mod norm;
mod sdpa;
mod softmax;

pub use bias::add_bias;
pub use capability::{
    get_cpu_capability, kernel_choice, with_cpu_capability, CpuCapability, KernelChoice,
};
pub use cpu::is_plain_cpu_f32;
pub use dropout::dropout;
pub use elementwise::{activation_in_place, can_activate_in_place, gelu_erf, silu, Elementwise};
#[cfg(target_os = "linux")]
pub use file_read::read_values_at;
pub use fused_grad::{
    add_promoted, add_scaled, cross_entropy_rows, linear_cross_entropy, rotary_embedding, silu_mul,
    WeightRows,
};
pub use fusion::{is_fusion_enabled, without_fusion};
pub use linear::{
    linear, linear_gelu, quantized_linear, quantized_linear_each, Q8_0_MAX_ROWS, QUANTIZED_MAX_ROWS,
};
pub use matmul::product_operand;
pub use memory::{return_freed_memory, reuse_freed_memory};
pub use norm::{compute_dtype, layer_norm, rms_norm, standardize_last_dim};
pub use q8_0_matmul::q8_0_kernel_applies;
pub use residual_norm::{can_fuse_residual_norm, residual_layer_norm};
pub use sdpa::{scaled_dot_product_attention, SdpaOptions};
pub use softmax::softmax;
pub use update::{chunked_update, update_in_place, ChunkRule, StateChunks};
