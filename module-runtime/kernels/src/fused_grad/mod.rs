//! Fused training passes: Linear with a bias (and over a quantized weight), LayerNorm, RMSNorm, the
//! exact GELU, the last-dimension softmax, dropout, scaled dot-product attention, the
//! cross-entropy of class ids, `a + s b`, the rotary position embedding and the SwiGLU product
//! `silu(gate) * up` as single candle ops that record a gradient, each with
//! a backward pass that is one pass too (or, for the products, their matmuls and one pass).
//!
//! Composed of candle's differentiable ops, these layers leave a chain of small nodes in the graph
//! (a LayerNorm is nine, dropout's mask five), and candle's backward walks each of them: a fresh
//! tensor per node and per gradient sum, broadcasts undone by reductions, transposed copies.
//! Profiles of a MiniLM fine-tuning step put these chains at most of the backward pass outside the
//! matmuls (BENCHMARKS.md). Each op here is one node whose backward computes the input (and
//! parameter) gradients directly, in passes over rows split over the threads of candle's own
//! elementwise kernels (see [`par_map`]).
//!
//! They run when a gradient is recorded (the input or a parameter tracks one: the inference passes
//! of this crate (`elementwise.rs`, `residual_norm.rs`) and candle's kernels serve the other case), on float32 CPU tensors,
//! with fusion enabled ([`without_fusion`](crate::without_fusion) turns them off, to compare or to
//! measure). Everywhere else the layers keep their composed path, which these ops match within
//! float32 rounding: values and gradients are checked against it and against PyTorch in
//! `tests/integration/fused_grad.rs`. Hooks see the same module outputs either way: each op
//! replaces one layer's own computation, never a sequence of layers.

mod add_promoted;
mod add_scaled;
mod attention;
mod attention_bf16;
mod cross_entropy;
mod dropout;
mod gelu;
mod gelu_bf16;
mod layer_norm;
mod linear;
mod linear_bf16;
mod linear_cross_entropy;
mod linear_gelu_bf16;
mod quantized_linear;
mod rms_norm;
mod rope;
mod round;
mod silu_mul;
mod softmax;

pub use add_promoted::add_promoted;
pub use add_scaled::add_scaled;
pub(crate) use attention::{attention, AttentionOptions};
pub use cross_entropy::cross_entropy_rows;
pub(crate) use dropout::{can_fuse_dropout, dropout};
pub(crate) use gelu::{can_fuse_gelu_erf, gelu_erf};
pub(crate) use gelu_bf16::gelu_erf_bf16;
pub(crate) use layer_norm::{can_fuse_layer_norm, layer_norm};
pub(crate) use linear::{can_fuse_linear, linear};
pub(crate) use linear_bf16::{bf16_operands, linear_bf16};
pub use linear_cross_entropy::{linear_cross_entropy, WeightRows};
pub(crate) use linear_gelu_bf16::linear_gelu_bf16;
pub(crate) use quantized_linear::{can_fuse_quantized_product, quantized_product};
pub(crate) use rms_norm::{can_fuse_rms_norm, rms_norm};
pub use rope::rotary_embedding;
pub(crate) use round::round_to;
pub use silu_mul::silu_mul;
pub(crate) use softmax::{can_fuse_softmax_last_dim, softmax_last_dim};

use candle_core::{DType, Storage, Tensor};

use crate::cpu::f32_slice;
use crate::fusion::is_fusion_enabled;
use crate::pool::{block_len, par_map};

/// Whether a fused training op may replace the composed ops over `tensors` (an input and the
/// parameters it meets): fusion is on, all are float32 CPU tensors, and at least one records a
/// gradient.
fn applies(tensors: &[&Tensor]) -> bool {
    is_fusion_enabled()
        && tensors
            .iter()
            .all(|t| t.dtype() == DType::F32 && t.device().is_cpu())
        && tensors.iter().any(|t| t.track_op())
}

/// Runs `f` on the float32 values of contiguous CPU tensors (an error for anything else; the ops
/// make their inputs contiguous before they record them, and their backward the gradient).
fn with_f32<const N: usize, R>(
    tensors: [&Tensor; N],
    op: &'static str,
    f: impl FnOnce([&[f32]; N]) -> R,
) -> candle_core::Result<R> {
    let guards = tensors.map(Tensor::storage_and_layout);
    let mut values: [&[f32]; N] = [&[]; N];
    for (v, (storage, layout)) in values.iter_mut().zip(&guards) {
        *v = match &**storage {
            Storage::Cpu(cpu) => f32_slice(cpu, layout, op)?,
            _ => {
                return Err(candle_core::Error::Msg(format!(
                    "{op}: expects CPU tensors"
                )));
            }
        };
    }
    Ok(f(values))
}

/// A fresh output as long as the inputs, filled by `f` block by block over [`par_map`]: each
/// call gets a block of whole rows (of `width` values) of the output and the same block of each
/// input, and returns what the pass keeps of that block (a partial sum), in block order. The
/// plumbing of every fused pass that writes one value per input value.
fn map_blocks<const N: usize, R: Send>(
    inputs: [&[f32]; N],
    width: usize,
    f: impl Fn(&mut [f32], [&[f32]; N]) -> R + Sync,
) -> (Vec<f32>, Vec<R>) {
    let len = inputs.first().map_or(0, |input| input.len());
    let mut out = vec![0f32; len];
    let block = block_len(len, width);
    let jobs = out.chunks_mut(block).enumerate().map(|(i, out)| {
        let start = i * block;
        let blocks = inputs.map(|input| &input[start..start + out.len()]);
        (out, blocks)
    });
    let kept = par_map(jobs.collect(), |(out, blocks)| f(out, blocks));
    (out, kept)
}

/// [`map_blocks`] for a pass that keeps nothing beside its output.
fn map_rows<const N: usize>(
    inputs: [&[f32]; N],
    width: usize,
    f: impl Fn(&mut [f32], [&[f32]; N]) + Sync,
) -> Vec<f32> {
    map_blocks(inputs, width, f).0
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Var};

    use super::*;
    use crate::fusion::without_fusion;

    /// The fused ops stand in only where a gradient is recorded, on float32 CPU tensors, with
    /// fusion on: elsewhere the composed path (or an inference kernel) runs.
    #[test]
    fn fused_ops_run_only_where_a_float32_cpu_gradient_is_recorded() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let tracked = Var::randn(0f32, 1., (2, 3), &dev)?;
        let tracked = tracked.as_tensor();
        let plain = tracked.detach();
        let double = Var::randn(0f64, 1., (2, 3), &dev)?;
        assert!(applies(&[tracked]));
        assert!(
            applies(&[&plain, tracked]),
            "a parameter that tracks is enough"
        );
        assert!(!applies(&[&plain]));
        assert!(!applies(&[double.as_tensor()]));
        assert!(!without_fusion(|| applies(&[tracked])));
        Ok(())
    }

    /// The fused output is what the gradient flows through: one node, not the composed chain.
    #[test]
    fn a_fused_op_is_one_node_of_the_graph() -> crate::error::Result<()> {
        let x = Var::randn(0f32, 1., (4, 8), &Device::Cpu)?;
        for y in [
            gelu_erf(x.as_tensor())?,
            softmax_last_dim(x.as_tensor())?,
            dropout(x.as_tensor(), 0.5)?,
        ] {
            assert!(y.track_op());
            // The one node's only tracked argument is the input itself.
            let nodes = y.sorted_nodes();
            assert_eq!(nodes.len(), 2, "the op and the input");
            assert_eq!(nodes[1].id(), x.as_tensor().id());
        }
        Ok(())
    }
}
