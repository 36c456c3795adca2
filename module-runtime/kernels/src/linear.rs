//! `x Wᵀ + b`: the entries a `Linear` layer calls, for a float weight ([`linear`]) and a
//! quantized one ([`quantized_linear`], [`quantized_linear_each`]), each choosing its kernel.

use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device, Tensor};

use module_core::autocast::autocast_cached;
use module_core::autocast_policy::{autocast_cast, autocast_cast_opt, autocast_target, AutocastOp};

use crate::bias::add_bias;
use crate::cpu::{cpu_half_dtype, widen};
use crate::error::Result;
use crate::fused_grad;
use crate::matmul::matmul;
use crate::q8_0_matmul::{q8_0_kernel_applies, q8_0_matmul_each};
use crate::Param;

/// The most input rows a quantized weight is multiplied with by candle's quantized matmul; above,
/// the float GEMM over the dequantized weight is faster (measured on the SmolLM-135M-shaped
/// decoder's 576×1536 weights: 1.6–2.8× faster at 1–2 rows, level at 4, 0.4–0.8× at 8–16).
/// `q8_0`, `q4_0` and `q4_K` weights on CPUs with AVX2 take this crate's kernel instead, up to
/// [`Q8_0_MAX_ROWS`].
pub const QUANTIZED_MAX_ROWS: usize = 4;

/// The most input rows a quantized weight is multiplied with by this crate's `q8_0` (`q4_0`,
/// `q4_K`) kernel (CPUs with AVX2); above, the float GEMM over the dequantized weight. Against the
/// float GEMM on the SmolLM-135M-shaped decoder's weights, cold, 2 threads
/// (`benches/quantized_rows.rs` in the `llama` package), at 1 / 32 / 128 / 512 rows: `q8_0`
/// 3.6–4.0× / 3.0–4.0× / 1.5–2.2× / 1.2–1.9×, `q4_0` 4.3–7.5× / 2.9–3.7× / 2.1–2.5× / 1.25–2.6×,
/// `q4_K` 5.6× / 2.6× / 1.8× / 1.8×: prompts take it too. Beyond, each tile's pass over every row
/// reads the rounded input again.
pub const Q8_0_MAX_ROWS: usize = 512;

/// `x Wᵀ + b` for `x` `[…, in]`, `w` `[out, in]` and `b` `[out]`, recording the gradient: with a
/// bias, on float32 CPU tensors that record one (fusion on), one op whose backward is two products
/// and one pass; otherwise the product (float32 CPU matrices on the barrier pool, anything else
/// candle's `matmul`) and the bias, added in place into the product's fresh output where nothing
/// records a gradient.
///
/// Under [`autocast`](module_core::autocast) `x`, `w` and `b` are cast to the autocast dtype
/// first (PyTorch's `linear` is a lower-precision op) and the result is in that dtype. Bfloat16
/// CPU products (bfloat16 operands, or autocast to bfloat16) run on the AVX512-BF16 kernel where
/// the CPU has it ([`KernelChoice::bf16_products`](crate::KernelChoice)), their backward's two
/// products too; there, and for float16, the products are otherwise computed in float32 from the
/// half-precision values and rounded once (float32 accumulation, as PyTorch's CPU kernels), on the
/// float32 kernels above.
///
/// ```
/// use module_runtime::candle_core::{Device, Tensor};
/// let x = Tensor::new(&[[1f32, 2.]], &Device::Cpu)?;
/// let w = Tensor::new(&[[1f32, 0.], [0., 1.], [1., 1.]], &Device::Cpu)?;
/// let b = Tensor::new(&[0f32, 0., 1.], &Device::Cpu)?;
/// let y = module_kernels::linear(&x, &w, Some(&b))?;
/// assert_eq!(y.to_vec2::<f32>()?, [[1., 2., 4.]]);
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub fn linear(x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    if let Some(y) = autocast_on_cpu(x, w, bias)? {
        return Ok(y);
    }
    let [x, w] = autocast_cast(AutocastOp::Linear, [x, w])?;
    let bias = autocast_cast_opt(AutocastOp::Linear, bias)?;
    let (x, w, bias) = (&x, &w, bias.as_ref());
    let mut all = vec![x, w];
    all.extend(bias);
    if all
        .iter()
        .all(|t| t.dtype() == DType::BF16 && t.device().is_cpu())
        && crate::kernel_choice().bf16_products
    {
        return fused_grad::linear_bf16(x, w, bias);
    }
    if let Some(half) = cpu_half_dtype(&all) {
        let b = bias.map(widen).transpose()?;
        let y = linear_same_dtype(&widen(x)?, &widen(w)?, b.as_ref())?;
        return Ok(y.to_dtype(half)?);
    }
    linear_same_dtype(x, w, bias)
}

