//! The examples' JSON lines of token ids: `generate`'s prompts in and one JSON line of generated
//! ids per prompt out, `finetune_lora`'s training sequences in. Here so tests run the examples'
//! own code paths.

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
        let Some(prompt) = token_ids(n, line)? else {
            continue;
        };
        let generated = generate(model, &[prompt], config)?;
        let text = serde_json::to_string(&generated[0])
            .map_err(|e| invalid(format!("writing JSON: {e}")))?;
        writeln!(output, "{text}")
            .and_then(|()| output.flush())
            .map_err(|e| invalid(format!("writing the output: {e}")))?;
    }
    Ok(())
}

/// Reads every non-empty line of `input` as a JSON array of token ids (`[1, 306, 4966]`): the
/// `finetune_lora` example's training sequences, in the file's order. A line that is not such an
/// array is an error naming its number.
///
/// ```
/// use llama::json_lines::read_token_ids;
/// let lines = read_token_ids("[1, 2, 3]\n\n[4, 5]\n".as_bytes())?;
/// assert_eq!(lines, [vec![1, 2, 3], vec![4, 5]]);
/// assert!(read_token_ids("[1, 2]\n[3, -1]\n".as_bytes()).unwrap_err().to_string().contains("line 2"));
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub fn read_token_ids(input: impl BufRead) -> Result<Vec<Vec<u32>>> {
    let mut lines = Vec::new();
    for (n, line) in input.lines().enumerate() {
        lines.extend(token_ids(n, line)?);
    }
    Ok(lines)
}

/// Line `n` (from 0) as token ids, `None` when blank.
fn token_ids(n: usize, line: std::io::Result<String>) -> Result<Option<Vec<u32>>> {
    let line = line.map_err(|e| invalid(format!("reading line {}: {e}", n + 1)))?;
    if line.trim().is_empty() {
        return Ok(None);
    }
    let ids = serde_json::from_str(&line).map_err(|e| {
        invalid(format!(
            "line {}: expected a JSON array of token ids: {e}",
            n + 1
        ))
    })?;
    Ok(Some(ids))
}
