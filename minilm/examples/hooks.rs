//! Forward hooks on a real model: all-MiniLM-L6-v2 loaded into the derived BERT.
//!
//! 1. `summary_with` runs one batch and prints every module with its input and output shapes.
//! 2. `capture` of `BertModel::path().encoder().layer().each()` (the typed form of
//!    `encoder.layer.*`) returns each layer's output by path; per-layer activation statistics
//!    follow.
//! 3. Activation patching: a typed forward hook on
//!    `BertModel::path().encoder().layer().at(L).attention().self_attention()`
//!    (`encoder.layer.L.attention.self`) zeroes one head's slice of the attention context; for each
//!    head, how far the sentence embeddings move (cosine similarity to the unpatched ones), and how
//!    the similarity of two related sentences changes.
//!
//! The paths are typed (`#[module(paths)]` on the BERT structs): a misspelled segment is a compile
//! error, and the hook gets the `BertSelfAttention` itself, its input and its output as their own
//! types, with no downcast.
//!
//! ```text
//! cargo run --release -p minilm --example hooks -- [--model DIR] [--layer L]
//! ```

use std::path::PathBuf;

use clap::Parser;
use minilm::bert::{BertConfig, BertModel, BertSelfAttention};
use minilm::minilm_dir;
use minilm::sentences::{encode_batch, load_tokenizer, mean_pool_normalized};
use module_runtime::prelude::*;
use module_runtime::Hooks;

type AnyResult<T> = std::result::Result<T, Box<dyn std::error::Error>>;

const SENTENCES: [&str; 4] = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The new movie is awesome.",
    "A cheetah is running behind its prey.",
];

/// Inspect and patch all-MiniLM-L6-v2 with forward hooks.
#[derive(Parser)]
struct Args {
    /// The checkpoint folder [default: $MINILM_DIR, else ../shared/models/all-MiniLM-L6-v2]
    #[arg(long, value_name = "DIR")]
    model: Option<PathBuf>,
    /// The encoder layer whose heads are zeroed one by one
    #[arg(long, value_name = "L", default_value_t = 0)]
    layer: usize,
}

/// Cosine similarity of two L2-normalized embeddings (rows of `[n, dim]`).
fn cosine(a: &Tensor, b: &Tensor) -> Result<Vec<f32>> {
    Ok((a * b)?.sum(1)?.to_vec1::<f32>()?)
}

fn main() -> AnyResult<()> {
    let Args { model, layer } = Args::parse();
    let dir = model
        .or_else(minilm_dir)
        .ok_or("no checkpoint found: pass --model DIR")?;
    let device = Device::Cpu;
    let config = BertConfig::from_json_file(&dir.join("config.json"))?;
    if layer >= config.num_hidden_layers {
        return Err(format!(
            "--layer {layer}: the model has {} layers",
            config.num_hidden_layers
        )
        .into());
    }
    let model = module_runtime::build_empty(|| BertModel::new(&config, &device))?;
    model.load_state_dict(dir.join("model.safetensors"), &LoadOptions::default())?;
    model.eval();
    let _no_grad = module_runtime::no_grad();
    let tokenizer = load_tokenizer(&dir)?;
    let (ids, mask) = encode_batch(&tokenizer, &SENTENCES, &device)?;
    let embed =
        |m: &BertModel| -> Result<Tensor> { mean_pool_normalized(&m.call((&ids, &mask))?, &mask) };

    // 1. Shapes from a dry run.
    println!("{}", model.summary_with(|m| m.call((&ids, &mask)))?);

    // 2. Every layer's output, by path (a typed pattern is a `str`: `encoder.layer.*`).
    let every_layer = BertModel::path().encoder().layer().each();
    let (hidden, layers) = model.capture(&[&every_layer], |m| m.call((&ids, &mask)))?;
    println!("per-layer activations over {} sentences:", SENTENCES.len());
    println!(
        "{:<18} {:>9} {:>9} {:>9}",
        "layer", "mean", "std", "max |x|"
    );
    for (path, outputs) in layers.iter() {
        let x = outputs[0].flatten_all()?;
        let mean = x.mean_all()?.to_scalar::<f32>()?;
        let std = x
            .broadcast_sub(&x.mean_all()?)?
            .sqr()?
            .mean_all()?
            .sqrt()?
            .to_scalar::<f32>()?;
        let max = x.abs()?.max(0)?.to_scalar::<f32>()?;
        println!("{path:<18} {mean:>9.4} {std:>9.4} {max:>9.3}");
    }
    let baseline = mean_pool_normalized(&hidden, &mask)?;
    let related =
        |e: &Tensor| -> Result<f32> { Ok(cosine(&e.narrow(0, 0, 1)?, &e.narrow(0, 1, 1)?)?[0]) };
    println!(
        "\nsimilarity of \"{}\" and \"{}\": {:.4}\n",
        SENTENCES[0],
        SENTENCES[1],
        related(&baseline)?
    );

    // 3. Zero one attention head at a time with a forward hook on the attention's `self` module,
    //    whose output holds the heads side by side.
    let target = BertModel::path()
        .encoder()
        .layer()
        .at(layer)
        .attention()
        .self_attention();
    // The path is checked at run time only for the index: `get` gives an `Option`.
    let heads = model.get(target.clone()).ok_or("no such layer")?.num_heads;
    assert_eq!(heads, config.num_attention_heads);
    let head_dim = config.hidden_size / heads;
    println!("zeroing one head of `{target}` at a time:");
    println!(
        "{:<6} {:>22} {:>22}",
        "head", "mean cos to unpatched", "related similarity"
    );
    let hooks = Hooks::new();
    for head in 0..heads {
        let keep: Vec<f32> = (0..config.hidden_size)
            .map(|i| if i / head_dim == head { 0.0 } else { 1.0 })
            .collect();
        let keep = Tensor::from_vec(keep, config.hidden_size, &device)?;
        // A typed hook: the module is a `BertSelfAttention`, its input the `(hidden, mask)` it
        // was called with (owned: `(&Tensor, &Tensor)` reads as `(Tensor, Tensor)`), its output
        // the context tensor, which the hook replaces.
        let handle = hooks.register_typed_hook(
            &target,
            move |_ctx,
                  attention: &BertSelfAttention,
                  (hidden, _mask): &(Tensor, Tensor),
                  context: &Tensor| {
                debug_assert_eq!(attention.num_heads, heads);
                debug_assert_eq!(hidden.dims(), context.dims());
                Ok(Some(context.broadcast_mul(&keep)?))
            },
            HookOptions::default(),
        )?;
        let patched = hooks.run(&model, embed)?;
        handle.remove();
        let moved = cosine(&baseline, &patched)?;
        let mean = moved.iter().sum::<f32>() / moved.len() as f32;
        println!("{head:<6} {mean:>22.5} {:>22.4}", related(&patched)?);
    }
    // With every handle removed, the model computes exactly what it did before.
    let again = hooks.run(&model, embed)?;
    let diff = (again - &baseline)?.abs()?.max_all()?.to_scalar::<f32>()?;
    println!("\nafter removing the hooks, the embeddings differ from the baseline by {diff}");
    Ok(())
}