/// `GELU(x Wᵀ + b)` (the exact GELU) as one op, where [`linear`] would multiply on the
/// AVX512-BF16 kernel (bfloat16 operands, or float32 and bfloat16 ones under autocast to bfloat16)
/// and a gradient is recorded, with fusion on: the values and gradients of [`linear`] then
/// [`gelu_erf`](crate::gelu_erf), with one graph node where they make two. `None` elsewhere: the
/// caller then makes the two calls. What `Linear::call_then` runs for a `GELU` under autocast.
///
/// ```
/// use module_runtime::amp::autocast;
/// use module_runtime::candle_core::Var;
/// use module_runtime::prelude::*;
/// let x = Var::randn(0f32, 1., (2, 4), &Device::Cpu)?;
/// let w = Tensor::randn(0f32, 1., (3, 4), &Device::Cpu)?;
/// let y = autocast("cpu", DType::BF16, || module_kernels::linear_gelu(&x, &w, None))?;
/// if module_kernels::kernel_choice().bf16_products {
///     assert_eq!(y.unwrap().dtype(), DType::BF16);
/// }
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub fn linear_gelu(x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Option<Tensor>> {
    let mut all = vec![x, w];
    all.extend(bias);
    let bf16 = match autocast_target(AutocastOp::Linear, x.device()) {
        Some(dtype) => dtype == DType::BF16,
        None => all.iter().all(|t| t.dtype() == DType::BF16),
    };
    let applies = bf16
        && crate::fusion::is_fusion_enabled()
        && crate::kernel_choice().bf16_products
        && fused_grad::bf16_operands(&all)
        && all.iter().any(|t| t.track_op());
    if !applies {
        return Ok(None);
    }
    Ok(Some(fused_grad::linear_gelu_bf16(x, w, bias)?))
}

/// [`linear`] under CPU autocast to a half dtype, where every operand is a float32, bfloat16 or
/// float16 CPU tensor: the values PyTorch's `linear` computes from the operands cast to the half
/// dtype (float32 accumulation, one rounding). Bfloat16 on the AVX512-BF16 kernel: every operand
/// rounded as the kernel reads it. Otherwise on the float32 kernels: a float32 operand is rounded
/// to the half dtype in float32 storage (one op each way, on the pool: the values of the cast and
/// the widening, and their backward's), a float32 parameter's rounded copy made once per scope
/// (autocast's weight cache). `None` elsewhere.
fn autocast_on_cpu(x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Option<Tensor>> {
    let Some(half) = autocast_target(AutocastOp::Linear, x.device()) else {
        return Ok(None);
    };
    let mut all = vec![x, w];
    all.extend(bias);
    let plain = |t: &&Tensor| {
        t.device().is_cpu() && matches!(t.dtype(), DType::F32 | DType::BF16 | DType::F16)
    };
    if !matches!(half, DType::BF16 | DType::F16) || !all.iter().all(plain) {
        return Ok(None);
    }
    if half == DType::BF16
        && crate::kernel_choice().bf16_products
        && fused_grad::bf16_operands(&all)
    {
        // Float32 operands, parameters included, are rounded to bfloat16 as the kernel reads
        // them, forward and backward (the values of PyTorch's cached cast), and the op hands a
        // float32 parameter its gradient in float32, the bfloat16 values widened (the cast's
        // backward): no cast in the graph, so no cache entry — a cast node would be one more
        // gradient candle sums into a zero-filled buffer each step, for every weight and bias.
        return Ok(Some(fused_grad::linear_bf16(x, w, bias)?));
    }
    let rounded = |t: &Tensor| -> Result<Tensor> {
        if t.dtype() == DType::F32 {
            let tag = if half == DType::BF16 {
                "bf16-in-f32"
            } else {
                "f16-in-f32"
            };
            autocast_cached(t, tag, |t| fused_grad::round_to(t, half))
        } else {
            Ok(t.to_dtype(half)?.to_dtype(DType::F32)?)
        }
    };
    let b = bias.map(rounded).transpose()?;
    let y = linear_same_dtype(&rounded(x)?, &rounded(w)?, b.as_ref())?;
    Ok(Some(y.to_dtype(half)?))
}

/// [`linear`] once the operands are in the dtype it computes in.
fn linear_same_dtype(x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    if let Some(b) = bias.filter(|b| fused_grad::can_fuse_linear(x, w, b)) {
        return fused_grad::linear(x, w, b);
    }
    let y = product(x, w)?;
    match bias {
        Some(b) => {
            let last = y.rank().saturating_sub(1);
            add_bias(y, b, last)
        }
        None => Ok(y),
    }
}

/// `x Wᵀ`, a fresh output: the batch dimensions folded into one so a single 2-D product runs
/// against Wᵀ, which is read in place (no transpose copy).
fn product(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    Ok(match x.dims() {
        [_, _] => matmul(x, &w.t()?)?,
        dims => {
            let (batch, in_features) = dims.split_at(dims.len().saturating_sub(1));
            let rows = batch.iter().product::<usize>();
            let y = x.reshape((rows, in_features.iter().product::<usize>()))?;
            let y = matmul(&y, &w.t()?)?;
            let mut out_dims = batch.to_vec();
            out_dims.push(w.dim(0)?);
            y.reshape(out_dims)?
        }
    })
}

/// `x Wᵀ + b` with the quantized weight `W` `[out, in]` that `weight` holds
/// ([`Param::quantize`]), the output in `x`'s dtype. For a few rows (decoding, prompts, small
/// batches; see [`QUANTIZED_MAX_ROWS`], [`Q8_0_MAX_ROWS`]) and unless a gradient must flow back
/// through `x` (no quantized product records one), the quantized product: a CPU
/// `q8_0`/`q4_0`/`q4_K` weight through this crate's kernel (tiles made once per weight), anything
/// else through candle's quantized matmul. Otherwise [`linear`] over the weight's dequantized
/// values, the same numbers: with many rows (a long prompt's prefill) the float GEMM is as fast
/// or faster (llama.cpp also dequantizes for large batches). A float `weight` takes [`linear`].
///
/// Where a gradient flows back through a float32 CPU `x` (QLoRA's frozen base, fusion on), the
/// weight is dequantized for the product and again for the backward's, and no float copy of it
/// stays in the graph between the two.
pub fn quantized_linear(x: &Tensor, weight: &Param, bias: Option<&Tensor>) -> Result<Tensor> {
    let takes_quantized = weight.quantized_dtype().is_some_and(|kind| {
        rows(x) <= max_quantized_rows(kind, &weight.device())
            && !(x.track_op() && module_core::is_grad_enabled())
    });
    if !takes_quantized {
        // A gradient through `x` (QLoRA): the product that keeps no float copy of the weight.
        if fused_grad::can_fuse_quantized_product(x, weight)
            && autocast_target(AutocastOp::Linear, x.device()).is_none()
        {
            let (_, in_features) = weight.shape().dims2()?;
            let y = fused_grad::quantized_product(&float_rows(x, in_features)?, weight)?;
            return from_rows(y, x, bias);
        }
        return linear(x, &weight.tensor()?, bias);
    }
    let shape = weight.shape();
    let (_, in_features) = shape.dims2()?;
    if x.dims().last() != Some(&in_features) {
        return Err(candle_core::Error::ShapeMismatchBinaryOp {
            lhs: x.shape().clone(),
            rhs: shape,
            op: "quantized linear",
        }
        .into());
    }
    let x2 = float_rows(x, in_features)?;
    let y = match q8_0_matmul_each(&x2, &[weight])? {
        Some(mut y) => y.remove(0),
        // Other kinds and devices: candle's quantized matmul over the weight, which no layout
        // replaced (only the `q8_0`/`q4_0`/`q4_K` kernel's tiles do, on the CPU).
        None => match weight.quantized()? {
            Some(w) => x2.apply_op1_no_bwd(&*w)?,
            None => return linear(x, &weight.tensor()?, bias),
        },
    };
    from_rows(y, x, bias)
}

/// `[x W₀ᵀ + b₀, x W₁ᵀ + b₁, …]` in one pass of the `q8_0` kernel over the barrier pool (the rows
/// rounded to 8 bits once, every weight's tiles one list the threads share out), or `None` where
/// any weight would not take that kernel in [`quantized_linear`] (a float or other kind of
/// weight, another device, too many rows, a CPU without AVX2, a gradient to record through `x`,
/// weights of different widths): the caller then runs them one by one. The values are those of
/// separate [`quantized_linear`] calls.
pub fn quantized_linear_each(
    x: &Tensor,
    weights: &[&Param],
    biases: &[Option<Tensor>],
) -> Result<Option<Vec<Tensor>>> {
    if weights.len() < 2 || !x.device().is_cpu() || (x.track_op() && module_core::is_grad_enabled())
    {
        return Ok(None);
    }
    let Some(&in_features) = x.dims().last() else {
        return Ok(None);
    };
    for weight in weights {
        let Some(kind) = weight.quantized_dtype() else {
            return Ok(None);
        };
        let device = weight.device();
        let (_, k) = weight.shape().dims2()?;
        if !q8_0_kernel_applies(kind, &device)
            || k != in_features
            || rows(x) > max_quantized_rows(kind, &device)
        {
            return Ok(None);
        }
    }
    let Some(products) = q8_0_matmul_each(&float_rows(x, in_features)?, weights)? else {
        return Ok(None);
    };
    products
        .into_iter()
        .zip(biases)
        .map(|(y, b)| from_rows(y, x, b.as_ref()))
        .collect::<Result<Vec<_>>>()
        .map(Some)
}

/// The most input rows a weight of `kind` on `device` is multiplied with in its quantized form.
fn max_quantized_rows(kind: GgmlDType, device: &Device) -> usize {
    if q8_0_kernel_applies(kind, device) {
        Q8_0_MAX_ROWS
    } else {
        QUANTIZED_MAX_ROWS
    }
}

/// The number of rows of `x` (every dimension but the last).
fn rows(x: &Tensor) -> usize {
    x.dims()
        .split_last()
        .map_or(0, |(_, batch)| batch.iter().product())
}

/// `x` `[…, in_features]` as contiguous float32 rows `[rows, in_features]`: what the quantized
/// kernels multiply.
fn float_rows(x: &Tensor, in_features: usize) -> Result<Tensor> {
    Ok(x.to_dtype(DType::F32)?
        .reshape((rows(x), in_features))?
        .contiguous()?)
}

/// A quantized product `y` `[rows, out]` of [`float_rows`] of `x`, back in `x`'s leading
/// dimensions and dtype, plus the bias.
fn from_rows(y: Tensor, x: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let mut dims = x.dims()[..x.rank() - 1].to_vec();
    dims.push(y.dim(1)?);
    let y = y.reshape(dims)?.to_dtype(x.dtype())?;
    match bias {
        Some(b) => {
            let last = y.rank() - 1;
            add_bias(y, b, last)
        }
        None => Ok(y),
    }
}
