//! The `generate` example's input and output: prompts as JSON lines of token ids in, one JSON
//! line of generated ids per prompt out. Here so tests run the example's own code path.

use std::io::{BufRead, Write};

use module_runtime::Result;

use crate::config::invalid;
use crate::{generate, GenerationConfig, LlamaForCausalLM};

/// Reads one prompt per non-empty line of `input` (a JSON array of token ids), generates for each
/// (one prompt at a time, as a batch of one) and writes the new ids to `output` as a JSON array
/// per line, in order.
///
/// ```
/// use llama::{json_lines::generate_json_lines, GenerationConfig, LlamaForCausalLM};
/// use module_runtime::prelude::*;
/// let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-llama");
/// let model = LlamaForCausalLM::from_pretrained(&dir, &Device::Cpu)?;
/// let config = GenerationConfig { max_new_tokens: 2, ..Default::default() };
/// let mut out = Vec::new();
/// generate_json_lines(&model, &config, "[242, 175, 307, 294, 301, 380, 230]\n".as_bytes(), &mut out)?;
/// assert_eq!(String::from_utf8(out).unwrap(), "[295,187]\n");
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub fn generate_json_lines(
    model: &LlamaForCausalLM,
    config: &GenerationConfig,
    input: impl BufRead,
    mut output: impl Write,
) -> Result<()> {
    for (n, line) in input.lines().enumerate() {
        let line = line.map_err(|e| invalid(format!("reading line {}: {e}", n + 1)))?;
        if line.trim().is_empty() {
            continue;
        }
        let prompt: Vec<u32> = serde_json::from_str(&line).map_err(|e| {
            invalid(format!(
                "line {}: expected a JSON array of token ids: {e}",
                n + 1
            ))
        })?;
        let generated = generate(model, &[prompt], config)?;
        let text = serde_json::to_string(&generated[0])
            .map_err(|e| invalid(format!("writing JSON: {e}")))?;
        writeln!(output, "{text}")
            .and_then(|()| output.flush())
            .map_err(|e| invalid(format!("writing the output: {e}")))?;
    }
    Ok(())
}
