//! Decoder speed: prefill tokens/s and greedy decode tokens/s of ours against candle-transformers'
//! `llama` on the same weights and against transformers in PyTorch, interleaved in one run (each
//! round runs every side once, in turn, so a shared machine's slow and fast moments fall on all of
//! them alike). f32, batch 1, a 128-token prompt, 64 greedy tokens: issue 30's item 5.
//!
//! ```text
//! PYTORCH=/path/to/venv/bin/python cargo bench -p llama --features peers --bench decode            # 5 rounds
//! PYTORCH=/path/to/venv/bin/python cargo bench -p llama --features peers --bench decode -- 10      # 10 rounds
//! ```
//!
//! The model is a random Llama shaped like SmolLM-135M (hidden 576, 30 layers, 9 heads / 3
//! key-value heads, intermediate 1536, vocabulary 49152, tied embeddings) that
//! `../shared/perf/pytorch_decode.py` (or `$PYTORCH_DECODE`) makes and saves: it is read from
//! `$LLAMA_BENCH_DIR`, else made there (default: `smollm-135m-random` in the system's temp folder)
//! by running that script once with `$PYTORCH`. With `PYTORCH` set, every round also runs the
//! script (a fresh process: the same seeded model, its own prompt, 2 threads) and its line is
//! printed per round.
//!
//! Without `$PYTORCH` and without a model in that folder, a random model of the same shape is made
//! in Rust instead (`LlamaForCausalLM::new`, PyTorch's default initializations) and saved there.
//!
//! Both candle sides run on `RAYON_NUM_THREADS` threads (2 unless set).
//!
//! The device is `MODULE_DEVICE`'s (the CPU when unset). On another device (`cuda:0`) PyTorch's
//! side is `pytorch_decode_device.py` beside this file unless `$PYTORCH_DECODE` names a script:
//! the same seeded model moved to that device, timed with the device synchronized:
//!
//! ```text
//! MODULE_DEVICE=cuda:0 PYTORCH=python3 QUANTIZE=q8_0 cargo bench -p llama --features cuda,peers --bench decode
//! ```
//!
//! Quantized weights (issue 30's item 4): `QUANTIZE=q8_0,q4_0,q4_k` adds, per kind, our model with
//! `quantize(&model, "**", kind)` (`prefill` and decode) and candle-transformers'
//! `quantized_llama` on the same quantized weights, interleaved with the others in each round. The
//! peer reads GGUF files only: the float checkpoint is written as one (`model-KIND.gguf` in the
//! model's folder, llama.cpp's names and metadata, `attn_q`/`attn_k` rows in llama.cpp's
//! interleaved order), every matrix rounded by candle's `QTensor::quantize` as `quantize` rounds
//! ours (rows move whole, so the values are the same). The greedy tokens of the two are compared
//! once, after the warm-up. A kind some matrix cannot take (`q4_k` needs rows of 256) has no peer:
//! ours keeps such layers in float, llama.cpp's files cannot.
//!
//! ```text
//! QUANTIZE=q8_0,q4_0 LLAMA_BENCH_DIR=/tmp/smollm cargo bench -p llama --features peers --bench decode -- 5
//! ```
//!
//! Ours: prefill is `scan` over the prompt (logits of every position, as PyTorch's `m(ids)`) and
//! `prefill` (the last position's logits only, as candle-transformers' `forward`); decode is 64
//! `step`s with an argmax after each, timed after the prefill. candle-transformers: `forward` on the
//! prompt, then 64 one-token `forward`s with its own cache (which concatenates the whole cache per
//! token).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use candle_transformers::models::llama as peer;
use candle_transformers::models::quantized_llama as quantized_peer;
use llama::LlamaForCausalLM;
use module_runtime::candle_core::quantized::{gguf_file, GgmlDType};
use module_runtime::candle_nn::VarBuilder;
use module_runtime::nn::{parse_quant_kind, quantize};
use module_runtime::prelude::*;

const PROMPT: usize = 128;
const NEW: usize = 64;

type AnyResult<T> = std::result::Result<T, Box<dyn std::error::Error>>;

/// Seconds of one prefill and of the decode steps after it, and the greedy tokens.
struct Timing {
    prefill: f64,
    decode: f64,
    tokens: Vec<u32>,
}

fn argmax(logits: &Tensor) -> Result<u32> {
    Ok(logits.flatten_all()?.argmax(0)?.to_scalar::<u32>()?)
}

