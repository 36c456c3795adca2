//! The dataflow graph of all-MiniLM-L6-v2 from one traced call of the derived BERT: every module
//! call with its shapes and parameters, tensors as edges (the residual connections of each layer
//! show as edges that skip the attention and feed-forward blocks), tensor-level work (the
//! attention's matmuls and softmax, the embeddings' sum) as ops nodes.
//!
//! ```text
//! cargo run --release -p minilm --example dataflow -- [--model DIR] [--depth N] [--out FILE.svg]
//! ```
//!
//! Writes `FILE.dot` (the full graph, or the view `--depth` deep: `--depth 2` shows each encoder
//! layer as one box, `--depth 3` its attention, intermediate and output blocks) and renders
//! `FILE.svg` (or `.png`) when Graphviz's `dot` is installed; without it, says how to get it.
//!
//! candle records no operation on integer tensors, so the attention mask's conversion to a float
//! bias shows as an ops node without incoming edges (the `Dataflow` docs list such limits).

use std::path::PathBuf;

use clap::Parser;
use minilm::bert::{BertConfig, BertModel};
use minilm::minilm_dir;
use minilm::sentences::{encode_batch, load_tokenizer};
use module_runtime::prelude::*;

type AnyResult<T> = std::result::Result<T, Box<dyn std::error::Error>>;

/// Draw all-MiniLM-L6-v2's dataflow graph.
#[derive(Parser)]
struct Args {
    /// The checkpoint folder [default: $MINILM_DIR, else ../shared/models/all-MiniLM-L6-v2]
    #[arg(long, value_name = "DIR")]
    model: Option<PathBuf>,
    /// Collapse calls this deep into single boxes (0: the model as one box) [default: the full graph]
    #[arg(long, value_name = "N")]
    depth: Option<usize>,
    /// The picture to write; its extension is the format (`svg`, `png`, `pdf`)
    #[arg(long, value_name = "FILE", default_value = "minilm_dataflow.svg")]
    out: PathBuf,
}

fn main() -> AnyResult<()> {
    let Args { model, depth, out } = Args::parse();
    let dir = model
        .or_else(minilm_dir)
        .ok_or("no checkpoint found: pass --model DIR")?;
    let device = Device::Cpu;
    let config = BertConfig::from_json_file(&dir.join("config.json"))?;
    let model = module_runtime::build_empty(|| BertModel::new(&config, &device))?;
    model.load_state_dict(dir.join("model.safetensors"), &LoadOptions::default())?;
    model.eval();
    let _no_grad = module_runtime::no_grad();
    let tokenizer = load_tokenizer(&dir)?;
    let (ids, mask) = encode_batch(
        &tokenizer,
        &[
            "A man is eating food.",
            "A cheetah is running behind its prey.",
        ],
        &device,
    )?;

    let full = model.dataflow(|m| m.call((&ids, &mask)))?;
    let graph = match depth {
        Some(d) => full.collapse(d),
        None => full.clone(),
    };
    let calls = full.nodes_of(module_runtime::NodeKind::Call).count();
    println!(
        "{calls} module calls, {} edges in the full graph; this view: {} nodes, {} edges",
        full.edges().len(),
        graph.nodes().len(),
        graph.edges().len()
    );
    // The residuals of layer 0, as edges: the attention's output skips the feed-forward block.
    let layer0 = full.collapse(3);
    if let (Some(attention), Some(output)) = (
        layer0.node("encoder.layer.0.attention"),
        layer0.node("encoder.layer.0.output"),
    ) {
        let skips = layer0.edges_from(attention.id).any(|e| e.to == output.id);
        println!(
            "encoder.layer.0.attention -> encoder.layer.0.output (skipping intermediate): {skips}"
        );
    }

    let dot_path = out.with_extension("dot");
    std::fs::write(&dot_path, graph.to_dot())?;
    println!("wrote {}", dot_path.display());
    match graph.render(&out) {
        Ok(()) => println!("wrote {}", out.display()),
        Err(e @ Error::GraphvizNotFound { .. }) => eprintln!("{e}"),
        Err(e) => return Err(e.into()),
    }
    Ok(())
}
