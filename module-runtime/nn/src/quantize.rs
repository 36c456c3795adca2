//! `quantize(&model, pattern, kind)`: the matching `Linear` layers' weights replaced in place by
//! quantized ones, multiplied by a quantized matmul (PyTorch's `torch.ao.quantization.quantize_dynamic`, by path
//! pattern, for any derived model).

use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::Shape;

use crate::error::{Error, Result};
use crate::linear::{LazyLinear, Linear};
use crate::{Module, Param};
use module_core::error::QuantizeError;
use module_core::names::{named_modules, named_parameters};
use module_core::quant::{check_quantizable, check_quantized_kind, quantize_value};
use module_core::{Names, PathPattern};

/// What [`quantize`] did: the layers it quantized, those it left in float, and the other paths
/// that read a quantized weight.
#[derive(Clone, Debug, PartialEq)]
#[must_use = "the report says which layers were left in float"]
pub struct QuantizeReport {
    /// The kind the weights were quantized to.
    pub kind: GgmlDType,
    /// The paths of the `Linear` layers whose weight is now quantized, in module order.
    pub quantized: Vec<String>,
    /// `Linear` layers the pattern matched whose rows (`in_features`) the kind's blocks do not
    /// fit, with their weight's shape: they stay in float, as llama.cpp's converter keeps such
    /// tensors (the tiny test Llama's `down_proj`, 176 wide, for 32-element blocks).
    pub kept_float: Vec<(String, Shape)>,
    /// Other paths of the quantized weights: a tied weight is one parameter, so the embedding
    /// `model.embed_tokens.weight` of a model whose `lm_head` was quantized reads the quantized
    /// values (dequantized), as llama.cpp does with a quantized `token_embd`.
    pub aliases: Vec<String>,
}