/// Times a prefill (`prefill`, returning the first greedy token), then `NEW` greedy steps
/// (`step(token, i)` returning the next), keeping the tokens.
fn timed(
    prefill: impl FnOnce() -> Result<u32>,
    mut step: impl FnMut(u32, usize) -> Result<u32>,
) -> Result<Timing> {
    let start = Instant::now();
    let mut token = prefill()?;
    let prefill = start.elapsed().as_secs_f64();
    let mut tokens = Vec::with_capacity(NEW + 1);
    tokens.push(token);
    let start = Instant::now();
    for i in 0..NEW {
        token = step(token, i)?;
        tokens.push(token);
    }
    Ok(Timing {
        prefill,
        decode: start.elapsed().as_secs_f64(),
        tokens,
    })
}

/// Ours: `scan` (all logits) when `all_logits`, else `prefill`; then `NEW` steps.
fn ours(model: &LlamaForCausalLM, prompt: &Tensor, all_logits: bool) -> Result<Timing> {
    let cache = std::cell::RefCell::new(None);
    timed(
        || {
            let start = model.initial_state(1)?;
            let (logits, filled) = if all_logits {
                let (logits, filled) = model.scan(prompt, start)?;
                (logits.narrow(1, PROMPT - 1, 1)?, filled)
            } else {
                model.prefill(prompt, start)?
            };
            *cache.borrow_mut() = Some(filled);
            argmax(&logits)
        },
        |token, _| {
            let state = cache.borrow_mut().take().expect("the prefill's cache");
            let (logits, next) = model.step(&Tensor::new(&[token], prompt.device())?, state)?;
            *cache.borrow_mut() = Some(next);
            argmax(&logits)
        },
    )
}

/// candle-transformers: `forward` on the prompt, then `NEW` one-token `forward`s.
fn candle_transformers(
    model: &peer::Llama,
    config: &peer::Config,
    prompt: &Tensor,
) -> Result<Timing> {
    // Made within the timed prefill, as ours is (`initial_state`).
    let cache = std::cell::RefCell::new(None);
    timed(
        || {
            let mut fresh = peer::Cache::new(true, DType::F32, config, prompt.device())?;
            let token = argmax(&model.forward(prompt, 0, &mut fresh)?);
            *cache.borrow_mut() = Some(fresh);
            token
        },
        |token, i| {
            let input = Tensor::new(&[[token]], prompt.device())?;
            let mut cache = cache.borrow_mut();
            let cache = cache.as_mut().expect("the prefill's cache");
            argmax(&model.forward(&input, PROMPT + i, cache)?)
        },
    )
}

