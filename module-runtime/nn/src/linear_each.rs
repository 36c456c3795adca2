//! Several `Linear` layers on one input (a decoder's query, key and value projections), computed
//! together where that is faster: [`Linear::call_each`].

use candle_core::Tensor;

use crate::common::param_tensor;
use crate::error::Result;
use crate::fused::fusion_applies;
use crate::{Linear, ModuleExt};

impl Linear {
    /// `[layers[0].call(x), layers[1].call(x), …]`: several layers on the same input, such as
    /// attention's query, key and value projections or SwiGLU's gate and up projections.
    ///
    /// The values are the separate calls'. It is faster in one case: weights quantized to `q8_0`
    /// `q4_0` or `q4_K` ([`quantize`](crate::quantize)) on a CPU with AVX2, up to
    /// [`Q8_0_MAX_ROWS`](crate::Q8_0_MAX_ROWS) rows (decoding, prompts). There the rows are rounded to 8 bits
    /// once and every layer's product is one pass over the thread pool instead of one each: a
    /// decoding step's products last microseconds, and a Llama decoder's step runs 6–9% faster
    /// with its q/k/v and gate/up so (BENCHMARKS.md, "q8_0 decoding"). Otherwise, and whenever a
    /// hook is attached (hooks see each layer's own call), a layer holds a LoRA adapter, or fusion
    /// is off
    /// ([`without_fusion`](crate::without_fusion)), the layers are called one after the other.
    /// PyTorch has no such call: its models fuse such projections by concatenating the weights,
    /// which would change the checkpoint's names here.
    ///
    /// ```
    /// use module_runtime::prelude::*;
    /// use module_runtime::nn::{quantize, GgmlDType, Linear};
    /// let (q, k) = (Linear::new(64, 32, &Device::Cpu)?, Linear::new(64, 16, &Device::Cpu)?);
    /// let x = Tensor::randn(0f32, 1., (1, 64), &Device::Cpu)?;
    /// let [qx, kx] = Linear::call_each([&q, &k], &x)?;
    /// assert_eq!((qx.dims(), kx.dims()), (&[1, 32][..], &[1, 16][..]));
    ///
    /// q.weight.quantize(GgmlDType::Q8_0)?;
    /// k.weight.quantize(GgmlDType::Q8_0)?;
    /// let [qx, kx] = Linear::call_each([&q, &k], &x)?; // one pass on the thread pool
    /// assert_eq!(qx.to_vec2::<f32>()?, q.call(&x)?.to_vec2::<f32>()?);
    /// assert_eq!(kx.to_vec2::<f32>()?, k.call(&x)?.to_vec2::<f32>()?);
    /// # Ok::<(), module_runtime::Error>(())
    /// ```
    pub fn call_each<const N: usize>(layers: [&Linear; N], x: &Tensor) -> Result<[Tensor; N]> {
        let outputs = match quantized_each(&layers, x)? {
            Some(outputs) => outputs,
            None => layers
                .iter()
                .map(|layer| layer.call(x))
                .collect::<Result<Vec<_>>>()?,
        };
        Ok(outputs
            .try_into()
            .unwrap_or_else(|_| unreachable!("one output per layer")))
    }
}

/// The layers' outputs from one pass of the `q8_0` kernel, or `None` where any of them would not
/// take that kernel when called alone (or a hook or the switch rules fusion out).
fn quantized_each(layers: &[&Linear], x: &Tensor) -> Result<Option<Vec<Tensor>>> {
    // A layer with an adapter adds its adapter's output in its own call; a parametrized one
    // computes its weight there.
    let own_call = |layer: &&Linear| {
        layer.lora.is_some()
            || layer.modules_to_save.is_some()
            || layer.parametrizations.is_some()
            || layer.reduce.is_some()
    };
    if !fusion_applies() || layers.iter().any(own_call) {
        return Ok(None);
    }
    let weights: Vec<_> = layers.iter().map(|layer| &layer.weight).collect();
    let biases = layers
        .iter()
        .map(|layer| param_tensor(&layer.bias))
        .collect::<Result<Vec<_>>>()?;
    module_kernels::quantized_linear_each(x, &weights, &biases)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::GgmlDType;
    use candle_core::Device;

    /// The one-pass path runs where the kernel applies (the integration tests check its values
    /// against the separate calls), and steps aside for a float layer or too many rows.
    #[test]
    fn the_single_pass_runs_where_the_kernel_applies() -> Result<()> {
        let dev = Device::Cpu;
        let (a, b) = (Linear::new(64, 40, &dev)?, Linear::new(64, 16, &dev)?);
        let x = Tensor::randn(0f32, 1., (2, 64), &dev)?;
        assert!(quantized_each(&[&a, &b], &x)?.is_none());
        a.weight.quantize(GgmlDType::Q8_0)?;
        assert!(quantized_each(&[&a, &b], &x)?.is_none());
        b.weight.quantize(GgmlDType::Q8_0)?;
        let simd = module_kernels::q8_0_kernel_applies(GgmlDType::Q8_0, &Device::Cpu);
        let together = quantized_each(&[&a, &b], &x)?;
        assert_eq!(together.is_some(), simd);
        if let Some(together) = together {
            for (t, layer) in together.iter().zip([&a, &b]) {
                let alone = layer.call(&x)?;
                assert_eq!(t.to_vec2::<f32>()?, alone.to_vec2::<f32>()?);
            }
        }
        let many = Tensor::randn(0f32, 1., (crate::Q8_0_MAX_ROWS + 1, 64), &dev)?;
        assert!(quantized_each(&[&a, &b], &many)?.is_none());
        Ok(())
    }
}
