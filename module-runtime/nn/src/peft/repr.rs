//! PEFT's `print(model)` text of an adapted layer: `(base_layer)` first, then the adapters'
//! dictionaries in PEFT's order.

use std::collections::BTreeMap;

use crate::peft::layer::LoraLayer;
use crate::{Module, Param};

impl LoraLayer {
    /// PEFT's `print(model)` body of the wrapped layer: `(base_layer): <base>`, then the
    /// adapters' dictionaries in PEFT's order.
    pub(crate) fn wrapped_repr(&self, base: &str) -> String {
        let dropouts: Vec<String> = self
            .lora_dropout
            .iter()
            .map(|(name, d)| match d.p {
                0.0 => format!("({name}): Identity()"),
                _ => format!("({name}): {}", module_core::module_repr(d)),
            })
            .collect();
        let dict = |label: &str, lines: Vec<String>| {
            if lines.is_empty() {
                return format!("({label}): ModuleDict()");
            }
            format!(
                "({label}): ModuleDict(\n  {}\n)",
                lines.join("\n").replace('\n', "\n  ")
            )
        };
        let entries = |d: &dyn Module| {
            let mut lines = Vec::new();
            d.visit_children(&mut |name, child| {
                if let module_core::Child::Module { module, .. } = child {
                    lines.push(format!("({name}): {}", module_core::module_repr(module)));
                }
            });
            lines
        };
        [
            format!("(base_layer): {base}"),
            dict("lora_dropout", dropouts),
            dict("lora_A", entries(&self.lora_a)),
            dict("lora_B", entries(&self.lora_b)),
            parameter_dict("lora_embedding_A", &self.lora_embedding_a),
            parameter_dict("lora_embedding_B", &self.lora_embedding_b),
            dict(
                "lora_magnitude_vector",
                entries(&self.lora_magnitude_vector),
            ),
        ]
        .join("\n")
    }
}

/// PyTorch's `ParameterDict` repr: `(label): ParameterDict(  (default): Parameter containing:
/// [torch.FloatTensor of size 4x12])`, its `extra_repr` lines inside the parentheses.
fn parameter_dict(label: &str, params: &BTreeMap<String, Param>) -> String {
    let lines: Vec<String> = params
        .iter()
        .map(|(name, p)| {
            let kind = match p.dtype() {
                candle_core::DType::F16 => "HalfTensor",
                candle_core::DType::BF16 => "BFloat16Tensor",
                candle_core::DType::F64 => "DoubleTensor",
                _ => "FloatTensor",
            };
            let device = if p.device().is_cpu() { "" } else { "cuda." };
            let size: Vec<String> = p.shape().dims().iter().map(usize::to_string).collect();
            format!(
                "  ({name}): Parameter containing: [torch.{device}{kind} of size {}]",
                size.join("x")
            )
        })
        .collect();
    match lines.len() {
        0 => format!("({label}): ParameterDict()"),
        1 => format!("({label}): ParameterDict({})", lines[0]),
        _ => format!("({label}): ParameterDict(\n  {}\n)", lines.join("\n  ")),
    }
}
