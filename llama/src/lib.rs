//! Llama-family decoders on `module-runtime`: Hugging Face's `LlamaForCausalLM` written with
//! `#[derive(Module)]`, loading transformers checkpoints by name, with the key/value cache as its
//! [`Recurrent`](module_runtime::Recurrent) state, and generation (greedy and sampled).
//!
//! - [`config`]: `config.json`, RoPE's frequencies;
//! - [`model`]: the layers (attention, SwiGLU, decoder layer, stack);
//! - [`causal_lm`]: the model with its head, loading, prefill (`scan`) and decoding (`step`);
//! - [`cache`]: the key/value cache;
//! - [`gguf`]: llama.cpp's GGUF files (quantized weights) by Hugging Face's names;
//! - [`gguf_export`]: a Hugging Face folder written as llama.cpp's GGUF, vocabulary included;
//! - [`generate`](mod@generate): logits processing, sampling and the generation loop;
//! - [`finetune`]: LoRA (QLoRA) fine-tuning, the `finetune_lora` example's training loop;
//! - [`json_lines`]: the examples' JSON lines of token ids.

pub mod cache;
pub mod causal_lm;
pub mod config;
pub mod finetune;
pub mod generate;
pub mod gguf;
pub mod gguf_export;
pub mod json_lines;
pub mod model;
pub mod tensor_parallel;

pub use cache::KvCache;
pub use causal_lm::LlamaForCausalLM;
pub use config::{LlamaConfig, RopeScaling};
pub use generate::{generate, GenerationConfig};
pub use gguf::{config_from_gguf, llama_names};
pub use gguf_export::save_gguf;