/// Quantizes, in place, the weights of the `Linear` layers (and built `LazyLinear`s) whose
/// module path matches `pattern` ([`PathPattern`]: `**` for all of them,
/// `model.layers.*.mlp.*`, `lm_head`), to `kind` (`GgmlDType::Q8_0`, `Q4_0`, `Q4K`, …): from
/// then on they multiply with a quantized matmul (this crate's kernel for `q8_0`, `q4_0` and
/// `q4_K` on the CPU, candle's for other kinds and devices). PyTorch's `quantize_dynamic`,
/// selecting layers by path pattern instead of by class.
///
/// The model's type does not change: a quantized `Linear` is still a `Linear`, whose `weight`
/// [`Param`] holds the quantized weight instead of its float values (see [`Param::quantize`]).
/// That parameter reads as the quantized values dequantized — its shape, dtype and device are
/// the logical ones, a
/// `state_dict` saves the dequantized values (what the model computes with; a later load
/// quantizes again) — and it is not trained: it is left out of `trainable_vars` (PyTorch's
/// quantized layers have no parameters either). A gradient still flows back to the layer's
/// input. `print(model)` shows `quantized=Q8_0` on each such layer. Biases stay in float.
///
/// The quantized matmul runs for inputs of up to [`QUANTIZED_MAX_ROWS`](crate::QUANTIZED_MAX_ROWS)
/// rows (decoding; [`Q8_0_MAX_ROWS`](crate::Q8_0_MAX_ROWS), prompts included, for `q8_0`,
/// `q4_0` and `q4_K` on CPUs with AVX2, whose kernel is this crate's); for more the layer multiplies with the
/// dequantized weight in float, which is as fast or faster there, as llama.cpp dequantizes for
/// large batches. Both use the quantized weight's values; the quantized kernel also rounds the
/// input rows to 8 bits per block.
///
/// A model built without values ([`build_empty`](module_core::build_empty)) is quantized before
/// its load: each matched weight is marked with `kind` and quantized as the load brings its
/// values, one tensor at a time, so a checkpoint streams into the quantized model without the
/// float model ever being in memory (Hugging Face's `from_pretrained` with a
/// `quantization_config`). Loading a GGUF's already quantized tensor into a marked weight takes
/// it as it is.
///
/// Tied weights stay tied: quantizing a `Linear` quantizes its weight for every alias. Another
/// `Linear` holding it multiplies with the quantized weight too, and any other reader (a tied
/// `Embedding`) reads the dequantized table — llama.cpp's semantics for a quantized
/// `token_embd`. [`QuantizeReport::aliases`] names those other paths.
///
/// Quantized blocks run along the input dimension, so a weight whose `in_features` is not a
/// multiple of the kind's block size (32 for `q8_0`/`q4_0`, 256 for the k-quants) cannot be
/// quantized: such layers stay in float and are listed in [`QuantizeReport::kept_float`]
/// (llama.cpp's converter does the same), unless none of the matched layers fits, which is an
/// error ([`QuantizeError::BlockSize`]). A pattern that matches no `Linear` is
/// [`QuantizeError::NoLinear`]. All or nothing: on an error, no weight was changed.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::{quantize, GgmlDType, Linear};
///
/// #[derive(Module)]
/// struct Mlp { fc1: Linear, fc2: Linear }
///
/// let dev = Device::Cpu;
/// let model = Mlp { fc1: Linear::new(64, 128, &dev)?, fc2: Linear::new(128, 10, &dev)? };
/// let x = Tensor::randn(0f32, 1., (2, 64), &dev)?;
/// let before = model.fc2.call(&model.fc1.call(&x)?)?;
///
/// let report = quantize(&model, "**", GgmlDType::Q8_0)?;
/// assert_eq!(report.quantized, ["fc1", "fc2"]);
/// assert_eq!(model.fc1.weight.quantized_dtype(), Some(GgmlDType::Q8_0));
/// assert_eq!(model.trainable_vars()?.len(), 2); // the biases
///
/// let after = model.fc2.call(&model.fc1.call(&x)?)?;
/// let diff = (after - before)?.abs()?.max_all()?.to_scalar::<f32>()?;
/// assert!(diff < 0.05, "{diff}");
/// assert!(quantize(&model, "fc3", GgmlDType::Q8_0).is_err()); // no such Linear
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub fn quantize(model: &dyn Module, pattern: &str, kind: GgmlDType) -> Result<QuantizeReport> {
    let pattern = PathPattern::new(pattern)?;
    check_quantized_kind(kind)?;
    let linears = linear_layers(model);
    let matched: Vec<&(String, &Linear)> = linears
        .iter()
        .filter(|(path, _)| pattern.matches(path))
        .collect();
    if matched.is_empty() {
        return Err(QuantizeError::NoLinear {
            pattern: pattern.as_str().to_owned(),
            available: linears.iter().take(8).map(|(p, _)| p.clone()).collect(),
        }
        .into());
    }
    let mut report = QuantizeReport {
        kind,
        quantized: Vec::new(),
        kept_float: Vec::new(),
        aliases: Vec::new(),
    };
    // Validate and quantize everything first (the costly, fallible part), then commit.
    let mut pending: Vec<(Param, Option<Arc<QTensor>>)> = Vec::new();
    let mut first_misfit = None;
    for (path, linear) in matched {
        let weight = &linear.weight;
        if pending.iter().any(|(p, _)| p.same_as(weight)) {
            // A weight two matched layers share: quantized once.
            report.quantized.push(path.clone());
            continue;
        }
        if weight.is_parametrized() {
            return Err(module_core::ParametrizeError::Invalid {
                path: format!("{path}.weight"),
                message: "a parametrized weight cannot be quantized: remove its \
                          parametrizations first (`remove_parametrizations`)"
                    .into(),
            }
            .into());
        }
        let shape = match weight.lazy_shape() {
            None => weight.shape(),
            // An empty weight of known shape is marked, and quantized as a load brings it.
            Some(lazy) => match lazy.known() {
                Some(dims) => Shape::from(dims),
                None => {
                    weight.var()?; // an unbuilt weight of unknown shape: its `NotLoaded` error
                    weight.shape()
                }
            },
        };
        if let Err(e) = check_quantizable(path, shape.dims(), kind) {
            first_misfit.get_or_insert(e);
            report.kept_float.push((path.clone(), shape));
            continue;
        }
        let q = if weight.quantized_dtype() == Some(kind) || !weight.is_built() {
            // Already this kind (quantizing its dequantized values again changes nothing), or
            // no values yet: marked in the commit below.
            None
        } else {
            // In row chunks, in parallel: the bytes of one whole quantization.
            let value = weight.var()?.as_tensor().detach();
            Some(quantize_value(&value, kind)?)
        };
        pending.push((weight.clone(), q));
        report.quantized.push(path.clone());
    }
    if pending.is_empty() {
        return Err(first_misfit.unwrap_or_else(|| Error::InvalidConfig {
            layer: "quantize",
            message: "nothing to quantize".to_owned(),
        }));
    }
    // One update: a call on another thread sees every matched layer quantized, or none.
    module_core::atomic_update(|| {
        for (param, q) in &pending {
            match q {
                Some(q) => param.set_quantized(q.clone())?,
                None if !param.is_built() => param.quantize(kind)?,
                None => {}
            }
        }
        Ok::<_, Error>(())
    })?;
    let own: Vec<String> = report.quantized.iter().map(|p| weight_path(p)).collect();
    report.aliases = named_parameters(model, &Names::new().keep_duplicates())
        .into_iter()
        .filter(|(path, p)| pending.iter().any(|(q, _)| q.same_as(p)) && !own.contains(path))
        .map(|(path, _)| path)
        .collect();
    Ok(report)
}