/// candle-transformers' `quantized_llama`: `forward` on the prompt at position 0 (which starts
/// its cache afresh), then `NEW` one-token `forward`s.
fn candle_transformers_quantized(
    model: &mut quantized_peer::ModelWeights,
    prompt: &Tensor,
) -> Result<Timing> {
    let model = std::cell::RefCell::new(model);
    timed(
        || argmax(&model.borrow_mut().forward(prompt, 0)?),
        |token, i| {
            let input = Tensor::new(&[[token]], prompt.device())?;
            argmax(&model.borrow_mut().forward(&input, PROMPT + i)?)
        },
    )
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> AnyResult<()> {
    // Two threads, as PyTorch's side (`torch.set_num_threads(2)`). Set, the variable also spares
    // candle's every matmul a read of /proc/cpuinfo (to count physical cores), for both candle
    // sides alike. Still single-threaded here: nothing reads the environment concurrently.
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        std::env::set_var("RAYON_NUM_THREADS", "2");
    }
    // The host and the kernels it takes, with every figure (BENCHMARKS.md names both).
    eprintln!(
        "kernels: {}",
        module_runtime::backends::cpu::kernel_choice()
    );
    let rounds: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(5);
    let device = candle_module::device_from_env()?;
    let pytorch = std::env::var_os("PYTORCH").map(PathBuf::from);
    let script = std::env::var_os("PYTORCH_DECODE")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let here = Path::new(env!("CARGO_MANIFEST_DIR"));
            if device.is_cpu() {
                here.join("../../shared/perf/pytorch_decode.py")
            } else {
                here.join("benches/pytorch_decode_device.py")
            }
        });
    let dir = std::env::var_os("LLAMA_BENCH_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| std::env::temp_dir().join("smollm-135m-random"));
    if !dir.join("model.safetensors").is_file() {
        match &pytorch {
            Some(python) => {
                let status = Command::new(python).arg(&script).arg(&dir).status()?;
                if !status.success() {
                    return Err(format!("{} failed to make the model", script.display()).into());
                }
            }
            None => make_random_model(&dir)?,
        }
    }
    // Memory first: on the machine these numbers come from (a virtual machine), the first
    // gigabyte or so a process writes streams ~20% slower than memory it takes later (the same
    // matmuls over the weights of a model loaded first: 21 ms a pass; loaded after another
    // model: 16.4 ms), which made whichever model loads first lose decode, ours or the peer's
    // (ours first: 34.9 against 41.0 tokens/s; candle-transformers first: 41.5 against 32.3). A
    // gigabyte written and held before any model loads gives every side the same memory.
    let ballast = std::hint::black_box(vec![1u8; 1 << 30]);
    let model = LlamaForCausalLM::from_pretrained(&dir, &device)?;
    let config: peer::LlamaConfig =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json"))?)?;
    let config = config.into_config(false);
    let weights = [dir.join("model.safetensors")];
    // SAFETY: the file is not modified while the benchmark runs.
    let vb = unsafe { VarBuilder::from_mmaped_safetensors(&weights, DType::F32, &device)? };
    let candle = peer::Llama::load(vb, &config)?;
    // A fixed prompt (the content does not change the work): ids from a small LCG.
    let mut state = 12345u64;
    let ids: Vec<u32> = (0..PROMPT)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 33) % config.vocab_size as u64) as u32
        })
        .collect();
    let prompt = Tensor::from_vec(ids, (1, PROMPT), &device)?;
    let mut quantized = quantized_models(&dir, &device)?;

    // Warm-up: page in the weights, size the allocators.
    ours(&model, &prompt, false)?;
    candle_transformers(&candle, &config, &prompt)?;
    for q in &mut quantized {
        let mine = ours(&q.ours, &prompt, false)?;
        if let Some(peer) = &mut q.peer {
            // The same quantized weights: the same greedy tokens, up to the order of float sums.
            let theirs = candle_transformers_quantized(peer, &prompt)?;
            let same = mine
                .tokens
                .iter()
                .zip(&theirs.tokens)
                .take_while(|(a, b)| a == b);
            println!(
                "{}: ours and quantized_llama agree on the first {} of {} greedy tokens",
                q.name,
                same.count(),
                mine.tokens.len()
            );
        }
    }

    let mut results: Vec<(String, Vec<Timing>)> = vec![
        ("ours, scan (all logits)".to_owned(), Vec::new()),
        ("ours, prefill (last logits)".to_owned(), Vec::new()),
        ("candle-transformers llama".to_owned(), Vec::new()),
    ];
    // Per kind: ours, then the peer's row when it has one.
    let mut rows = Vec::new();
    for q in &quantized {
        rows.push(results.len());
        results.push((format!("ours {}, prefill", q.name), Vec::new()));
        if q.peer.is_some() {
            results.push((format!("quantized_llama {}", q.name), Vec::new()));
        }
    }
    for round in 0..rounds {
        results[0].1.push(ours(&model, &prompt, true)?);
        results[1].1.push(ours(&model, &prompt, false)?);
        results[2]
            .1
            .push(candle_transformers(&candle, &config, &prompt)?);
        for (q, &row) in quantized.iter_mut().zip(&rows) {
            let t = ours(&q.ours, &prompt, false)?;
            let mut line = format!(
                "round {round}: ours {} prefill {:.0} tokens/s, decode {:.1} tokens/s",
                q.name,
                PROMPT as f64 / t.prefill,
                NEW as f64 / t.decode
            );
            results[row].1.push(t);
            if let Some(peer) = &mut q.peer {
                let t = candle_transformers_quantized(peer, &prompt)?;
                line += &format!(
                    "; quantized_llama prefill {:.0} tokens/s, decode {:.1} tokens/s",
                    PROMPT as f64 / t.prefill,
                    NEW as f64 / t.decode
                );
                results[row + 1].1.push(t);
            }
            println!("{line}");
        }
        if let Some(python) = &pytorch {
            let out = Command::new(python).arg(&script).output()?;
            let text = String::from_utf8_lossy(&out.stdout);
            let line = text
                .lines()
                .rfind(|l| l.contains("prefill"))
                .unwrap_or("pytorch: no result (see its stderr)");
            println!("round {round}: pytorch: {line}");
        }
        let last = |i: usize| &results[i].1[round];
        println!(
            "round {round}: ours prefill {:.0}/{:.0} tokens/s, decode {:.1} tokens/s; \
             candle-transformers prefill {:.0} tokens/s, decode {:.1} tokens/s",
            PROMPT as f64 / last(0).prefill,
            PROMPT as f64 / last(1).prefill,
            NEW as f64 / last(1).decode,
            PROMPT as f64 / last(2).prefill,
            NEW as f64 / last(2).decode,
        );
    }
    println!(
        "\nmedians over {rounds} rounds on {:?} (f32 unless named, batch 1, {PROMPT}-token prompt, {NEW} greedy tokens):",
        device.location()
    );
    for (name, timings) in &results {
        let prefill = median(timings.iter().map(|t| PROMPT as f64 / t.prefill).collect());
        let rates: Vec<f64> = timings.iter().map(|t| NEW as f64 / t.decode).collect();
        let (lo, hi) = rates
            .iter()
            .fold((f64::MAX, 0f64), |(lo, hi), r| (lo.min(*r), hi.max(*r)));
        let decode = median(rates);
        println!(
            "{name:32} prefill {prefill:6.0} tokens/s   decode {decode:5.1} tokens/s ({lo:.1}–{hi:.1})"
        );
    }
    // Each quantized kind's decode speed over float32's (ours, `prefill`), and over the peer's
    // on the same weights, round by round: the same round's runs met the same moment of the
    // machine.
    let per_round = |what: &str, num: &[Timing], den: &[Timing]| {
        let ratios: Vec<f64> = num
            .iter()
            .zip(den)
            .map(|(q, f)| f.decode / q.decode)
            .collect();
        let (lo, hi) = ratios
            .iter()
            .fold((f64::MAX, 0f64), |(lo, hi), r| (lo.min(*r), hi.max(*r)));
        println!(
            "{what}, per round: median {:.2}x ({lo:.2}–{hi:.2}x)",
            median(ratios.clone())
        );
    };
    for (q, &row) in quantized.iter().zip(&rows) {
        per_round(
            &format!("{} decode over float32's", q.name),
            &results[row].1,
            &results[1].1,
        );
        if q.peer.is_some() {
            per_round(
                &format!("{} decode over quantized_llama's", q.name),
                &results[row].1,
                &results[row + 1].1,
            );
        }
    }
    drop(ballast);
    Ok(())
}

