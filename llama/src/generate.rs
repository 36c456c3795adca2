//! Generation: transformers' logits processors (repetition penalty, temperature, top-k, top-p),
//! greedy choice or seeded sampling, stop tokens and a length limit, over a left-padded batch
//! that is prefilled in one pass and decoded one token per step with the [`KvCache`].

use module_runtime::prelude::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::cache::KvCache;
use crate::config::invalid;
use crate::LlamaForCausalLM;

/// How to generate: transformers' `GenerationConfig` fields of the same names.
///
/// Sampling (`do_sample=True`) is on when `temperature` is above 0 or `top_k` or `top_p` is set;
/// otherwise each token is the highest-scoring one (greedy; ties go to the lowest id, as
/// `argmax`). Sampling draws from a ChaCha8 generator seeded with `seed`: the same seed gives the
/// same tokens on every platform.
#[derive(Clone, Debug, PartialEq)]
pub struct GenerationConfig {
    /// The most tokens to generate per prompt.
    pub max_new_tokens: usize,
    /// Divides the logits before sampling; `None` or 0 with no `top_k`/`top_p`: greedy.
    pub temperature: Option<f64>,
    /// Keep only the `k` highest-scoring tokens (ties with the `k`-th kept).
    pub top_k: Option<usize>,
    /// Keep the smallest set of highest-probability tokens whose probabilities sum over `p`.
    pub top_p: Option<f64>,
    /// transformers' `repetition_penalty`: the logit of every token already in the sequence
    /// (prompt included) is divided by it when positive, multiplied when negative. 1: none.
    pub repetition_penalty: f64,
    /// A row stops after generating one of these (it is part of the output).
    pub stop_tokens: Vec<u32>,
    /// The sampling generator's seed.
    pub seed: u64,
}

impl Default for GenerationConfig {
    fn default() -> Self {
        Self {
            max_new_tokens: 20,
            temperature: None,
            top_k: None,
            top_p: None,
            repetition_penalty: 1.0,
            stop_tokens: Vec::new(),
            seed: 0,
        }
    }
}

impl GenerationConfig {
    /// Whether tokens are sampled rather than chosen greedily.
    pub fn do_sample(&self) -> bool {
        self.temperature.is_some_and(|t| t > 0.0) || self.top_k.is_some() || self.top_p.is_some()
    }

    fn check(&self) -> Result<()> {
        let bad = |what: String| Err(invalid(format!("generation config: {what}")));
        if self
            .temperature
            .is_some_and(|t| !(t >= 0.0 && t.is_finite()))
        {
            return bad(format!("temperature {:?} is not >= 0", self.temperature));
        }
        if self.top_k == Some(0) {
            return bad("top_k is 0".to_owned());
        }
        if self.top_p.is_some_and(|p| !(p > 0.0 && p <= 1.0)) {
            return bad(format!("top_p {:?} is not in (0, 1]", self.top_p));
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return bad(format!(
                "repetition_penalty {} is not > 0",
                self.repetition_penalty
            ));
        }
        Ok(())
    }
}

/// transformers' `RepetitionPenaltyLogitsProcessor`: each token in `seen` has its score divided
/// by `penalty` if positive, multiplied if negative (once per token, however often it occurs).
pub fn apply_repetition_penalty(scores: &mut [f32], seen: &[u32], penalty: f64) {
    if penalty == 1.0 {
        return;
    }
    let penalty = penalty as f32;
    let mut done = vec![false; scores.len()];
    for &t in seen {
        let t = t as usize;
        if t < scores.len() && !done[t] {
            done[t] = true;
            let s = scores[t];
            scores[t] = if s < 0.0 { s * penalty } else { s / penalty };
        }
    }
}

/// transformers' `TopKLogitsWarper`: scores below the `k`-th highest become -inf.
pub fn apply_top_k(scores: &mut [f32], k: usize) {
    if k >= scores.len() {
        return;
    }
    let mut sorted = scores.to_vec();
    sorted.sort_unstable_by(|a, b| b.total_cmp(a));
    let threshold = sorted[k.max(1) - 1];
    for s in scores.iter_mut() {
        if *s < threshold {
            *s = f32::NEG_INFINITY;
        }
    }
}

/// transformers' `TopPLogitsWarper`: sorted ascending, tokens whose cumulative probability is at
/// most `1 - p` become -inf (the highest-scoring token always stays).
pub fn apply_top_p(scores: &mut [f32], p: f64) {
    let probs = softmax(scores);
    let mut order: Vec<usize> = (0..scores.len()).collect();
    order.sort_by(|a, b| scores[*a].total_cmp(&scores[*b]));
    let mut cumulative = 0f32;
    let last = order.len().saturating_sub(1);
    for (rank, &i) in order.iter().enumerate() {
        cumulative += probs[i];
        if cumulative <= (1.0 - p) as f32 && rank < last {
            scores[i] = f32::NEG_INFINITY;
        }
    }
}

