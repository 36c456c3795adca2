//! LoRA and QLoRA fine-tuning of the tiny Llama through `llama::finetune::train_lora` (the
//! `finetune_lora` example's code path): the loss falls, runs repeat, the saved PEFT folder
//! reloads with the in-memory model's logits, gradients reach every adapter through a `q8_0`
//! base that stays quantized, and bad data is refused before the model is touched.
//!
//! The losses and the trained model's logits are PyTorch + peft's for the same run
//! (`tests/fixtures/tiny-llama-finetuned/torch_reference.safetensors`). `LLAMA_WRITE_FINETUNED=1`
//! writes the trained adapter, its logits and losses, the initial adapter and the data into that
//! folder for `fixtures/peft/check_llama_finetune.py`, which loads the adapter with `peft` onto
//! transformers' Llama, compares the logits, runs the same training in PyTorch and writes
//! `torch_reference.safetensors`.

use super::*;
use llama::finetune::{train_lora, FinetuneConfig, PROJECTIONS};
use module_runtime::nn::peft::{PeftExt, DEFAULT_ADAPTER};
use module_runtime::nn::{quantize, GgmlDType};

/// Training sequences of several lengths (the batch is padded), tokens from the fixture's
/// prompts and generations.
/// The runtime's generator is one per process: tests here that seed it and draw from it (the
/// adapters' initialization) hold this, so that a test's repeated run draws what its first did.
static SEEDED: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn seeded() -> std::sync::MutexGuard<'static, ()> {
    SEEDED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn data() -> Vec<Vec<u32>> {
    let (prompts, generated) = reference_json();
    vec![
        [prompts[0].clone(), generated[0][..9].to_vec()].concat(),
        prompts[1].clone(),
        [prompts[2].clone(), generated[2][..4].to_vec()].concat(),
        generated[1][..5].to_vec(),
        generated[0][10..30].to_vec(),
    ]
}

fn prompts() -> Tensor {
    ids(&reference_json().0)
}

/// The adapter a run of this test trained, with PyTorch's run of the same training.
fn finetuned_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-llama-finetuned")
}

/// Every adapter's `lora_B` (zero at PEFT's init, and weight decay keeps a zero at zero): nonzero
/// after training only where a gradient reached it.
fn lora_b_norms(model: &LlamaForCausalLM) -> Vec<(String, f32)> {
    model
        .named_parameters()
        .into_iter()
        .filter(|(path, _)| path.contains(".lora_B."))
        .map(|(path, p)| {
            let t = p.tensor().unwrap();
            let norm = t
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            (path, norm)
        })
        .collect()
}

/// The logits of the reference prompts without gradients (what generation computes).
fn inference_logits(model: &LlamaForCausalLM) -> Tensor {
    let _no_grad = module_runtime::no_grad();
    model.call(&prompts()).unwrap()
}

/// The trained adapter, its logits and losses, the adapter before training and the data, for
/// `fixtures/peft/check_llama_finetune.py`.
fn write_finetuned(
    model: &LlamaForCausalLM,
    config: &FinetuneConfig,
    logits: &Tensor,
    losses: &[f32],
) {
    let out = finetuned_dir();
    model.save_pretrained(&out).unwrap();
    // `train_lora`'s start: the same seed, then the adapter.
    let mut initial = self::model();
    module_runtime::manual_seed(config.seed);
    module_runtime::nn::peft::get_peft_model(&mut initial, &config.lora).unwrap();
    initial.save_pretrained(out.join("initial")).unwrap();
    let lines: String = data()
        .iter()
        .map(|seq| serde_json::to_string(seq).unwrap() + "\n")
        .collect();
    std::fs::write(out.join("data.jsonl"), lines).unwrap();
    let mut sd = StateDict::new();
    sd.insert("ids", prompts());
    sd.insert("logits", logits.clone());
    sd.insert("losses", Tensor::new(losses, &Device::Cpu).unwrap());
    sd.save_safetensors(out.join("rust_logits.safetensors"))
        .unwrap();
}

#[test]
fn the_training_forward_gives_transformers_logits() {
    let _seeded = seeded();
    let model = model();
    let logits = model.call(&prompts()).unwrap();
    let diff = max_diff(&logits, &reference()["logits"]);
    assert!(diff < 1e-4, "max logit difference {diff}");
}

/// The forward that records gradients (differentiable RoPE, the attention's gradient kernel)
/// gives transformers' logits on the grouped-query, llama3-RoPE fixture too: an adapter at
/// PEFT's init (`lora_B` zero) adds nothing but makes every projection's output tracked.
#[test]
fn the_tracked_forward_gives_transformers_logits_with_grouped_query_attention() {
    let _seeded = seeded();
    let dir = fixture().join("../tiny-llama-gqa");
    let mut model = LlamaForCausalLM::from_pretrained(&dir, &device()).unwrap();
    let reference =
        candle_core::safetensors::load(dir.join("reference.safetensors"), &device()).unwrap();
    let prompts = reference["prompts"].to_dtype(DType::U32).unwrap();
    module_runtime::nn::peft::get_peft_model(&mut model, &llama::finetune::lora_config(4)).unwrap();
    let logits = model.call(&prompts).unwrap();
    assert!(logits.track_op());
    let diff = max_diff(&logits, &reference["logits"]);
    assert!(diff < 1e-4, "max logit difference {diff}");
}