/// The kind llama.cpp names `name` (`q8_0`, `q4_0`, `q4_1`, `q5_0`, `q5_1`, `q2_k`, `q3_k`,
/// `q4_k`, `q5_k`, `q6_k`; case and the `_` before `k` do not matter), for command lines and
/// environment variables; [`Error::InvalidConfig`] naming the kinds otherwise.
///
/// ```
/// use module_runtime::nn::{parse_quant_kind, GgmlDType};
/// assert_eq!(parse_quant_kind("q8_0")?, GgmlDType::Q8_0);
/// assert_eq!(parse_quant_kind("Q4K")?, GgmlDType::Q4K);
/// assert!(parse_quant_kind("q7").is_err());
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub fn parse_quant_kind(name: &str) -> Result<GgmlDType> {
    let kind = match name.to_ascii_lowercase().replace("_k", "k").as_str() {
        "q4_0" => GgmlDType::Q4_0,
        "q4_1" => GgmlDType::Q4_1,
        "q5_0" => GgmlDType::Q5_0,
        "q5_1" => GgmlDType::Q5_1,
        "q8_0" => GgmlDType::Q8_0,
        "q2k" => GgmlDType::Q2K,
        "q3k" => GgmlDType::Q3K,
        "q4k" => GgmlDType::Q4K,
        "q5k" => GgmlDType::Q5K,
        "q6k" => GgmlDType::Q6K,
        _ => {
            return Err(Error::InvalidConfig {
                layer: "quantize",
                message: format!(
                    "unknown quantization {name:?}: q8_0, q4_0, q4_1, q5_0, q5_1, q2_k, q3_k, \
                     q4_k, q5_k, q6_k"
                ),
            })
        }
    };
    Ok(kind)
}

/// Every `Linear` (and built or unbuilt `LazyLinear`) under `model`, by module path.
fn linear_layers(model: &dyn Module) -> Vec<(String, &Linear)> {
    named_modules(model, &Names::new())
        .into_iter()
        .filter_map(|(path, m)| {
            let linear = m
                .downcast_ref::<Linear>()
                .or_else(|| m.downcast_ref::<LazyLinear>().map(|l| &**l))?;
            Some((path, linear))
        })
        .collect()
}