/// `softmax(scores)` in float32.
fn softmax(scores: &[f32]) -> Vec<f32> {
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let exp: Vec<f32> = scores.iter().map(|s| (s - max).exp()).collect();
    let sum: f32 = exp.iter().sum();
    exp.into_iter().map(|e| e / sum).collect()
}

/// The first index of the highest score (`argmax`).
fn argmax(scores: &[f32]) -> u32 {
    let mut best = 0;
    for (i, s) in scores.iter().enumerate() {
        if *s > scores[best] {
            best = i;
        }
    }
    best as u32
}

/// Picks the next token from one row's logits and the tokens so far: the processors, then greedy
/// or a draw from `rng`.
pub fn next_token(
    logits: &mut [f32],
    seen: &[u32],
    config: &GenerationConfig,
    rng: &mut ChaCha8Rng,
) -> u32 {
    apply_repetition_penalty(logits, seen, config.repetition_penalty);
    if !config.do_sample() {
        return argmax(logits);
    }
    if let Some(t) = config.temperature.filter(|t| *t > 0.0) {
        logits.iter_mut().for_each(|s| *s /= t as f32);
    }
    if let Some(k) = config.top_k {
        apply_top_k(logits, k);
    }
    if let Some(p) = config.top_p {
        apply_top_p(logits, p);
    }
    let probs = softmax(logits);
    let mut u = rng.random::<f32>();
    for (i, p) in probs.iter().enumerate() {
        if u < *p {
            return i as u32;
        }
        u -= p;
    }
    argmax(logits)
}

/// Generates up to `config.max_new_tokens` tokens after each prompt; returns each row's new tokens
/// (the stop token included when one ended the row).
///
/// The prompts are left-padded into one batch and prefilled in one pass
/// ([`LlamaForCausalLM::prefill`] on a cache with the padding), then decoded one token per step
/// ([`Recurrent::step`]).
///
/// ```
/// use llama::{generate, GenerationConfig, LlamaForCausalLM};
/// use module_runtime::prelude::*;
/// let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-llama");
/// let model = LlamaForCausalLM::from_pretrained(&dir, &Device::Cpu)?;
/// let config = GenerationConfig { max_new_tokens: 3, ..Default::default() }; // greedy
/// let out = generate(&model, &[vec![242, 175, 307, 294, 301, 380, 230]], &config)?;
/// assert_eq!(out, [vec![295, 187, 162]]); // transformers' generate(do_sample=False)
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub fn generate(
    model: &LlamaForCausalLM,
    prompts: &[Vec<u32>],
    config: &GenerationConfig,
) -> Result<Vec<Vec<u32>>> {
    config.check()?;
    if prompts.is_empty() {
        return Ok(Vec::new());
    }
    if let Some(i) = prompts.iter().position(Vec::is_empty) {
        return Err(invalid(format!("prompt {i} is empty")));
    }
    let vocab = model.config.vocab_size;
    if let Some(t) = prompts.iter().flatten().find(|t| **t as usize >= vocab) {
        return Err(invalid(format!(
            "token id {t} is out of the vocabulary ({vocab})"
        )));
    }
    let device = model.model.embed_tokens.weight.device();
    let width = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let padding: Vec<usize> = prompts.iter().map(|p| width - p.len()).collect();
    let mut ids = Vec::with_capacity(prompts.len() * width);
    for (p, pad) in prompts.iter().zip(&padding) {
        ids.extend(std::iter::repeat_n(0u32, *pad));
        ids.extend(p);
    }
    let ids = Tensor::from_vec(ids, (prompts.len(), width), &device)?;
    let mut cache: KvCache =
        model.cache_with_capacity(prompts.len(), width + config.max_new_tokens)?;
    cache.set_padding(padding)?;
    let mut rng = ChaCha8Rng::seed_from_u64(config.seed);
    let mut seen: Vec<Vec<u32>> = prompts.to_vec();
    let mut out = vec![Vec::new(); prompts.len()];
    let mut done = vec![false; prompts.len()];
    let (mut logits, next_cache) = model.prefill(&ids, cache)?;
    cache = next_cache;
    for step in 0..config.max_new_tokens {
        let rows = logits.to_dtype(DType::F32)?.to_vec2::<f32>()?;
        let mut tokens = Vec::with_capacity(rows.len());
        for (i, mut row) in rows.into_iter().enumerate() {
            if done[i] {
                tokens.push(*out[i].last().unwrap_or(&0));
                continue;
            }
            let t = next_token(&mut row, &seen[i], config, &mut rng);
            out[i].push(t);
            seen[i].push(t);
            done[i] = config.stop_tokens.contains(&t);
            tokens.push(t);
        }
        if step + 1 == config.max_new_tokens || done.iter().all(|d| *d) {
            break;
        }
        let input = Tensor::new(tokens.as_slice(), &device)?;
        let (next_logits, next_cache) = model.step(&input, cache)?;
        logits = next_logits;
        cache = next_cache;
    }
    Ok(out)
}
