//! The SwiGLU product `silu(gate) * up` as one op with a one-pass backward.
//!
//! Composed, the gated feed-forward block of Llama-family models keeps `silu(gate)` in the graph
//! beside `gate`, `up` and the product, as large as each (for a SmolLM-135M-shaped training step
//! at batch 4 × 256, 6 MB per layer, 190 MB over the 30 layers), until the backward has run. Here
//! the op keeps only its two inputs and its output, and the backward recomputes the gate's
//! sigmoid from `gate`, giving both gradients in one pass with candle's composed arithmetic.

use candle_core::{CpuStorage, DType, Layout, Shape, Tensor};

use crate::cpu::f32_slice;
use crate::error::Result;
use crate::fused_grad::{applies, map_rows, with_f32};

/// `silu(gate) * up` (`gate σ(gate) up`, the SwiGLU of a gated feed-forward block: transformers'
/// `act_fn(gate_proj(x)) * up_proj(x)`), for two tensors of one shape. Where a gradient is
/// recorded on float32 CPU tensors (fusion on) this is one op that keeps only `gate`, `up` and
/// the output in the graph, its backward one pass that recomputes the sigmoid; elsewhere (or
/// for shapes that differ, which broadcast as candle's product does) candle's `silu` and product.
/// Both give the same bits, forward and backward.
///
/// ```
/// use module_runtime::candle_core::{Device, Tensor, Var};
/// let gate = Var::new(&[0f32, 2.], &Device::Cpu)?;
/// let up = Var::new(&[3f32, 0.5], &Device::Cpu)?;
/// let y = module_kernels::silu_mul(gate.as_tensor(), up.as_tensor())?;
/// let unfused = (gate.as_tensor().silu()? * up.as_tensor())?;
/// assert_eq!(y.to_vec1::<f32>()?, unfused.to_vec1::<f32>()?);
/// let grads = y.sum_all()?.backward()?;
/// assert_eq!(grads.get(&gate).unwrap().to_vec1::<f32>()?[0], 1.5); // σ(0) · 3
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub fn silu_mul(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    if gate.shape() != up.shape() || !applies(&[gate, up]) {
        return Ok(crate::elementwise::silu(gate)?.broadcast_mul(up)?);
    }
    Ok(gate.contiguous()?.apply_op2(&up.contiguous()?, SiluMul)?)
}

/// `silu(g)` as candle's float32 kernel computes it (`g / (1 + e⁻ᵍ)`, libm's `expf`).
fn silu(g: f32) -> f32 {
    g / (1. + (-g).exp())
}

/// The candle op of [`silu_mul`]: its arguments are the gate and the up projection.
struct SiluMul;

impl candle_core::CustomOp2 for SiluMul {
    fn name(&self) -> &'static str {
        "silu-mul-fused"
    }

    fn cpu_fwd(
        &self,
        gate: &CpuStorage,
        gate_layout: &Layout,
        up: &CpuStorage,
        up_layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let gate = f32_slice(gate, gate_layout, self.name())?;
        let up = f32_slice(up, up_layout, self.name())?;
        let y = map_rows([gate, up], 1, |y, [gate, up]| {
            for ((y, &g), &u) in y.iter_mut().zip(gate).zip(up) {
                *y = silu(g) * u;
            }
        });
        Ok((CpuStorage::F32(y), gate_layout.shape().clone()))
    }

    /// `dgate = (g up) (σ (1 − s) + s)` and `dup = g s`, with `s = silu(gate)` and the sigmoid
    /// `σ = 1 / (exp(−gate) + 1)` recomputed, in candle's order of operations (its product's and
    /// its `silu`'s backward), each only for an argument that records a gradient.
    fn bwd(
        &self,
        gate: &Tensor,
        up: &Tensor,
        _y: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let grad = grad.to_dtype(DType::F32)?.contiguous()?;
        let (want_gate, want_up) = (gate.track_op(), up.track_op());
        let (dgate, dup) = with_f32([gate, up, &grad], self.name(), |[gate, up, g]| {
            let dgate = want_gate.then(|| {
                map_rows([gate, up, g], 1, |d, [gate, up, g]| {
                    for (((d, &x), &u), &g) in d.iter_mut().zip(gate).zip(up).zip(g) {
                        let sigmoid = 1. / ((-x).exp() + 1.);
                        let s = silu(x);
                        *d = (g * u) * (sigmoid * (1. - s) + s);
                    }
                })
            });
            let dup = want_up.then(|| {
                map_rows([gate, g], 1, |d, [gate, g]| {
                    for ((d, &x), &g) in d.iter_mut().zip(gate).zip(g) {
                        *d = g * silu(x);
                    }
                })
            });
            (dgate, dup)
        })?;
        let keep = |t: &Tensor, values: Option<Vec<f32>>| {
            values
                .map(|v| Tensor::from_vec(v, t.shape(), t.device()))
                .transpose()
        };
        Ok((keep(gate, dgate)?, keep(up, dup)?))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Var};

    use super::*;
    use crate::fusion::without_fusion;

    /// Fused or composed: the same bits, forward and backward, for both arguments (and for one
    /// that records no gradient).
    #[test]
    fn fused_silu_mul_matches_composed_bit_for_bit() -> crate::error::Result<()> {
        let dev = Device::Cpu;
        let gate = Var::randn(0f32, 3., (4, 33, 70), &dev)?;
        let up = Var::randn(0f32, 1., (4, 33, 70), &dev)?;
        let upstream = Tensor::randn(0f32, 1., (4, 33, 70), &dev)?;
        let run = |up: &Tensor| -> crate::error::Result<Vec<Vec<f32>>> {
            let y = silu_mul(gate.as_tensor(), up)?;
            let grads = (&y * &upstream)?.sum_all()?.backward()?;
            let flat = |t: &Tensor| t.flatten_all()?.to_vec1::<f32>();
            let mut out = vec![flat(&y)?, flat(grads.get(&gate).expect("gate's gradient"))?];
            if let Some(dup) = grads.get(up) {
                out.push(flat(dup)?);
            }
            Ok(out)
        };
        let tracked = up.as_tensor();
        assert_eq!(run(tracked)?, without_fusion(|| run(tracked))?);
        let frozen = up.as_tensor().detach();
        let fused = run(&frozen)?;
        assert_eq!(
            fused.len(),
            2,
            "no gradient for an argument that records none"
        );
        // (candle's composed product stores one for it all the same.)
        assert_eq!(fused[..], without_fusion(|| run(&frozen))?[..2]);
        Ok(())
    }
}