#[test]
fn lora_training_lowers_the_loss_and_the_saved_adapter_reloads() {
    let _seeded = seeded();
    let mut model = model();
    let base_logits = model.call(&prompts()).unwrap();
    let config = FinetuneConfig::new(4, 8);
    let mut printed = Vec::new();
    let losses = train_lora(&mut model, &data(), &config, |step, loss| {
        printed.push(format!("step {step} loss {loss:.4}"))
    })
    .unwrap();
    assert_eq!(printed.len(), 8);
    assert_eq!(printed[0], format!("step 1 loss {:.4}", losses[0]));
    assert!(
        losses[7] < losses[0] - 0.05,
        "the loss does not fall: {losses:?}"
    );
    // Repeatable: the same seed gives the same adapter init, hence the same losses.
    let mut again = self::model();
    let repeated = train_lora(&mut again, &data(), &config, |_, _| {}).unwrap();
    assert_eq!(repeated, losses);
    // Every adapter trained: the gradient reached all 14, `q_proj`/`k_proj` through RoPE.
    let norms = lora_b_norms(&model);
    assert_eq!(norms.len(), 2 * PROJECTIONS.len());
    assert!(norms.iter().all(|(_, n)| *n > 0.0), "{norms:?}");
    // The adapted model's logits moved; the base's (adapter disabled) did not (up to the
    // rounding of the kernels that record gradients, which the trainable adapter selects).
    let logits = inference_logits(&model);
    assert!(max_diff(&model.call(&prompts()).unwrap(), &logits) < 1e-4);
    assert!(max_diff(&logits, &base_logits) > 1e-3);
    let disabled = model
        .disable_adapter(|| model.call(&prompts()))
        .unwrap()
        .unwrap();
    assert!(max_diff(&disabled, &base_logits) < 1e-5);
    // Saved as PEFT's folder, loaded onto a fresh base: the in-memory model's logits, also
    // through the cached path generation takes.
    let dir = temp_dir("finetuned");
    model.save_pretrained(&dir).unwrap();
    let mut reloaded = self::model();
    let layers = reloaded.load_adapter(&dir, DEFAULT_ADAPTER, false).unwrap();
    assert_eq!(layers.len(), 14);
    assert_eq!(max_diff(&inference_logits(&reloaded), &logits), 0.0);
    let (scanned, _) = reloaded
        .scan(&prompts(), reloaded.initial_state(3).unwrap())
        .unwrap();
    assert!(max_diff(&scanned, &logits) < 1e-5);
    // PyTorch + peft's run of the same training from the same initial adapter
    // (`check_llama_finetune.py`): the same losses and, after it, the same logits.
    let torch = candle_core::safetensors::load(
        finetuned_dir().join("torch_reference.safetensors"),
        &Device::Cpu,
    )
    .unwrap();
    let torch_losses: Vec<f64> = torch["losses"].to_vec1().unwrap();
    for (step, (ours, theirs)) in losses.iter().zip(&torch_losses).enumerate() {
        assert!(
            (*ours as f64 - theirs).abs() < 1e-5,
            "step {}: loss {ours} vs PyTorch's {theirs}",
            step + 1
        );
    }
    let diff = max_diff(&logits.to_device(&Device::Cpu).unwrap(), &torch["logits"]);
    assert!(diff < 1e-4, "logits after training: {diff} from PyTorch's");
    if std::env::var_os("LLAMA_WRITE_FINETUNED").is_some() {
        write_finetuned(&model, &config, &logits, &losses);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// QLoRA: adapters in float over a `q8_0` base. The gradient reaches every adapter through the
/// quantized layers after it, the base stays quantized (no float copy kept) and frozen, the loss
/// falls, and the saved adapter reloads onto a base quantized after its load with the same
/// logits.
#[test]
fn qlora_trains_float_adapters_over_a_base_that_stays_quantized() {
    let _seeded = seeded();
    // Quantized on the way in, as the `finetune_lora` example loads its QLoRA base.
    let (mut model, report) =
        LlamaForCausalLM::from_pretrained_quantized(&fixture(), &device(), "**", GgmlDType::Q8_0)
            .unwrap();
    // 13 of 15: `down_proj`'s rows (176) are no multiple of q8_0's 32-wide blocks.
    assert_eq!(report.quantized.len(), 13);
    let quantized: Vec<Param> = report
        .quantized
        .iter()
        .map(|path| model.get_parameter(&format!("{path}.weight")).unwrap())
        .collect();
    let float_losses = train_lora(
        &mut self::model(),
        &data(),
        &FinetuneConfig::new(4, 8),
        |_, _| {},
    )
    .unwrap();
    let losses = train_lora(&mut model, &data(), &FinetuneConfig::new(4, 8), |_, _| {}).unwrap();
    assert!(
        losses[7] < losses[0] - 0.05,
        "the loss does not fall: {losses:?}"
    );
    // The quantized model's losses: near the float model's, not equal (q8_0's rounding).
    assert!((losses[0] - float_losses[0]).abs() < 0.05);
    assert_ne!(losses, float_losses);
    let norms = lora_b_norms(&model);
    assert_eq!(norms.len(), 14);
    assert!(norms.iter().all(|(_, n)| *n > 0.0), "{norms:?}");
    for (path, p) in report.quantized.iter().zip(&quantized) {
        assert_eq!(p.quantized_dtype(), Some(GgmlDType::Q8_0), "{path}");
        assert!(!p.requires_grad(), "{path}");
    }
    // The adapters themselves are float and were the only trained parameters.
    let a = model
        .get_parameter("model.layers.0.self_attn.q_proj.lora_A.default.weight")
        .unwrap();
    assert!(!a.is_quantized() && a.requires_grad() && a.dtype() == DType::F32);
    // Inference (no gradient to record) takes the q8_0 kernel, which also rounds the activations
    // to 8 bits (llama.cpp's product); training multiplies the float activations with the
    // dequantized weight (a transient copy, freed after the step), so the two differ by q8_0's
    // rounding. The reloaded, frozen adapter gives the in-memory model's inference logits.
    let logits = inference_logits(&model);
    let tracked = model.call(&prompts()).unwrap();
    assert!(max_diff(&tracked, &logits) < 0.5);
    let dir = temp_dir("qlora");
    model.save_pretrained(&dir).unwrap();
    let mut reloaded = self::model();
    let _ = quantize(&reloaded, "**", GgmlDType::Q8_0).unwrap();
    reloaded.load_adapter(&dir, DEFAULT_ADAPTER, false).unwrap();
    assert_eq!(max_diff(&inference_logits(&reloaded), &logits), 0.0);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_training_data_is_refused_before_the_model_changes() {
    let _seeded = seeded();
    let mut model = model();
    let config = FinetuneConfig::new(4, 2);
    let cases: [(Vec<Vec<u32>>, &str); 3] = [
        (vec![], "no training sequences"),
        (vec![vec![1, 2, 3], vec![7]], "sequence 2 has 1 token"),
        (
            vec![vec![1, 384]],
            "token id 384, outside the vocabulary of 384",
        ),
    ];
    for (data, message) in cases {
        let err = train_lora(&mut model, &data, &config, |_, _| {}).unwrap_err();
        assert!(err.to_string().contains(message), "{err}");
        assert!(
            matches!(
                &err,
                module_runtime::optim::Error::Runtime(Error::InvalidInput { .. })
            ),
            "{err:?}"
        );
        assert!(model.adapter_names().is_empty());
    }
    // A second adapter of the same name is PEFT's error, before any step.
    train_lora(&mut model, &data(), &config, |_, _| {}).unwrap();
    let before = model.call(&prompts()).unwrap();
    let err = train_lora(&mut model, &data(), &config, |_, _| {}).unwrap_err();
    assert!(err.to_string().contains("default"), "{err}");
    assert_eq!(max_diff(&model.call(&prompts()).unwrap(), &before), 0.0);
}

/// QLoRA with `gradient_checkpointing_enable()` (PEFT's QLoRA recipe): the layers' inputs record
/// no gradient (the embedding is frozen), yet every adapter gets the gradient it gets without
/// checkpointing, bit for bit.
#[test]
fn checkpointed_qlora_gives_the_adapters_the_plain_gradients() {
    let _seeded = seeded();
    let mut model = model();
    let _ = quantize(&model, "**", GgmlDType::Q8_0).unwrap();
    module_runtime::manual_seed(0);
    module_runtime::nn::peft::get_peft_model(&mut model, &llama::finetune::lora_config(4)).unwrap();
    model.train();
    let ids = prompts();
    let run = || {
        let loss = model.call(&ids).unwrap().sqr().unwrap().mean_all().unwrap();
        let grads = loss.backward().unwrap();
        model
            .named_parameters()
            .into_iter()
            .filter(|(name, _)| name.contains("lora_"))
            .map(|(name, p)| {
                let g = grads
                    .get(&p.tensor().unwrap())
                    .map(|g| g.flatten_all().unwrap().to_vec1::<f32>().unwrap());
                (name, g)
            })
            .collect::<Vec<_>>()
    };
    let plain = run();
    model.gradient_checkpointing_enable();
    let checkpointed = run();
    model.gradient_checkpointing_disable();
    assert_eq!(plain.len(), 2 * 2 * PROJECTIONS.len());
    assert!(plain.iter().all(|(_, g)| g.is_some()), "{plain:?}");
    assert_eq!(checkpointed, plain);
}
