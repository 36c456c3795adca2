//! Peak memory of loading all-MiniLM-L6-v2, against the checkpoint's size: our strict load into a
//! built model (`derived`), our model built only to load (`empty`: `build_empty` + a strict load),
//! candle-transformers' `BertModel::load` on a memory-mapped `VarBuilder` (`candle_transformers`),
//! and candle-nn's `VarBuilder::from_mmaped_safetensors` reading every tensor (`varbuilder`). Each
//! runs in its own process, since the peak (`VmHWM`) is per process:
//!
//! ```text
//! for m in derived empty candle_transformers varbuilder; do
//!     cargo bench -p minilm --features peers --bench load_memory -- $m
//! done
//! ```
//!
//! Resident memory counts the pages of the memory-mapped file that were read, as the kernel does.

use candle_nn::VarBuilder;

#[path = "support/mod.rs"]
mod support;
use candle_module::process_memory_mib;
use minilm::bert::{BertConfig, BertModel};
use minilm::minilm_dir;
use module_runtime::prelude::*;

fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    let which = std::env::args()
        .skip(1)
        .find(|a| !a.starts_with("--"))
        .unwrap_or_else(|| "derived".to_owned());
    let Some(dir) = minilm_dir() else {
        eprintln!("*** SKIPPED: no all-MiniLM-L6-v2 checkpoint (set MINILM_DIR) ***");
        return Ok(());
    };
    let path = dir.join("model.safetensors");
    let file_mib = std::fs::metadata(&path)?.len() as f64 / (1024.0 * 1024.0);
    let device = Device::Cpu;
    let (rss_before, _) = process_memory_mib();
    // Each arm measures while it still holds what it loaded.
    let (held, rss_model, (rss_after, peak)) = match which.as_str() {
        "derived" => {
            let model = BertModel::new(&BertConfig::minilm_l6(), &device)?;
            let (rss_model, _) = process_memory_mib();
            model.load_state_dict(&path, &LoadOptions::default())?;
            (model.num_parameters(), rss_model, process_memory_mib())
        }
        "empty" => {
            let model =
                module_runtime::build_empty(|| BertModel::new(&BertConfig::minilm_l6(), &device))?;
            let (rss_model, _) = process_memory_mib();
            model.load_state_dict(&path, &LoadOptions::default())?;
            (model.num_parameters(), rss_model, process_memory_mib())
        }
        "candle_transformers" => {
            let _model = support::peer(&dir, &device)?;
            (0, rss_before, process_memory_mib())
        }
        "varbuilder" => {
            // SAFETY: the checkpoint is not modified while mapped.
            let vb = unsafe { VarBuilder::from_mmaped_safetensors(&[&path], DType::F32, &device)? };
            let st = unsafe { candle_core::safetensors::MmapedSafetensors::new(&path)? };
            let mut tensors = Vec::new();
            for (name, view) in st.tensors() {
                if DType::try_from(view.dtype()).is_ok_and(|d| d == DType::F32) {
                    tensors.push(vb.get(view.shape(), &name)?);
                }
            }
            let held = tensors.iter().map(|t| t.elem_count()).sum();
            (held, rss_before, process_memory_mib())
        }
        other => {
            return Err(format!(
                "unknown mode `{other}`: derived, empty, candle_transformers or varbuilder"
            )
            .into())
        }
    };
    println!(
        "{which}: checkpoint {file_mib:.1} MiB; RSS before {rss_before:.1} MiB, with the model built \
         {rss_model:.1} MiB, after the load {rss_after:.1} MiB, peak {peak:.1} MiB; \
         peak above the start = {:.2} x the checkpoint{}",
        (peak - rss_before) / file_mib,
        if held > 0 { format!(" ({held} values held)") } else { String::new() }
    );
    Ok(())
}
