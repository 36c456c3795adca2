//! LoRA fine-tuning of a [`LlamaForCausalLM`] (QLoRA over a `quantize`d base): PEFT's
//! `get_peft_model` on every projection of attention and MLP, then next-token cross-entropy with
//! AdamW on the adapter alone, as a `transformers.Trainer` run over a PEFT model does. What the
//! `finetune_lora` example runs; the adapter is then saved with
//! [`PeftExt::save_pretrained`](module_runtime::nn::peft::PeftExt::save_pretrained).
//!
//! The choices, where PEFT and transformers leave them to the user:
//!
//! - **Targets**: `q_proj`, `k_proj`, `v_proj`, `o_proj`, `gate_proj`, `up_proj`, `down_proj`
//!   ([`PROJECTIONS`]), PEFT's names; the head and the embedding stay frozen.
//! - **Scale**: `lora_alpha = 2 r` (PEFT's own default is a fixed `lora_alpha = 8`, which makes
//!   the update's scale `8 / r` shrink as the rank grows; `2 r` keeps it at 2 for every rank, the
//!   common choice in PEFT's and QLoRA's examples).
//! - **Optimizer**: AdamW, lr 1e-3, weight decay 0.01, betas (0.9, 0.999), eps 1e-8 (PEFT's
//!   quick tour's `TrainingArguments`; torch's AdamW defaults for the rest), no schedule, no
//!   gradient clipping.
//! - **Batches**: [`FinetuneConfig::batch_size`] sequences (4) per step, taken in the file's
//!   order and wrapping around at its end (a smaller file gives every step all of it): no
//!   shuffling, so a run is repeatable; shuffle the file for another order.
//! - **Padding**: each batch is right-padded to its longest sequence; the padded positions get
//!   the label -100 (transformers' `ignore_index`), so they add nothing to the loss, and no
//!   attention mask is needed: with causal attention a token never sees the padding after it.
//!   Each sequence computes exactly what it would alone.
//! - **Loss**: transformers' `ForCausalLMLoss`: the logits of position `t` against token `t + 1`,
//!   averaged over every real (not padded) target of the batch, computed by
//!   [`linear_cross_entropy`] (the head by blocks of the vocabulary: the logits are never whole).
//! - **Seed**: [`manual_seed`]`(seed)` before the adapter is made:
//!   `lora_A`'s initialization (PEFT's Kaiming-uniform; `lora_B` starts at zero) is the only
//!   random draw, so two runs with the same seed print the same losses.

use module_runtime::nn::loss::linear_cross_entropy;
use module_runtime::nn::peft::{get_peft_model, LoraConfig, TargetModules};
use module_runtime::optim::{AdamW, Error as TrainError, Optimizer};
use module_runtime::prelude::*;

use crate::LlamaForCausalLM;

/// The modules that get an adapter: every projection of attention and MLP, by PEFT's names.
pub const PROJECTIONS: [&str; 7] = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
];

/// PEFT's `LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=[every projection],
/// task_type="CAUSAL_LM")`: LoRA of rank `rank` on the [`PROJECTIONS`], PEFT's initialization.
pub fn lora_config(rank: usize) -> LoraConfig {
    LoraConfig {
        r: rank,
        lora_alpha: 2.0 * rank as f64,
        task_type: Some("CAUSAL_LM".to_owned()),
        ..LoraConfig::new(TargetModules::names(PROJECTIONS))
    }
}

/// How [`train_lora`] trains: the adapter and the optimizer's hyper-parameters (see the
/// [module](self) for the defaults' reasons).
#[derive(Clone, Debug)]
pub struct FinetuneConfig {
    /// The adapter added before training ([`lora_config`] by default).
    pub lora: LoraConfig,
    /// Optimizer steps (one batch each).
    pub steps: usize,
    /// Sequences per batch (default 4).
    pub batch_size: usize,
    /// AdamW's learning rate (default 1e-3).
    pub lr: f64,
    /// AdamW's decoupled weight decay (default 0.01).
    pub weight_decay: f64,
    /// The seed of [`manual_seed`], set before the adapter is made
    /// (default 0).
    pub seed: u64,
}

impl FinetuneConfig {
    /// LoRA of rank `rank` ([`lora_config`]) trained for `steps` steps, with the defaults.
    pub fn new(rank: usize, steps: usize) -> Self {
        Self {
            lora: lora_config(rank),
            steps,
            batch_size: 4,
            lr: 1e-3,
            weight_decay: 0.01,
            seed: 0,
        }
    }
}