/// One `$QUANTIZE` kind: ours, and candle-transformers' `quantized_llama` on the same weights
/// where llama.cpp's format can hold them.
struct Quantized {
    name: String,
    ours: LlamaForCausalLM,
    peer: Option<quantized_peer::ModelWeights>,
}

/// `$QUANTIZE`'s kinds (`q8_0,q4_0`), each our model read from `dir` and quantized with `"**"`,
/// and the peer read from `dir/model-KIND.gguf` (written first when missing).
fn quantized_models(dir: &Path, device: &Device) -> AnyResult<Vec<Quantized>> {
    let Ok(kinds) = std::env::var("QUANTIZE") else {
        return Ok(Vec::new());
    };
    let mut models = Vec::new();
    for name in kinds.split(',').filter(|k| !k.is_empty()) {
        let kind = parse_quant_kind(name)?;
        let model = LlamaForCausalLM::from_pretrained(dir, device)?;
        let report = quantize(&model, "**", kind)?;
        println!(
            "{name}: {} Linear layers quantized, {} kept in float32 (rows not a multiple of the block)",
            report.quantized.len(),
            report.kept_float.len()
        );
        let path = dir.join(format!("model-{name}.gguf"));
        let peer = match gguf_peer(dir, &path, kind, device) {
            Ok(peer) => Some(peer),
            Err(e) => {
                println!("{name}: no quantized_llama peer: {e}");
                None
            }
        };
        models.push(Quantized {
            name: name.to_owned(),
            ours: model,
            peer,
        });
    }
    Ok(models)
}

/// candle-transformers' `quantized_llama` from `path`, which is first written from the float
/// checkpoint in `dir` when missing (see [`write_gguf`]).
fn gguf_peer(
    dir: &Path,
    path: &Path,
    kind: GgmlDType,
    device: &Device,
) -> AnyResult<quantized_peer::ModelWeights> {
    if !path.is_file() {
        llama::save_gguf(dir, path, kind)?;
        println!("wrote {}", path.display());
    }
    let mut file = std::fs::File::open(path)?;
    let content = gguf_file::Content::read(&mut file)?;
    Ok(quantized_peer::ModelWeights::from_gguf(
        content, &mut file, device,
    )?)
}

/// A random Llama shaped like SmolLM-135M, made in Rust (PyTorch's default initializations) and
/// saved to `dir` with its `config.json`, for a run without PyTorch.
fn make_random_model(dir: &Path) -> AnyResult<()> {
    let json = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
        "vocab_size": 49152, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0, "tie_word_embeddings": true, "bos_token_id": 0,
        "eos_token_id": 0,
    });
    eprintln!(
        "making a random SmolLM-135M-shaped model in {}",
        dir.display()
    );
    LlamaForCausalLM::save_random_pretrained(dir, &json)?;
    Ok(())
}