/// The path of a layer's `weight`.
fn weight_path(layer: &str) -> String {
    if layer.is_empty() {
        "weight".to_owned()
    } else {
        format!("{layer}.weight")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::common::max_diff;
    use crate::{Forward, ModuleExt};
    use candle_core::{Device, Tensor, Var};

    /// The quantized matmul gives the float matmul over the dequantized weight, up to the
    /// blockwise quantization of the input it does; a gradient still reaches the input.
    #[test]
    fn quantized_linear_matches_its_dequantized_weight_and_passes_gradients() {
        let dev = Device::Cpu;
        let fc = Linear::new(64, 8, &dev).unwrap();
        let _ = quantize(&fc, "**", GgmlDType::Q8_0).unwrap();
        assert_eq!(fc.weight.quantized_dtype(), Some(GgmlDType::Q8_0));
        let x = Tensor::randn(0f32, 1., (1, 3, 64), &dev).unwrap();
        let y = crate::without_grad(|| fc.forward(&x)).unwrap();
        let w = fc.weight.tensor().unwrap();
        let b = fc.bias.as_ref().unwrap().tensor().unwrap();
        let want = x
            .broadcast_matmul(&w.t().unwrap())
            .unwrap()
            .broadcast_add(&b)
            .unwrap();
        assert_eq!(y.dims(), [1, 3, 8]);
        assert!(max_diff(&y, &want) > 0.0); // the quantized kernel ran (it rounds the input)
        assert!(max_diff(&y, &want) < 0.02, "{}", max_diff(&y, &want));
        // Through the float path when the input needs a gradient: the weight gets none.
        let xv = Var::from_tensor(&x).unwrap();
        let loss = fc.forward(xv.as_tensor()).unwrap().sum_all().unwrap();
        let grads = loss.backward().unwrap();
        assert!(grads.get(xv.as_tensor()).is_some());
        assert!(grads.get(fc.weight.var().unwrap().as_tensor()).is_none());
        assert_eq!(fc.trainable_vars().unwrap().len(), 1); // the bias
    }

    /// A load quantizes the loaded values again; `dequantize` makes the weight float again.
    #[test]
    fn loads_requantize_and_dequantize_restores_training() {
        let dev = Device::Cpu;
        let fc = Linear::no_bias(32, 4, &dev).unwrap();
        let _ = quantize(&fc, "**", GgmlDType::Q4_0).unwrap();
        let before = fc.weight.quantized().unwrap().unwrap();
        let new = Tensor::randn(0f32, 1., (4, 32), &dev).unwrap();
        fc.weight.set(&new).unwrap();
        let after = fc.weight.quantized().unwrap().unwrap();
        assert!(!Arc::ptr_eq(&before, &after));
        let deq = after.dequantize(&dev).unwrap();
        assert_eq!(max_diff(&deq, &fc.weight.tensor().unwrap()), 0.0);
        assert!(max_diff(&deq, &new) > 0.0); // q4_0's rounding
        assert!(!fc.weight.requires_grad());
        fc.weight.dequantize().unwrap();
        assert!(fc.weight.requires_grad() && fc.weight.quantized().unwrap().is_none());
        assert_eq!(fc.trainable_vars().unwrap().len(), 1);
    }

    /// An `Embedding` whose table is a quantized weight (tied to a quantized head) looks its
    /// rows up in the quantized table: the dequantized table's rows, any id dtype and shape; an
    /// id outside the table is a typed error.
    #[test]
    fn an_embedding_tied_to_a_quantized_head_reads_its_rows_quantized() {
        let dev = Device::Cpu;
        let head = Linear::no_bias(64, 10, &dev).unwrap();
        let mut table = crate::Embedding::new(10, 64, &dev).unwrap();
        table.weight = head.weight.clone();
        let _ = quantize(&head, "**", GgmlDType::Q4_0).unwrap();
        let deq = head
            .weight
            .quantized()
            .unwrap()
            .unwrap()
            .dequantize(&dev)
            .unwrap();
        for ids in [
            Tensor::new(&[[3u32, 0, 9], [3, 3, 1]], &dev).unwrap(),
            Tensor::new(&[7i64, 2], &dev).unwrap(),
            Tensor::new(&[5u8], &dev).unwrap(),
        ] {
            let rows = table.forward(&ids).unwrap();
            let flat = ids.flatten_all().unwrap().to_dtype(candle_core::DType::U32);
            let want = deq.index_select(&flat.unwrap(), 0).unwrap();
            let mut dims = ids.dims().to_vec();
            dims.push(64);
            assert_eq!(rows.dims(), dims.as_slice());
            assert_eq!(
                max_diff(&rows.flatten_to(ids.rank() - 1).unwrap(), &want),
                0.0
            );
        }
        for bad in [Tensor::new(&[10u32], &dev), Tensor::new(&[-1i64], &dev)] {
            let err = table.forward(&bad.unwrap()).unwrap_err();
            assert!(
                err.to_string().contains("outside the table's 10 rows"),
                "{err}"
            );
        }
    }

    /// Once the kernel has made its tiles (`q8_0`, `q4_0`, `q4_K`), they are the weight's only copy:
    /// the weight, its rows, its values and a tied embedding's rows come back from them
    /// exactly, and the products stay the same.
    #[test]
    fn the_tiles_replace_the_weight_exactly() {
        for kind in [GgmlDType::Q8_0, GgmlDType::Q4_0, GgmlDType::Q4K] {
            tiles_replace_the_weight_exactly(kind);
        }
    }

    fn tiles_replace_the_weight_exactly(kind: GgmlDType) {
        let dev = Device::Cpu;
        if !module_kernels::q8_0_kernel_applies(kind, &dev) {
            return; // no AVX2: candle's kernel, no tiles
        }
        // 40 rows: the last tile is padded.
        let head = Linear::no_bias(256, 40, &dev).unwrap();
        let mut table = crate::Embedding::new(40, 256, &dev).unwrap();
        table.weight = head.weight.clone();
        let _ = quantize(&head, "**", kind).unwrap();
        let original = head.weight.quantized().unwrap().unwrap();
        let bytes = original.data().unwrap().to_vec();
        let values = head.weight.tensor().unwrap();
        drop(original);
        let x = Tensor::randn(0f32, 1., (1, 256), &dev).unwrap();
        let before = crate::without_grad(|| head.forward(&x)).unwrap();
        // The tiles exist now; the weight is made again from them on each call.
        let a = head.weight.quantized().unwrap().unwrap();
        let b = head.weight.quantized().unwrap().unwrap();
        assert!(!Arc::ptr_eq(&a, &b));
        assert_eq!(a.data().unwrap().as_ref(), bytes.as_slice());
        let rows = head.weight.quantized_rows(&[39, 0, 17]).unwrap().unwrap();
        let row = 256 / kind.block_size() * kind.type_size();
        let want: Vec<u8> = [39, 0, 17]
            .iter()
            .flat_map(|&r| bytes[r * row..(r + 1) * row].to_vec())
            .collect();
        assert_eq!(rows.data().unwrap().as_ref(), want.as_slice());
        assert!(head.weight.quantized_rows(&[40]).is_err());
        assert_eq!(max_diff(&head.weight.tensor().unwrap(), &values), 0.0);
        let ids = Tensor::new(&[39u32, 3], &dev).unwrap();
        let looked_up = table.forward(&ids).unwrap();
        let want = values.index_select(&ids, 0).unwrap();
        assert_eq!(max_diff(&looked_up, &want), 0.0);
        let after = crate::without_grad(|| head.forward(&x)).unwrap();
        assert_eq!(max_diff(&before, &after), 0.0);
        head.weight.dequantize().unwrap();
        assert_eq!(max_diff(&head.weight.tensor().unwrap(), &values), 0.0);
    }

    /// A `LazyLinear` is quantized once built; before, its unbuilt weight is an error and
    /// nothing changes.
    #[test]
    fn lazy_linears_quantize_once_built() {
        let dev = Device::Cpu;
        let fc = LazyLinear::new(4, &dev).unwrap();
        let err = quantize(&fc, "**", GgmlDType::Q8_0).unwrap_err();
        assert!(matches!(err, Error::NotLoaded { .. }), "{err}");
        let x = Tensor::randn(0f32, 1., (1, 64), &dev).unwrap();
        let before = fc.forward(&x).unwrap();
        let report = quantize(&fc, "**", GgmlDType::Q8_0).unwrap();
        assert_eq!(report.quantized, [""]);
        let after = crate::without_grad(|| fc.forward(&x)).unwrap();
        assert!(max_diff(&before, &after) < 0.05);
        assert!(fc.weight.is_quantized());
    }

    /// Patterns select module paths; a weight shared by two layers is quantized once and both
    /// layers use it.
    #[test]
    fn patterns_and_shared_weights() {
        #[derive(crate::Module)]
        #[module(crate = module_core)]
        struct Two {
            a: Linear,
            b: Linear,
            c: Linear,
        }
        let dev = Device::Cpu;
        let a = Linear::new(32, 32, &dev).unwrap();
        let b = Linear::from_params(a.weight.clone(), None);
        let m = Two {
            a,
            b,
            c: Linear::new(32, 2, &dev).unwrap(),
        };
        let report = quantize(&m, "a", GgmlDType::Q8_0).unwrap();
        assert_eq!(report.quantized, ["a"]);
        assert_eq!(report.aliases, ["b.weight"]);
        assert!(m.b.weight.is_quantized() && !m.c.weight.is_quantized());
        let report = quantize(&m, "*", GgmlDType::Q8_0).unwrap();
        assert_eq!(report.quantized, ["a", "b", "c"]);
        assert!(m.c.weight.is_quantized());
    }
}