/// Adds the LoRA adapter `config.lora` to `model` (frozen base: float, or `quantize`d for QLoRA,
/// the adapter in float over it) and trains it for `config.steps` AdamW steps of next-token
/// cross-entropy over `sequences` (token ids, at least 2 per sequence). Calls `on_step(step,
/// loss)` after each step (from 1) and returns the losses; the model is left in evaluation mode
/// with the trained adapter active, ready for
/// [`save_pretrained`](module_runtime::nn::peft::PeftExt::save_pretrained).
///
/// Each loss is that of the batch before its step (what `Trainer` logs). The data are checked
/// before the model is touched: no sequence, a sequence of fewer than 2 tokens, an id outside
/// the vocabulary or a zero batch size is an [`Error::InvalidInput`] naming the sequence (its
/// number among the sequences, from 1), and an adapter [`get_peft_model`] refuses (one already
/// there) is its [`PeftError`](module_runtime::PeftError), before any step; both come as the
/// optimizer's [`TrainError::Runtime`], whose errors (the training's) are the others.
///
/// ```
/// use llama::finetune::{train_lora, FinetuneConfig};
/// use llama::LlamaForCausalLM;
/// use module_runtime::nn::peft::PeftExt;
/// use module_runtime::prelude::*;
/// let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-llama");
/// let mut model = LlamaForCausalLM::from_pretrained(&dir, &Device::Cpu)?;
/// let data = vec![vec![242, 175, 307, 294, 301], vec![1, 2, 3]];
/// let config = FinetuneConfig { lr: 1e-2, ..FinetuneConfig::new(4, 3) };
/// let losses = train_lora(&mut model, &data, &config, |step, loss| println!("step {step} loss {loss:.4}"))?;
/// assert!(losses[2] < losses[0]);
/// // Only the adapters train: rank 4 on the 7 projections of 2 layers, `r * (in + out)` each.
/// let per_layer = 2 * (64 + 64) + 2 * (64 + 16) + 3 * (64 + 176);
/// assert_eq!(model.get_nb_trainable_parameters().0, 2 * 4 * per_layer);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn train_lora(
    model: &mut LlamaForCausalLM,
    sequences: &[Vec<u32>],
    config: &FinetuneConfig,
    mut on_step: impl FnMut(usize, f32),
) -> std::result::Result<Vec<f32>, TrainError> {
    check_data(sequences, config.batch_size, model.config.vocab_size)?;
    module_runtime::manual_seed(config.seed);
    get_peft_model(model, &config.lora)?;
    let options = AdamW::options()
        .lr(config.lr)
        .weight_decay(config.weight_decay);
    let mut opt = AdamW::new(&*model, options)?;
    let device = model.model.embed_tokens.weight.device();
    let batch = config.batch_size.min(sequences.len());
    let mut losses = Vec::with_capacity(config.steps);
    model.train();
    let result = (0..config.steps).try_for_each(|step| {
        let rows = (0..batch).map(|j| &sequences[(step * batch + j) % sequences.len()]);
        let (ids, labels) = padded_batch(rows.collect(), &device)?;
        // Every position against the next token; the last position's label is -100 (it
        // predicts nothing), as transformers pads the labels rather than copying the logits.
        // The head and the loss by blocks of the vocabulary: the logits are never whole.
        let hidden = model.hidden_states(&ids)?;
        let loss = linear_cross_entropy(&hidden, &model.lm_head, &labels, -100)?;
        let value = loss.to_dtype(DType::F32)?.to_scalar::<f32>()?;
        let grads = loss.backward()?;
        // The graph (every activation) hangs from the loss: freed before the optimizer's step
        // allocates its state, as PyTorch frees it during the backward.
        drop((loss, hidden));
        opt.step(&grads)?;
        losses.push(value);
        on_step(step + 1, value);
        Ok::<(), TrainError>(())
    });
    model.eval();
    result.map(|()| losses)
}

/// The data errors [`train_lora`] reports before it touches the model.
fn check_data(sequences: &[Vec<u32>], batch_size: usize, vocab: usize) -> Result<()> {
    let bad = |message: String| Error::InvalidInput {
        layer: "train_lora",
        message,
    };
    if sequences.is_empty() {
        return Err(bad("no training sequences".to_owned()));
    }
    if batch_size == 0 {
        return Err(bad("the batch size must be at least 1".to_owned()));
    }
    for (i, seq) in sequences.iter().enumerate() {
        if seq.len() < 2 {
            return Err(bad(format!(
                "sequence {} has {} token(s): at least 2 are needed for a next-token target",
                i + 1,
                seq.len()
            )));
        }
        if let Some(id) = seq.iter().find(|id| **id as usize >= vocab) {
            return Err(bad(format!(
                "sequence {} holds the token id {id}, outside the vocabulary of {vocab}",
                i + 1
            )));
        }
    }
    Ok(())
}

/// `rows` right-padded (with id 0) into ids `[batch, longest]`, and the flattened next-token
/// labels `[batch * longest]` (`i64`): row `r`'s position `t` is labelled with its token
/// `t + 1`, or -100 past its end (its last position included).
fn padded_batch(rows: Vec<&Vec<u32>>, device: &Device) -> Result<(Tensor, Tensor)> {
    let width = rows.iter().map(|r| r.len()).max().unwrap_or(0);
    let mut ids = Vec::with_capacity(rows.len() * width);
    let mut labels = Vec::with_capacity(rows.len() * width);
    for row in &rows {
        ids.extend(row.iter().copied().chain(std::iter::repeat(0)).take(width));
        labels.extend(
            row[1..]
                .iter()
                .map(|id| *id as i64)
                .chain(std::iter::repeat(-100))
                .take(width),
        );
    }
    Ok((
        Tensor::from_vec(ids, (rows.len(), width), device)?,
        Tensor::from_vec(labels, rows.len() * width, device)?,
    ))
}
